"""Measure this machine's verify and drafter pass times and fit a ``Calibration``.

``calibrate`` times the target's verify pass at n = 1 … 128 new tokens over a cached prefix
(``verify_passes``) and two stand-in drafters (the first layers of the target, and one layer +
LM head for a feature head); ``calibrate_batches`` adds the real batched pass
(``BatchVerifier.score`` over B trees of n nodes, ragged masks and per-row positions included).
Every curve is timed interleaved in a shuffled order (``measure_interleaved``), so slow drift of
a shared machine spreads over all points instead of biasing the late ones.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from treespec.planning.calibration import BATCH_NS, Calibration, Curve, _device_description
from treespec.planning.shapes import ModelShape

__all__ = [
    "BATCH_SIZES",
    "DEFAULT_NS",
    "DRAFT_WIDTHS",
    "batch_verify_passes",
    "bucket_steps",
    "calibrate",
    "calibrate_batches",
    "compiled_ns",
    "compiled_verify_passes",
    "measure",
    "measure_interleaved",
    "time_interleaved",
    "verify_passes",
]


# Token counts measured by default: every n up to 8 (where CPU cost is steep), then sparser.
DEFAULT_NS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64,
                               80, 96, 112, 128)


def measure(
    fn: Callable[[], object],
    n_warmup: int = 2,
    n_rep: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median seconds of ``fn()`` over ``n_rep`` calls after ``n_warmup`` untimed calls.

    ``fn`` must finish its work before returning (synchronise accelerators inside it).
    ``clock``: wall clock by default; ``time.thread_time`` counts only this thread's CPU
    time, which on a shared machine leaves out time other processes held the core (a
    single-threaded pass only: it ignores work done by other threads).
    """
    if not isinstance(n_warmup, int) or n_warmup < 0:
        raise ValueError(f"n_warmup must be an int >= 0, got {n_warmup!r}")
    if not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be an int >= 1, got {n_rep!r}")
    for _ in range(n_warmup):
        fn()
    times = []
    for _ in range(n_rep):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def measure_interleaved(
    fns: Sequence[Callable[[], object]],
    n_warmup: int = 2,
    n_rep: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> list[float]:
    """Median seconds of each of ``fns``, timed round-robin: rep r times fns[0], fns[1], …
    once each, so a slow drift of the machine (other processes, clock changes) hits every
    fn alike instead of distorting the curve between neighbours. Same arguments as ``measure``.
    """
    return [statistics.median(bucket) for bucket in time_interleaved(fns, n_warmup, n_rep, clock)]


def time_interleaved(
    fns: Sequence[Callable[[], object]],
    n_warmup: int = 2,
    n_rep: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> list[list[float]]:
    """Every timing ``measure_interleaved`` takes: ``n_rep`` seconds per fn, in rep order."""
    if not isinstance(n_warmup, int) or n_warmup < 0:
        raise ValueError(f"n_warmup must be an int >= 0, got {n_warmup!r}")
    if not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be an int >= 1, got {n_rep!r}")
    for _ in range(n_warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(n_rep):
        for fn, bucket in zip(fns, times):
            start = clock()
            fn()
            bucket.append(clock() - start)
    return times


def _truncated_model(model: Any, layers: int) -> Any:
    """A copy of ``model`` with only its first ``layers`` decoder layers (same weights, same
    final norm and LM head, its linear layers packed as ``model``'s are): the "early-exit"
    drafter."""
    import copy

    from transformers import AutoModelForCausalLM

    from treespec.fastpath.packing import linear_kernel, pack_linears

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    for attr in ("layer_types",):  # per-layer lists must shrink with the layer count
        if isinstance(getattr(config, attr, None), list):
            setattr(config, attr, getattr(config, attr)[:layers])
    param = next(model.parameters())
    draft = AutoModelForCausalLM.from_config(config, dtype=param.dtype).to(param.device)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"early-exit copy misses weights: {missing[:5]}")
    draft = draft.eval().requires_grad_(False)
    kernel = linear_kernel(model)
    if kernel != "stock":   # a stock copy of a packed target would time PyTorch's GEMM, not the target's
        pack_linears(draft, kernel=kernel)
    return draft


def verify_passes(model: Any, ns: Sequence[int], context: int, seed: int = 0) -> list[Callable[[], None]]:
    """One callable per n: a verify-shaped pass of ``model`` (a HF causal LM).

    Each call runs n tree tokens (a chain; the mask's shape, not the tree, sets the cost) over a
    cached prefix of ``context`` random tokens with the verifier's 4-D mask and positions, takes
    the softmax of the [n, V] logits, and crops the cache back to the prefix (shared by all
    callables, built once here). n = 1 runs as the verifier runs a root alone: the model's own
    one-token step, without mask or positions.
    """
    import torch
    from transformers import DynamicCache

    from treespec.fastpath.device import synchronize
    from treespec.core.masks import attn_implementation_of, tree_forward_args
    from treespec.core.tree import DraftTree

    param = next(model.parameters())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        if context:
            prefix = torch.randint(vocab, (1, context), generator=gen).to(param.device)
            model(input_ids=prefix, cache=cache, use_cache=True)
    attn_impl = attn_implementation_of(model)

    def make(n_tokens: int) -> Callable[[], None]:
        tree = DraftTree(torch.randint(vocab, (n_tokens,), generator=gen), torch.arange(-1, n_tokens - 1))

        @torch.inference_mode()
        def fn() -> None:
            pos, mask = tree_forward_args(tree, context, attn_impl, param.dtype, param.device)
            out = model(input_ids=tree.tokens.to(param.device)[None], position_ids=pos,
                        attention_mask=mask, cache=cache, use_cache=True)
            out.logits[0].float().softmax(-1)
            cache.crop(-n_tokens)
            synchronize(param.device)

        return fn

    return [make(n) for n in ns]


def compiled_verify_passes(passes: Any, ns: Sequence[int], context: int, seed: int = 0) -> list[Callable[[], None]]:
    """One callable per n, as :func:`verify_passes`, through ``passes`` (a
    :class:`treespec.runtime.compiled.CompiledPasses`): the graph of n's bucket over the static
    cache holding ``context`` random tokens, then the softmax of the n real rows' logits. Every
    bucket an n needs is compiled here, before any clock starts; the cache is taken from the
    request that held it (that request must prefill again)."""
    import torch

    from treespec.core.tree import DraftTree
    from treespec.fastpath.device import synchronize

    model = passes.model
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    passes.warm(max(ns), (), context)
    passes.owner = None
    passes.prefill(torch.randint(vocab, (context,), generator=gen), ())

    def make(n_tokens: int) -> Callable[[], None]:
        tree = DraftTree(torch.randint(vocab, (n_tokens,), generator=gen), torch.arange(-1, n_tokens - 1))

        def fn() -> None:
            logits, _ = passes.score(tree, context, ())
            logits.float().softmax(-1)
            synchronize(passes.device)

        return fn

    return [make(n) for n in ns]


def compiled_ns(passes: Any, top: int = 64) -> tuple[int, ...]:
    """The node counts a compiled target's curve is measured at: every bucket up to the one
    that holds ``top`` nodes (each runs one graph, so the cost of n nodes is the cost of n's
    bucket)."""
    last = passes.bucket(top) or passes.buckets[-1]
    return tuple(b for b in passes.buckets if b <= last)


def bucket_steps(curve: Curve, buckets: Sequence[int]) -> Curve:
    """``curve``, measured at ``buckets``, as the step function a compiled target runs: n nodes
    cost what n's bucket costs, so each bucket's time is also written at the previous bucket
    + 1 (``Curve`` interpolates between its points: flat inside a bucket, a step after it)."""
    ns: list[int] = []
    seconds: list[float] = []
    spread: list[float] | None = None if curve.spread is None else []
    previous = 0
    for i, (n, t) in enumerate(zip(curve.ns, curve.seconds)):
        for point in sorted({previous + 1, n}):
            ns.append(point)
            seconds.append(t)
            if spread is not None:
                spread.append(curve.spread[i])
        previous = n
    return Curve.fit(ns, seconds, spread)


# A calibration's 1-token pass is checked against fresh ones only when it took at least this long
# (shorter passes, e.g. tiny test models, time too noisily) ...
STALE_CHECK_MIN_SECONDS = 0.005
# ... and flagged when the two differ by more than this factor (timing spreads: 5-15 %).
STALE_PASS_FACTOR = 1.5


def pass_time_disagrees(calibration: Calibration, model: Any, reps: int = 5, passes: Any = None) -> str | None:
    """Why ``calibration``'s 1-token pass time t(1) no longer describes this machine, or None:
    the median of ``reps`` fresh passes (its own verify pass, :func:`verify_passes`, or through
    the compiled ``passes``) differs from it by more than :data:`STALE_PASS_FACTOR`, as when the
    file was measured under another load."""
    cached = calibration.target(1)
    if cached < STALE_CHECK_MIN_SECONDS:
        return None
    fns = (verify_passes(model, [1], context=calibration.context) if passes is None
           else compiled_verify_passes(passes, [1], context=calibration.context))
    fresh = measure(fns[0], n_warmup=1, n_rep=reps)
    if max(cached / fresh, fresh / cached) <= STALE_PASS_FACTOR:
        return None
    return (f"has t(1) = {cached * 1e3:.1f} ms, but a 1-token pass takes {fresh * 1e3:.1f} ms now "
            f"({cached / fresh:.2f}x)")


def _shuffled_curve(passes: Callable[[Sequence[int]], list[Callable[[], None]]], points: Sequence[int],
                    n_warmup: int, n_rep: int, clock: Callable[[], float], label: str,
                    say: Callable[[str], None]) -> Curve:
    """The Curve of ``passes(order)`` (one callable per n of ``order``) timed round-robin in a
    shuffled order: neither machine drift nor the previous pass's size (allocator state) lines
    up with n."""
    order = sorted(points, key=lambda n: random.Random(n).random())
    timed = dict(zip(order, time_interleaved(passes(order), n_warmup, n_rep, clock)))
    curve = Curve.from_timings(list(points), [timed[n] for n in points])
    say(f"{label}: " + ", ".join(f"n={n} {t * 1e3:.2f} ms" for n, t in zip(curve.ns, curve.seconds))
        + ("" if curve.noise is None else f"; timing spread {curve.noise:.1%}"))
    return curve


# Batch sizes and nodes per request ``calibrate_batches`` measures by default.
BATCH_SIZES: tuple[int, ...] = (2, 4, 8, 16)


def batch_verify_passes(model: Any, batch: int, ns: Sequence[int], context: int,
                        seed: int = 0, passes: Any = None) -> list[Callable[[], None]]:
    """One callable per n: ONE batched verify pass (``BatchVerifier.score``: B chains of n nodes
    over B cached prefixes of ``context`` random tokens, ragged 4-D mask, per-row positions,
    softmax per request), then ``discard`` back to the prefixes (built once here). ``passes``:
    None (eager), or the target's ``BatchPasses`` (its compiled batch graphs, as the server
    runs them)."""
    import torch

    from treespec.core.tree_batch import TreeBatch
    from treespec.fastpath.device import synchronize
    from treespec.core.sampling import SamplingConfig
    from treespec.core.tree import DraftTree
    from treespec.runtime.batch_verifier import BatchVerifier

    param = next(model.parameters())
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    if passes is None:
        verifier = BatchVerifier(model)
    else:
        from treespec.runtime.batch_compiled import CompiledBatchVerifier

        verifier = CompiledBatchVerifier(passes)
    verifier.prefill([torch.randint(vocab, (context + 1,), generator=gen) for _ in range(batch)])
    config = [SamplingConfig(1.0)] * batch   # the full softmax, as a T > 0 request pays

    def make(n_tokens: int) -> Callable[[], None]:
        trees = [DraftTree(torch.randint(vocab, (n_tokens,), generator=gen), torch.arange(-1, n_tokens - 1))
                 for _ in range(batch)]
        tree_batch = TreeBatch.from_trees(trees, config)

        def fn() -> None:
            verifier.score(tree_batch)
            verifier.discard()
            synchronize(param.device)

        return fn

    return [make(n) for n in ns]


def calibrate_batches(calibration: Calibration, model: Any, batches: Sequence[int] = BATCH_SIZES,
                      ns: Sequence[int] = BATCH_NS, n_warmup: int = 1, n_rep: int = 5,
                      clock: Callable[[], float] = time.perf_counter,
                      progress: Callable[[str], None] | None = None, passes: Any = None) -> Calibration:
    """``calibration`` plus the batched verify pass of ``model`` measured at every B in
    ``batches`` (> 1) and n nodes per request in ``ns`` (``Calibration.batch_target``), at the
    calibration's context; run it with the calibration's threads. Cost: about
    (n_warmup + n_rep) · Σ_B B · Σ n rows through the target (~1 min for the defaults on a
    135M model on one CPU core). ``passes``: the target's ``BatchPasses`` where its passes are
    compiled: measured through its graphs at their node buckets up to ``ns[-1]`` (n nodes
    cost what their bucket costs), each a graph of its own to compile first."""
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in batches):
        raise ValueError(f"batches must be ints >= 2 (batch 1 is the target curve), got {list(batches)}")
    if not ns or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in ns) or list(ns) != sorted(set(ns)):
        raise ValueError(f"ns must be increasing ints >= 1, got {list(ns)}")
    say = progress or (lambda message: None)
    measured = dict(calibration.batch_target)
    if passes is not None:
        if passes.model is not model:
            raise ValueError("passes must be the compiled batch passes of model (batch_passes(target))")
        ns = tuple(n for n in passes.node_buckets if n <= ns[-1]) or passes.node_buckets[:1]
    for b in sorted(set(batches)):
        curve = _shuffled_curve(lambda order: batch_verify_passes(model, b, order, calibration.context,
                                                                  passes=passes),
                                ns, n_warmup, n_rep, clock, f"batch {b}", say)
        measured[b] = curve if passes is None else bucket_steps(curve, ns)
    return dataclasses.replace(calibration, batch_target=measured)


