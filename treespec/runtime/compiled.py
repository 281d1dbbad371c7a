"""The target's verify passes as compiled, fixed-shape graphs over a preallocated KV cache.

Eager PyTorch runs a SmolLM2 pass as ~2,000 Python-dispatched ops (30 layers of norms, rotary
embeddings, attention, residual adds around the packed linear layers); on a CPU that costs as
much as the linear layers' own arithmetic. :class:`CompiledPasses` hands the *stock* HF model's
``forward`` to ``torch.compile`` (nothing of the model forked or patched) with:

- **a static cache**: HF's own ``StaticCache``, ``max_len`` positions preallocated, written at
  ``cache_position``; compaction after a tree pass moves the accepted rows in place;
- **node buckets**: a tree of n nodes runs in the graph of the smallest bucket >= n (default
  1, 2, 4, 8, 16, 32, 64); the ``b - n`` dummy rows carry token 0, attend to their own slot only
  and write cache slots beyond the tree, which no later mask lets anyone read, so they change
  no real row's output;
- **custom operators**: the packed kernels run inside the graph as ``torch.ops.treespec.*``
  (:mod:`treespec.fastpath.ops`), not as graph breaks;
- **direct calls**: after a key's first pass, its compiled graph is called with the inputs it
  was compiled on (:class:`DirectGraphs`), without Dynamo's guards and gathering of inputs
  (~0.8 ms of a 1-node SmolLM2 pass on AVX2).

One graph per (bucket, feature layers) is compiled on first use; Inductor caches its code on
disk, so a later process compiles in seconds. A prompt's prefill stays eager (one long pass).
Every real row's logits equal the eager pass's to fp32 rounding (fused norms may round
differently), and the block kernels are batch-invariant, so greedy decoding on the compiled
path equals plain decoding on the compiled path token for token (``tests/test_compiled.py``).

A drafter model's calls (:func:`compile_drafter`) run through the same class: each call is F
rows written at the next cache slots under a bool mask (:meth:`CompiledPasses.run`), padded to
:data:`DRAFTER_BUCKETS`; with a sliced draft vocabulary the graph ends at the decoder.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Sequence

import torch

from treespec.core.tree import DraftTree
from treespec.fastpath.graphs import DirectGraphs

__all__ = ["DEFAULT_BUCKETS", "DRAFTER_BUCKETS", "CompiledPasses", "compile_drafter", "compile_drafter_for",
           "compile_target", "drafter_passes", "feature_drafter", "model_drafter", "parse_buckets", "warm_drafter"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# a drafter model's calls: a chain expands one node a call, and a root call feeds 1-2 tokens
# (the bonus token, and the last draft where it was accepted unexpanded); a tree's frontier 4
DRAFTER_BUCKETS = (1, 2, 4)
_LEN_STEP = 256          # the cache grows in whole steps of this many positions (each size recompiles)


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"1,5"`` -> (1, 5): node counts to compile graphs for, from a command line."""
    try:
        buckets = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ValueError(f"buckets {text!r}: expected comma-separated node counts, e.g. 1,2,4") from None
    if buckets[0] < 1:
        raise ValueError(f"buckets {text!r}: node counts start at 1")
    return buckets


def compile_target(target, buckets: Sequence[int] = DEFAULT_BUCKETS, max_len: int = 512):
    """``target`` (the same model object) with its tree passes run as compiled, fixed-shape graphs
    over a preallocated cache (:class:`CompiledPasses`: ``buckets`` node counts, ``max_len``
    positions to start with): a new :class:`treespec.Target` whose generators verify through
    them, one request at a time."""
    from dataclasses import replace

    passes = CompiledPasses(target.model, buckets, max_len)
    return replace(target, passes=passes, speed_path=f"{target.speed_path}; passes: compiled (torch.compile, "
                                                     f"buckets {', '.join(map(str, passes.buckets))} nodes)")


def model_drafter(drafter):
    """The :class:`treespec.drafters.ModelDrafter` that ``drafter`` drafts with (itself, or a
    hybrid or switch drafter's head), or None."""
    from treespec.drafters.model import ModelDrafter

    while drafter is not None and not isinstance(drafter, ModelDrafter):
        drafter = getattr(drafter, "head", None)
    return drafter


