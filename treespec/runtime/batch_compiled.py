"""Batched verification on compiled passes: ``BatchVerifier``'s contract (B requests with ragged
prefixes, ONE pass a step, ``compact`` / ``retain`` / ``add`` between steps) over static caches
and fixed-shape graphs, for a target whose passes are compiled (``compile_target``).

The live requests sit in the cache of their *batch bucket* (1, 2, 4, 8, ...: the smallest power
of two that holds them), one :class:`CompiledPasses` of that many cache rows each; bucket 1 is
the target's own passes (the graphs ``SpeculativeGenerator`` runs). Per layer, keys/values
[B_bucket, H, L, d]:

    row b:  slots [0, P_b)    request b's committed tokens except its root (valid)
            slots [P_b, L)    whatever earlier passes left there: no mask reads it

A pass writes every request's M nodes at the shared slots S .. S + M - 1 (S = max P_b) under a
mask that lets node i of request b read [0, P_b) and its ancestors, the M padded to a node
bucket and the requests to the batch bucket (a dummy row reads its own slot only), so row b
computes what ``TreeVerifier`` computes for request b alone. ``compact`` moves the kept slots to
P_b, P_b + 1, ...; nothing is zeroed or cropped. When the live count crosses a bucket, the rows
move to the other bucket's cache (a copy of their valid slots, at a join or leave only). A
joining request's prompt runs eagerly (``BatchVerifier``'s own prefill) and its rows are copied in.
"""

from __future__ import annotations

from typing import Sequence

import torch

from treespec.core.masks import padded_tree_masks
from treespec.core.tree_batch import TreeBatch
from treespec.runtime.batch_verifier import BatchVerifier, BatchVerifyOutput
from treespec.runtime.compiled import CompiledPasses

__all__ = ["BATCH_NODE_BUCKETS", "BatchPasses", "CompiledBatchVerifier", "batch_passes"]

# node buckets of the passes of more than one request: a chain of one draft at most. Each
# (batch, nodes) pair is a graph of its own (minutes to compile the first time), and on the
# CPUs measured auto plans no tree at batch >= 2 (serve_load_avx2.md); a larger tree runs eagerly
BATCH_NODE_BUCKETS = (1, 2)