def calibrate(
    model: Any,
    name: str,
    ns: Sequence[int] = DEFAULT_NS,
    context: int = 128,
    early_exit_layers: int = 4,
    draft_ns: Sequence[int] | None = None,
    n_warmup: int = 2,
    n_rep: int = 7,
    threads: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
    passes: Any = None,
) -> Calibration:
    """Measure ``model`` (a HF causal LM) on its device and return the fitted Calibration.

    Measures the verify pass at every n in ``ns``, and two drafters at every n in ``draft_ns``
    (default: ``ns`` up to 64): "early_exit" (the first ``early_exit_layers`` target layers +
    LM head) and "eagle" (one target-width layer + LM head; EAGLE's 2H -> H fusion layer is
    left out, a small fraction of the pass). Each curve is ``measure_interleaved`` over its
    points (``verify_passes``).
    ``threads``: torch intra-op threads for the measurement (default: leave as set); on a
    shared machine 1 thread is far less sensitive to other processes. ``clock``: see ``measure``.
    ``passes``: None (eager passes), or the target's compiled passes
    (:class:`treespec.runtime.compiled.CompiledPasses` of ``model``): the target curve then
    times the graphs the generator runs, one per bucket up to the one holding max(ns) nodes
    (:func:`compiled_ns`; each compiles first, about a minute, seconds when Inductor's disk
    cache has it), as steps (:func:`bucket_steps`); the stand-in drafters stay eager.
    Cost: len(ns) · (n_warmup + n_rep) passes of the model, plus the drafters'.
    """
    import torch

    from treespec.planning.roofline import _check_sizes

    for n in ns:
        _check_sizes(n, 1, context)
    layers = model.config.num_hidden_layers
    if not 1 <= early_exit_layers <= layers:
        raise ValueError(f"early_exit_layers must be in [1, {layers}], got {early_exit_layers}")
    draft_ns = tuple(n for n in ns if n <= 64) if draft_ns is None else tuple(draft_ns)
    dtype_bytes = next(model.parameters()).element_size()
    shape = ModelShape.from_hf_config(model.config, name=name, bytes_per_weight=dtype_bytes, bytes_per_kv=dtype_bytes)
    say = progress or (lambda message: None)
    previous_threads = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        return _calibrate(model, name, shape, ns, draft_ns, context, early_exit_layers, n_warmup, n_rep, clock, say,
                          passes)
    finally:
        torch.set_num_threads(previous_threads)


