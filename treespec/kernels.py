"""Compiled CPU kernels: the fp32 *panel GEMM* for small-row passes on AVX2 + FMA CPUs.

Glossary
--------
- **panel** — 16 output columns of a weight ``W [N, K]`` stored k-major (``[P, K, 16]``,
  ``P = ceil(N / 16)``; a last partial panel is zero-padded). One panel is one sequential read.
- **panel GEMM** — ``treespec/csrc/panel_gemm.cpp``: a tile of up to 6 rows of ``x`` times one
  panel (or 1-3 rows times 4-2 panels) with all partial sums in AVX2 registers; every row block
  of a panel reuses it from cache, so the weights are read from memory once per pass whatever
  the row count. PyTorch's own fp32 GEMM re-packs the weights on every call of 2 or more rows;
  on an AMD EPYC core a 4-node tree pass went from 1.6-1.8x to 1.3-1.5x a 1-node pass, and the
  1-node pass itself from 84-102 to 66-71 ms (``benchmarks/results/verify_cost_avx2.md``).
- **batch-invariant** — each output is one FMA chain over ``k`` in order, so a row's result is
  bit-identical whether it is multiplied alone or with other rows. A 1-token decode step and a
  tree pass therefore see the same linear outputs for the same row.

The kernel is compiled from source with ``torch.utils.cpp_extension`` the first time it is
needed (about a minute; cached in PyTorch's extension directory, rebuilt when the source
changes). Where it cannot be (no AVX2/FMA, no C++ compiler, no ninja), :func:`panel_status`
says why and callers keep PyTorch's own path.
"""

from __future__ import annotations

import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path

import torch

from treespec.cpu import CpuInfo, cpu_info

__all__ = ["PANEL", "PanelUnavailable", "pack_panels", "panel_linear", "panel_status"]

PANEL = 16
SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]


class PanelUnavailable(RuntimeError):
    """The panel kernel cannot run here; the message says why."""


def _missing_tools() -> str | None:
    from torch.utils.cpp_extension import is_ninja_available

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} not on PATH; set CXX)"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


@lru_cache(maxsize=1)
def _build():
    """(module, None) or (None, reason). Built once per process, cached on disk across them."""
    missing = _missing_tools()
    if missing:
        return None, missing
    from torch.utils.cpp_extension import load

    print("treespec: loading the fp32 panel kernel (compiled on first use, about a minute)...",
          file=sys.stderr, flush=True)
    try:
        module = load("treespec_panel_gemm", sources=[str(SOURCE)], extra_cflags=_FLAGS,
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # a compiler error is a reason to keep the stock path, not a crash
        return None, f"building {SOURCE.name} failed: {type(e).__name__}: {str(e).splitlines()[-1:]}"
    return module, None


def panel_status(cpu: CpuInfo | None = None, build: bool = True) -> tuple[bool, str]:
    """Whether the panel kernel runs on this machine, and why not if it does not.

    ``cpu``: a :class:`treespec.cpu.CpuInfo` (default: this machine's). ``build=False``
    only checks the CPU flags (no compilation).
    """
    cpu = cpu if cpu is not None else cpu_info()
    lacking = [f for f in ("avx2", "fma") if f not in cpu.flags]
    if lacking:
        return False, f"CPU lacks {' and '.join(lacking)} ({cpu.model})"
    if not build:
        return True, "AVX2 + FMA"
    module, why = _build()
    return module is not None, why or "AVX2 + FMA, kernel built"


def _kernel():
    module, why = _build()
    if module is None:
        raise PanelUnavailable(why)
    return module


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 (CPU) -> panels [P, K, 16], zero-padded to a multiple of 16 rows."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_panels takes a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    n, k = weight.shape
    pad = -n % PANEL
    w = weight.detach()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    # [N', K] -> [P, 16, K] -> [P, K, 16]
    return w.view(-1, PANEL, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``panels = pack_panels(W)``; x [..., K] float32 on the CPU."""
    k = panels.shape[1]
    rows = x.numel() // k
    # [..., K] -> [rows, K] -> [rows, N]
    y = _kernel().panel_linear(x.reshape(rows, k).contiguous(), panels)
    if y.shape[1] != out_features:         # zero-padded last panel
        y = y[:, :out_features]
    if bias is not None:
        y = y + bias.detach()
    return y.reshape(*x.shape[:-1], out_features)
