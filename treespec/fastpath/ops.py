"""treespec's packed CPU kernels as PyTorch custom operators, so ``torch.compile`` calls them
inside one graph instead of breaking it at every linear layer.

Eager passes call the kernels directly (:mod:`treespec.fastpath.kernels`): a custom operator's
dispatch costs microseconds a call, ~200 calls a pass. Under ``torch.compile``
(:func:`torch.compiler.is_compiling`) :class:`treespec.fastpath.packing.PackedLinear` calls these
operators instead; their *fake* implementations give the output's shape and dtype without
running anything, which is all the compiler needs to trace through them. Each one returns a new
tensor and mutates nothing, so the compiler may reorder it like any other pure op.

    torch.ops.treespec.block_linear(x, blob, bits, isa, half_scales, out_features)
    torch.ops.treespec.panel_linear(x, panels, isa, out_features)
    torch.ops.treespec.amx_linear(x, blob, bits, half_scales, out_features)

``x`` [..., K] float32 on the CPU -> [..., out_features]; the bias is left to the caller (a plain
add the compiler fuses). ``isa`` is the kernel module's number (0 AVX2, 1 AVX-512; ``kernels.ISAS``).
"""

from __future__ import annotations

import torch

from treespec.fastpath import kernels

__all__ = ["amx_linear", "block_linear", "panel_linear"]


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.numel() // k
    return x.reshape(rows, k).contiguous()


def _shaped(y: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
    """The kernel's [rows, 16 P] output as x's leading dims x ``out_features`` (a zero-padded last
    panel's columns dropped: a copy, since an operator must not return a view of a slice)."""
    if y.shape[1] != out_features:
        return y[:, :out_features].reshape(*x.shape[:-1], out_features).clone()
    return y.view(*x.shape[:-1], out_features)


@torch.library.custom_op("treespec::block_linear", mutates_args=())
def block_linear(x: torch.Tensor, blob: torch.Tensor, bits: int, isa: int, half_scales: bool,
                 out_features: int) -> torch.Tensor:
    k = x.shape[-1]
    y = kernels._kernel().panel_linear_blocks(_rows(x, k), blob, bits, isa, half_scales)
    return _shaped(y, x, out_features)


@torch.library.custom_op("treespec::panel_linear", mutates_args=())
def panel_linear(x: torch.Tensor, panels: torch.Tensor, isa: int, out_features: int) -> torch.Tensor:
    k = x.shape[-1]
    y = kernels._kernel().panel_linear(_rows(x, k), panels, isa)
    return _shaped(y, x, out_features)


@torch.library.custom_op("treespec::amx_linear", mutates_args=())
def amx_linear(x: torch.Tensor, blob: torch.Tensor, bits: int, half_scales: bool, out_features: int) -> torch.Tensor:
    k = x.shape[-1]
    y = kernels._kernel().amx_linear_blocks(_rows(x, k), blob, bits, half_scales)
    return _shaped(y, x, out_features)


def _fake(x: torch.Tensor, *args) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], args[-1])


for _op in (block_linear, panel_linear, amx_linear):
    _op.register_fake(_fake)
