"""Fast target passes on the CPU without forking the model: packed weights and native bf16.

Glossary
--------
- **re-pack** — a GEMM library copies the weight matrix into its blocked, cache-friendly layout
  before multiplying. For fp32 ``F.linear`` with 4 or more rows, PyTorch's default path does this
  on *every* call: a 16-row tree pass then reads and rewrites every weight once more than a
  1-row decode step, so verifying a small tree costs far more than one decode step.
- **packed linear** — :class:`PackedLinear`, a drop-in ``nn.Linear`` replacement that keeps the
  weight pre-packed once (oneDNN's blocked layout, through ``torch.ops.mkldnn``) next to the
  original parameter. The original stays the module's ``weight`` (same ``Parameter`` object, so
  tied embeddings, ``state_dict`` and fingerprints are unchanged); the packed copy is not part of
  the state. Memory: one extra copy of every packed weight (≈ +540 MB for SmolLM2 in fp32).
- **panel linear** — the same module on the fp32 *panel GEMM* (:mod:`treespec.fastpath.kernels`, compiled
  once per machine): weights stored as 16-column panels and read once per pass for 1 to
  :data:`PANEL_MAX_ROWS` rows, each output one in-order FMA chain (bit-identical for a row alone
  or among others). Chosen for fp32 on every CPU with AVX2 (AVX-512 ones included), over exact
  integer blocks where the weights are ones (``"blocks"``); ask for oneDNN with ``kernel="onednn"``.
- **amx** — ``kernel="amx"``: the integer blocks of ``"blocks"`` multiplied on the CPU's AMX
  tile unit with each linear layer's input rounded to bf16 (:func:`treespec.fastpath.kernels.amx_linear`;
  weights exact, sums fp32, everything outside the linear layers fp32). A pass of 16 rows costs
  little more than one, where the vector kernels pay each row's multiply-adds. Not the fp32
  target: like bf16, a different target, compared with plain decoding on the same path. Asked
  for by name only (``load_target(..., pack="amx")``), on a CPU with AMX-BF16. 6-bit blocks
  (GGUF Q6_K, a scale per 16 values) have no tile code: those layers run the vector block
  kernel (fp32 inputs) in an amx model.
- **x8** — ``kernel="x8"``: the integer blocks of ``"blocks"`` times each layer's input
  rounded to 8-bit integers per block of 32 (:func:`treespec.fastpath.kernels.x8_linear`, as
  llama.cpp multiplies its quantized weights): integer products, 32 a pair of instructions, on
  every CPU with AVX2. A different target again (x keeps 8 bits a block), compared with plain
  decoding on the same path; asked for by name only (``load_target(..., pack="x8")``).
- **native bf16** — matrix units that multiply bf16 directly (x86 ``avx512_bf16`` or
  ``amx_bf16``; a CUDA device with compute capability ≥ 8.0). Without them bf16 is emulated and
  slower than fp32, so ``dtype="auto"`` picks fp32 there.

A bf16 target is a *different target* from the fp32 one: its baseline is plain decoding of the
same bf16 weights. The fp32 packed path is the same target: oneDNN's blocked fp32 GEMM rounds
differently from MKL's in the last bits (logits within ~1e-4), exactly as PyTorch's own 1-row and
16-row fp32 kernels already differ; greedy output stays token-identical to HF ``generate`` (tested
on the real model).

Which path runs is decided from what the machine has (CPU flags from ``/proc/cpuinfo``, whether
this PyTorch build has oneDNN), never assumed; :func:`pack_linears` returns a report that says
what it did and why.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treespec.fastpath.cpu import BF16_FLAGS, RELEVANT_FLAGS, CpuInfo, _read_cpuinfo, cpu_info  # noqa: F401 (re-exported)
from treespec.fastpath.kernels import (ISAS, _isa_index, BlockPanels, amx_linear, amx_status, block_linear,
                                      x8_linear, kernel_isa, pack_blocks, pack_x8, pack_panels, panel_linear,
                                      panel_status)

__all__ = [
    "CpuInfo",
    "PackReport",
    "PackedLinear",
    "cpu_info",
    "is_packed",
    "linear_isa",
    "linear_kernel",
    "machine_info",
    "machine_line",
    "native_bf16",
    "pack_linears",
    "pack_weight",
    "packed_linear",
    "packing_available",
    "resolve_dtype",
    "stores_blocks",
    "TARGET_DTYPES",
    "unpack_linears",
]


# fp32: below this many rows PyTorch's own kernel (a GEMV, no re-pack) is as fast or faster.
# Where the crossover lies depends on the CPU (benchmarks/linear_rows.py measures it): packed
# ahead from 4 rows on AVX-512 CPUs, from 2 on AVX2-only ones, whose stock 2- and 3-row products
# are slower than the 4-row one.
FP32_MIN_ROWS = 4
FP32_MIN_ROWS_AVX2 = 2

# The panel GEMM runs passes of 1..PANEL_MAX_ROWS rows (decode steps and trees); longer ones
# (prefill) go to PyTorch's GEMM, whose re-pack is amortized there (benchmarks/verify_cost.py
# compares the kernels by tree size).
PANEL_MAX_ROWS = 64

# bf16 on oneDNN where the bf16 units are AVX-512 BF16 without AMX: a product of 1-3 rows with a
# large weight runs slower than one of 4 rows (benchmarks/results/linear_rows_bf16_epyc.md), so
# such inputs are padded with zero rows to BF16_PAD_ROWS; smaller weights are faster unpadded.
# On AMX padding gains nothing (linear_rows_bf16_amx.md), so it stays off there.
BF16_PAD_ROWS = 4
BF16_PAD_MIN_WEIGHT = 4_000_000   # elements

KERNELS = ("onednn", "panel", "blocks", "amx", "x8")
PANEL_KERNELS = ("panel", "blocks")     # treespec's vector kernels (an ISA to pick, 1..PANEL_MAX_ROWS rows)
BLOCK_KERNELS = ("blocks", "amx", "x8")   # the kernels that store exact integer blocks where a weight is one
FP32_KERNELS = ("panel",) + BLOCK_KERNELS
_ROUNDING = {   # the block kernels that round each layer's input, and how (a target of their own)
    "amx": "rounded to bf16 on the AMX tile unit (treespec.fastpath.kernels.amx_linear)",
    "x8": "rounded to 8-bit integers per block of 32, integer products on the AVX2 kernels "
          "(treespec.fastpath.kernels.x8_linear)",
}
_ISA_NAMES = {"avx2": "AVX2", "avx512": "AVX-512"}   # the panel kernels' instruction sets, as printed


def fp32_min_rows(cpu: CpuInfo) -> int:
    """Fewest rows for which packed fp32 beats stock ``F.linear`` on ``cpu`` (measured above)."""
    return FP32_MIN_ROWS if "avx512f" in cpu.flags else FP32_MIN_ROWS_AVX2


def pad_rows_for(weight: torch.Tensor, pad_rows: int) -> int:
    """A plan's ``pad_rows`` for one weight: kept for large weights, 0 (no padding) below
    ``BF16_PAD_MIN_WEIGHT``, where the unpadded product is the faster one."""
    return pad_rows if weight.numel() >= BF16_PAD_MIN_WEIGHT else 0


def native_bf16(device: str | torch.device = "cpu", cpu: CpuInfo | None = None) -> tuple[bool, str]:
    """Whether ``device`` multiplies bf16 in hardware, and the reason in words."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        ok = major >= 8
        return ok, f"CUDA compute capability {major}.{minor} ({'>=' if ok else '<'} 8.0 for native bf16)"
    if device.type != "cpu":
        return False, f"no bf16 rule for device type {device.type!r}; using float32"
    cpu = cpu if cpu is not None else cpu_info()
    have = [f for f in BF16_FLAGS if f in cpu.flags]
    if have:
        return True, f"CPU has {' and '.join(have)} ({cpu.model})"
    return False, f"CPU has neither {' nor '.join(BF16_FLAGS)} ({cpu.model}): bf16 would be emulated"


