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
    torch.ops.treespec.x8_linear(x, blob, bits, half_scales, sub_scales, out_features)
    torch.ops.treespec.row_attention(q, k, v, mask, scale, isa)

``x`` [..., K] float32 on the CPU -> [..., out_features]; the bias is left to the caller (a plain
add the compiler fuses). ``row_attention``: q [B, Hq, T, d], k and v [B, Hkv, S, d], a bool mask
[B, 1 or Hq, T, >= S] -> [B, T, Hq, d] (``kernels.row_attention_kernel``). ``isa`` is the kernel
module's number (0 AVX2, 1 AVX-512; ``kernels.ISAS``).
Importing this module builds the kernel where needed (:class:`kernels.PanelUnavailable` where it
cannot run).
"""

from __future__ import annotations

import torch

from treespec.fastpath import kernels

__all__ = ["amx_linear", "block_linear", "panel_linear", "row_attention", "x8_linear"]

kernels._kernel()   # loading the module registers treespec::* (raises PanelUnavailable where it cannot)


def _fake(x: torch.Tensor, *args) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], args[-1])


for _name in ("block_linear", "panel_linear", "amx_linear", "x8_linear"):
    torch.library.register_fake(f"treespec::{_name}")(_fake)


@torch.library.register_fake("treespec::row_attention")
def _fake_row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                        isa: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])   # [B, T, Hq, d]


block_linear = torch.ops.treespec.block_linear.default
panel_linear = torch.ops.treespec.panel_linear.default
amx_linear = torch.ops.treespec.amx_linear.default
x8_linear = torch.ops.treespec.x8_linear.default
row_attention = torch.ops.treespec.row_attention.default