def batch_bucket(batch: int) -> int:
    """The cache rows that ``batch`` requests run in: the smallest power of two >= batch."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    return 1 << (batch - 1).bit_length()


class BatchPasses:
    """The compiled passes of a target for every batch bucket (created on first use): bucket 1
    is the target's own ``passes``; the others are ``CompiledPasses`` of that many cache rows
    and :data:`BATCH_NODE_BUCKETS` nodes. One verifier at a time owns them (``owner``)."""

    def __init__(self, single: CompiledPasses, node_buckets: Sequence[int] = BATCH_NODE_BUCKETS):
        if single.batch != 1:
            raise ValueError(f"single must be one request's passes (batch 1), got batch {single.batch}")
        self.single = single
        self.model = single.model
        self.node_buckets = tuple(node_buckets)
        self.owner = None
        self._by_batch: dict[int, CompiledPasses] = {1: single}

    def of(self, batch: int) -> CompiledPasses:
        """The passes that ``batch`` requests run in."""
        rows = batch_bucket(batch)
        if rows not in self._by_batch:
            s = self.single
            self._by_batch[rows] = CompiledPasses(s.model, self.node_buckets, s.max_len, announce=s.announce,
                                                  cpp_wrapper=s.cpp_wrapper, head=s.head, role="server",
                                                  batch=rows)
        return self._by_batch[rows]

    @torch.inference_mode()
    def warm(self, max_batch: int, nodes: int = 1, layers: tuple[int, ...] = (), length: int = 0,
             draft_max_batch: int | None = None) -> None:
        """Compile now (before serving) the graphs of every batch bucket up to ``max_batch``
        requests, for trees of up to ``nodes`` nodes (the largest bucket's at batch > 1; one
        node in a bucket whose batches all exceed ``draft_max_batch``, where no request drafts)
        with the feature ``layers``, over caches of at least ``length`` positions. The caches'
        content is left undefined: no verifier may own them while this runs."""
        self.owner = None
        self.single.warm(nodes, layers, length)
        for b in sorted({batch_bucket(b) for b in range(2, max_batch + 1)}):
            passes = self.of(b)
            passes.reserve(length + passes.buckets[-1] + 1)
            drafts = draft_max_batch is None or b // 2 < draft_max_batch   # bucket b holds batches b/2+1 .. b
            top = (passes.bucket(nodes) or passes.buckets[-1]) if drafts else 1
            for m in (x for x in passes.buckets if x <= top):
                ids = torch.zeros(b, m, dtype=torch.long)
                pos = torch.arange(m).expand(b, m)
                allowed = torch.ones(m, m, dtype=torch.bool).tril().expand(b, m, m)
                passes.run_batch(ids, pos, allowed, 0, tuple(layers))


def batch_passes(target) -> BatchPasses:
    """The :class:`BatchPasses` of a target with compiled passes (made once, kept on its
    ``passes``: the server and its calibration share the graphs)."""
    if target.passes is None:
        raise ValueError(f"{target.name}'s passes are not compiled (compile_target(target) first)")
    if getattr(target.passes, "batched", None) is None:
        target.passes.batched = BatchPasses(target.passes)
    return target.passes.batched


class CompiledBatchVerifier(BatchVerifier):
    """A ``BatchVerifier`` whose passes run compiled (see the module docstring)."""

    def __init__(self, passes: BatchPasses, target_layers: tuple[int, ...] = ()):
        if not isinstance(passes, BatchPasses):
            raise TypeError(f"passes must be a BatchPasses (batch_passes(target)), got {type(passes).__name__}")
        super().__init__(passes.model, target_layers)
        self.passes = passes
        self.rows: CompiledPasses | None = None      # the bucket's passes whose cache holds the live rows

    @property
    def cache_len(self) -> int:
        """S, where the next pass writes: the longest valid prefix."""
        return max(self.prefix_lens, default=0)

    def _check_owner(self) -> None:
        if self.passes.owner is not self:
            raise RuntimeError("another verifier wrote the compiled batch caches since this one's prefill: "
                               "one verifier (one server) at a time runs on a target's compiled passes")
        if self.rows is self.passes.single and self.rows.owner is not self:
            raise RuntimeError("a generator's request took the target's compiled passes while this server's "
                               "request held them: run a server and a generator on separate targets "
                               "(compile_target each)")

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[torch.Tensor], features: bool = True):
        self.prefix_lens, self.rows, self._pending = [], None, None
        self.passes.owner = self
        return self.add(prompts, features)

    @torch.inference_mode()
    def add(self, prompts: Sequence[torch.Tensor], features: bool = True):
        if self.rows is None and not self.prefix_lens:
            self.passes.owner = self
        self._check_owner()
        if self._pending is not None:
            raise RuntimeError("compact() the last scores before add()")
        cache, lens, feats = self._prefill(prompts, features)      # eagerly, on a cache of their own
        old = self.batch_size
        self._move(list(range(old)), old + len(lens), max(self.prefix_lens + lens))
        s = max(lens)
        if s:
            for mine, theirs in zip(self.rows.cache.layers, cache.layers):
                mine.keys[old:old + len(lens), :, :s] = theirs.keys[:, :, :s]
                mine.values[old:old + len(lens), :, :s] = theirs.values[:, :, :s]
        self.prefix_lens = self.prefix_lens + lens
        self.cache = self.rows.cache
        return feats

    def _move(self, keep: list[int], batch: int, length: int) -> None:
        """The live rows ``keep`` (in that order) as rows 0, 1, ... of the cache of ``batch``
        requests, which holds at least ``length`` positions (a pass past its size grows it)."""
        dest = self.passes.of(batch)
        old = self.rows
        need = length + 1
        if dest is old:
            dest._ensure(need, keep=True)
            if keep != list(range(len(keep))):
                idx = torch.tensor(keep, device=self.device)
                for layer in dest.cache.layers:
                    layer.keys[:len(keep)] = layer.keys.index_select(0, idx)
                    layer.values[:len(keep)] = layer.values.index_select(0, idx)
        else:
            dest.reserve(need)
            if keep and old is not None:
                s = max(self.prefix_lens[i] for i in keep)
                idx = torch.tensor(keep, device=self.device)
                for new, prev in zip(dest.cache.layers, old.cache.layers):
                    new.keys[:len(keep), :, :s] = prev.keys.index_select(0, idx)[:, :, :s]
                    new.values[:len(keep), :, :s] = prev.values.index_select(0, idx)[:, :, :s]
        if dest is self.passes.single:
            dest.owner = self            # the target's own passes: a generator's prefill takes them back
        self.rows = dest
        self.cache = dest.cache

    @torch.inference_mode()
    def score(self, batch: TreeBatch, features: bool = True) -> BatchVerifyOutput:
        if self.rows is None:
            raise RuntimeError("call prefill() before score()")
        self._check_owner()
        self._check_batch(batch)
        s = self.cache_len
        ids, pos = self._rows(batch)
        allowed = padded_tree_masks(batch.trees, self.prefix_lens, s)        # [B, M, S + M]
        layers = self.target_layers if features else ()
        logits, hidden = self.rows.run_batch(ids, pos, allowed, s, layers)
        self.cache = self.rows.cache                       # a pass past the cache's size grows it
        self._pending = (s, batch.sizes)
        return self._outputs(batch, logits, hidden if layers else None)

    @torch.inference_mode()
    def compact(self, keeps: Sequence[torch.Tensor]) -> None:
        """Keep, per request, the tree rows ``keeps[b]`` (the root first) at slots P_b .. P_b +
        K_b - 1: request b then holds P_b + K_b valid slots (what lies past them is never read)."""
        rows = self._kept(keeps)
        self._check_owner()
        s = self._pending[0]
        rb, src, dst = [], [], []
        for b, (p, kl) in enumerate(zip(self.prefix_lens, rows)):
            rb += [b] * len(kl)
            src += [s + j for j in kl]
            dst += range(p, p + len(kl))
        if src != dst:
            rb, src, dst = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (rb, src, dst))
            for layer in self.rows.cache.layers:
                for kv in (layer.keys, layer.values):          # [B_bucket, H, L, D]
                    kv[rb, :, dst] = kv[rb, :, src]            # the right side is gathered first
        self.prefix_lens = [p + len(k) for p, k in zip(self.prefix_lens, rows)]
        self._pending = None

    @torch.inference_mode()
    def discard(self) -> None:
        """Undo the last ``score``: its rows lie past every valid prefix, where no mask reads."""
        if self._pending is None:
            raise RuntimeError("nothing to discard: call score() first")
        self._pending = None

    @torch.inference_mode()
    def retain(self, rows: Sequence[int]) -> None:
        if self._pending is not None:
            raise RuntimeError("compact() the last scores before retain()")
        rows = [int(r) for r in rows]
        if not rows or any(not 0 <= r < self.batch_size for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct request indices in [0, {self.batch_size}), got {rows}")
        self._check_owner()
        lens = [self.prefix_lens[r] for r in rows]
        self._move(rows, len(rows), max(lens))
        self.prefix_lens = lens

