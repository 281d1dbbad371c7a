"""Low-bit weights for a *drafter*: the same model, read from a quarter of the bytes.

Glossary
--------
- **group** — :data:`GROUP` consecutive input (``k``) values of one output row share a scale
  ``d`` and an offset ``z``: ``w ≈ d (q - 8) + z`` with ``q`` a 4-bit integer (PyTorch's int4
  layout). The scale and offset come from the group's minimum and maximum (as GGUF's Q4_1 does).
- **Int4Linear** — an ``nn.Linear`` stand-in that runs PyTorch's CPU int4 kernel
  (``aten._weight_int4pack_mm_for_cpu``) on passes of a few rows, in the layer's dtype (bf16 or
  fp16), and a dense copy of the same 4-bit weights on longer ones. A one-row pass of
  Qwen2.5-Coder-0.5B's 24 decoder layers reads 180 MB instead of 716 MB in bf16; measured on one
  AMX core, a whole one-token draft pass took 49 ms against 108 ms packed in bf16
  (``benchmarks/results/quant_drafter.md``).
- **8-bit head** — :func:`round_linears_to_blocks8`: an fp32 feature head (eagle, eagle3, mtp)
  on a target that runs the fp32 block kernel gets its linear layers rounded to 8-bit blocks
  (GGUF Q8_0's rounding, a scale per 32 ``k`` values), which the block kernel reads at 1.125
  bytes a weight instead of 4. The shipped eagle3's held-out acceptance is unchanged by it
  (top-1 at depth 1: 0.5269 against 0.5271 in fp32, 11,071 positions;
  ``benchmarks/results/head_weights_amx.md``).

Why only drafters: a drafter's weights decide which tokens are *proposed*, never which are
*kept*. Rejection sampling reads the q the tokens were drafted from, so a 4-bit drafter is
exactly as lossless as the bf16 one; it may be accepted less often (the benchmark measures
both). A target's weights are the output law itself and are never quantized here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GROUP", "INT4_MAX_ROWS", "Int4Linear", "QuantReport", "check_int4_dtype", "dequantize", "quantize_linears",
           "quantize_weight", "round_linears_to_blocks8"]

GROUP = 32          # k values per scale/offset pair
ROW_MULTIPLE = 16   # the kernel's layout packs output rows 16 at a time (fewer are zero-padded)
_INNER_K_TILES = 2  # PyTorch's CPU int4 packing parameter (k tiles of 16 per inner block)
# The int4 kernel's time grows with the rows; the dense copy's (PyTorch's bf16 GEMM, unpacked)
# hardly does. A whole 0.5B draft pass on one AMX core: 50 ms for 1 row, 80 for 4, 138 for 8 and
# 181 for 10 on int4, 154-161 ms dense (benchmarks/results/quant_drafter.md): up to 8 rows on int4.
INT4_MAX_ROWS = 8
INT4_DTYPES = (torch.bfloat16, torch.float16)


def check_int4_dtype(dtype: torch.dtype, what: str) -> None:
    """Refuse int4 weights for ``what`` (a layer, a model, a target) whose dtype is ``dtype``
    unless it is bf16 or fp16: the one reason, said once for every caller."""
    if dtype not in INT4_DTYPES:
        raise ValueError(f"int4 drafter weights need a bf16 or fp16 model: {what} is {dtype}. PyTorch's CPU int4 "
                         "kernel runs fp32 inputs an order of magnitude slower than the fp32 layers it would "
                         "replace (benchmarks/results/quant_drafter.md): run it with dtype='bfloat16' or drop "
                         "weights='int4'")


def quantize_weight(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (4-bit codes ``q`` [N, K] int32 in 0..15, ``scales_and_zeros``
    [K / group, N, 2] fp32) with ``w ≈ d (q - 8) + z`` per group (min/max: the group's extremes
    are stored exactly, up to fp32 rounding). ``K`` must be a multiple of ``group``."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group}")
    w = weight.detach().float().reshape(n, k // group, group)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((w - low) / scale).round_().clamp_(0, 15).to(torch.int32).reshape(n, k)
    zero = low + 8 * scale     # the kernel computes d (q - 8) + z
    scales_and_zeros = torch.stack([scale.reshape(n, -1), zero.reshape(n, -1)], -1).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The fp32 weights ``q`` and ``scales_and_zeros`` stand for (the reference the tests use)."""
    n, k = q.shape
    scale = scales_and_zeros[..., 0].t().reshape(n, k // group, 1)
    zero = scales_and_zeros[..., 1].t().reshape(n, k // group, 1)
    return ((q.reshape(n, k // group, group).float() - 8) * scale + zero).reshape(n, k)


class Int4Linear(nn.Module):
    """``linear`` with 4-bit group weights (see module docstring).

    Passes of up to ``max_rows`` (:data:`INT4_MAX_ROWS`) rows run the int4 kernel; longer ones
    (a prompt's prefill, a wide tree level) run PyTorch's own GEMM over ``dense_weight``, the
    same dequantized weights in the layer's dtype (the int4 kernel's cost grows with the rows: a
    16-row pass took 1.6x the dense one). Either way the layer multiplies by the same 4-bit
    weights. So the layer saves bytes read per pass, not memory. The dense copy is a buffer, not
    an ``nn.Linear``, so that ``pack_linears`` leaves it alone (a packed copy would double its
    memory for passes that are rare in drafting)."""

    def __init__(self, linear: nn.Linear, group: int = GROUP, max_rows: int = INT4_MAX_ROWS):
        super().__init__()
        weight = linear.weight
        check_int4_dtype(weight.dtype, "the layer")
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        self.max_rows = max_rows
        self.dtype = weight.dtype
        q, scales_and_zeros = quantize_weight(weight, group)
        scales_and_zeros = scales_and_zeros.to(self.dtype)    # what the kernel reads; the dense copy too
        self.register_buffer("dense_weight", dequantize(q, scales_and_zeros.float(), group).to(self.dtype),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias, persistent=False)
        pad = -self.out_features % ROW_MULTIPLE
        if pad:   # zero rows (code 0, scale and offset 0 -> weight 0); their outputs are dropped
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            scales_and_zeros = torch.cat([scales_and_zeros, scales_and_zeros.new_zeros(
                scales_and_zeros.shape[0], pad, 2)], 1)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(weight.device), _INNER_K_TILES),
                             persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(weight.device, self.dtype), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes a pass of up to ``max_rows`` rows reads (codes, scales and offsets)."""
        return self.packed.numel() * self.packed.element_size() + \
            self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.max_rows or x.dtype != self.dtype or x.requires_grad:
            return F.linear(x, self.dense_weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, int4"


@dataclass(frozen=True)
class QuantReport:
    """What :func:`quantize_linears` did."""

    quantized: int
    bytes_before: int
    bytes_after: int
    skipped: tuple[str, ...]    # "name (why)" for each linear layer left as it was

    def __str__(self) -> str:
        left = f"; left {len(self.skipped)}: {', '.join(self.skipped)}" if self.skipped else ""
        return (f"int4 (group {GROUP}): {self.quantized} linear layers, {self.bytes_before / 2**20:.0f} MB -> "
                f"{self.bytes_after / 2**20:.0f} MB read per pass of up to {INT4_MAX_ROWS} rows{left}")


def quantize_linears(model: nn.Module, group: int = GROUP, skip: tuple[nn.Module, ...] = ()) -> QuantReport:
    """Replace every ``nn.Linear`` (and packed linear) of ``model`` by an :class:`Int4Linear`, in
    place. For a drafter's own model only: its modules must not be shared with a target (an
    early-exit drafter's are), or the target would be changed too. CPU only; a layer whose
    ``in_features`` is not a multiple of ``group`` is left as it is and named in the report.
    bf16 or fp16 weights only (:class:`Int4Linear` says why). Layers in ``skip`` are left as they are."""
    from treespec.fastpath.packing import PackedLinear

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    weight = next(model.parameters(), None)
    if weight is not None and weight.device.type != "cpu":
        raise ValueError(f"int4 drafter weights run on the CPU kernel only; the model is on {weight.device}: "
                         "drop the quantization there")
    if weight is not None:   # before any layer is replaced
        check_int4_dtype(weight.dtype, "the model")
    count, before, after, skipped = 0, 0, 0, []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            linear = child.unpacked() if isinstance(child, PackedLinear) else child
            if type(linear) is not nn.Linear or any(child is m for m in skip):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            if linear.in_features % group:
                skipped.append(f"{full} (in_features {linear.in_features} not a multiple of {group})")
                continue
            layer = Int4Linear(linear, group)
            before += linear.weight.numel() * linear.weight.element_size()
            after += layer.nbytes
            setattr(parent, name, layer)
            count += 1
    return QuantReport(count, before, after, tuple(skipped))


def round_linears_to_blocks8(model: nn.Module) -> tuple[int, tuple[str, ...]]:
    """Round the weight of every fp32 ``nn.Linear`` (or packed linear) of ``model``, in place, to
    the nearest weights 8-bit blocks hold exactly (:func:`treespec.fastpath.kernels.round_to_blocks8`).
    Packed on the block kernel afterwards (``pack_linears``, or a packed layer's own repack when
    its weight changes), each is then read as 8-bit blocks. For a drafter's own modules only,
    never ones shared with a target. Returns (layers rounded, "name (why)" for each left as it was:
    ``in_features`` not a multiple of 32)."""
    from treespec.fastpath.kernels import BLOCK, round_to_blocks8
    from treespec.fastpath.packing import PackedLinear

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    layers = [(name, layer) for name, layer in model.named_modules()
              if type(layer) is nn.Linear or isinstance(layer, PackedLinear)]
    for name, layer in layers:   # every layer checked before any is changed
        weight = layer.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"8-bit blocks are read by the fp32 CPU block kernel; {name or 'the layer'} is "
                             f"{weight.dtype} on {weight.device}")
    count, skipped = 0, []
    with torch.no_grad():
        for name, layer in layers:
            if layer.weight.shape[1] % BLOCK:
                skipped.append(f"{name} (in_features {layer.weight.shape[1]} not a multiple of {BLOCK})")
                continue
            layer.weight.copy_(round_to_blocks8(layer.weight))
            count += 1
    return count, tuple(skipped)
