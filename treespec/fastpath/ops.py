"""treespec's packed CPU kernels as PyTorch operators, so ``torch.compile`` calls them inside one
graph instead of breaking it at every linear layer.

The operators are defined and implemented in C++ (``csrc/panel_gemm.cpp``, registered when the
kernel module loads): a compiled graph reaches the kernel through the dispatcher with no Python
in between. A Python ``torch.library.custom_op`` cost about 40 us a call more (211 calls a
SmolLM2 pass: 8 ms). This module loads the kernel and gives each operator its *fake*
implementation, the output's shape and dtype without running anything, which is all the
compiler needs to trace through it. Each returns a new tensor and mutates nothing, so the
compiler may reorder it like any other pure op. Eager passes call the kernels directly
(:mod:`treespec.fastpath.kernels`).

    torch.ops.treespec.block_linear(x, blob, bits, isa, half_scales, out_features)
    torch.ops.treespec.panel_linear(x, panels, isa, out_features)
    torch.ops.treespec.amx_linear(x, blob, bits, half_scales, out_features)
    torch.ops.treespec.x8_linear(x, blob, bits, half_scales, out_features)

``x`` [..., K] float32 on the CPU -> [..., out_features]; the bias is left to the caller (a plain
add the compiler fuses). ``isa`` is the kernel module's number (0 AVX2, 1 AVX-512; ``kernels.ISAS``).
Importing this module builds the kernel where needed (:class:`kernels.PanelUnavailable` where it
cannot run).
"""

from __future__ import annotations

import torch

from treespec.fastpath import kernels

__all__ = ["amx_linear", "block_linear", "x8_linear", "panel_linear"]

kernels._kernel()   # loading the module registers treespec::* (raises PanelUnavailable where it cannot)


def _fake(x: torch.Tensor, *args) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], args[-1])


for _name in ("block_linear", "panel_linear", "amx_linear", "x8_linear"):
    torch.library.register_fake(f"treespec::{_name}")(_fake)

block_linear = torch.ops.treespec.block_linear.default
panel_linear = torch.ops.treespec.panel_linear.default
amx_linear = torch.ops.treespec.amx_linear.default
x8_linear = torch.ops.treespec.x8_linear.default
