"""Batched tree verification: ONE target forward scores the trees of B requests.

The target is a stock HF causal LM and the KV cache a stock ``DynamicCache`` of batch B whose
rows have different valid lengths (ragged prefixes). Layout, per layer, keys/values
[B, H_kv, S, d_head]:

    row b:  slots [0, P_b)      request b's committed tokens except its root (valid)
            slots [P_b, S)      padding: zeros between steps, never attended

S = max P_b. A verify pass appends M = max N_b rows to every row (slots S .. S + M - 1): request
b's tree nodes in the first N_b, padding after. Each query row gets a 4-D boolean mask over its
own request's valid slots only (its prefix ‖ its ancestors; a padding row sees only itself) and
position P_b + depth, so row b computes exactly what ``TreeVerifier`` computes for request b
alone. ``compact`` then gathers, per row, the root and the accepted path to P_b, P_b + 1, ...,
zeroes everything past the new valid length and crops the shared length to max(P_b + K_b):
each row's valid cache equals sequential decoding of its request, nothing of a rejected branch
survives, and memory is bounded by the longest live request. Requests leave between steps
with ``retain`` (rows selected, length cropped to the longest kept row) and join with ``add``
(their own prefill forward, one per prompt length, so a request's cache never depends on who
joined with it; rows appended, both sides zero-padded to the longer length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from treespec.core.tree_batch import TreeBatch
from treespec.fastpath.kvcache import GrowingLayer
from treespec.drafters.base import TargetFeatures
from treespec.core.masks import attn_implementation_of, padded_tree_masks, to_hf_mask
from treespec.core.sampling import process


@dataclass(frozen=True)
class BatchVerifyOutput:
    """Target outputs for a TreeBatch, flat in the batch's node order.

    Attributes:
        logits:   FloatTensor[T, V]; raw target logits of every node (model dtype).
        probs:    FloatTensor[T, V]; p(.|path to node) processed with the request's config.
        features: tuple of B TargetFeatures, request b's hidden states [N_b, H] per layer.
    """

    logits: torch.Tensor
    probs: torch.Tensor
    features: tuple[TargetFeatures, ...]


class BatchVerifier:
    """Owns the target's batched KV cache for B requests (row b = request b).

    Invariant between steps: row b's valid slots are request b's committed tokens except the
    last one (the root of its next tree): ``prefix_lens[b]`` of them, starting at slot 0.
    """

    def __init__(self, model: torch.nn.Module, target_layers: tuple[int, ...] = ()):
        self.model = model
        self.target_layers = tuple(target_layers)
        self.attn_impl = attn_implementation_of(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: DynamicCache | None = None
        self.prefix_lens: list[int] = []
        self._pending: tuple[int, list[int]] | None = None   # (S, tree sizes) of the last score

    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def cache_len(self) -> int:
        """S, the shared (padded) length of every cache row."""
        return self.cache.get_seq_length() if self.cache is not None else 0

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor | None, mask: torch.Tensor | None, cache: DynamicCache,
                 logits_to_keep: int = 0, features: bool = True):
        """``mask`` None: plain causal attention (positions from the cache); ``logits_to_keep``:
        HF's own argument, 0 = logits for every row, k = the last k rows."""
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=None if mask is None else to_hf_mask(mask, self.attn_impl, self.dtype),
            cache=cache,
            use_cache=True,
            output_hidden_states=features and bool(self.target_layers),
            logits_to_keep=logits_to_keep,
        )
        return out.logits, out.hidden_states

    def _features(self, hidden, b: int, n: int) -> TargetFeatures:
        if not self.target_layers or hidden is None:
            return TargetFeatures.empty()
        return TargetFeatures({i: hidden[i][b, :n] for i in self.target_layers})

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[torch.Tensor], features: bool = True) -> tuple[TargetFeatures, ...]:
        """Cache prompt[:-1] of every request (LongTensor[P_b + 1] each): one forward where all
        have one length, else one per prompt, zero-padded and stacked (so a request's cache never
        depends on who joined with it); returns each request's features [P_b, H] (empty ones
        with ``features=False``: no request needs the target's hidden states). The last tokens
        are the roots."""
        self.cache, self.prefix_lens, feats = self._prefill(prompts, features)
        self._pending = None
        return feats

    @torch.inference_mode()
    def add(self, prompts: Sequence[torch.Tensor], features: bool = True) -> tuple[TargetFeatures, ...]:
        """Requests join between steps: prefill ``prompts`` (one forward of their own) and append
        them as rows B, B + 1, ... of the cache, padded to the longer of the two lengths.
        ``features`` as for ``prefill``."""
        if self.cache is None:
            return self.prefill(prompts, features)
        if self._pending is not None:
            raise RuntimeError("compact() the last scores before add()")
        cache, lens, feats = self._prefill(prompts, features)
        _concat_rows(self.cache, cache, self.batch_size, len(lens), max(self.prefix_lens + lens))
        self.prefix_lens = self.prefix_lens + lens
        return feats

    def _prefill(self, prompts: Sequence[torch.Tensor], features: bool = True):
        """(a fresh batched cache of prompt[:-1] per row, their lengths, their features)."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of LongTensor (one per request)")
        for b, p in enumerate(prompts):
            if not isinstance(p, torch.Tensor) or p.dtype != torch.long or p.dim() != 1 or p.numel() < 1:
                raise TypeError(f"prompts[{b}] must be a 1-D LongTensor with at least one token")
        cache = DynamicCache(config=self.model.config)
        kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
        # full-attention layers that append in place (a step copies no cached row; retain / add,
        # which replace the tensors, are adopted at the next forward)
        cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
        if kinds:
            raise NotImplementedError(f"BatchVerifier gathers full-attention KV rows; this model's cache has "
                                      f"{sorted(kinds)} layers (sliding window / linear attention), whose "
                                      "compaction it does not know")
        lens = [p.numel() - 1 for p in prompts]
        s = max(lens)
        if len(set(lens)) > 1:
            # Each prompt alone, then their rows zero-padded and stacked: a padded batch's masked
            # attention rounds differently from a lone prompt's causal one, and greedy output
            # would then depend on which requests happened to join together
            parts = [self._prefill([p], features) for p in prompts]
            for b, (part, _, _) in enumerate(parts[1:], start=1):
                _concat_rows(parts[0][0], part, b, 1, s)
            return parts[0][0], lens, tuple(f for _, _, feats in parts for f in feats)
        if s == 0:
            hidden = self.model.config.hidden_size
            empty = TargetFeatures({i: torch.zeros(0, hidden, device=self.device, dtype=self.dtype)
                                    for i in self.target_layers}) if features else TargetFeatures.empty()
            return cache, lens, tuple(empty for _ in prompts)
        # [B, S]: equal lengths (one request, or several of one length), no padding: causal
        ids = torch.stack([p[:-1] for p in prompts]).to(self.device)
        # No prompt row's logits are used (the root's come with the first tree): the LM head runs
        # over one row, not B x S (a [S, V] product and its S x V floats per request otherwise).
        _, hidden = self._forward(ids, None, None, cache, logits_to_keep=1, features=features)
        return cache, lens, tuple(self._features(hidden, b, p) for b, p in enumerate(lens))

    @torch.inference_mode()
    def score(self, batch: TreeBatch, features: bool = True) -> BatchVerifyOutput:
        """One forward over every request's tree; appends max N_b rows to the cache (undone by
        ``compact``). ``features=False``: no request needs the target's hidden states this step
        (their ``features`` are empty)."""
        if self.cache is None:
            raise RuntimeError("call prefill() before score()")
        self._check_batch(batch)
        s, sizes = self.cache_len, batch.sizes
        ids, pos = self._rows(batch)
        # [B, M, S + M]
        mask = padded_tree_masks(batch.trees, self.prefix_lens, s, self.device)
        logits, hidden = self._forward(ids, pos, mask, self.cache, features=features)
        self._pending = (s, sizes)
        return self._outputs(batch, logits, hidden)

    def _check_batch(self, batch: TreeBatch) -> None:
        """TypeError / ValueError / RuntimeError where ``batch`` cannot be scored now."""
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"batch must be a TreeBatch, got {type(batch).__name__}")
        if batch.batch_size != self.batch_size:
            raise ValueError(f"the batch has {batch.batch_size} requests but the cache holds "
                             f"{self.batch_size}; call retain() when requests leave")
        if self._pending is not None:
            raise RuntimeError("score() called twice without compact(); compact the last scores first")
        vocab = self.model.config.vocab_size
        if batch.vocab_size is not None and batch.vocab_size != vocab:
            raise ValueError(f"the batch's vocab is {batch.vocab_size} but the target's is {vocab}")

    def _rows(self, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, M] tokens and positions of the batch's nodes, right-padded (padding: token 0 at
        the row's P_b)."""
        m = max(batch.sizes)
        ids = torch.zeros(batch.batch_size, m, dtype=torch.long, device=self.device)
        pos = torch.tensor(self.prefix_lens, device=self.device)[:, None].repeat(1, m)
        for b, tree in enumerate(batch.trees):
            ids[b, :tree.num_nodes] = tree.tokens.to(self.device)
            pos[b, :tree.num_nodes] += tree.depth.to(self.device)
        return ids, pos

    def _outputs(self, batch: TreeBatch, logits: torch.Tensor, hidden) -> BatchVerifyOutput:
        """The flat outputs of a pass's logits [B, M, V] and hidden states (by layer)."""
        sizes = batch.sizes
        # [T, V]
        flat = torch.cat([logits[b, :n] for b, n in enumerate(sizes)])
        probs = torch.cat([process(logits[b, :n].float(), cfg)
                           for b, (n, cfg) in enumerate(zip(sizes, batch.configs))])
        feats = tuple(self._features(hidden, b, n) for b, n in enumerate(sizes))
        return BatchVerifyOutput(flat, probs, feats)

    @torch.inference_mode()
    def compact(self, keeps: Sequence[torch.Tensor]) -> None:
        """Keep, per request, the tree rows ``keeps[b]`` (LongTensor[K_b]: node indices, the root
        first, e.g. ``RequestAcceptance.keep_src``) at slots P_b .. P_b + K_b - 1; afterwards row
        b holds P_b + K_b valid slots, zeros after them, and the shared length is the longest."""
        rows = self._kept(keeps)
        s = self._pending[0]
        new_lens = [p + len(k) for p, k in zip(self.prefix_lens, rows)]
        s_new = max(new_lens)
        # Only the kept tree slots move (row b: slot s + kl[i] -> p_b + i); the prefixes stay where
        # they are. Row b's old padding [P_b, S) held zeros already, so of the slots past its new
        # length only this step's tree slots [S, S') need zeroing. In place: a step costs
        # O(kept + tree) slots per row, neither a copy of the cache nor of its padding.
        rb, src, dst, zb, zs = [], [], [], [], []
        for b, (p, kl, end) in enumerate(zip(self.prefix_lens, rows, new_lens)):
            rb += [b] * len(kl)
            src += [s + j for j in kl]
            dst += range(p, end)
            start = max(end, s)
            zb += [b] * (s_new - start)
            zs += range(start, s_new)
        rb, src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (rb, src, dst))
        zb, zs = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (zb, zs))
        for layer in self.cache.layers:
            for kv in (layer.keys, layer.values):          # [B, H, S_total, D]
                kv[rb, :, dst] = kv[rb, :, src]            # the right side is gathered first
                if zs.numel():
                    kv[zb, :, zs] = 0
            _shorten(layer, s_new)
        self.prefix_lens = new_lens
        self._pending = None

    def _kept(self, keeps: Sequence[torch.Tensor]) -> list[list[int]]:
        """``compact``'s ``keeps`` checked against the last scores, as lists."""
        if self._pending is None:
            raise RuntimeError("call score() before compact()")
        s, sizes = self._pending
        if not isinstance(keeps, (list, tuple)) or len(keeps) != len(sizes):
            raise ValueError(f"keeps must be a list of {len(sizes)} LongTensors (one per request)")
        rows = []
        for b, (keep, n) in enumerate(zip(keeps, sizes)):
            if not isinstance(keep, torch.Tensor) or keep.dtype != torch.long or keep.dim() != 1:
                raise TypeError(f"keeps[{b}] must be a 1-D LongTensor of node indices")
            kl = keep.tolist()
            if not kl or kl[0] != 0 or any(not 0 < j < n for j in kl[1:]) or kl[1:] != sorted(set(kl[1:])):
                raise ValueError(f"keeps[{b}] must be the root (0) then increasing node indices < "
                                 f"N={n}, got {kl}")
            rows.append(kl)
        return rows

    @torch.inference_mode()
    def discard(self) -> None:
        """Undo the last ``score``: its tree rows leave the cache and every row is back to its
        state before it (a timing loop repeats one pass; a caller whose acceptance failed
        restores the target cache)."""
        if self._pending is None:
            raise RuntimeError("nothing to discard: call score() first")
        s, _ = self._pending
        for layer in self.cache.layers:
            if layer.is_initialized:
                _shorten(layer, s)
        self._pending = None

    def retain(self, rows: Sequence[int]) -> None:
        """Keep only the requests ``rows`` (in that order), e.g. when others finish; the shared
        length shrinks to the longest kept row."""
        if self._pending is not None:
            raise RuntimeError("compact() the last scores before retain()")
        rows = [int(r) for r in rows]
        if not rows or any(not 0 <= r < self.batch_size for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct request indices in [0, {self.batch_size}), got {rows}")
        lens = [self.prefix_lens[r] for r in rows]
        s_new = max(lens)
        idx = torch.tensor(rows, device=self.device)
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, idx)[:, :, :s_new]
                layer.values = layer.values.index_select(0, idx)[:, :, :s_new]
        self.prefix_lens = lens


