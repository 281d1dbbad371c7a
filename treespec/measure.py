"""Measurements that run real generations: they drive the engine, so they sit above it.

The engine depends on the pure cost model (``treespec.cost``: curves, roofline, planner) and on
the tree builders; the two measurements that *run* the engine live here, so nothing below the
engine imports it:

- ``measure_acceptance_vector``: Sequoia's positional acceptance vector a[0..w-1] of a drafter,
  estimated from generations with one-level trees (``treespec.trees.SequoiaBuilder`` uses it).
- ``calibrate_drafter``: a registered drafter's pass times by width and its acceptance vector,
  added to a ``treespec.cost.Calibration`` (``treespec calibrate --drafter NAME``).

Both were defined in ``treespec.trees.sequoia`` and ``treespec.cost.calibration``; those
paths still resolve to these functions.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

from treespec.cost.calibration import DRAFT_WIDTHS, Calibration, Curve
from treespec.drafters import load_drafter
from treespec.drafters.base import Drafter, TimedDrafter
from treespec.engine import SpeculativeGenerator
from treespec.trees.base import DraftMode, check_int
from treespec.trees.static import StaticTreeBuilder

__all__ = ["calibrate_drafter", "measure_acceptance_vector"]


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
) -> Calibration:
    """``calibration`` plus the registered drafter ``name`` measured for real on ``target``.

    Pass times: greedy generations on ``prompts[0]`` with a static tree of ``w`` root children,
    each with one child, so every step makes one expand call over 1 node (the root, including
    the drafter's commit work) and one over ``w`` nodes; the median call time per width gives
    ``drafters[name]``. Acceptance: ``measure_acceptance_vector`` (width ``acceptance_width``,
    greedy) over ``prompts``, stored in ``acceptance[name]``. Held-out prompts, please: the
    numbers are meant for other text. Run it with the threads the engine will use.
    """
    if not prompts:
        raise ValueError("calibrate_drafter needs at least one prompt (held-out text)")
    if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"widths must be positive ints, got {list(widths)}")
    say = progress or (lambda message: None)
    drafter = TimedDrafter(load_drafter(name, target), clock)
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
    curve = Curve.fit(ns, [statistics.median(samples[n]) for n in ns])
    say(f"{name}: " + ", ".join(f"n={n} {t * 1e3:.2f} ms" for n, t in zip(curve.ns, curve.seconds)))
    vector = measure_acceptance_vector(drafter.inner, target, list(prompts), width=acceptance_width,
                                       max_new_tokens=max_new_tokens)
    say(f"{name} acceptance: " + ", ".join(f"{a:.3f}" for a in vector))
    return dataclasses.replace(
        calibration,
        drafters={**calibration.drafters, name: curve},
        acceptance={**calibration.acceptance, name: tuple(vector)},
    )