def _calibrate(model: Any, name: str, shape: ModelShape, ns: Sequence[int], draft_ns: Sequence[int], context: int,
               early_exit_layers: int, n_warmup: int, n_rep: int, clock: Callable[[], float],
               say: Callable[[str], None], passes: Any = None) -> Calibration:
    import torch

    def curve(m: Any, label: str, points: Sequence[int]) -> Curve:
        return _shuffled_curve(lambda order: verify_passes(m, order, context), points, n_warmup, n_rep, clock,
                               label, say)

    if passes is None:
        target = curve(model, "target", ns)
    else:
        if passes.model is not model:
            raise ValueError("passes must be the compiled passes of model (compile_target(target).passes)")
        buckets = compiled_ns(passes, max(ns))
        target = bucket_steps(_shuffled_curve(lambda order: compiled_verify_passes(passes, order, context), buckets,
                                              n_warmup, n_rep, clock, "target (compiled)", say), buckets)
    drafter_layers = {"early_exit": early_exit_layers, "eagle": 1}
    drafters = {kind: curve(_truncated_model(model, k), kind, draft_ns) for kind, k in drafter_layers.items()}
    return Calibration(
        model=name,
        shape=shape,
        context=context,
        target=target,
        drafters=drafters,
        drafter_layers=drafter_layers,
        device=_device_description(next(model.parameters()).device),
        threads=torch.get_num_threads(),
        clock=getattr(clock, "__name__", str(clock)),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


# Widths (nodes per expand call) measured for a real drafter by default.
DRAFT_WIDTHS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