def _concat_rows(mine: DynamicCache, theirs: DynamicCache, mine_rows: int, their_rows: int, s: int) -> None:
    """Append the rows of cache ``theirs`` (``their_rows`` requests) after those of ``mine``
    (``mine_rows``), both zero-padded to ``s`` positions; a side with nothing cached yet (roots
    only) counts as zeros."""
    for layer, other in zip(mine.layers, theirs.layers):
        filled = [x for x in (layer, other) if x.is_initialized and x.keys.numel()]
        if not filled:
            continue                        # nothing cached anywhere yet (all roots only)
        _, heads, _, dim = filled[0].keys.shape

        def rows(x, b: int) -> tuple[torch.Tensor, torch.Tensor]:
            """A layer's (keys, values) [b, H_kv, S, d] zero-padded to S, empty ones too."""
            if x in filled:
                k, v = x.keys, x.values
            else:
                k = v = filled[0].keys.new_zeros(b, heads, 0, dim)
            return (torch.nn.functional.pad(k, (0, 0, 0, s - k.shape[2])),
                    torch.nn.functional.pad(v, (0, 0, 0, s - v.shape[2])))

        (ok, ov), (nk, nv) = rows(layer, mine_rows), rows(other, their_rows)
        if not layer.is_initialized:
            layer.lazy_initialization(ok, ov)
        layer.keys, layer.values = torch.cat([ok, nk]), torch.cat([ov, nv])


def _shorten(layer, length: int) -> None:
    """Keep a cache layer's first ``length`` positions: a shorter view of a growing layer's
    buffer (its next forward appends in place), a slice of any other."""
    extra = layer.keys.shape[-2] - length
    if extra > 0 and isinstance(layer, GrowingLayer):
        layer.crop(-extra)
    elif extra > 0:
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