# GGUF weight types whose dequantized values the block kernel stores exactly as 4-, 6- or 8-bit
# integer blocks (``kernels.pack_blocks``; tests/test_blocks.py checks each against the gguf
# package's own dequantization; Q5_0 as 8-bit blocks, Q6_K as 6-bit ones: a scale per 16 values).
EXACT_BLOCK_GGUF_TYPES = frozenset({"Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q6_K"})
# The ones ``dtype="auto"`` runs in fp32 on the block kernel rather than in native bf16 (measured
# with SmolLM2's Q4_1 / Q8_0). Q6_K's 6-bit blocks run the AVX2 code on every CPU and were not
# measured against native bf16 there: a checkpoint with them (the Qwen2.5-Coder pair) keeps bf16.
BLOCKS_BEFORE_BF16_TYPES = EXACT_BLOCK_GGUF_TYPES - {"Q6_K"}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu",
                  cpu: CpuInfo | None = None,
                  weight_types: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """``"auto"`` -> bf16 where the hardware has native bf16 matrix units, else fp32; with one
    exception, measured: on a CPU with native bf16 (AVX-512 BF16 or AMX), fp32 on the block kernel
    when every weight matrix of the checkpoint is of an exact block type (``weight_types``: the
    GGUF types of its matrices; None = unknown). The block kernel then reads 0.75-1.1 bytes per
    weight against bf16's 2: a 1-token SmolLM2 pass took 32 ms on it against 61 ms in bf16 on an
    AVX-512-BF16 EPYC (benchmarks/results/verify_cost_epyc_avx512bf16.md) and 27.5 ms against
    46.1 ms on an AMX Xeon (verify_cost_amx_blocks.md).

    The others are taken as asked, by name or as a ``torch.dtype`` (:data:`TARGET_DTYPES`):
    float32, bfloat16, float16, and float64, a reference precision for exactness checks that no
    packed kernel takes (PyTorch's stock modules run it, slower than float32; the reason says so).
    Anything else (an integer or 8-bit float dtype, an unknown name) is refused with the accepted
    values. Returns the dtype and the reason, for printing once.
    """
    if isinstance(dtype, torch.dtype):
        return _target_dtype(dtype, repr(dtype))
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a torch.dtype or a name ({_DTYPE_NAMES}), got {type(dtype).__name__}")
    if dtype == "auto":
        ok, why = native_bf16(device, cpu)
        if ok and torch.device(device).type == "cpu":
            blocks, reason = _blocks_before_bf16(cpu if cpu is not None else cpu_info(), weight_types)
            if blocks:
                return torch.float32, f"auto: {reason}"
        return (torch.bfloat16 if ok else torch.float32), f"auto: {why}"
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use one of {_DTYPE_NAMES}")
    return _target_dtype(resolved, repr(dtype))