def feature_drafter(drafter):
    """The :class:`treespec.drafters.feature.FeatureDrafter` (EAGLE, EAGLE-3, MTP) that
    ``drafter`` drafts with (itself, or a hybrid or switch drafter's head), or None."""
    from treespec.drafters.feature import FeatureDrafter

    while drafter is not None and not isinstance(drafter, FeatureDrafter):
        drafter = getattr(drafter, "head", None)
    return drafter


def drafter_passes(drafter) -> "CompiledPasses | None":
    """The compiled passes of ``drafter``'s model (:func:`model_drafter`), or None."""
    return getattr(model_drafter(drafter), "passes", None)


def warm_drafter(drafter, length: int) -> None:
    """Compile now (off any clock) every bucket of ``drafter``'s compiled calls, a model's or a
    feature head's, for a cache of at least ``length`` positions; nothing where it has none.
    Its cache content is left undefined: call before a request's ``begin``."""
    if (passes := drafter_passes(drafter)) is not None:
        passes.warm(passes.buckets[-1], (), length)
    elif (head := getattr(feature_drafter(drafter), "compiled", None)) is not None:
        head.warm(length)


def compile_drafter(drafter, buckets: Sequence[int] = DRAFTER_BUCKETS, max_len: int = 512):
    """``drafter`` (changed in place and returned) with its calls run as compiled, fixed-shape
    graphs over a preallocated cache, as :func:`compile_target` runs a target's:

    - a :class:`treespec.drafters.ModelDrafter` (a small model of the target's family, an
      early-exit model), or a hybrid or switch drafter that drafts with one: its model's calls,
      padded to ``buckets`` rows; a call of more rows (the prompt) runs eagerly on the same
      cache; with a ``draft_vocab`` the graphs end at the decoder and the sliced head runs after;
    - a feature drafter (EAGLE, EAGLE-3, MTP; or a hybrid over one): its head's calls
      (:class:`treespec.drafters.feature_compiled.CompiledHeadCalls`, rows padded to 1, 2, 4,
      8). Where the CPU runs the head's block as two fused C++ calls (AVX-512), ValueError.

    The drafts' q is the eager call's to fp32 rounding, and acceptance reads that q, so the
    output stays exact."""
    inner = model_drafter(drafter)
    if inner is not None:
        inner.passes = CompiledPasses(inner.model, buckets, max_len, head=inner.vocab_head is None, role="drafter")
        return drafter
    feature = feature_drafter(drafter)
    if feature is None:
        raise TypeError(f"compile_drafter compiles a drafter model's or a feature head's calls; a "
                        f"{type(drafter).__name__} has neither (pass a ModelDrafter, e.g. "
                        "load_drafter('qwen2.5-coder-0.5b', target), a feature drafter such as eagle3, or a "
                        "hybrid / switch drafter over one)")
    from treespec.drafters.feature_compiled import CompiledHeadCalls, head_compiles

    if not head_compiles(feature.head):
        raise ValueError("this CPU runs the feature head's block as two fused C++ calls already (AVX-512 row "
                         "attention, integer-block linear layers); its calls are not compiled")
    feature.compiled = CompiledHeadCalls(feature.head, max_len=max_len)
    return drafter


def compile_drafter_for(target, drafter):
    """``drafter`` with its calls compiled (:func:`compile_drafter`, the cache sized as the
    target's) where ``target``'s passes are compiled and the drafter has a model or a feature
    head of its own whose calls can be and are not compiled yet; else ``drafter`` as it is.
    What ``--compile`` does to a drafter."""
    if target.passes is None:
        return drafter
    if model_drafter(drafter) is not None:
        if drafter_passes(drafter) is None:
            compile_drafter(drafter, max_len=target.passes.max_len)
        return drafter
    feature = feature_drafter(drafter)
    if feature is not None and feature.compiled is None:
        from treespec.drafters.feature_compiled import head_compiles

        if head_compiles(feature.head):
            compile_drafter(drafter, max_len=target.passes.max_len)
    return drafter


