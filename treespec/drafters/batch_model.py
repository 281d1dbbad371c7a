"""BatchModelDrafter: ``ModelDrafter`` for many requests, ONE forward of the HF model per call.

Per request (key) the state is the single drafter's (``treespec.drafters.model``): ``prefix``
committed tokens cached before the root, ``pending`` committed tokens not yet fed (the last one
is the root), ``slots`` tree node -> cache column. All requests share one stock
``DynamicCache`` of batch B (row b = ``keys[b]``, see ``treespec.drafters.batched``): a call
appends max F_b positions to every row (4-D mask over the row's own columns, positions per
row), then each row's F_b new columns move right after its ``used`` ones, so every row stays
laid out exactly as the single drafter's cache. ``begin`` prefills a joining request's prompt
(all but the root) in a forward of its own and appends it as a row, so a long prompt is never
padded across the other rows. ``commit`` moves the kept slots (root and accepted nodes that
were fed) after the prefix; ``drop`` removes the row.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch
from transformers import DynamicCache

from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.drafters.batched import (
    DraftAnswer, DraftCall, Key, RowCheckpoints, RowInputs, ancestor_columns, batch_inputs, check_calls,
    move_columns, settle_moves,
)
from treespec.core.masks import attn_implementation_of, to_hf_mask
from treespec.targets.loader import context_limit


@dataclass
class _Row:
    prefix: int = 0                               # committed tokens cached before the root
    pending: list[int] = field(default_factory=list)   # committed, not fed; the last is the root
    slots: dict[int, int] = field(default_factory=dict)  # tree node -> cache column
    used: int = 0                                 # columns of the row holding its cache

    def copy(self) -> "_Row":
        return replace(self, pending=list(self.pending), slots=dict(self.slots))


class BatchModelDrafter(RowCheckpoints):
    """Many requests of an independent-model drafter (see the module docstring)."""

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = False

    def __init__(self, model: torch.nn.Module, vocab_size: int, cost_kind: str = "early_exit"):
        self.model = model.eval()
        self.vocab_size = int(vocab_size)
        self.cost_kind = cost_kind
        limit, why = context_limit(model)
        self.max_context, self.max_context_reason = limit, f"the drafter model's {why}"
        self.attn_impl = attn_implementation_of(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.cache = DynamicCache(config=model.config)
        # HF causal LMs take logits_to_keep [B, K]: the LM head runs on the needed positions only
        self.slices_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.keys: list[Key] = []
        self.rows: dict[Key, _Row] = {}
        self.calls = 0

    # ------------------------------------------------------------------ protocol
    @torch.inference_mode()
    def begin(self, key: Key, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        """A request joins: prompt_ids[:-1] go through a forward of their own (so a long prompt
        is not padded across every row of the next call) and become a new row; the root is
        fed with the first expansion, as the single drafter feeds its last pending token."""
        if key in self.rows:
            raise ValueError(f"request {key!r} was already begun")
        ids = [int(t) for t in prompt_ids.tolist()]
        own = DynamicCache(config=self.model.config)
        if len(ids) > 1:                # a prefill, not a drafting round: not in ``calls``
            extra = {"logits_to_keep": 1} if self.slices_logits else {}
            self.model(input_ids=torch.tensor([ids[:-1]], device=self.device), cache=own, use_cache=True,
                       **extra)
        self._append_row(own)
        self.keys.append(key)
        n = len(ids) - 1
        self.rows[key] = _Row(prefix=n, pending=ids[-1:], used=n)

    @torch.inference_mode()
    def expand_batch(self, calls: Sequence[DraftCall]) -> list[DraftAnswer]:
        check_calls(calls, self.rows.__contains__)
        s = self.cache.get_seq_length() if self._initialized() else 0
        inputs: list[RowInputs | None] = [None] * len(self.keys)
        for key, tree, nodes in calls:
            inputs[self.keys.index(key)] = self._row_inputs(key, tree, nodes)
        ids, pos, allowed = batch_inputs(inputs, s, self.device)
        counts = [0 if r is None else len(r.tokens) for r in inputs]
        roots = {self.keys.index(key) for key, _, nodes in calls if nodes == [0]}
        # [B, K] positions whose logits are needed: a root run's last token, every tree node
        wanted = [[c - 1] if b in roots else list(range(c)) for b, c in enumerate(counts)]
        width = max(len(w) for w in wanted)
        keep = torch.tensor([w + [w[-1]] * (width - len(w)) if w else [0] * width for w in wanted],
                            device=self.device)
        extra = {"logits_to_keep": keep} if self.slices_logits else {}
        self.calls += 1
        out = self.model(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True,
                         attention_mask=to_hf_mask(allowed, self.attn_impl, self.dtype), **extra)
        # [B, K, V]: row b's needed logits first
        logits = out.logits if self.slices_logits else out.logits.gather(
            1, keep[:, :, None].expand(-1, -1, out.logits.shape[-1]))
        used = [self.rows[k].used for k in self.keys]
        self._settle(settle_moves(used, counts, s), [u + c for u, c in zip(used, counts)])
        answers = []
        for key, tree, nodes in calls:
            b = self.keys.index(key)
            row, f = self.rows[key], counts[b]
            if nodes == [0]:            # root: the last fed committed token
                row.prefix += f - 1
                row.slots = {0: row.prefix}
                row.pending = []
            else:
                for r, n in enumerate(nodes):
                    row.slots[n] = row.used + r
            row.used += f
            answers.append((logits[b, :len(nodes)].float(), None))
        return answers

    @torch.inference_mode()
    def commit(self, key: Key, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        row = self._get(key)
        fed = []
        for n in [0] + path.tolist():
            if n not in row.slots:
                break
            fed.append(row.slots[n])
        toks = tokens.tolist()
        # tokens of accepted nodes never fed (unexpanded leaves), then the new root
        row.pending = toks[len(fed) - 1:] if fed else row.pending + toks
        b = self.keys.index(key)
        moves = [(b, src, row.prefix + i) for i, src in enumerate(fed)]
        used = [self.rows[k].used for k in self.keys]
        used[b] = row.prefix + len(fed)
        self._settle(moves, used)
        row.prefix, row.used, row.slots = used[b], used[b], {}

    def drop(self, key: Key) -> None:
        self._get(key)
        b = self.keys.index(key)
        del self.rows[key]
        self.keys.pop(b)
        if not self.keys:
            self.cache = DynamicCache(config=self.model.config)
            return
        rows = [i for i in range(len(self.keys) + 1) if i != b]
        keep = torch.tensor(rows, dtype=torch.long, device=self.device)
        width = max(r.used for r in self.rows.values())
        self._each_kv(lambda x: x.index_select(0, keep)[:, :, :width])

    # ------------------------------------------------------------------ internals
    def _get(self, key: Key) -> _Row:
        try:
            return self.rows[key]
        except KeyError:
            raise KeyError(f"request {key!r} was never begun (or was dropped)") from None

    def _row_inputs(self, key: Key, tree: PartialTree, nodes: list[int]) -> RowInputs:
        """The single drafter's checks and inputs for one request (see ModelDrafter.expand)."""
        row = self.rows[key]
        if 0 in nodes:
            if len(nodes) != 1:
                raise ValueError("the root must be expanded on its own, before any other node")
            if row.slots:
                raise ValueError("the root was already expanded for this tree")
            if not row.pending or row.pending[-1] != tree.tokens[0]:
                raise ValueError(f"root token {tree.tokens[0]} is not the last committed token "
                                 f"{row.pending[-1:] or None}")
            n = len(row.pending)
            return RowInputs(row.pending, list(range(row.prefix, row.prefix + n)), row.prefix,
                             [[]] * n, causal=True)
        bad = [n for n in nodes if tree.parents[n] not in row.slots or n in row.slots]
        if bad:
            raise ValueError(f"nodes {bad} cannot be expanded: each node is expanded once, after its parent")
        sees = ancestor_columns(tree, nodes, row.slots)
        return RowInputs([tree.tokens[n] for n in nodes], [row.prefix + tree.depth[n] for n in nodes],
                         row.prefix, sees)

    def _append_row(self, own: DynamicCache) -> None:
        """Append a batch-1 cache as the last row, both sides zero-padded to the longer length."""
        b = len(self.keys)
        for mine, theirs in zip(self.cache.layers, own.layers):
            if not mine.is_initialized and not theirs.is_initialized:
                continue
            ref = (mine if mine.is_initialized else theirs).keys
            width = max(x.keys.shape[2] for x in (mine, theirs) if x.is_initialized)

            def padded(layer, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
                if not layer.is_initialized:
                    z = ref.new_zeros(rows, ref.shape[1], width, ref.shape[3])
                    return z, z.clone()
                pad = (0, 0, 0, width - layer.keys.shape[2])
                return (torch.nn.functional.pad(layer.keys, pad), torch.nn.functional.pad(layer.values, pad))

            (mk, mv), (tk, tv) = padded(mine, b), padded(theirs, 1)
            if not mine.is_initialized:
                mine.lazy_initialization(tk, tv)
            mine.keys, mine.values = torch.cat([mk, tk]), torch.cat([mv, tv])

    def _initialized(self) -> bool:
        return any(layer.is_initialized for layer in self.cache.layers)

    def _each_kv(self, fn) -> None:
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys, layer.values = fn(layer.keys), fn(layer.values)

    def _settle(self, moves: list[tuple[int, int, int]], used: list[int]) -> None:
        """Apply column moves to every layer, then crop the shared length to the longest row."""
        width = max(used)

        def fix(x: torch.Tensor) -> torch.Tensor:
            move_columns(x, moves)
            return x[:, :, :width]

        self._each_kv(fix)
