"""Measurements that run real generations: they drive the engine, so they sit above it.

The engine depends on the pure cost model (``treespec.planning``: curves, roofline, planner) and on
the tree builders; the two measurements that *run* the engine live here, so nothing below the
engine imports it:

- ``measure_acceptance_vector``: Sequoia's positional acceptance vector a[0..w-1] of a drafter,
  estimated from generations with one-level trees (``treespec.builders.SequoiaBuilder`` uses it).
- ``calibrate_drafter``: a registered drafter's pass times by width, the generator's own work
  around them and its acceptance vectors (greedy and T = 1), added to a
  ``treespec.planning.Calibration`` (``treespec calibrate --drafter NAME``);
  ``calibrate_acceptance`` adds the vectors alone, ``calibrate_loop`` the loop costs alone;
  ``calibrate_drafter_batches`` adds its batched drafting call (B requests in one
  ``expand_batch``) for the server's planner.

Both were defined in ``treespec.builders.sequoia`` and ``treespec.planning.calibration``; those
paths still resolve to these functions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from treespec.planning.calibration import PLAIN_LOOP, Calibration, Curve, LoopCost, acceptance_key
from treespec.calibrate.passes import DRAFT_WIDTHS, _shuffled_curve
from treespec.drafters import load_drafter
from treespec.drafters.base import Drafter, TargetFeatures, TimedDrafter, capabilities
from treespec.runtime.compiled import compile_drafter_for
from treespec.runtime.generator import SpeculativeGenerator
from treespec.builders.base import DraftMode, TreeBuilder, check_int
from treespec.builders.chain import ChainBuilder
from treespec.builders.dynamic import DynamicTreeBuilder
from treespec.builders.static import StaticTreeBuilder

__all__ = ["ACCEPTANCE_MODES", "ACCEPTANCE_TEMPERATURES", "CALIBRATION_PROMPTS", "acceptance_keys",
           "calibration_prompts", "calibrate_acceptance", "calibrate_drafter", "calibrate_drafter_batches", "calibrate_loop",
           "measure_acceptance_vector"]

# Temperatures a drafter's acceptance is measured at by default: greedy, and T = 1 (acceptance
# of the same drafts is lower when the target samples, so T > 0 requests need their own plan).
ACCEPTANCE_TEMPERATURES: tuple[float, ...] = (0.0, 1.0)

# MT-bench questions the calibration measures acceptance on: the last ones (the demo and the
# benchmarks start from the first). Eight first turns x 32 tokens is about 180 verify steps per
# vector: a standard error near 0.035 on a depth-1 acceptance of 0.4 (four gave 0.05).
CALIBRATION_PROMPTS = 8


def calibration_prompts() -> list[str]:
    """The held-out prompts of a calibration: the first turns of the last
    ``CALIBRATION_PROMPTS`` MT-bench questions."""
    from treespec.data import mtbench_questions

    return [q.turns[0] for q in mtbench_questions()[-CALIBRATION_PROMPTS:]]


# Drafting modes measured above T = 0, for builder="auto" to plan each and build the faster:
# the drafter's ranked tokens, and draws from its distribution (a chain's one draw is the
# classic speculative sampling; a node's several children drawn without replacement). On
# SmolLM2 with eagle3 at T = 1 a drawn 1-draft chain's draft is accepted 0.37 of the time, a
# ranked one 0.19 (benchmarks/results/draw_modes.md).
ACCEPTANCE_MODES: tuple[DraftMode, ...] = ("deterministic", "without_replacement")


def acceptance_keys(name: str, temperature: float) -> list[str]:
    """The ``Calibration.acceptance`` keys ``calibrate_acceptance`` writes for ``name`` at
    ``temperature``: one at T = 0 (greedy drafts are deterministic in every mode), one per
    ``ACCEPTANCE_MODES`` above."""
    return [acceptance_key(name, temperature, mode) for mode in _modes_at(temperature)]


def _modes_at(temperature: float) -> tuple[DraftMode, ...]:
    """The drafting modes measured at ``temperature``: greedy drafts are ranked in every mode."""
    return ACCEPTANCE_MODES if temperature > 0 else ("deterministic",)


def measure_acceptance_vector(
    drafter: Drafter | str,
    target,
    prompts: Sequence[str | Sequence[int]],
    width: int,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    mode: DraftMode = "deterministic",
    seed: int = 0,
) -> tuple[float, ...]:
    """Estimate a[0..width-1] from real generations.

    Every step drafts a one-level tree of ``width`` children of the root (the drafter's ranked
    candidates, or ``width`` draws in a stochastic ``mode``) and records which child, if any,
    verification accepted. a[i] = (steps accepting child i) / steps. ``target``: a
    ``treespec.Target``; ``drafter``: a Drafter or a registered name.
    """
    check_int("width", width)
    counts = [0] * width
    steps = 0

    def record(built, acceptance, step) -> None:
        nonlocal steps
        steps += 1
        if acceptance.num_accepted:
            node = int(acceptance.path[0])
            counts[node - 1] += 1  # depth-1 nodes are 1..width in trial order

    builder = StaticTreeBuilder([(i,) for i in range(width)], mode)
    gen = SpeculativeGenerator(target, drafter, builder)
    for i, prompt in enumerate(prompts):
        gen.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                     seed=seed + i, on_step=record)
    if steps == 0:
        raise ValueError("no verification steps ran; pass at least one prompt")
    return tuple(c / steps for c in counts)


def calibrate_drafter(
    calibration: Calibration,
    name: str,
    target: Any,
    prompts: Sequence[str | Sequence[int]],
    widths: Sequence[int] = DRAFT_WIDTHS,
    acceptance_width: int = 8,
    max_new_tokens: int = 32,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
    temperatures: Sequence[float] = ACCEPTANCE_TEMPERATURES,
) -> Calibration:
    """``calibration`` plus the registered drafter ``name`` measured for real on ``target``.

    Pass times: greedy generations on ``prompts[0]`` with a static tree of ``w`` root children,
    each with one child, so every step makes one expand call over 1 node (the root, including
    the drafter's commit work) and one over ``w`` nodes; the median call time per width gives
    ``drafters[name]``. The generator's work around the passes: ``calibrate_loop``.
    Acceptance: ``calibrate_acceptance`` at every T in ``temperatures``. The drafter's
    ``weights_checksum`` goes to ``weights`` (a cache knows when it is stale).
    Held-out prompts, please: the numbers are meant for other text. Run it with the threads the
    engine will use.
    """
    if not prompts:
        raise ValueError("calibrate_drafter needs at least one prompt (held-out text)")
    if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be positive ints, got {list(widths)}")
    say = progress or (lambda message: None)
    # timed as the generator runs it: a model drafter of a compiled target compiled too
    drafter = TimedDrafter(compile_drafter_for(target, load_drafter(name, target)), clock)
    samples: dict[int, list[float]] = {}
    for w in sorted(set(widths)):
        builder = StaticTreeBuilder([(i,) for i in range(w)] + [(i, 0) for i in range(w)])
        gen = SpeculativeGenerator(target, drafter, builder)
        gen.generate(prompts[0], max_new_tokens=4)  # warm-up
        drafter.reset()
        gen.generate(prompts[0], max_new_tokens=max_new_tokens)
        for nodes, seconds in drafter.calls:
            samples.setdefault(nodes, []).append(seconds)
    ns = sorted(samples)
    curve = Curve.from_timings(ns, [samples[n] for n in ns])
    say(f"{name}: " + ", ".join(f"n={n} {t * 1e3:.2f} ms" for n, t in zip(curve.ns, curve.seconds)))
    weights = {k: v for k, v in calibration.weights.items() if k != name}
    if (checksum := capabilities(drafter.inner).weights_checksum) is not None:
        weights[name] = checksum
    calibration = dataclasses.replace(calibration, drafters={**calibration.drafters, name: curve}, weights=weights)
    calibration = calibrate_loop(calibration, drafter.inner, name, target, prompts, max_new_tokens, progress)
    return calibrate_acceptance(calibration, drafter.inner, name, target, prompts, temperatures,
                                acceptance_width, max_new_tokens, progress)


# The trees ``calibrate_loop`` times the generator with: the two shapes builder="auto" builds
# (a chain, and a dynamic tree, whose builder ranks and grows each level in Python).
LOOP_BUILDERS: tuple[Callable[[], TreeBuilder], ...] = (
    lambda: ChainBuilder(budget=3),
    lambda: DynamicTreeBuilder(budget=8, depth=3, top_k=4),
)


def calibrate_loop(
    calibration: Calibration,
    drafter: Drafter | str,
    name: str,
    target: Any,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int = 32,
    progress: Callable[[str], None] | None = None,
    builders: Sequence[Callable[[], TreeBuilder]] = LOOP_BUILDERS,
) -> Calibration:
    """``calibration`` plus the generator's own seconds per step, besides the calibrated passes,
    for plain decoding (``PLAIN_LOOP``) and with ``drafter`` (stored under ``name``): a
    ``treespec.planning.LoopCost`` each, which the planner adds to the step it predicts.

    Greedy generations of ``max_new_tokens`` on ``prompts[0]`` (after a short warm-up each): a
    budget-1 tree (auto's plain decoding), then the trees of ``builders`` (default
    ``LOOP_BUILDERS``) with ``drafter`` timed per call. ``step`` = the step's time outside its
    verify pass and its drafting phase (acceptance, compaction, commit, the loop) per step;
    for the drafter, ``call`` = the drafting phase's time outside the drafter's calls per call.
    Wall-clock seconds, as the generator books its steps. The verify pass itself is left to the
    calibrated curve: subtracting that curve instead would book the machine's drift between the
    two measurements (a shared host's speed moves by tens of % within minutes) as loop work.
    """
    if not prompts:
        raise ValueError("calibrate_loop needs at least one prompt (held-out text)")
    check_int("max_new_tokens", max_new_tokens)
    say = progress or (lambda message: None)
    if isinstance(drafter, str):
        drafter = compile_drafter_for(target, load_drafter(drafter, target))
    timed = TimedDrafter(drafter.inner if isinstance(drafter, TimedDrafter) else drafter, time.perf_counter)

    def run(builder: TreeBuilder) -> tuple[float, float, int, int]:
        """(accept + other seconds, drafting seconds outside the drafter's calls, steps, calls)."""
        gen = SpeculativeGenerator(target, timed, builder)
        gen.generate(prompts[0], max_new_tokens=4)  # warm-up
        timed.reset()
        stats = gen.generate(prompts[0], max_new_tokens=max_new_tokens).stats
        return stats.accept_time + stats.other_time, stats.draft_time - timed.expand_time, stats.steps, len(timed.calls)

    rest, around, steps, calls = run(DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    plain = LoopCost((rest + around) / steps)
    rest = around = 0.0
    steps = calls = 0
    for make in builders:
        r, a, s, c = run(make())
        rest, around, steps, calls = rest + r, around + a, steps + s, calls + c
    drafting = LoopCost(rest / steps, max(0.0, around / calls) if calls else 0.0)
    say(f"{name} loop: {drafting.step * 1e3:.2f} ms a step + {drafting.call * 1e3:.2f} ms a drafter call "
        f"(plain decoding: {plain.step * 1e3:.2f} ms a step)")
    return dataclasses.replace(calibration, loop={**calibration.loop, PLAIN_LOOP: plain, name: drafting})


def calibrate_acceptance(
    calibration: Calibration,
    drafter: Drafter | str,
    name: str,
    target: Any,
    prompts: Sequence[str | Sequence[int]],
    temperatures: Sequence[float] = ACCEPTANCE_TEMPERATURES,
    width: int = 8,
    max_new_tokens: int = 32,
    progress: Callable[[str], None] | None = None,
) -> Calibration:
    """``calibration`` plus ``drafter``'s positional acceptance vector (``measure_acceptance_vector``,
    width ``width``, seeded) at every T in ``temperatures``, and above T = 0 in every
    ``ACCEPTANCE_MODES``, stored under ``acceptance_key(name, T, mode)``
    (``Calibration.acceptance_for`` reads it)."""
    if not prompts:
        raise ValueError("calibrate_acceptance needs at least one prompt (held-out text)")
    if not temperatures:
        raise ValueError("temperatures must name at least one temperature, e.g. (0.0, 1.0)")
    say = progress or (lambda message: None)
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, target)
    vectors = dict(calibration.acceptance)
    for temperature in temperatures:
        for mode in _modes_at(temperature):
            key = acceptance_key(name, temperature, mode)
            vector = measure_acceptance_vector(drafter, target, list(prompts), width=width,
                                               max_new_tokens=max_new_tokens, temperature=temperature,
                                               mode=mode)
            vectors[key] = tuple(vector)
            say(f"{key} acceptance: " + ", ".join(f"{a:.3f}" for a in vector))
    return dataclasses.replace(calibration, acceptance=vectors)


def calibrate_drafter_batches(
    calibration: Calibration,
    name: str,
    target: Any,
    batches: Sequence[int] = (2, 4),
    widths: Sequence[int] = DRAFT_WIDTHS,
    n_warmup: int = 1,
    n_rep: int = 5,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    progress: Callable[[str], None] | None = None,
    drafter: Drafter | None = None,
) -> Calibration:
    """``calibration`` plus the registered drafter ``name``'s batched drafting call measured
    for real (``drafter``: that drafter already loaded, default ``load_drafter(name, target)``):
    for each B in ``batches`` (> 1), B requests over ``calibration.context`` random
    prompt tokens each (with the target's features where the drafter reads them), roots
    expanded, then ONE ``expand_batch`` over ``w`` new children of every root per point
    (``restore``d after each, so every call starts from the same state), in a shuffled
    round-robin over ``widths``. Stored as ``Calibration.batch_drafters[name][B]``; the
    planner's ``draft_s`` reads it instead of stretching the batch-1 curve to ``w B`` nodes."""
    import torch

    from treespec.fastpath.device import synchronize
    from treespec.drafters.base import PartialTree
    from treespec.drafters.batched import as_batch_drafter
    from treespec.runtime.batch_verifier import BatchVerifier

    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in batches):
        raise ValueError(f"batches must be ints >= 2 (batch 1 is calibrate_drafter's curve), got {list(batches)}")
    if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be positive ints, got {list(widths)}")
    if name not in calibration.drafters:
        raise ValueError(f"calibrate_drafter({name!r}) first: the batch-1 curve anchors the batched ones")
    say = progress or (lambda message: None)
    vocab = target.model.config.vocab_size
    measured = dict(calibration.batch_drafters.get(name, {}))
    single = drafter if drafter is not None else load_drafter(name, target)
    for b in sorted(set(batches)):
        batched = as_batch_drafter(single)       # a fresh batched state, weights shared
        gen = torch.Generator().manual_seed(seed + b)
        prompts = [torch.randint(vocab, (calibration.context + 1,), generator=gen) for _ in range(b)]
        if batched.needs_target_hidden:
            feats = BatchVerifier(target.model, batched.target_layers).prefill(prompts)
        else:
            feats = [TargetFeatures.empty()] * b
        for key, (prompt, f) in enumerate(zip(prompts, feats)):
            batched.begin(key, prompt, f)
        roots = [int(p[-1]) for p in prompts]
        batched.expand_batch([(key, PartialTree.rooted(r), [0]) for key, r in enumerate(roots)])
        rooted = batched.checkpoint()

        def passes(order: Sequence[int], batched=batched, roots=roots, rooted=rooted):
            def make(w: int):
                def fn() -> None:
                    calls = []
                    for key, r in enumerate(roots):
                        tree = PartialTree.rooted(r)
                        calls.append((key, tree, [tree.add(0, (r + 1 + i) % vocab) for i in range(w)]))
                    batched.expand_batch(calls)
                    synchronize(target.device)
                    batched.restore(rooted)
                return fn
            return [make(w) for w in order]

        measured[b] = _shuffled_curve(passes, sorted(set(widths)), n_warmup, n_rep, clock,
                                      f"{name} batch {b}", say)
    return dataclasses.replace(calibration, batch_drafters={**calibration.batch_drafters, name: measured})