# The dtypes a target is loaded in; float64 is a reference precision (stock modules only).
TARGET_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DTYPE_NAMES = ", ".join(repr(n) for n in ("auto", *(str(d).removeprefix("torch.") for d in TARGET_DTYPES)))


def _target_dtype(dtype: torch.dtype, given: str) -> tuple[torch.dtype, str]:
    """``dtype`` and its reason if a target can be loaded in it, else a ValueError with the fix."""
    if dtype not in TARGET_DTYPES:
        hint = (" (8-bit weights: load_target's pack='blocks' runs the GGUF's integer blocks in float32)"
                if dtype in (torch.int8, torch.uint8) or (dtype.is_floating_point and dtype.itemsize == 1) else "")
        raise ValueError(f"dtype={given} cannot hold a target's weights; use one of {_DTYPE_NAMES} or the "
                         f"torch.dtype of the same name{hint}")
    if dtype == torch.float64:
        return dtype, "requested: a float64 reference, PyTorch's stock modules (no packed kernel takes float64)"
    return dtype, "requested"


def _blocks_before_bf16(cpu: CpuInfo, weight_types: frozenset[str] | None) -> tuple[bool, str]:
    """Whether fp32 on the block kernel should replace native bf16 (see ``resolve_dtype``)."""
    if not weight_types or not weight_types <= BLOCKS_BEFORE_BF16_TYPES or not panel_status(cpu, build=False)[0]:
        return False, ""
    units = "AMX" if "amx_bf16" in cpu.flags else "AVX-512 BF16"
    return True, (f"every weight matrix is an exact block type ({', '.join(sorted(weight_types))}): fp32 on "
                  f"the block kernel reads fewer bytes per pass than bf16 on this CPU's {units} units "
                  f"({cpu.model}) and was measured faster on such a CPU")


