"""Cost model: roofline step times, local calibration and tree sizing (pure functions).

    shapes       ModelShape (from any HF config, or a preset) -> bytes, FLOPs per token
    hardware     Hardware presets (H100, MI300X, H200, A100, L40) and custom specs
    roofline     t_target / t_draft / arithmetic intensity / compute-bound batch
    acceptance   τ of chains and trees, optimal trees under positional acceptance
    calibration  measure(), Calibration (JSON), CalibratedCost for this machine
    planner      best_tree / auto_budget (auto_min_gain) / batch_limits / plan_curve
    cli          `treespec plan` and `treespec calibrate`
"""

from treespec.cost.acceptance import (
    DEFAULT_BETA,
    OptimalTree,
    acceptance_vector,
    expected_chain_tokens,
    expected_tokens_positional,
    expected_tree_tokens,
    optimal_tree,
    optimal_trees,
)
from treespec.cost.calibration import (
    CalibratedCost,
    Calibration,
    Curve,
    acceptance_key,
    batch_verify_passes,
    calibrate,
    calibrate_batches,
    default_calibration_path,
    machine_mismatch,
    measure,
    measure_interleaved,
    verify_passes,
)
from treespec.cost.hardware import HARDWARE_PRESETS, Hardware, get_hardware
from treespec.cost.planner import (
    BatchLimits,
    RooflineCost,
    StepCost,
    TreeChoice,
    auto_budget,
    auto_min_gain,
    auto_threshold_text,
    batch_limits,
    best_choice,
    best_tree,
    plan_curve,
)
from treespec.cost.roofline import (
    DRAFTER_KINDS,
    DrafterSpec,
    arithmetic_intensity,
    compute_bound_batch,
    pass_bytes,
    pass_flops,
    pass_time,
    t_draft,
    t_target,
)
from treespec.cost.shapes import MODEL_PRESETS, ModelShape, model_shape

__all__ = [
    "DEFAULT_BETA",
    "DRAFTER_KINDS",
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "BatchLimits",
    "CalibratedCost",
    "Calibration",
    "Curve",
    "DrafterSpec",
    "Hardware",
    "ModelShape",
    "OptimalTree",
    "RooflineCost",
    "StepCost",
    "TreeChoice",
    "acceptance_vector",
    "arithmetic_intensity",
    "auto_budget",
    "auto_min_gain",
    "auto_threshold_text",
    "batch_limits",
    "best_choice",
    "best_tree",
    "acceptance_key",
    "batch_verify_passes",
    "calibrate",
    "calibrate_batches",
    "compute_bound_batch",
    "default_calibration_path",
    "machine_mismatch",
    "expected_chain_tokens",
    "expected_tokens_positional",
    "expected_tree_tokens",
    "get_hardware",
    "measure",
    "measure_interleaved",
    "model_shape",
    "optimal_tree",
    "optimal_trees",
    "pass_bytes",
    "pass_flops",
    "pass_time",
    "plan_curve",
    "t_draft",
    "t_target",
    "verify_passes",
]


def __getattr__(name: str):
    """``calibrate_drafter`` lives in ``treespec.measure`` (above the engine); this old path
    still resolves, on first use."""
    if name == "calibrate_drafter":
        from treespec.measure import calibrate_drafter

        return calibrate_drafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
