"""What the host CPU is: its model name and the instruction-set flags that choose a fast path.

Read once per process from ``/proc/cpuinfo`` (the hardware does not change under a process);
:mod:`treespec.fastpath.packing` and :mod:`treespec.fastpath.kernels` pick their paths from it, and every result
file records it, so numbers from different machines are never compared blindly.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = ["BF16_FLAGS", "RELEVANT_FLAGS", "CpuInfo", "cpu_info"]

# Flags that decide a path or explain a number; result files record these.
RELEVANT_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16",
                  "amx_int8", "avx512_fp16")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuInfo:
    """What the host CPU is: ``model`` name and the subset of :data:`RELEVANT_FLAGS` it has."""

    model: str
    flags: tuple[str, ...]
    torch_capability: str   # PyTorch's own dispatch level ("AVX512", "AVX2", "DEFAULT"...)

    @property
    def native_bf16(self) -> bool:
        return any(f in self.flags for f in BF16_FLAGS)

    @property
    def kind(self) -> str:
        """The machine kind result files are named by: "amx" (AMX bf16 tiles), "avx512bf16"
        (AVX-512 BF16 dot products, no AMX), "avx2" (AVX2 + FMA only), else "cpu"."""
        if "amx_bf16" in self.flags:
            return "amx"
        if "avx512_bf16" in self.flags:
            return "avx512bf16"
        return "avx2" if "avx2" in self.flags else "cpu"


def _read_cpuinfo(text: str) -> tuple[str, set[str]]:
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The host CPU (read once per process; the hardware does not change under it)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model, flags = _read_cpuinfo(f.read())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # pragma: no cover - very old torch
        capability = "unknown"
    return CpuInfo(model, tuple(f for f in RELEVANT_FLAGS if f in flags), capability)
