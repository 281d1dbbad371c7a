"""Hardware presets for the roofline: peak memory bandwidth, peak dense bf16 FLOP/s, the
fraction of each a real decode step attains, and a fixed per-pass overhead.

Units: bandwidth in bytes/s, compute in FLOP/s, overhead in seconds. "Dense" means without
2:4 structured sparsity (datasheets print the sparse figure first; dense is half of it).

Sources (datasheet peaks):
    H100 SXM5  NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, BF16 1,979 TFLOP/s
               with sparsity -> 989 dense.
    H200 SXM   NVIDIA H200 datasheet: 4.8 TB/s HBM3e, BF16 1,979 sparse -> 989 dense.
    MI300X     AMD Instinct MI300X datasheet: 5.3 TB/s HBM3, BF16 1,307.4 TFLOP/s dense.
    A100 SXM4  NVIDIA A100 datasheet (80 GB): 2,039 GB/s HBM2e (rounded to 2.0 TB/s, as in
               DESIGN.md), BF16 312 TFLOP/s dense.
    L40        NVIDIA L40 datasheet: 864 GB/s GDDR6, BF16 181.05 TFLOP/s dense (362 sparse).

Efficiencies (attained / peak) are estimates, not measurements of ours:
    bandwidth  0.85 everywhere: streaming reads of large weight matrices reach 80-90 % of peak
               on HBM GPUs. One shared value keeps memory-bound ratios equal to the datasheet
               ratios (MI300X / H100 decode = 5.3 / 3.35).
    compute    large bf16 GEMMs: A100 ~80 % (cuBLAS ~250 TFLOP/s); H100 / H200 ~70 %
               (~700 TFLOP/s, clocks drop under full tensor load); MI300X ~50 % (SemiAnalysis,
               "MI300X vs H100 vs H200 Benchmark Part 1: Training", Dec 2024, measured roughly
               600-650 TFLOP/s BF16 GEMM); L40 50 %: a 300 W card whose sustained tensor clocks
               sit well below the boost clock the datasheet assumes. With datasheet peaks alone
               the L40's ridge point (209 FLOP/B) would exceed the A100's (156 FLOP/B) and
               predict larger trees on the L40, the opposite of Sequoia's measured optima
               (Chen et al. 2024: 128 nodes on A100, 64 on L40 for Llama-2-7B + JF68M).
    overhead   100 µs per forward pass: launch, host sync and sampling of a CUDA-graph-captured
               step (an assumption; an eager PyTorch step of a 7B model costs several ms more).
Custom hardware: ``Hardware(name, bandwidth, peak_flops, ...)`` with your own numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["HARDWARE_PRESETS", "Hardware", "get_hardware"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator as the roofline sees it.

    Attributes:
        name:                 label for tables and plots.
        bandwidth:            peak memory bandwidth, bytes/s.
        peak_flops:           peak dense FLOP/s in the weights' dtype (bf16 for the presets).
        bandwidth_efficiency: attained fraction of ``bandwidth``, in (0, 1].
        compute_efficiency:   attained fraction of ``peak_flops``, in (0, 1].
        overhead_s:           fixed seconds added to every forward pass (launches, sync).
        source:               where the numbers come from.
    """

    name: str
    bandwidth: float
    peak_flops: float
    bandwidth_efficiency: float = 0.85
    compute_efficiency: float = 0.7
    overhead_s: float = 1e-4
    source: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"hardware {self.name!r}: bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.peak_flops > 0:
            raise ValueError(f"hardware {self.name!r}: peak_flops must be > 0 FLOP/s, got {self.peak_flops!r}")
        for field in ("bandwidth_efficiency", "compute_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"hardware {self.name!r}: {field} must be in (0, 1], got {value!r}")
        if not self.overhead_s >= 0:
            raise ValueError(f"hardware {self.name!r}: overhead_s must be >= 0, got {self.overhead_s!r}")

    @functools.cached_property
    def effective_bandwidth(self) -> float:
        """Attained bytes/s."""
        return self.bandwidth * self.bandwidth_efficiency

    @functools.cached_property
    def effective_flops(self) -> float:
        """Attained FLOP/s."""
        return self.peak_flops * self.compute_efficiency

    @functools.cached_property
    def ridge_point(self) -> float:
        """Attained FLOP per byte at which a pass turns from memory- to compute-bound."""
        return self.effective_flops / self.effective_bandwidth


HARDWARE_PRESETS: dict[str, Hardware] = {
    "h100": Hardware("h100", 3.35e12, 989e12, compute_efficiency=0.7,
                     source="NVIDIA H100 SXM5 datasheet"),
    "mi300x": Hardware("mi300x", 5.3e12, 1307e12, compute_efficiency=0.5,
                       source="AMD Instinct MI300X datasheet"),
    "h200": Hardware("h200", 4.8e12, 989e12, compute_efficiency=0.7,
                     source="NVIDIA H200 SXM datasheet"),
    "a100": Hardware("a100", 2.0e12, 312e12, compute_efficiency=0.8,
                     source="NVIDIA A100 SXM4 80GB datasheet"),
    "l40": Hardware("l40", 864e9, 181e12, compute_efficiency=0.5,
                    source="NVIDIA L40 datasheet"),
}


def get_hardware(name: str) -> Hardware:
    """Preset by name (case-insensitive). Unknown name -> ``KeyError`` listing the presets."""
    key = name.strip().lower()
    if key not in HARDWARE_PRESETS:
        raise KeyError(f"unknown hardware {name!r}; known hardware: {sorted(HARDWARE_PRESETS)} "
                       f"(or 'local' for a calibrated machine, or a custom Hardware(...))")
    return HARDWARE_PRESETS[key]