def machine_info() -> dict:
    """CPU model, relevant flags, thread count and versions: recorded in every result file."""
    cpu = cpu_info()
    return {
        "cpu_model": cpu.model,
        "cpu_flags": list(cpu.flags),
        "torch_cpu_capability": cpu.torch_capability,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "onednn": torch.backends.mkldnn.is_available(),
        # Other processes on a shared machine slow every timing: say how busy it was.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def machine_line(info: dict | None = None) -> str:
    """One Markdown line naming the CPU, its relevant flags and the thread count."""
    m = info if info is not None else machine_info()
    flags = ", ".join(m["cpu_flags"]) or "none of " + ", ".join(RELEVANT_FLAGS)
    return (f"CPU: {m['cpu_model']}; flags: {flags}; torch {m['torch']} ({m['torch_cpu_capability']}), "
            f"{m['torch_threads']} thread(s).")


def packing_available() -> bool:
    """Whether this PyTorch build can pre-pack linear weights (oneDNN with its linear ops)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] copied once into oneDNN's blocked layout (an opaque CPU tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _fast_path_ok(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, rows: int, min_rows: int,
                  max_rows: int | None) -> bool:
    """Whether a packed kernel (weights in ``dtype``) may serve ``x``: ``min_rows``..``max_rows``
    rows, the packed dtype, the CPU, and no autograd through either side (a packed kernel has no
    backward: with a trainable weight the stock op must run, or its gradient would be lost)."""
    # runs ~200 times per target pass: the cheapest tests first (``is_cpu`` is a flag read;
    # ``device.type`` builds a device object)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    return (min_rows <= rows and (max_rows is None or rows <= max_rows) and x.dtype == dtype
            and weight.dtype == dtype and x.is_cpu)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, min_rows: int = 1,
                  bias: torch.Tensor | None = None, pad_rows: int = 0) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``packed`` (:func:`pack_weight` of ``weight``) when
    x has >= ``min_rows`` rows in the packed dtype on the CPU without autograd; else the stock op.
    ``pad_rows``: fewer rows than this are multiplied padded with zero rows to this count (the
    padding's outputs are dropped), where the GEMM is faster for it (``BF16_PAD_ROWS``)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if packed is None or not _fast_path_ok(x, weight, packed.dtype, rows, min_rows, None):
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.detach()
    # [rows, in] -> [rows, out]
    flat = x.reshape(rows, weight.shape[1])
    if 0 < rows < pad_rows:
        flat = torch.cat([flat, flat.new_zeros(pad_rows - rows, flat.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return y[:rows].reshape(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight is packed once for a faster CPU GEMM (fp32 or bf16).

    ``kernel="onednn"``: oneDNN's blocked layout, used for inputs of at least ``min_rows`` rows in
    the packed dtype. ``kernel="panel"``: the fp32 panel GEMM (:mod:`treespec.fastpath.kernels`), used for
    ``min_rows`` to ``max_rows`` rows. ``kernel="blocks"``: the same GEMM reading the weight as
    exact 4-, 6- or 8-bit integer blocks where it is one (a weight dequantized from a GGUF Q4_1,
    Q4_K, Q5_0, Q6_K or Q8_0 checkpoint is; :func:`treespec.fastpath.kernels.pack_blocks` checks
    every value), fp32 panels where it is not; the same fp32 weights as ``"panel"``, summed block
    by block (a few ulp from its outputs, closer to the exact product), from 5.3-6.4x (4-bit),
    3.6x (8-bit) or 3.2x (6-bit) fewer bytes.
    ``kernel="amx"``: those blocks on the AMX tile unit, every pass, with x rounded to bf16 (the
    module's glossary: *amx*; a different target). ``kernel="x8"``: those blocks times x
    rounded to 8-bit integers per block of 32 (*x8*; a different target). ``isa`` picks the
    panel and block kernels' instruction set (one of
    :data:`treespec.fastpath.kernels.ISAS`; None: the CPU's best); the outputs are the same bits.
    Other inputs take the stock ``F.linear`` on the original weight. The packed copy is rebuilt
    if the weight changes in place (its version counter moves), so it never goes stale.
    """

    def __init__(self, linear: nn.Linear, min_rows: int = 1, kernel: str = "onednn",
                 max_rows: int | None = None, pad_rows: int = 0, isa: str | None = None):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"PackedLinear wraps an nn.Linear, got {type(linear).__name__}")
        if linear.weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs CPU weights; this one is on {linear.weight.device}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        if kernel in FP32_KERNELS and linear.weight.dtype != torch.float32:
            raise ValueError(f"the {kernel} kernel is float32 only; this weight is {linear.weight.dtype} "
                             "(use kernel='onednn')")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight          # the same Parameter: ties and state_dict unchanged
        self.bias = linear.bias
        self.kernel = kernel
        self.min_rows = int(min_rows)
        self.max_rows = PANEL_MAX_ROWS if max_rows is None and kernel in PANEL_KERNELS else max_rows
        if isinstance(pad_rows, bool) or not isinstance(pad_rows, int) or pad_rows < 0:
            raise ValueError(f"pad_rows must be an int >= 0 (0 = no padding), got {pad_rows!r}")
        if pad_rows and kernel != "onednn":
            raise ValueError(f"pad_rows is an option of the onednn kernel, not {kernel!r}")
        self.pad_rows = pad_rows
        if isa is not None and (isa not in ISAS or kernel not in PANEL_KERNELS):
            raise ValueError(f"isa must be None or one of {ISAS}, for the panel and block kernels only; "
                             f"got {isa!r} with kernel={kernel!r}")
        self.isa = isa
        self._pack()

    @property
    def isa(self) -> str | None:
        return self._isa

    @isa.setter
    def isa(self, isa: str | None) -> None:
        # the kernel module's ISA number, read here: a compiled graph must not open /proc/cpuinfo
        # (None: an ISA this CPU lacks; the eager kernels refuse it with the reason)
        try:
            self._isa_code = _isa_index(isa) if self.kernel in PANEL_KERNELS else 0
        except ValueError:
            self._isa_code = None
        self._isa = isa

    def _pack(self) -> None:
        packed = None
        if self.kernel in BLOCK_KERNELS:
            packed = pack_x8(self.weight) if self.kernel == "x8" else pack_blocks(self.weight)
        if packed is None:
            packed = pack_weight(self.weight) if self.kernel == "onednn" else pack_panels(self.weight)
        self._packed = packed
        # the records the AMX tiles multiply: 4- and 8-bit ones (6-bit ones run the vector code)
        self._on_tiles = self.kernel == "amx" and isinstance(packed, BlockPanels) and packed.bits != 6
        self._version = self.weight._version

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the packed copy: what one pass through the fast path reads."""
        p = self._packed
        if isinstance(p, BlockPanels):
            return p.nbytes
        return self.weight.numel() * self.weight.element_size() if self.kernel == "onednn" else p.numel() * 4

    @property
    def storage(self) -> str:
        """How the packed copy holds the weight: "4-bit blocks", "8-bit blocks", "fp32 panels",
        or "onednn"."""
        if isinstance(self._packed, BlockPanels):
            return f"{self._packed.bits}-bit blocks"
        return "onednn" if self.kernel == "onednn" else "fp32 panels"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Runs ~200 times per target pass: the parameters are read from nn.Module's own dict
        # (``self.weight`` goes through ``Module.__getattr__``, about 1 us a read; a bias of None
        # is a plain attribute, not in the dict).
        params = self._parameters
        weight, bias = params["weight"], params.get("bias")
        if torch.compiler.is_compiling():
            return self._compiled_forward(x, weight, bias)
        if weight._version != self._version:
            self._pack()
        if self.kernel == "onednn":
            return packed_linear(x, weight, self._packed, self.min_rows, bias, self.pad_rows)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if _fast_path_ok(x, weight, torch.float32, rows, self.min_rows, self.max_rows):
            packed = self._packed
            if isinstance(packed, BlockPanels):
                if self._on_tiles:
                    return amx_linear(x, packed, bias)
                if self.kernel == "x8":
                    return x8_linear(x, packed, bias)
                return block_linear(x, packed, bias, self.isa)
            return panel_linear(x, packed, self.out_features, bias, self.isa)
        return F.linear(x, weight, bias)

    def _compiled_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same kernels as :meth:`forward`, through their custom operators
        (:mod:`treespec.fastpath.ops`) so a compiled graph calls them in place. The packed copy is
        the one made when the graph was traced: a compiled target does not follow in-place weight
        changes (recompile, or repack with ``_pack``, after changing weights)."""
        from treespec.fastpath import ops

        packed = self._packed
        if self.kernel == "onednn":
            return packed_linear(x, weight, packed, self.min_rows, bias, self.pad_rows)
        k = x.shape[-1]
        rows = x.numel() // k if k else 0
        if not _fast_path_ok(x, weight, torch.float32, rows, self.min_rows, self.max_rows):
            return F.linear(x, weight, bias)
        if self._isa_code is None:
            raise ValueError(f"isa={self.isa!r} cannot run on this CPU; set isa=None (the CPU's best)")
        if isinstance(packed, BlockPanels):
            if self._on_tiles:
                y = ops.amx_linear(x, packed.blob, packed.bits, packed.half_scales, packed.out_features)
            elif self.kernel == "x8":
                y = ops.x8_linear(x, packed.blob, packed.bits, packed.half_scales, packed.layout == "x8k",
                                  packed.out_features)
            else:
                y = ops.block_linear(x, packed.blob, packed.bits, self._isa_code, packed.half_scales,
                                     packed.out_features)
        else:
            y = ops.panel_linear(x, packed, self._isa_code, self.out_features)
        return y if bias is None else y + bias

    def blocks(self) -> BlockPanels | None:
        """The integer blocks the vector block kernel reads for this layer (repacked first if the
        weight changed), or None where it runs another kernel or stores fp32 panels."""
        if self.kernel != "blocks":
            return None
        if self.weight._version != self._version:
            self._pack()
        return self._packed if isinstance(self._packed, BlockPanels) else None

    def extra_repr(self) -> str:
        rows = f"{self.min_rows}..{self.max_rows}" if self.max_rows is not None else f">= {self.min_rows}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}, storage={self.storage}, "
                f"dtype={self.weight.dtype}, rows={rows}" + (f", isa={self.isa}" if self.isa else ""))

    def unpacked(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this module's parameters."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")
        linear.weight = self.weight
        linear.bias = self.bias
        return linear


@dataclass(frozen=True)
class PackReport:
    """What :func:`pack_linears` did: how many layers it packed, on which path, and why."""

    packed: int
    path: str      # e.g. "panel (fp32, 1..64 rows)", "onednn (bf16)", "onednn (fp32, >= 4 rows)", "stock"
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class _Plan:
    kernel: str                # one of KERNELS
    min_rows: int
    max_rows: int | None
    reason: str
    pad_rows: int = 0          # onednn: pad fewer rows to this many (weights >= BF16_PAD_MIN_WEIGHT)


def _packing_plan(dtype: torch.dtype, device: torch.device, cpu: CpuInfo,
                  kernel: str | None = None) -> _Plan | str:
    """The plan, or the reason to leave the model as it is. ``kernel`` None picks by the CPU."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be None (pick by CPU) or one of {KERNELS}, got {kernel!r}")
    if kernel in FP32_KERNELS and dtype != torch.float32:
        raise ValueError(f"kernel={kernel!r} is float32 only; these weights are {dtype} (use kernel='onednn')")
    if device.type != "cpu":
        return f"weights on {device}: packing is a CPU path"
    if kernel in _ROUNDING:   # asked for by name only: each is a target of its own
        ok, why = (amx_status if kernel == "amx" else panel_status)(cpu)
        if not ok:
            raise ValueError(f"kernel={kernel!r} is not available here: {why}")
        return _Plan(kernel, 1, None, f"exact 4/6/8-bit integer blocks times each layer's input {_ROUNDING[kernel]}, "
                     "every pass; fp32 panels on the vector kernels for weights that are not blocks")
    # The block GEMM wins wherever a pass is bound by reading the weights: measured on an AVX2-only
    # EPYC and on an AVX-512-BF16 EPYC (SmolLM2, one thread: a 1-token pass 32 ms against 80 ms for
    # oneDNN/stock fp32, and ahead of oneDNN up to 32 rows; benchmarks/results/verify_cost_epyc_
    # avx512bf16.md). It reads exact integer blocks where the weights are ones (the same fp32
    # weights, fewer bytes).
    fallback = ""
    if dtype == torch.float32 and (kernel in PANEL_KERNELS or kernel is None and "avx2" in cpu.flags):
        ok, why = panel_status(cpu)
        if ok:
            chosen = kernel or "blocks"
            stored = ("as exact 4/6/8-bit integer blocks where the weights are ones, else as fp32 "
                      "16-column panels" if chosen == "blocks" else "as 16-column panels")
            return _Plan(chosen, 1, PANEL_MAX_ROWS, f"fp32 weights stored {stored}, read once per pass "
                         f"of 1..{PANEL_MAX_ROWS} rows by the {_ISA_NAMES[kernel_isa(cpu)]} kernels "
                         "(treespec.fastpath.kernels); PyTorch's GEMM above")
        if kernel in PANEL_KERNELS:
            raise ValueError(f"kernel={kernel!r} is not available here: {why}")
        fallback = f" (panel kernel unavailable: {why})"
    if not packing_available():
        return "this PyTorch build has no oneDNN linear packing" + fallback
    if dtype == torch.bfloat16:
        if not cpu.native_bf16:
            return "bf16 without native bf16 units: packing would not make it fast"
        pad = BF16_PAD_ROWS if "amx_bf16" not in cpu.flags else 0
        return _Plan("onednn", 1, None,
                     f"bf16 GEMM on {'/'.join(f for f in BF16_FLAGS if f in cpu.flags)} with weights packed once"
                     + (f"; 1-{pad - 1} rows padded to {pad} for weights of >= {BF16_PAD_MIN_WEIGHT:,} "
                        f"values (faster on AVX-512 BF16 without AMX)" if pad else ""), pad)
    if dtype == torch.float32:
        rows = fp32_min_rows(cpu)
        return _Plan("onednn", rows, None,
                     f"fp32 weights packed once for >= {rows} rows on this "
                     f"{'AVX-512' if 'avx512f' in cpu.flags else 'AVX2'} CPU (stock F.linear re-packs "
                     f"them on every call){fallback}")
    return f"no packed path for {dtype}"


def pack_linears(model: nn.Module, enabled: bool = True, cpu: CpuInfo | None = None,
                 kernel: str | None = None) -> PackReport:
    """Swap every ``nn.Linear`` of ``model`` for a :class:`PackedLinear`, in place, where it helps.

    Helps = CPU weights in fp32 (the panel GEMM on AVX2 CPUs, over exact integer blocks where
    the weights are ones; oneDNN packing for tree passes elsewhere), or bf16 on a CPU with native
    bf16 units (oneDNN, every pass). Elsewhere (GPU, fp16, no oneDNN, ``enabled=False``) the model
    is left untouched and the report says why. ``kernel`` (one of :data:`KERNELS`) overrides the
    CPU-based choice; asking for one that cannot run here is a ``ValueError``. Modules, parameter
    names and the ``forward`` code of the model are unchanged; only leaf ``nn.Linear`` objects
    are replaced.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not enabled:
        return PackReport(0, "stock", "packing turned off")
    weight = next(model.parameters(), None)
    if weight is None:   # e.g. a head already quantized to Int4Linear (buffers only)
        return PackReport(0, "stock", "no parameters to pack")
    plan = _packing_plan(weight.dtype, weight.device, cpu if cpu is not None else cpu_info(), kernel)
    if isinstance(plan, str):
        return PackReport(0, "stock", plan)
    layers = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == weight.dtype:
                layer = PackedLinear(child, plan.min_rows, plan.kernel, plan.max_rows,
                                     pad_rows_for(child.weight, plan.pad_rows))
                setattr(parent, name, layer)
                layers.append(layer)
    if plan.kernel in FP32_KERNELS:
        kind = (f"fp32, {plan.min_rows}..{plan.max_rows} rows" if plan.max_rows
                else f"fp32 weights, x {'as bf16' if plan.kernel == 'amx' else 'as 8-bit integers'}")
        if plan.kernel in BLOCK_KERNELS:
            stored = Counter(layer.storage for layer in layers)
            kind += "; " + ", ".join(f"{n} as {what}" for what, n in sorted(stored.items()))
    else:
        kind = "bf16" if weight.dtype == torch.bfloat16 else f"fp32, >= {plan.min_rows} rows"
    return PackReport(len(layers), f"{plan.kernel} ({kind})" if layers else "stock", plan.reason)


def is_packed(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` runs on a packed path."""
    return linear_kernel(model) != "stock"


def linear_kernel(model: nn.Module) -> str:
    """One of :data:`KERNELS`, or "stock": the path ``model``'s linear layers run on."""
    return next((m.kernel for m in model.modules() if isinstance(m, PackedLinear)), "stock")


def stores_blocks(model: nn.Module) -> bool:
    """Whether any linear layer of ``model`` is stored as integer blocks (the block kernel found
    exact 4/6/8-bit blocks: a target dequantized from a GGUF Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 checkpoint)."""
    return any(isinstance(m, PackedLinear) and isinstance(m._packed, BlockPanels) for m in model.modules())


def linear_isa(model: nn.Module) -> str | None:
    """The instruction set (one of :data:`treespec.fastpath.kernels.ISAS`) that ``model``'s panel or
    block layers run on, or None where its linear layers run on neither."""
    layer = next((m for m in model.modules() if isinstance(m, PackedLinear)), None)
    if layer is None or layer.kernel not in PANEL_KERNELS:
        return None
    return layer.isa or kernel_isa()


def unpack_linears(model: nn.Module) -> int:
    """Undo :func:`pack_linears` in place; returns how many layers were restored."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.unpacked())
                count += 1
    return count
