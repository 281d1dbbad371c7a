"""A feature head's calls (EAGLE, EAGLE-3, MTP) as compiled, fixed-shape graphs over a static
KV cache, as ``treespec.runtime.compiled`` runs a target's passes.

A ``FeatureDrafter`` calls its head once per root (the committed slots not fed yet) and once per
frontier (F tree nodes): a few rows through embedding, fusion, one decoder block. Eagerly that
is ~60 Python-dispatched ops around seven small matrix products; :class:`CompiledHeadCalls`
hands the head's own ``forward`` to ``torch.compile`` with

- **a static cache**: keys / values [1, Hkv, L, d] preallocated (:class:`StaticSlots`); a call's
  rows are written at the drafter's next slots (``index_copy_``), and the drafter's stable cache
  (committed slots, then the current tree's) is just a count of slots in use;
- **row buckets**: F rows run in the graph of the smallest bucket >= F (1, 2, 4, 8); a dummy
  row carries token 0 and reads only its own slot, which lies past every real slot and is
  written again before anything reads it; more rows than the largest bucket (a prompt) run
  eagerly on the same buffers.

Every real row's output equals the eager call's to fp32 rounding, and acceptance reads the q
the draft came from, so the output law is untouched. Where the CPU runs the head's block as
two fused C++ calls (AVX-512 hosts, ``DraftBlock._fused_layers``), those are kept instead:
:func:`head_compiles` says which.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Sequence

import torch

from treespec.fastpath.graphs import DirectGraphs

__all__ = ["HEAD_BUCKETS", "CompiledHeadCalls", "StaticSlots", "head_compiles"]

HEAD_BUCKETS = (1, 2, 4, 8)
_LEN_STEP = 256
_ARGS = ("toks", "feat", "pos", "mask", "slots")   # _forward's tensor arguments, in order


class StaticSlots:
    """A head's KV cache as fixed buffers, keys / values [1, Hkv, L, d]. ``update`` (what
    ``DraftBlock`` calls on a cache layer) writes the call's rows at ``slots`` and returns the
    whole buffers, which the call's mask reads."""

    def __init__(self, heads: int, dim: int, length: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(1, heads, length, dim, dtype=dtype, device=device)
        self.values = torch.zeros(1, heads, length, dim, dtype=dtype, device=device)
        self.slots = torch.zeros(1, dtype=torch.long, device=device)

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.slots, k)
        self.values.index_copy_(2, self.slots, v)
        return self.keys, self.values


def head_compiles(head) -> bool:
    """Whether ``head``'s calls run compiled: not where its block takes the fused C++ calls
    (the AVX-512 row attention kernel with every linear layer on integer blocks)."""
    block = head.block
    layers = (block.q_proj, block.k_proj, block.v_proj, block.o_proj, block.gate_proj, block.up_proj,
              block.down_proj)
    from treespec.fastpath.packing import PackedLinear

    fused = block._row_kernel() and all(isinstance(layer, PackedLinear) and layer.blocks() is not None
                                        for layer in layers)
    return not fused


def _skip_head_guards(entries) -> list[bool]:
    """Dynamo's guards but those on the head's module tree (the contract: one head for the life
    of its calls, not replaced, re-packed or hooked meanwhile), as for a target's passes."""
    return ["self.head" not in entry.name for entry in entries]


