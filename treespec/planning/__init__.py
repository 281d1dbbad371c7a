"""The cost model: roofline step times, the calibration file, tree sizing. Pure functions.

    shapes       ModelShape (from any HF config, or a preset) -> bytes, FLOPs per token
    hardware     Hardware presets (H100, MI300X, H200, A100, L40) and custom specs
    roofline     t_target / t_draft / arithmetic intensity / compute-bound batch
    tau          β and τ of chains and trees, optimal trees under positional acceptance
    calibration  Calibration (the JSON file), CalibratedCost for this machine
    planner      best_tree / auto_budget (auto_min_gain) / batch_limits / plan_curve

Nothing here runs a model: measuring is ``treespec.calibrate``.
"""

from treespec.planning.tau import (
    DEFAULT_BETA,
    OptimalTree,
    acceptance_rate,
    acceptance_vector,
    expected_chain_tokens,
    expected_tokens_positional,
    expected_tree_tokens,
    optimal_tree,
    optimal_trees,
    validate_acceptance,
)
from treespec.planning.calibration import (
    PLAIN_LOOP, CalibratedCost, Calibration, Curve, LoopCost, acceptance_key, default_calibration_path,
    machine_mismatch, model_calibration_path, target_calibration_path,
)
from treespec.planning.hardware import HARDWARE_PRESETS, Hardware, get_hardware
from treespec.planning.planner import (
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
from treespec.planning.roofline import (
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
from treespec.planning.shapes import MODEL_PRESETS, ModelShape, model_shape

__all__ = [
    "DEFAULT_BETA",
    "DRAFTER_KINDS",
    "HARDWARE_PRESETS",
    "MODEL_PRESETS",
    "PLAIN_LOOP",
    "BatchLimits",
    "CalibratedCost",
    "Calibration",
    "Curve",
    "LoopCost",
    "DrafterSpec",
    "Hardware",
    "ModelShape",
    "OptimalTree",
    "RooflineCost",
    "StepCost",
    "TreeChoice",
    "acceptance_rate",
    "acceptance_vector",
    "arithmetic_intensity",
    "auto_budget",
    "auto_min_gain",
    "auto_threshold_text",
    "batch_limits",
    "best_choice",
    "best_tree",
    "acceptance_key",
    "compute_bound_batch",
    "default_calibration_path",
    "machine_mismatch",
    "model_calibration_path",
    "target_calibration_path",
    "expected_chain_tokens",
    "expected_tokens_positional",
    "expected_tree_tokens",
    "get_hardware",
    "model_shape",
    "optimal_tree",
    "optimal_trees",
    "validate_acceptance",
    "pass_bytes",
    "pass_flops",
    "pass_time",
    "plan_curve",
    "t_draft",
    "t_target",
]
