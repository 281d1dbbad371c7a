"""BatchFeatureDrafter: ``FeatureDrafter`` (EAGLE, EAGLE-3, MTP) for many requests, ONE head
forward per call.

Per request (key) the state is the single drafter's (``treespec.drafters.feature``, whose
glossary of slots, features and the stable cache applies): ``committed`` slots computed from
the target's true features, ``pending`` slots queued at commit, the root's position, and per
tree node -> g (predicted feature) and node -> cache column. The K/V of every request live in
one right-padded [B, H_kv, S, d] pair (row b = ``keys[b]``, see ``treespec.drafters.batched``):
a call runs the head once over max F_b new positions per row (4-D mask over the row's own
columns, positions per row) and writes row b's F_b new K/V right after its ``used`` columns,
so each row is laid out exactly as the single drafter's cache. ``commit`` drops the row's tree
region (``used = committed``); ``drop`` removes the row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.drafters.batched import (
    DraftAnswer, DraftCall, Key, RowCheckpoints, RowInputs, ancestor_columns, batch_inputs, check_calls,
)


@dataclass
class _Row:
    committed: int = 0                            # committed slots in the cache
    pending_tokens: list[int] = field(default_factory=list)
    pending_feats: torch.Tensor | None = None     # [n, H] fused features of the pending slots
    pending_raw: list[dict[int, torch.Tensor]] = field(default_factory=list)   # queued, not fused yet
    root_token: int = -1
    root_pos: int = -1
    g: dict[int, torch.Tensor] = field(default_factory=dict)    # node -> predicted feature [H]
    slot: dict[int, int] = field(default_factory=dict)          # node -> cache column
    used: int = 0                                 # columns holding the row's cache

    def copy(self) -> "_Row":
        # tensors are replaced, never written in place: sharing them is safe
        return replace(self, pending_tokens=list(self.pending_tokens), pending_raw=list(self.pending_raw),
                       g=dict(self.g), slot=dict(self.slot))


class BatchFeatureDrafter(RowCheckpoints):
    """Many requests of a feature-head drafter (see the module docstring)."""

    needs_target_hidden = True
    path_independent = False

    def __init__(self, head: torch.nn.Module, vocab_size: int):
        """``head``: a ``treespec.drafters.feature.FeatureHead`` (not imported: feature.py imports us)."""
        self.head = head.eval().requires_grad_(False)
        self.vocab_size = int(vocab_size)
        self.target_layers = head.target_layers
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        d2t = head.draft_to_target
        self.d2t = None if d2t is None else d2t.to(self.device)
        blk = head.block
        self.k = torch.zeros(0, blk.nkv, 0, blk.d, device=self.device, dtype=self.dtype)
        self.v = self.k.clone()
        self.keys: list[Key] = []
        self.rows: dict[Key, _Row] = {}
        self.calls = 0

    # ------------------------------------------------------------------ protocol
    def begin(self, key: Key, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        if key in self.rows:
            raise ValueError(f"request {key!r} was already begun")
        ids = [int(t) for t in prompt_ids.tolist()]
        row = _Row(root_token=ids[-1])
        self._queue(row, ids[1:], features)
        self.k = torch.cat([self.k, self.k.new_zeros(1, *self.k.shape[1:])])
        self.v = torch.cat([self.v, self.v.new_zeros(1, *self.v.shape[1:])])
        self.keys.append(key)
        self.rows[key] = row

    @torch.inference_mode()
    def expand_batch(self, calls: Sequence[DraftCall]) -> list[DraftAnswer]:
        check_calls(calls, self.rows.__contains__)
        self._fuse_pending([self.rows[key] for key, _, nodes in calls if 0 in nodes])
        s = self.k.shape[2]
        inputs: list[RowInputs | None] = [None] * len(self.keys)
        feats: list[torch.Tensor | None] = [None] * len(self.keys)
        for key, tree, nodes in calls:
            b = self.keys.index(key)
            inputs[b], feats[b] = self._row_inputs(self.rows[key], tree, nodes)
        ids, pos, allowed = batch_inputs(inputs, s, self.device)
        m = ids.shape[1]
        h = self.head.cfg.hidden_size
        # [B, M, H]: each row's input features, zero padded
        feat = torch.zeros(len(self.keys), m, h, device=self.device, dtype=self.dtype)
        for b, f in enumerate(feats):
            if f is not None:
                feat[b, :f.shape[0]] = f
        self.calls += 1
        past = (self.k, self.v) if s else None
        g, (k_new, v_new) = self.head(ids, feat, pos, past, allowed[:, None])
        counts = [0 if r is None else len(r.tokens) for r in inputs]
        self._write(k_new, v_new, counts)
        picked, sizes = [], []
        for key, tree, nodes in calls:
            b = self.keys.index(key)
            row, f = self.rows[key], counts[b]
            if nodes == [0]:
                self._after_root(row, f)
                row.g[0] = g[b, f - 1]
                picked.append(g[b, f - 1:f])
            else:
                for r, n in enumerate(nodes):
                    row.g[n] = g[b, r]
                    row.slot[n] = row.used + r
                picked.append(g[b, :f])
            row.used += f
            sizes.append(picked[-1].shape[0])
        # one LM-head pass over every request's rows
        logits = self.head.logits(torch.cat(picked)).float()
        return [(x, self.d2t) for x in logits.split(sizes)]

    def commit(self, key: Key, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        row = self._get(key)
        toks = [int(t) for t in tokens.tolist()]
        if features.length != len(toks):
            raise ValueError(f"commit needs features for the old root and the {len(toks) - 1} accepted "
                             f"nodes ({len(toks)} rows), got {features.length}")
        # stable cache: the row keeps its committed slots only (its columns past them are stale)
        row.used, row.g, row.slot = row.committed, {}, {}
        row.root_token = toks[-1]
        self._queue(row, toks, features)
        width = max(r.used for r in self.rows.values())
        self.k, self.v = self.k[:, :, :width], self.v[:, :, :width]

    def drop(self, key: Key) -> None:
        self._get(key)
        b = self.keys.index(key)
        del self.rows[key]
        self.keys.pop(b)
        rows = [i for i in range(len(self.keys) + 1) if i != b]
        keep = torch.tensor(rows, dtype=torch.long, device=self.device)
        width = max((r.used for r in self.rows.values()), default=0)
        self.k = self.k.index_select(0, keep)[:, :, :width]
        self.v = self.v.index_select(0, keep)[:, :, :width]

    # ------------------------------------------------------------------ internals
    def _get(self, key: Key) -> _Row:
        try:
            return self.rows[key]
        except KeyError:
            raise KeyError(f"request {key!r} was never begun (or was dropped)") from None

    def _queue(self, row: _Row, tokens: list[int], features: TargetFeatures) -> None:
        """Queue committed slots (tokens[i], feature row i), fed at the next root expansion; their
        features are fused then, for every request in one head call (``_fuse_pending``)."""
        if features.length != len(tokens):
            raise ValueError(f"{len(tokens)} tokens but {features.length} feature rows")
        if not tokens:
            return
        row.pending_tokens += tokens
        row.pending_raw.append({l: features.hidden[l] for l in self.target_layers})

    def _fuse_pending(self, rows: list[_Row]) -> None:
        """Fuse the queued target features of ``rows`` in ONE ``head.fuse`` call (per request it
        would be B small matmuls every step) into each row's ``pending_feats``."""
        rows = [r for r in rows if r.pending_raw]
        if not rows:
            return
        chunks = [c for r in rows for c in r.pending_raw]
        hidden = {l: torch.cat([c[l] for c in chunks]).to(self.device, self.dtype) for l in self.target_layers}
        fused = self.head.fuse(hidden).split([sum(next(iter(c.values())).shape[0] for c in r.pending_raw)
                                              for r in rows])
        for r, f in zip(rows, fused):
            r.pending_feats = f if r.pending_feats is None else torch.cat((r.pending_feats, f))
            r.pending_raw = []

    def _row_inputs(self, row: _Row, tree: PartialTree, nodes: list[int]):
        """(RowInputs, input features [F, H]) of one request: FeatureDrafter's checks and inputs."""
        h = self.head.cfg.hidden_size
        if 0 in nodes:
            if len(nodes) != 1:
                raise ValueError("the root must be expanded on its own, before any other node")
            if tree.tokens[0] != row.root_token:
                raise ValueError(f"root token {tree.tokens[0]} is not the last committed token {row.root_token}")
            if 0 in row.g:
                raise ValueError("the root was already expanded for this tree")
            n = len(row.pending_tokens)
            if n == 0:   # a one-token prompt: a temporary root slot, zero feature, position 0
                return RowInputs([row.root_token], [0], 0, [[]]), \
                    torch.zeros(1, h, device=self.device, dtype=self.dtype)
            c = row.committed
            return RowInputs(row.pending_tokens, list(range(c, c + n)), c, [[]] * n, causal=True), \
                row.pending_feats
        bad = [n for n in nodes if tree.parents[n] not in row.g or n in row.g]
        if bad:
            raise ValueError(f"nodes {bad} cannot be expanded: each node is expanded once, after its parent")
        sees = ancestor_columns(tree, nodes, row.slot)
        feat = torch.stack([row.g[tree.parents[n]] for n in nodes])
        positions = [row.root_pos + tree.depth[n] for n in nodes]
        return RowInputs([tree.tokens[n] for n in nodes], positions, row.committed, sees), feat

    @staticmethod
    def _after_root(row: _Row, f: int) -> None:
        """Bookkeeping of a root expansion that fed ``f`` positions."""
        if not row.pending_tokens:      # the temporary root slot
            row.root_pos, row.slot[0] = 0, row.used
            return
        row.committed += f
        row.root_pos = row.committed - 1
        row.pending_tokens, row.pending_feats = [], None

    def _write(self, k_new: torch.Tensor, v_new: torch.Tensor, counts: list[int]) -> None:
        """Row b's first counts[b] new K/V columns go right after its used columns."""
        used = [self.rows[k].used for k in self.keys]
        width = max(u + c for u, c in zip(used, counts))
        if width > self.k.shape[2]:
            grow = (0, 0, 0, width - self.k.shape[2])
            self.k = torch.nn.functional.pad(self.k, grow)
            self.v = torch.nn.functional.pad(self.v, grow)
        moves = [(b, r, u + r) for b, (u, c) in enumerate(zip(used, counts)) for r in range(c)]
        idx = torch.tensor(moves, dtype=torch.long, device=self.device)
        self.k[idx[:, 0], :, idx[:, 2]] = k_new[idx[:, 0], :, idx[:, 1]]
        self.v[idx[:, 0], :, idx[:, 2]] = v_new[idx[:, 0], :, idx[:, 1]]