class CompiledHeadCalls:
    """Compiled calls of one feature head over a static cache (see the module docstring).

    ``length``: the slots in use (the drafter's committed slots, then its tree's); a call
    writes at ``length``, ``length + 1``, ... and the caller moves ``length`` on."""

    def __init__(self, head, buckets: Sequence[int] = HEAD_BUCKETS, max_len: int = 512, announce: bool = True,
                 cpp_wrapper: bool | None = None):
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be row counts >= 1, e.g. {HEAD_BUCKETS}; got {buckets}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < buckets[-1] + 1:
            raise ValueError(f"max_len must be an int > the largest bucket ({buckets[-1]}), got {max_len!r}")
        self.head = head
        head.block._row_kernel()     # its CPU probe (a file read) cached now, not traced into a graph
        self.buckets = buckets
        self.announce = announce
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        block = head.block
        self.layer = StaticSlots(block.nkv, block.d, -(-max_len // _LEN_STEP) * _LEN_STEP, self.dtype, self.device)
        self.length = 0
        self._seen: set[tuple[int, int]] = set()
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.cpp_wrapper = self.device.type == "cpu" if cpp_wrapper is None else bool(cpp_wrapper)
        # its own copy of _forward's code: Dynamo keeps graphs and guards per code object; after a
        # key's first call its graph is called directly (DirectGraphs: no guards, no gathering)
        forward = types.FunctionType(CompiledHeadCalls._forward.__code__.replace(), globals(), "_forward")
        self._graphs = DirectGraphs({"cpp_wrapper": True} if self.cpp_wrapper else {}, _ARGS)
        self._graph = torch.compile(types.MethodType(forward, self), fullgraph=True, dynamic=False,
                                    backend=self._graphs.backend, options={"guard_filter_fn": _skip_head_guards})

    @property
    def max_len(self) -> int:
        return self.layer.keys.shape[2]

    def _forward(self, toks, feat, pos, mask, slots):
        self.layer.slots = slots       # an argument, so that a direct call passes each call's own
        g, _ = self.head(toks, feat, pos, self.layer, mask)
        return g

    def reserve(self, length: int) -> None:
        """Buffers of at least ``length`` slots, the slots in use kept."""
        if length <= self.max_len:
            return
        old = self.layer
        block = self.head.block
        self._graphs.forget()                # their inputs hold the old buffers
        self.layer = StaticSlots(block.nkv, block.d, -(-length // _LEN_STEP) * _LEN_STEP, self.dtype, self.device)
        self.layer.keys[:, :, :self.length] = old.keys[:, :, :self.length]
        self.layer.values[:, :, :self.length] = old.values[:, :, :self.length]

    @torch.inference_mode()
    def run(self, toks: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """One call over F new slots written at ``length``, ...: ``toks`` LongTensor[1, F],
        ``feat`` [1, F, H], ``pos`` LongTensor[1, F], ``allowed`` BoolTensor[F, length + F] (the
        slots each row reads); returns g [F, H] and moves ``length`` on by F."""
        n, start = toks.shape[1], self.length
        bucket = next((b for b in self.buckets if b >= n), None)
        rows = bucket or n
        self.reserve(start + rows + self.buckets[-1] + 1)
        dev, L = self.device, self.max_len
        ids = torch.zeros(1, rows, dtype=torch.long, device=dev)
        ids[0, :n] = toks[0]
        f = torch.zeros(1, rows, feat.shape[-1], dtype=feat.dtype, device=dev)
        f[0, :n] = feat[0]
        p = torch.full((1, rows), start, dtype=torch.long, device=dev)
        p[0, :n] = pos[0]
        mask = torch.zeros(1, 1, rows, L, dtype=torch.bool, device=dev)
        own = torch.arange(rows, device=dev)
        mask[0, 0, own, start + own] = True                  # dummy rows: their own slot only
        mask[0, 0, :n, :start + n] = allowed
        slots = torch.arange(start, start + rows, device=dev)
        self.layer.slots = slots
        if bucket is None:                                   # past every bucket (a prompt): eagerly
            g = self._forward(ids, f, p, mask, slots)
        elif (direct := self._graphs.get((rows, L))) is not None:
            g, _ = direct((ids, f, p, mask, slots))
        else:
            key = (rows, L)
            fresh = key not in self._seen
            if fresh and self.announce:
                wrapper = "; its C++ wrapper takes minutes the first time" if self.cpp_wrapper else ""
                print(f"treespec: compiling the feature head's {rows}-row call (cache {L} slots{wrapper}; "
                      "Inductor caches it on disk)...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            with self._graphs.capturing():
                g = self._graph(ids, f, p, mask, slots)
            if fresh:
                self._seen.add(key)
                if self.announce:
                    print(f"treespec: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
                # the call again, directly: the same slots rewritten with the same rows
                self._graphs.adopt(key, (ids, f, p, mask, slots), (g,))
        self.length = start + n
        return g[0, :n]

    @torch.inference_mode()
    def warm(self, length: int = 0) -> None:
        """Compile now (before a clock starts) every bucket's graph for buffers of at least
        ``length`` slots; the slots in use are left undefined (call before a request's begin)."""
        self.length = 0
        self.reserve(length + self.buckets[-1] + 1)
        hidden = self.head.cfg.hidden_size
        for b in self.buckets:
            if (b, self.max_len) in self._seen:
                continue
            self.length = 0
            self.run(torch.zeros(1, b, dtype=torch.long, device=self.device),
                     torch.zeros(1, b, hidden, dtype=self.dtype, device=self.device),
                     torch.arange(b, device=self.device)[None], torch.ones(b, b, dtype=torch.bool).tril())
        self.length = 0
