"""Tree sizing: pick the budget and depth that maximise expected tokens per second.

For a tree of d draft nodes (its budget is d + 1 nodes, the root included) and depth D on a
batch of B sequences:

    step_s       = t_draft(level widths) + t_target(n = d + 1 tokens per sequence)
    tokens_per_s = B · τ(d, D) / step_s          (aggregate over the batch)
    speedup      = tokens_per_s / (B / t_target(1))  (vs. plain decoding on the same model)

τ(d, D) is the optimal tree's (``tau.optimal_trees``). d = 0 (no speculation) is
always a candidate, so the answer shrinks to a chain, then to nothing, as the batch grows and
verification turns compute-bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from treespec.planning.tau import DEFAULT_BETA, optimal_trees
from treespec.planning.calibration import CalibratedCost, Calibration
from treespec.planning.hardware import Hardware, get_hardware
from treespec.planning.roofline import DrafterSpec, compute_bound_batch, t_draft, t_target
from treespec.planning.shapes import ModelShape, model_shape

__all__ = [
    "BatchLimits",
    "RooflineCost",
    "StepCost",
    "TreeChoice",
    "auto_budget",
    "auto_min_gain",
    "auto_threshold_text",
    "batch_limits",
    "best_choice",
    "best_tree",
    "plan_curve",
]

Acceptance = float | Sequence[float]


class StepCost(Protocol):
    """Seconds of the two halves of a speculative step."""

    def verify_s(self, n_tokens: int, batch: int, context: int) -> float:
        """Target pass over ``n_tokens`` per sequence (root included)."""
        ...

    def draft_s(self, widths: Sequence[int], batch: int, context: int) -> float:
        """Drafting passes, ``widths[l]`` nodes expanded at level l."""
        ...

    def loop_s(self, widths: Sequence[int], batch: int) -> float:
        """The engine's own work in a step drafting ``widths`` (() for plain decoding): accepting,
        compacting, the builder around its drafter calls."""
        ...


@dataclass(frozen=True)
class RooflineCost:
    """StepCost of a preset or custom accelerator from the roofline (``roofline.py``)."""

    target: ModelShape
    drafter: DrafterSpec
    hardware: Hardware

    def verify_s(self, n_tokens: int, batch: int, context: int) -> float:
        return t_target(self.target, self.hardware, n_tokens, batch, context)

    def draft_s(self, widths: Sequence[int], batch: int, context: int) -> float:
        return t_draft(self.target, self.drafter, self.hardware, widths, batch, context)

    def loop_s(self, widths: Sequence[int], batch: int) -> float:
        return 0.0   # a roofline counts bytes and FLOPs, not the host's bookkeeping


@dataclass(frozen=True)
class TreeChoice:
    """A tree size and its predicted performance.

    Attributes:
        drafts:       draft nodes, root excluded (0 = no speculation); ``budget`` (a property)
                      is drafts + 1, the nodes incl. the root that every builder takes.
        depth:        levels below the root (0 when drafts is 0); drafts == depth is a chain.
        tau:          predicted tokens per step (accepted + 1).
        tokens_per_s: predicted tokens/s summed over the batch.
        speedup:      tokens_per_s over plain decoding's on the same cost model.
        verify_s:     seconds of the target pass over drafts + 1 tokens per sequence.
        draft_s:      seconds of drafting (all levels).
        level_sizes:  nodes per depth, the root's level first.
        loop_s:       seconds of the engine's own work in the step (``StepCost.loop_s``).
    """

    drafts: int
    depth: int
    tau: float
    tokens_per_s: float
    speedup: float
    verify_s: float
    draft_s: float
    level_sizes: tuple[int, ...]
    loop_s: float = 0.0

    @property
    def budget(self) -> int:
        """Tree nodes including the root: the ``budget`` argument of every builder."""
        return self.drafts + 1

    @property
    def step_s(self) -> float:
        return self.verify_s + self.draft_s + self.loop_s

    @property
    def is_chain(self) -> bool:
        """True for a chain or no speculation (every level holds at most one node)."""
        return max(self.level_sizes) <= 1


def _check_planning(batch: int, context: int, max_drafts: int, max_depth: int) -> None:
    for name, value, low in (("batch", batch, 1), ("context", context, 0),
                             ("max_drafts", max_drafts, 0), ("max_depth", max_depth, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def plan_curve(
    cost: StepCost,
    acceptance: Acceptance,
    batch: int = 1,
    context: int = 0,
    max_drafts: int = 128,
    max_depth: int = 16,
) -> list[TreeChoice]:
    """The best choice of every size, 0 .. max_drafts draft nodes (each at its best depth <= max_depth).

    Budgets no tree can use (all further nodes worth 0) are left out.
    """
    _check_planning(batch, context, max_drafts, max_depth)
    verify_cache: dict[int, float] = {}

    def verify_s(n_tokens: int) -> float:
        if n_tokens not in verify_cache:
            verify_cache[n_tokens] = cost.verify_s(n_tokens, batch, context)
        return verify_cache[n_tokens]

    plain_loop = cost.loop_s((), batch)
    baseline = batch / (verify_s(1) + plain_loop)
    best: dict[int, TreeChoice] = {0: TreeChoice(0, 0, 1.0, baseline, 1.0, verify_s(1), 0.0, (1,), plain_loop)}
    for depth in range(1, max_depth + 1):
        for tree in optimal_trees(acceptance, max_drafts, depth)[1:]:
            if tree.depth < depth:  # the same tree was scored at a smaller depth limit
                continue
            verify = verify_s(tree.budget)
            draft = cost.draft_s(tree.draft_widths, batch, context)
            loop = cost.loop_s(tree.draft_widths, batch)
            rate = batch * tree.tau / (verify + draft + loop)
            if tree.drafts not in best or rate > best[tree.drafts].tokens_per_s:
                best[tree.drafts] = TreeChoice(tree.drafts, tree.depth, tree.tau, rate, rate / baseline,
                                               verify, draft, tree.level_sizes, loop)
    return [best[b] for b in sorted(best)]


def best_choice(curve: Sequence[TreeChoice]) -> TreeChoice:
    """The highest tokens/s of a curve; ties go to the smaller tree."""
    if not curve:
        raise ValueError("empty plan curve")
    return max(curve, key=lambda c: (c.tokens_per_s, -c.drafts))


def _resolve(
    model: ModelShape | str, drafter: DrafterSpec | str, hardware: Hardware | Calibration | str
) -> tuple[ModelShape, DrafterSpec, StepCost]:
    target = model_shape(model) if isinstance(model, str) else model
    spec = DrafterSpec(drafter) if isinstance(drafter, str) else drafter
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    if isinstance(hardware, Calibration):
        return target, spec, CalibratedCost.for_model(hardware, spec.kind, target)
    return target, spec, RooflineCost(target, spec, hardware)


def best_tree(
    model: ModelShape | str,
    drafter: DrafterSpec | str,
    hardware: Hardware | Calibration | str,
    batch: int = 1,
    context: int = 2048,
    acceptance: Acceptance | None = None,
    max_drafts: int = 128,
    max_depth: int = 16,
) -> TreeChoice:
    """Budget, depth, τ, tokens/s and speedup of the best tree.

    Args:
        model:      target shape or preset name (``shapes.MODEL_PRESETS``).
        drafter:    DrafterSpec or a kind name ("eagle", "early_exit", "medusa", "lookup";
                    "model" needs a DrafterSpec with the draft shape).
        hardware:   a Hardware (preset name accepted) for the roofline, or a local Calibration.
        batch:      sequences decoded together (B).
        context:    cached tokens per sequence (P).
        acceptance: β or a positional acceptance vector; default ``DEFAULT_BETA[kind]``.
    """
    target, spec, cost = _resolve(model, drafter, hardware)
    if acceptance is None:
        acceptance = DEFAULT_BETA[spec.kind]
    return best_choice(plan_curve(cost, acceptance, batch, context, max_drafts, max_depth))


# builder="auto" speculates only where the cost model predicts at least this speedup, on a
# quiet machine: a predicted gain this small is within the model's error on a real machine
# (benchmarks/batch.py reports predicted against measured gains), so it is as likely to lose as
# to win, and plain decoding never loses to itself.
AUTO_MIN_GAIN = 1.05

# A noisy machine asks for more (``auto_min_gain``): the predicted gain is a ratio of two pass
# times, each of which strays by the calibration's timing noise. Speculation must clear the
# plain pass by this many standard deviations of that ratio.
AUTO_NOISE_SIGMAS = 2.0
_IQR_PER_SIGMA = 1.349   # interquartile range of a normal distribution, in standard deviations


def auto_min_gain(calibration: Calibration) -> float:
    """The predicted speedup ``builder="auto"`` needs before it speculates on this machine.

    ``AUTO_MIN_GAIN``, raised on a noisy machine to 1 + ``AUTO_NOISE_SIGMAS`` standard
    deviations of a ratio of two pass times: a single pass's relative deviation σ is the
    calibration's ``timing_noise`` (an interquartile range) / 1.349, and a ratio of two
    independent ones strays by √2 σ. The calibration saw how far one pass strays; the run
    happens later, under whatever else the machine is doing then, so a gain inside that band
    is not one the run can count on. A calibration without spreads gets ``AUTO_MIN_GAIN``.
    """
    noise = calibration.timing_noise
    if noise is None:
        return AUTO_MIN_GAIN
    return max(AUTO_MIN_GAIN, 1.0 + AUTO_NOISE_SIGMAS * math.sqrt(2.0) * noise / _IQR_PER_SIGMA)


def auto_threshold_text(calibration: Calibration) -> str:
    """``auto_min_gain`` in words, with the spread it came from (CLIs and benchmark headers)."""
    noise = calibration.timing_noise
    return (f"speculates where the cost model predicts at least {auto_min_gain(calibration):.2f}x"
            + ("" if noise is None else f" (timing spread {noise:.1%} per pass on this machine)"))


def auto_budget(
    calibration: Calibration,
    acceptance: Acceptance,
    drafter_kind: str,
    max_drafts: int = 64,
    max_depth: int = 16,
    batch: int = 1,
    min_gain: float | None = None,
) -> TreeChoice:
    """The engine's ``budget="auto"``: best tree on this machine from its calibration.

    ``batch`` sequences (the server passes its current batch size) at the calibration's
    context, using the measured target curve and the measured pass time of ``drafter_kind``
    (``Calibration.drafters``; "lookup" costs 0). A tree whose predicted speedup is below
    ``min_gain`` (default ``auto_min_gain(calibration)``: higher on a noisy machine) gives way
    to plain decoding (0 drafts, budget 1).
    """
    if min_gain is None:
        min_gain = auto_min_gain(calibration)
    if not min_gain >= 1.0:
        raise ValueError(f"min_gain must be >= 1 (1: speculate on any predicted gain), got {min_gain!r}")
    cost = CalibratedCost(calibration, drafter_kind)
    curve = plan_curve(cost, acceptance, batch, calibration.context, max_drafts, max_depth)
    choice = best_choice(curve)
    return choice if choice.speedup >= min_gain else curve[0]


@dataclass(frozen=True)
class BatchLimits:
    """Batch sizes at which speculation stops paying (None: not reached up to the scan limit).

    Attributes:
        decode_compute_bound: smallest batch whose plain decoding pass is compute-bound.
        verify_compute_bound: smallest batch whose verification of the batch-1 best tree
                              (budget = drafts + 1 tokens per sequence) is compute-bound.
        chain:                smallest batch whose best tree is a chain (or nothing).
        no_speculation:       smallest batch whose best tree has no draft node.
    Compute-bound batches are roofline quantities: None for a calibrated machine.
    """

    decode_compute_bound: int | None
    verify_compute_bound: int | None
    chain: int | None
    no_speculation: int | None


def _first_batch(predicate: Callable[[int], bool], max_batch: int) -> int | None:
    """Smallest batch in [1, max_batch] with ``predicate`` true, assuming it stays true above:
    doubling, then bisection."""
    low, batch = 0, 1
    while not predicate(batch):
        if batch >= max_batch:
            return None
        low, batch = batch, min(2 * batch, max_batch)
    while batch - low > 1:
        mid = (low + batch) // 2
        low, batch = (low, mid) if predicate(mid) else (mid, batch)
    return batch


def batch_limits(
    model: ModelShape | str,
    drafter: DrafterSpec | str,
    hardware: Hardware | Calibration | str,
    context: int = 2048,
    acceptance: Acceptance | None = None,
    max_batch: int = 4096,
    max_drafts: int = 128,
    max_depth: int = 16,
) -> BatchLimits:
    """Where verification turns compute-bound and the best tree shrinks to a chain / nothing."""
    target, spec, cost = _resolve(model, drafter, hardware)
    if acceptance is None:
        acceptance = DEFAULT_BETA[spec.kind]

    def choice(batch: int) -> TreeChoice:
        return best_choice(plan_curve(cost, acceptance, batch, context, max_drafts, max_depth))

    decode_bound = verify_bound = None
    if isinstance(cost, RooflineCost):
        decode_bound = compute_bound_batch(target, cost.hardware, 1, context, max_batch)
        verify_bound = compute_bound_batch(target, cost.hardware, choice(1).budget, context, max_batch)
    return BatchLimits(
        decode_compute_bound=decode_bound,
        verify_compute_bound=verify_bound,
        chain=_first_batch(lambda b: choice(b).is_chain, max_batch),
        no_speculation=_first_batch(lambda b: choice(b).drafts == 0, max_batch),
    )
