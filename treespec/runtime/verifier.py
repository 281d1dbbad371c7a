"""Tree-attention verification: score every node of a DraftTree in ONE target forward.

The target is a stock HF causal LM. Tree tokens go in with ``position_ids = P + depth`` and a
4-D mask (cached prefix ‖ ancestor mask); afterwards ``compact`` gathers the KV rows of the
root and the accepted path in place, so the cache holds exactly what sequential decoding of the
emitted tokens would hold and never grows with rejected branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from treespec.drafters.base import TargetFeatures
from treespec.core.masks import attn_implementation_of, tree_forward_args
from treespec.core.sampling import SamplingConfig, process
from treespec.core.tree import DraftTree
from treespec.fastpath.kvcache import growing_cache, keep_rows


@dataclass(frozen=True)
class VerifyOutput:
    """Target outputs for one tree.

    Attributes:
        probs:    FloatTensor[N, V]; processed target distribution p(.|path to node).
        features: target hidden states [N, H] per requested layer (empty if none requested).
    """

    probs: torch.Tensor
    features: TargetFeatures


class TreeVerifier:
    """Owns the target's KV cache for one request.

    Invariant between steps: the cache holds the committed tokens except the last one (the
    root of the next tree), i.e. ``prefix_len`` positions.
    """

    def __init__(self, model: torch.nn.Module, sampling: SamplingConfig, target_layers: tuple[int, ...] = (),
                 passes=None):
        """``passes``: a :class:`treespec.runtime.compiled.CompiledPasses` of ``model`` to run the
        tree passes as compiled graphs over its static cache (one request at a time), or None
        (eager passes over a growing cache)."""
        self.model = model
        self.passes = passes
        self.sampling = sampling
        self.target_layers = tuple(target_layers)
        self.attn_impl = attn_implementation_of(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache: DynamicCache | None = None
        self.prefix_len = 0

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor | None, mask: torch.Tensor | None,
                 logits_to_keep: int = 0):
        """``logits_to_keep``: HF's own argument; 0 = logits for every row, k = the last k rows."""
        out = self.model(
            input_ids=ids,
            position_ids=pos,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=bool(self.target_layers),
            logits_to_keep=logits_to_keep,
        )
        feats = TargetFeatures({i: out.hidden_states[i][0] for i in self.target_layers}) \
            if self.target_layers else TargetFeatures.empty()
        return out.logits[0], feats

    def _no_features(self) -> TargetFeatures:
        """The features of an empty prompt body: zero rows per requested layer."""
        size = self.model.config.hidden_size
        return TargetFeatures({i: torch.zeros(0, size, device=self.device, dtype=self.dtype)
                               for i in self.target_layers})

    def _check_owner(self) -> None:
        if self.passes.owner is not self:
            raise RuntimeError("another request prefilled the compiled passes' cache since this one's prefill: "
                               "a compiled target serves one request at a time (finish one stream before "
                               "starting the next, or give concurrent requests an eager target)")

    @torch.inference_mode()
    def prefill(self, prompt_ids: torch.Tensor) -> TargetFeatures:
        """Cache prompt_ids[:-1] (LongTensor[P]); returns their features. The last token is the root."""
        self.prefix_len = 0
        body = prompt_ids[:-1]
        empty = body.numel() == 0
        if self.passes is not None:
            self.passes.owner = self                # the static cache is this request's until another's prefill
            hidden = self.passes.prefill(body, self.target_layers)
            self.cache = self.passes.cache
            self.prefix_len = body.numel()
            if empty:
                return self._no_features()
            return TargetFeatures(hidden) if self.target_layers else TargetFeatures.empty()
        self.cache = growing_cache(self.model.config)   # appends in place (treespec.fastpath.kvcache)
        if empty:
            return self._no_features()
        ids = body.to(self.device)[None]
        # No prefix row's logits are used (the root's come with the first tree): skip the LM head
        # over the prompt but one row (P x V multiply-adds, ~0.15 s for 300 fp32 tokens here).
        _, feats = self._forward(ids, None, None, logits_to_keep=1)
        self.prefix_len = body.numel()
        return feats

    @torch.inference_mode()
    def score(self, tree: DraftTree) -> VerifyOutput:
        """One forward over all N nodes; appends N rows to the cache (undone by ``compact``)."""
        if self.cache is None:
            raise RuntimeError("call prefill() before score()")
        p = self.prefix_len
        if self.passes is not None:
            self._check_owner()
            logits, hidden = self.passes.score(tree, p, self.target_layers)
            self.cache = self.passes.cache          # a pass past the cache's size grows it
            feats = TargetFeatures(hidden) if self.target_layers else TargetFeatures.empty()
            return VerifyOutput(process(logits.float(), self.sampling), feats)
        ids = tree.tokens.to(self.device)[None]
        # a root alone takes the model's own one-token path (no mask, no positions)
        pos, mask = tree_forward_args(tree, p, self.attn_impl, self.dtype, self.device)
        logits, feats = self._forward(ids, pos, mask)
        # [N, V]
        probs = process(logits.float(), self.sampling)
        return VerifyOutput(probs, feats)

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """A plain decoding step: the pass of :meth:`score` over a tree that is ``token`` alone,
        then :meth:`compact` of it, in one (a compiled target's inputs built for one row
        directly). Returns its logits [1, V] as float32 (as :meth:`score` hands them to
        ``process``), unprocessed: :func:`treespec.core.rejection.accept_root_logits` draws from them."""
        if self.cache is None:
            raise RuntimeError("call prefill() before step()")
        if self.passes is not None:
            self._check_owner()
            logits = self.passes.step(token, self.prefix_len)
            self.cache = self.passes.cache
        else:
            logits, _ = self._forward(torch.tensor([[token]], device=self.device), None, None)
        self.prefix_len += 1
        return logits.float()

    @torch.inference_mode()
    def compact(self, keep: torch.Tensor) -> None:
        """Keep the tree rows ``keep`` (LongTensor[K], node indices incl. the root, root first).

        Moves rows P + keep[i] to P + i in place in every layer, then crops the rest.
        The last kept node's token is *not* the next root: the next root is the new token, so
        after compaction the prefix is P + K and every cached position is committed.
        """
        nodes = keep.tolist()
        if not nodes or nodes[0] != 0 or any(b <= a for a, b in zip(nodes, nodes[1:])):
            raise ValueError(f"keep must be a path from the root, increasing from node 0, got {nodes}")
        p = self.prefix_len
        if self.passes is not None:
            self._check_owner()
            self.passes.keep(p, [p + node for node in nodes])
        else:
            keep_rows(self.cache, p, [p + node for node in nodes])   # a path's nodes increase: moves only
        self.prefix_len = p + len(nodes)
