"""Measurements that run models on this machine and write what the cost model reads.

    passes     the target's verify pass and stand-in drafters timed at n = 1 … 128 tokens,
               batched passes; ``calibrate`` / ``calibrate_batches`` return a Calibration
    drafters   a registered drafter's pass times and acceptance vectors, measured by running
               the generator (so this package sits above ``treespec.runtime``)
    ensure     ``ensure_calibration``: the cached calibration builder="auto" reads, with what it
               lacks measured now (``treespec generate / demo / serve --budget auto``)
"""

from treespec.calibrate.drafters import calibrate_drafter, measure_acceptance_vector
from treespec.calibrate.passes import (
    batch_verify_passes, calibrate, calibrate_batches, measure, measure_interleaved, verify_passes,
)

__all__ = [
    "batch_verify_passes", "calibrate", "calibrate_batches", "calibrate_drafter", "measure",
    "measure_acceptance_vector", "measure_interleaved", "verify_passes",
]