def _skip_model_guards(entries) -> list[bool]:
    """Which of Dynamo's guards a pass runs: all but those on the model's module tree (its
    submodules, their hooks and weights: about 800 checks, 2.4 ms of a SmolLM2 pass on AVX2);
    those on the inputs, the cache and the globals stay. In their place, the contract of
    :class:`CompiledPasses`: one model for its life, whose modules are not replaced, re-packed or
    hooked while its passes run."""
    return ["self.model" not in entry.name for entry in entries]


_ARGS = ("ids", "pos", "cache_pos", "mask")     # _forward's tensor arguments, as :meth:`CompiledPasses.inputs` orders them


class CompiledPasses:
    """Compiled verify passes of one HF causal LM; one request at a time owns the cache.

    ``buckets``: the node counts graphs are compiled for (a larger tree runs eagerly on the same
    cache). ``max_len``: positions preallocated; a request that needs more grows the cache to the
    next multiple of 256 (copying its rows) and compiles again for that size.
    """

    def __init__(self, model: torch.nn.Module, buckets: Sequence[int] = DEFAULT_BUCKETS, max_len: int = 512,
                 announce: bool = True, cpp_wrapper: bool | None = None, head: bool = True, role: str = "target",
                 batch: int = 1):
        buckets = tuple(sorted(set(int(b) for b in buckets)))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"buckets must be node counts >= 1, e.g. {DEFAULT_BUCKETS}; got {buckets}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < buckets[-1] + 1:
            raise ValueError(f"max_len must be an int > the largest bucket ({buckets[-1]}), got {max_len!r}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1 (requests the cache holds), got {batch!r}")
        self.model = model
        self.batch = batch                      # rows of the cache: 1 = one request (run / score / prefill)
        self.head = bool(head)                  # False: passes end at the decoder's final norm (no LM head)
        self.role = role                        # whose passes these are, in what they announce
        self.buckets = buckets
        self.max_len = -(-max_len // _LEN_STEP) * _LEN_STEP
        self.announce = announce
        self.cache = None
        self.owner = None                       # the TreeVerifier whose request the cache holds
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._seen: set[tuple] = set()          # (batch, bucket, layers, max_len) graphs compiled in this process
        self._slots: torch.Tensor | None = None # 0 .. max_len - 1: a one-token step's mask is slots <= start
        import torch._dynamo

        # one graph per bucket x feature-layer set x cache size; never fall back to eager silently
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # Inductor's C++ wrapper (the default on a CPU): the graph's kernels and treespec's operators
        # called from generated C++, not Python; a SmolLM2 pass on AVX2 19.5 -> 15.9 ms. A graph's
        # first compile then takes minutes instead of ~20 s (later processes: Inductor's disk cache)
        self.cpp_wrapper = self.device.type == "cpu" if cpp_wrapper is None else bool(cpp_wrapper)
        # Dynamo keeps graphs and their guards per code object: this instance compiles its own copy of
        # _forward's code, so no guard needs to tell its model from another CompiledPasses' model
        forward = types.FunctionType(CompiledPasses._forward.__code__.replace(), globals(), "_forward",
                                     CompiledPasses._forward.__defaults__)
        self._graphs = DirectGraphs({"cpp_wrapper": True} if self.cpp_wrapper else {}, _ARGS)
        self._graph = torch.compile(types.MethodType(forward, self), fullgraph=True, dynamic=False,
                                    backend=self._graphs.backend, options={"guard_filter_fn": _skip_model_guards})

    # -------------------------------------------------------------- the cache
    def _ensure(self, length: int, keep: bool) -> None:
        """A cache of at least ``length`` positions, every layer allocated; a new one where there
        is none or it is too short, holding the old one's rows where ``keep``."""
        from transformers import StaticCache

        if self.cache is not None and length <= self.max_len:
            return
        old, self.max_len = self.cache, max(self.max_len, -(-length // _LEN_STEP) * _LEN_STEP)
        self._graphs.forget()                   # their inputs name the old cache's tensors
        self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        self._materialize()
        if keep and old is not None:
            for new, prev in zip(self.cache.layers, old.layers):
                n = prev.keys.shape[-2]
                new.keys[..., :n, :].copy_(prev.keys)
                new.values[..., :n, :].copy_(prev.values)

    def _room(self, end: int) -> None:
        """A cache holding slots up to ``end`` (exclusive), its rows kept: grown where it is
        shorter, with room for one more largest tree after it."""
        if end > self.max_len:
            self._ensure(end + self.buckets[-1] + 1, keep=True)

    def reserve(self, length: int) -> None:
        """A cache of at least ``length`` positions for a new request (its content undefined)."""
        self._ensure(length, keep=False)

    def _materialize(self) -> None:
        """Allocate every layer's tensors now (HF does it on the first write), so the compiled
        graphs always see the same tensors."""
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        like = torch.zeros(self.batch, heads, 1, dim, dtype=self.dtype, device=self.device)
        for layer in self.cache.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(like, like)

    @torch.inference_mode()
    def _set_length(self, length: int) -> None:
        """HF's static layers write at their own counter (``cumulative_length``), not at
        ``cache_position``: point it at ``length`` before a pass."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    @torch.inference_mode()
    def prefill(self, body: torch.Tensor, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """Cache the prompt ``body`` (LongTensor[P], eagerly: one long pass); returns the hidden
        states of ``layers`` [P, H]."""
        self._one_request("prefill")
        self._ensure(body.numel() + self.buckets[-1] + 1, keep=False)
        self._set_length(0)
        if body.numel() == 0:
            return {}
        out = self.model(input_ids=body.to(self.device)[None], cache=self.cache,
                         cache_position=torch.arange(body.numel(), device=self.device), use_cache=True,
                         output_hidden_states=bool(layers), logits_to_keep=1)
        return {i: out.hidden_states[i][0] for i in layers}

    # -------------------------------------------------------------- passes
    def _one_request(self, what: str) -> None:
        if self.batch != 1:
            raise RuntimeError(f"{what} runs one request's passes; this cache holds {self.batch} requests "
                               "(run_batch, as CompiledBatchVerifier does)")

    def _forward(self, ids, pos, cache_pos, mask, layers: tuple[int, ...], last_only: bool = False):
        # the eager fallback's long passes (a drafter's prompt) ask for the last row's logits only
        args = dict(input_ids=ids, position_ids=pos, cache_position=cache_pos, attention_mask=mask,
                    cache=self.cache, use_cache=True, output_hidden_states=bool(layers))
        if not self.head:
            out = self.model.get_decoder()(**args)
            return out.last_hidden_state, tuple(out.hidden_states[i] for i in layers)
        out = self.model(**args, **({"logits_to_keep": 1} if last_only else {}))
        return out.logits, tuple(out.hidden_states[i] for i in layers)

    def bucket(self, nodes: int) -> int | None:
        """The smallest bucket holding ``nodes`` nodes, or None (the pass runs eagerly)."""
        return next((b for b in self.buckets if b >= nodes), None)

    def inputs(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, start: int, rows: int):
        """(ids, positions, cache positions, bool mask [1, 1, rows, max_len]) of F rows written at
        cache slots ``start``, ``start + 1``, ...: ``ids`` and ``pos`` LongTensor[F], ``allowed``
        BoolTensor[F, start + F] (the slots each row reads), padded with dummy rows to ``rows``."""
        n, dev = ids.numel(), self.device
        padded_ids = torch.zeros(1, rows, dtype=torch.long, device=dev)
        padded_ids[0, :n] = ids.to(dev)
        padded_pos = torch.full((1, rows), start, dtype=torch.long, device=dev)
        padded_pos[0, :n] = pos.to(dev)
        cache_pos = torch.arange(start, start + rows, device=dev)
        mask = torch.zeros(1, 1, rows, self.max_len, dtype=torch.bool, device=dev)
        mask[0, 0, :n, :start + n] = allowed.to(dev)
        dummy = torch.arange(n, rows, device=dev)
        mask[0, 0, dummy, start + dummy] = True             # a dummy row sees its own slot only
        return padded_ids, padded_pos, cache_pos, mask

    @staticmethod
    def tree_rows(tree: DraftTree, prefix_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, positions, allowed) of ``tree``'s nodes after ``prefix_len`` cached positions:
        each node reads the prefix and its ancestors."""
        n = tree.num_nodes
        allowed = torch.ones(n, prefix_len + n, dtype=torch.bool)
        allowed[:, prefix_len:] = tree.ancestor_mask
        return tree.tokens, prefix_len + tree.depth, allowed

    @torch.inference_mode()
    def score(self, tree: DraftTree, prefix_len: int, layers: tuple[int, ...]):
        """Logits [N, V] of every node and the hidden states of ``layers`` ([N, H] each); writes
        the tree's rows at cache slots P, P + 1, ... (and the dummy rows' after them)."""
        return self.run(*self.tree_rows(tree, prefix_len), prefix_len, layers)

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, start: int,
            layers: tuple[int, ...] = (), last_only: bool = False):
        """One pass over F rows written at cache slots ``start``, ... (:meth:`inputs`): their
        logits [F, V] (the final hidden states [F, H] when built with ``head=False``; the last
        row's only, [1, ...], with ``last_only``) and the hidden states of ``layers`` ([F, H]
        each). F up to the largest bucket runs in its bucket's graph, a longer pass eagerly."""
        self._one_request("run")
        n = ids.numel()
        bucket = self.bucket(n)
        rows = bucket or n
        self._room(start + rows)
        padded = self.inputs(ids, pos, allowed, start, rows)
        self._set_length(start)
        if bucket is None:                                    # larger than every bucket: eager
            out, hidden = self._forward(*padded, layers, last_only)
            out = out[0, -1:] if last_only else out[0]
            return out, {i: h[0] for i, h in zip(layers, hidden)}
        out, hidden = self.call(padded, layers)
        return out[0, n - 1:n] if last_only else out[0, :n], {i: h[0, :n] for i, h in zip(layers, hidden)}

    @torch.inference_mode()
    def step(self, token: int, start: int) -> torch.Tensor:
        """The logits [1, V] of a one-token pass of ``token`` at position ``start`` (written at
        cache slot ``start``): :meth:`run` of that one row, its inputs built directly (a plain
        decoding step's; the same tensors ``inputs`` builds)."""
        self._one_request("step")
        if self.buckets[0] != 1:
            allowed = torch.ones(1, start + 1, dtype=torch.bool)
            return self.run(torch.tensor([token]), torch.tensor([start]), allowed, start)[0]
        self._room(start + 1)
        if self._slots is None or self._slots.numel() != self.max_len:
            self._slots = torch.arange(self.max_len, device=self.device)
        pos = torch.tensor([[start]], device=self.device)
        padded = (torch.tensor([[token]], device=self.device), pos, pos[0], (self._slots <= start)[None, None, None])
        self._set_length(start)
        out, _ = self.call(padded, ())
        return out[0, :1]

    def call(self, padded, layers: tuple[int, ...]):
        """The graph of ``padded`` (ids, positions, cache positions, mask; :meth:`inputs` or
        :meth:`batch_inputs`) shapes: (logits or final hidden states [batch, rows, ...], the
        hidden states of ``layers``), compiled on first use (announced: a C++ wrapper takes
        minutes the first time)."""
        rows = padded[0].shape[1]
        key = (self.batch, rows, layers, self.max_len)
        if (direct := self._graphs.get(key)) is not None:
            return direct(padded)
        fresh = key not in self._seen
        if fresh and self.announce:
            wrapper = "; its C++ wrapper takes minutes the first time" if self.cpp_wrapper else ""
            what = f"{rows}-node pass" if self.batch == 1 else f"pass of {self.batch} requests x {rows} nodes"
            print(f"treespec: compiling the {self.role}'s {what} (cache {self.max_len} positions{wrapper}; "
                  "Inductor caches it on disk)...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with self._graphs.capturing():
            out, hidden = self._graph(*padded, layers)
        if fresh:
            self._seen.add(key)
            if self.announce:
                print(f"treespec: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            # the same pass again through the captured graph, from the same cache length: where it
            # gives the same bits, later passes of this key call it directly
            self._set_length(int(padded[2][0]))
            self._graphs.adopt(key, padded, (out, *hidden))
        return out, hidden

    def batch_inputs(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, start: int, rows: int):
        """:meth:`inputs` for B <= ``batch`` requests of M rows each, written at cache slots
        ``start``, ... of their own cache rows: ``ids``, ``pos`` LongTensor[B, M], ``allowed``
        BoolTensor[B, M, start + M]; padded to ``rows`` nodes and ``batch`` requests (a dummy
        row, of a request or of a missing request, sees its own slot only)."""
        b, m = ids.shape
        dev = self.device
        padded_ids = torch.zeros(self.batch, rows, dtype=torch.long, device=dev)
        padded_ids[:b, :m] = ids.to(dev)
        padded_pos = torch.full((self.batch, rows), start, dtype=torch.long, device=dev)
        padded_pos[:b, :m] = pos.to(dev)
        cache_pos = torch.arange(start, start + rows, device=dev)
        mask = torch.zeros(self.batch, 1, rows, self.max_len, dtype=torch.bool, device=dev)
        own = torch.arange(rows, device=dev)
        mask[:, 0, own, start + own] = True                   # dummy rows: their own slot only
        mask[:b, 0, :m, :start + m] = allowed.to(dev)
        return padded_ids, padded_pos, cache_pos, mask

    @torch.inference_mode()
    def run_batch(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor, start: int,
                  layers: tuple[int, ...] = ()):
        """One pass over B requests' M rows each (:meth:`batch_inputs`), written at slots
        ``start``, ... of cache rows 0 .. B - 1: logits [B, M, V] and the hidden states of
        ``layers`` ([B, M, H] each). M up to the largest bucket runs in its bucket's graph, a
        longer pass eagerly."""
        b, m = ids.shape
        if b > self.batch:
            raise ValueError(f"{b} requests in a pass of a cache of {self.batch} rows")
        bucket = self.bucket(m)
        rows = bucket or m
        self._room(start + rows)
        padded = self.batch_inputs(ids, pos, allowed, start, rows)
        self._set_length(start)
        out, hidden = self._forward(*padded, layers) if bucket is None else self.call(padded, layers)
        return out[:b, :m], {i: h[:b, :m] for i, h in zip(layers, hidden)}

    @torch.inference_mode()
    def warm(self, nodes: int, layers: tuple[int, ...] = (), length: int = 0) -> None:
        """Compile now (before any clock starts) every bucket a tree of up to ``nodes`` nodes
        may use, with the feature ``layers`` the drafter reads, for a cache of at least
        ``length`` positions (a request's prompt + new tokens + a tree: the cache then never
        grows, and nothing compiles, while the request is timed): a dummy chain per bucket at
        an empty prefix. The cache's content is left undefined: call before a request's prefill."""
        self._ensure(length + self.buckets[-1] + 1, keep=False)
        top = self.bucket(nodes) or self.buckets[-1]
        todo = [b for b in self.buckets if b <= top and (self.batch, b, tuple(layers), self.max_len) not in self._seen]
        if not todo:
            return
        # one eager pass first: transformers installs its hidden-state hooks on the first call
        # that asks for them, under a lock a compiled graph cannot trace
        self.owner = None
        self.prefill(torch.zeros(1, dtype=torch.long, device=self.device), tuple(layers))
        for b in todo:
            chain = DraftTree(torch.zeros(b, dtype=torch.long), torch.arange(-1, b - 1))
            self.score(chain, 0, tuple(layers))

    @torch.inference_mode()
    def keep(self, start: int, rows: Sequence[int]) -> None:
        """Move cache slots ``rows`` (increasing, from ``start``) to ``start``, ``start + 1``, ...;
        the slots after them are left as they are (no mask reads them again)."""
        rows = list(rows)
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and rows[0] < start):
            raise ValueError(f"rows must increase from position {start} or later, got {rows}")
        if rows == list(range(start, start + len(rows))):
            return
        src = torch.tensor(rows, device=self.device)
        for layer in self.cache.layers:
            layer.keys[..., start:start + len(rows), :] = layer.keys.index_select(-2, src)
            layer.values[..., start:start + len(rows), :] = layer.values.index_select(-2, src)
