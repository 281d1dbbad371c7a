"""The roofline plus what it leaves out, with constants fitted to published GPU measurements.

A speculative step on a GPU serving engine costs more than bytes / bandwidth. Four terms:

    t_plain  = roofline(1 token per sequence)                              (bandwidth at η)
    t_verify = roofline(n tokens per sequence) + κ · B · P · kv · (n − 1) / (η · bandwidth)
               + verify_s
    t_draft  = Σ_levels [ roofline of one drafter pass (its widths) + level_s ]
    speedup  = τ · t_plain / (t_verify + t_draft)

    η          achievable fraction of the datasheet bandwidth in a decode pass (``bandwidth_efficiency``)
    level_s    fixed seconds per drafting pass: a launch-bound pass of a small model, its top-k and
               the tree bookkeeping between passes
    verify_s   fixed seconds a speculative step adds to its verify pass: tree mask and positions,
               the acceptance walk, the KV bookkeeping of the accepted path
    κ          attention over the tree: extra reads of each sequence's cached KV per tree token
               beyond the first (0: the prefix is read once for all n tokens; 1: once per token)

All constants live in ``FITTED`` with their source. ``benchmarks/cost_anchors.py`` fits them to
``anchors.ANCHORS`` (a grid least-squares on log speedup) and writes
``benchmarks/results/cost_anchors.{md,json}``; a test checks the numbers here equal the JSON's.
The roofline presets (``hardware.py``) are unchanged: this is a separate StepCost.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from treespec.planning.anchors import Anchor, EngineKind
from treespec.planning.hardware import Hardware, get_hardware
from treespec.planning.roofline import DrafterSpec, t_draft, t_target
from treespec.planning.shapes import ModelShape, model_shape

__all__ = ["FITTED", "EngineConstants", "FittedCost", "anchor_cost", "fitted_constants", "predict_anchor"]


@dataclass(frozen=True)
class EngineConstants:
    """The terms the roofline misses, for one GPU preset and one kind of engine.

    Attributes:
        bandwidth_efficiency: η, attained / datasheet bandwidth in a decode pass, in (0, 1].
        level_s:              fixed seconds per drafting pass.
        verify_s:             fixed seconds a speculative step adds to its verify pass.
        tree_kv_reads:        κ in [0, 1], extra prefix-KV reads per tree token beyond the first.
        source:               where the numbers come from (fitted rows, or what they are carried from).
    """

    bandwidth_efficiency: float
    level_s: float
    verify_s: float
    tree_kv_reads: float
    source: str

    def __post_init__(self) -> None:
        if not 0 < self.bandwidth_efficiency <= 1:
            raise ValueError(f"bandwidth_efficiency must be in (0, 1], got {self.bandwidth_efficiency!r}")
        for name in ("level_s", "verify_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if not 0 <= self.tree_kv_reads <= 1:
            raise ValueError(f"tree_kv_reads must be in [0, 1], got {self.tree_kv_reads!r}")


# Measured STREAM copy bandwidth, Azure AI-benchmarking-guide (github.com/samuel-bohman/
# AI-benchmarking-guide, Azure_Results/ND_H100_v5_results.md and ND_MI300X_v5_results.md):
# H100 2.90 TB/s of 3.35 (0.866), MI300X 4.11 TB/s of 5.3 (0.775).
STREAM_FRACTION = {"h100": 2.90 / 3.35, "mi300x": 4.11 / 5.3}

# --- fitted by benchmarks/cost_anchors.py (results/cost_anchors.json); do not edit by hand ------
_H100_GRAPH = EngineConstants(
    bandwidth_efficiency=0.6838, level_s=0.0003, verify_s=0.00185, tree_kv_reads=1.0,
    source="fitted to the held H100 rows of anchors.ANCHORS (SGLang, vLLM; batch 1-64)")
# --- end of fitted constants ----------------------------------------------------------------


def _carried(base: EngineConstants, efficiency: float, why: str) -> EngineConstants:
    return dataclasses.replace(base, bandwidth_efficiency=efficiency, source=why)


FITTED: dict[tuple[str, EngineKind], EngineConstants] = {
    ("h100", "graph"): _H100_GRAPH,
    # No held row on these GPUs: the host-side fixed costs are carried from the H100 fit (the same
    # engines launch the same graphs from a CPU), η is scaled by the measured STREAM fractions.
    ("mi300x", "graph"): _carried(
        _H100_GRAPH, round(_H100_GRAPH.bandwidth_efficiency * STREAM_FRACTION["mi300x"] / STREAM_FRACTION["h100"], 4),
        "not fitted (no MI300X row publishes τ): H100's fixed costs; η = H100's × 0.775 / 0.866, the "
        "measured STREAM fractions"),
    ("h200", "graph"): _carried(
        _H100_GRAPH, _H100_GRAPH.bandwidth_efficiency,
        "not fitted (no H200 row): H100's constants (same GPU generation and engines)"),
    ("a100", "graph"): _carried(
        _H100_GRAPH, _H100_GRAPH.bandwidth_efficiency,
        "not fitted (the A100 rows ran an eager PyTorch loop, not a graph engine): H100's constants"),
    ("a100", "eager"): _carried(
        _H100_GRAPH, _H100_GRAPH.bandwidth_efficiency,
        "not fitted (two rows, GPU count unstated): H100's graph-engine constants, which hold them"),
    ("l40", "graph"): _carried(
        _H100_GRAPH, _H100_GRAPH.bandwidth_efficiency, "not fitted (no L40 row): H100's constants"),
}


def fitted_constants(hardware: str, engine_kind: EngineKind = "graph") -> EngineConstants:
    """``FITTED[(hardware, engine_kind)]``; unknown pair -> ``KeyError`` listing what exists."""
    key = (hardware.strip().lower(), engine_kind)
    if key not in FITTED:
        raise KeyError(f"no fitted constants for {key}; known: {sorted(FITTED)}")
    return FITTED[key]


@dataclass(frozen=True)
class FittedCost:
    """StepCost (``planner.StepCost``): the roofline at η plus the fixed and tree-attention terms.

    ``hardware`` is the datasheet preset; ``gpus`` > 1 models tensor parallelism as that many
    times the bandwidth and FLOP/s (no communication cost).
    """

    target: ModelShape
    drafter: DrafterSpec
    hardware: Hardware
    constants: EngineConstants
    gpus: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus must be a positive int, got {self.gpus!r}")

    @property
    def effective_hardware(self) -> Hardware:
        """The preset at η (and times ``gpus``): what the roofline terms run on."""
        hw = self.hardware
        return dataclasses.replace(hw, name=f"{hw.name}-fitted", bandwidth=hw.bandwidth * self.gpus,
                                   peak_flops=hw.peak_flops * self.gpus,
                                   bandwidth_efficiency=self.constants.bandwidth_efficiency)

    def verify_s(self, n_tokens: int, batch: int, context: int) -> float:
        hw = self.effective_hardware
        seconds = t_target(self.target, hw, n_tokens, batch, context)
        if n_tokens > 1:
            tree_bytes = self.constants.tree_kv_reads * batch * context * self.target.kv_bytes_per_token \
                * (n_tokens - 1)
            seconds += tree_bytes / hw.effective_bandwidth + self.constants.verify_s
        return seconds

    def draft_s(self, widths: Sequence[int], batch: int, context: int) -> float:
        seconds = t_draft(self.target, self.drafter, self.effective_hardware, widths, batch, context)
        if not widths or self.drafter.kind == "lookup":
            return seconds
        passes = 1 if self.drafter.kind == "medusa" else len(widths)
        return seconds + passes * self.constants.level_s

    def loop_s(self, widths: Sequence[int], batch: int) -> float:
        return 0.0   # the engine's own step work is in verify_s and level_s


def anchor_cost(anchor: Anchor, constants: EngineConstants | None = None) -> FittedCost:
    """The FittedCost a row runs under (its GPU preset, engine kind, model and drafter)."""
    target = model_shape(anchor.shape, bytes_per_weight=anchor.bytes_per_weight)
    if anchor.drafter_kind == "model":
        if anchor.draft_shape is None:
            raise ValueError(f"anchor {anchor.key!r}: a 'model' drafter needs draft_shape")
        spec = DrafterSpec("model", shape=model_shape(anchor.draft_shape, bytes_per_weight=anchor.bytes_per_weight))
    else:
        spec = DrafterSpec(anchor.drafter_kind, draft_vocab=anchor.draft_vocab)  # type: ignore[arg-type]
    if constants is None:
        constants = fitted_constants(anchor.gpu, anchor.engine_kind)
    return FittedCost(target, spec, get_hardware(anchor.gpu), constants, anchor.gpus or 1)


def predict_anchor(anchor: Anchor, constants: EngineConstants | None = None, tau: float | None = None) -> float:
    """Predicted speedup of a row: its τ (or ``tau``) and its tree under the fitted cost model."""
    tau = anchor.tau if tau is None else tau
    if tau is None:
        raise ValueError(f"anchor {anchor.key!r} publishes no τ: pass tau=")
    if not tau >= 1:
        raise ValueError(f"tau must be >= 1 (tokens per target forward), got {tau!r}")
    cost = anchor_cost(anchor, constants)
    plain = cost.verify_s(1, anchor.batch, anchor.context)
    step = cost.verify_s(anchor.tree.verify_tokens, anchor.batch, anchor.context) \
        + cost.draft_s(anchor.tree.widths, anchor.batch, anchor.context)
    return tau * plain / step


def log_error(predicted: float, published: float) -> float:
    """|log(predicted / published)|, the fit's residual."""
    return abs(math.log(predicted / published))
