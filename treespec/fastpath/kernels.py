"""Compiled CPU kernels: the fp32 *panel GEMM* for small-row passes on AVX2 + FMA and AVX-512 CPUs.

Glossary
--------
- **panel** — 16 output columns of a weight ``W [N, K]`` stored k-major (``[P, K, 16]``,
  ``P = ceil(N / 16)``; a last partial panel is zero-padded). One panel is one sequential read.
- **panel GEMM** — ``treespec/fastpath/csrc/panel_gemm.cpp``: a tile of up to 6 rows of ``x`` times one
  panel (or 1-3 rows times 4-2 panels) with all partial sums in AVX2 registers; every row block
  of a panel reuses it from cache, so the weights are read from memory once per pass whatever
  the row count. PyTorch's own fp32 GEMM re-packs the weights on every call of 2 or more rows,
  so a small tree pass reads them more than once (measurements: ``docs/cpu-fast-path.md``).
- **batch-invariant** — each output is one FMA chain over ``k`` in order, so a row's result is
  bit-identical whether it is multiplied alone or with other rows. A 1-token decode step and a
  tree pass therefore see the same linear outputs for the same row.
- **exact blocks** — a weight dequantized from a GGUF Q4_1 / Q8_0 checkpoint (SmolLM2's, the
  target here) is, value for value, ``d q + m`` per block of 32 ``k`` values, with ``q`` a 4- or
  8-bit integer and ``d``, ``m`` fp16 numbers. :func:`pack_blocks` finds that form and checks
  every value bit for bit; :func:`block_linear` then reads 0.625-0.75 (4-bit; fp16 or fp32
  scales) or 1.125 (8-bit) bytes a weight instead of 4. It never rebuilds a weight: per block it
  sums the 32 products of x with the integers ``q`` (one FMA chain, in k order), then adds
  ``d`` times that sum and ``m`` times the block's sum of x into the output. The same fp32 target
  (the same weights, summed in another order, and rounding less than the fp32 panels, which
  round every product: ``tests/test_blocks.py``), read from 5x fewer bytes, without the
  multiply-add per weight a rebuild costs (a pass of 1-16 rows takes 0.91-0.96 of the time on
  the AVX-512 code, ``benchmarks/results/kernel_sums_amx.md``). The order is the same for every
  row count and on both ISAs, so blocks are batch-invariant too.

- **ISA** — the module holds the kernels twice: for AVX2 + FMA (16 ymm registers, a panel is two
  of them) and for AVX-512 F (32 zmm registers, a panel is one, up to 16 rows of accumulators),
  the latter compiled under function-level target options so one build serves both. A CPU with
  AVX-512 F runs the AVX-512 kernels (:func:`kernel_isa`); their outputs are the same bits
  (each output is still the same sequence of operations), and passes of 1-32 rows of blocks take
  0.64-0.92 of the AVX2 kernels' time there (``benchmarks/results/kernel_isa_amx.md``; 1-3 rows
  run four panels at a time, four independent FMA chains, which a 1-row pass waits on).

- **amx** — :func:`amx_linear`: the same integer blocks on the AMX tile unit of CPUs with
  AMX-BF16. Each block's 32 products of a row go through one tile product, with the integers as
  bf16 (exact) and x *rounded to bf16*; then the block is scaled into y as above. Up to 16 rows
  share a tile, so a pass of 16 rows costs little more than one; but x keeps 8 significant bits,
  so a model on it is not the fp32 target (like a bf16 one, it is compared with plain decoding on
  the same path). Its rows are batch-invariant too: a tile row depends on that row only.

- **x8** — :func:`x8_linear`: the same integer blocks times x *rounded to 8-bit integers* per
  block of 32 k values (``dx = max |x| / 127``, ``qx = round(x / dx)``), as llama.cpp multiplies
  its quantized weights: four k values of a column in four bytes, one ``VPMADDUBSW`` multiplies
  32 weights by x's integers, and a block's sums stay exact 16/32-bit integers until it is
  scaled into y. The records hold the same bytes as :func:`pack_blocks`' in another order
  (:func:`x8_records`), or for GGUF K-quants (Q4_K, Q6_K) the same weights in the file's own
  scale form, a fifth to a third fewer bytes (``layout="x8k"``, :mod:`treespec.fastpath.subscales`);
  what a pass costs against the fp32 blocks:
  ``benchmarks/results/verify_cost_avx2.md``. Not the fp32 product (x keeps 8 bits a block): a
  target of its own, batch-invariant like the others, run with row attention so a tree's rows
  are its one-token steps' bits (:mod:`treespec.fastpath.attention`).

The kernel is compiled from source with ``torch.utils.cpp_extension`` the first time it is
needed (about a minute; cached in PyTorch's extension directory, rebuilt when the source
changes). Where it cannot be (no AVX2/FMA, no C++ compiler, no ninja), :func:`panel_status`
says why and callers keep PyTorch's own path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from treespec.fastpath.cpu import CpuInfo, cpu_info
from treespec.fastpath.subscales import SUPER, SubScaled, sub_scaled

__all__ = ["AMX_FLAGS", "BLOCK", "ISAS", "PANEL", "BlockPanels", "PanelUnavailable", "amx_linear", "amx_status",
           "block_linear", "kernel_isa", "pack_blocks", "pack_panels", "panel_linear", "panel_status",
           "pack_x8", "x8_linear", "x8_records",
           "ROW_HEAD_DIMS", "dequantize_blocks8", "draft_block_post", "draft_block_pre", "quantize_blocks8",
           "round_to_blocks8", "row_attention_kernel"]

PANEL = 16
BLOCK = 32
SOURCE = Path(__file__).parent / "csrc" / "panel_gemm.cpp"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


# What every build of the kernels executes (F16C: fp16 scales to floats in one instruction; every
# x86 CPU with AVX2 has it, but it is a flag of its own).
PANEL_FLAGS = ("avx2", "fma", "f16c")

X8_LAYOUTS = ("x8", "x8k")   # x8_records' record kinds (per-block float scales; K-quants' shared ones)

ISAS = ("avx2", "avx512")   # the kernels' instruction sets, in the module's numbering (0, 1)

# What the AMX block kernel executes: tile loads and bf16 tile products, and AVX-512 BF16 / BW
# around them (x rounded to bf16, q widened to bf16; every CPU with AMX also has AVX-512 BW and VL).
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f")


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


def compile_kernel(source: Path, name: str):
    """``source`` compiled as the Python extension module ``name`` with the kernel's flags
    (``torch.utils.cpp_extension``, cached on disk). Also used to build another revision of the
    kernel beside this one (``benchmarks/kernel_ab.py``)."""
    from torch.utils.cpp_extension import load

    # treespec's own module registers the torch.ops.treespec operators (treespec.fastpath.ops),
    # a second build beside it must not
    ops = ["-DTREESPEC_OPS"] if name == "treespec_panel_gemm" else []
    return load(name, sources=[str(source)], extra_cflags=_FLAGS + ops, extra_ldflags=["-fopenmp"], verbose=False)


def build_needed(name: str = "treespec_panel_gemm", source: Path = SOURCE) -> bool:
    """Whether loading ``source`` as module ``name`` (:func:`compile_kernel`) will compile it,
    as ``torch.utils.cpp_extension`` decides: no built module or build file in its extension
    folder, a build file for another source or other flags, or ninja finding work (the source or
    a header newer than the build). Anything it cannot read counts as a build."""
    import subprocess

    try:
        from torch.utils.cpp_extension import LIB_EXT, _get_build_directory

        folder = Path(_get_build_directory(name, verbose=False))
        rules = folder / "build.ninja"
        if not (folder / f"{name}{LIB_EXT}").exists() or not rules.exists():
            return True
        text = rules.read_text()
        if str(source.resolve()) not in text or not all(flag in text for flag in _FLAGS):
            return True
        dry = subprocess.run(["ninja", "-n", "-C", str(folder)], capture_output=True, text=True, timeout=60)
        return dry.returncode != 0 or "no work to do" not in dry.stdout
    except Exception:  # a private torch helper moved, ninja missing, a file unreadable: say it may compile
        return True


@lru_cache(maxsize=1)
def _build():
    """(module, None) or (None, reason). Built once per process, cached on disk across them; the
    one-minute message is printed only when a build is needed (:func:`build_needed`)."""
    missing = _missing_tools()
    if missing:
        return None, missing
    if build_needed():
        print("treespec: compiling the fp32 panel kernel (once per source change, about a minute)...",
              file=sys.stderr, flush=True)
    try:
        module = compile_kernel(SOURCE, "treespec_panel_gemm")
    except Exception as e:  # a compiler error is a reason to keep the stock path, not a crash
        return None, f"building {SOURCE.name} failed: {type(e).__name__}: {str(e).splitlines()[-1:]}"
    return module, None


def panel_status(cpu: CpuInfo | None = None, build: bool = True) -> tuple[bool, str]:
    """Whether the panel kernel runs on this machine, and why not if it does not.

    ``cpu``: a :class:`treespec.fastpath.cpu.CpuInfo` (default: this machine's). ``build=False``
    only checks the CPU flags (no compilation).
    """
    cpu = cpu if cpu is not None else cpu_info()
    lacking = [f for f in PANEL_FLAGS if f not in cpu.flags]
    if lacking:
        return False, f"CPU lacks {', '.join(lacking)} ({cpu.model})"
    isa = "AVX-512 F" if kernel_isa(cpu) == "avx512" else "AVX2 + FMA"
    if not build:
        return True, isa
    module, why = _build()
    return module is not None, why or f"{isa}, kernel built"


def amx_status(cpu: CpuInfo | None = None, build: bool = True) -> tuple[bool, str]:
    """Whether the AMX block kernel (:func:`amx_linear`) runs here, and why not if it does not:
    the CPU flags of :data:`AMX_FLAGS`, the module built, and the OS granting this process the
    tile state (Linux asks for it per process). ``build=False`` checks the flags only."""
    cpu = cpu if cpu is not None else cpu_info()
    lacking = [f for f in AMX_FLAGS if f not in cpu.flags]
    if lacking:
        return False, f"CPU lacks {', '.join(lacking)} ({cpu.model})"
    if not build:
        return True, "AMX-BF16"
    module, why = _build()
    if module is None:
        return False, why
    if not module.amx_permitted():
        return False, "the OS did not grant the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM refused)"
    return True, "AMX-BF16, kernel built"


def kernel_isa(cpu: CpuInfo | None = None) -> str:
    """The kernels' instruction set for ``cpu`` (default: this machine's): "avx512" where it has
    AVX-512 F, else "avx2". Both give the same bits; AVX-512 is faster from 4 rows."""
    cpu = cpu if cpu is not None else cpu_info()
    return "avx512" if "avx512f" in cpu.flags else "avx2"


@lru_cache(maxsize=1)
def _host_isa() -> int:
    return ISAS.index(kernel_isa())


def _isa_index(isa: str | None) -> int:
    """The module's number for ``isa`` (None: this CPU's best). An ISA the CPU lacks is refused:
    its instructions would kill the process (SIGILL), not raise."""
    if isa is None:
        return _host_isa()
    if isa not in ISAS:
        raise ValueError(f"isa must be None (this CPU's best) or one of {ISAS}, got {isa!r}")
    if isa == "avx512" and kernel_isa() != "avx512":
        raise ValueError(f"isa='avx512' needs AVX-512 F, which this CPU lacks ({cpu_info().model}); use 'avx2'")
    return ISAS.index(isa)


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
                 bias: torch.Tensor | None = None, isa: str | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``panels = pack_panels(W)``; x [..., K] float32 on the CPU.
    ``isa``: one of :data:`ISAS` (default: :func:`kernel_isa`); the outputs are the same bits."""
    code = _isa_index(isa)
    return _linear(x, panels.shape[1], out_features, bias, lambda x2: _kernel().panel_linear(x2, panels, code))


def _linear(x: torch.Tensor, k: int, out_features: int, bias: torch.Tensor | None, run) -> torch.Tensor:
    """``run`` ([rows, K] contiguous -> [rows, 16 P]) on x [..., K]: the padded panel columns
    dropped, the bias added, the leading dimensions restored."""
    rows = x.numel() // k
    y = run(x.view(rows, k) if x.is_contiguous() else x.reshape(rows, k).contiguous())
    if y.shape[1] != out_features:         # zero-padded last panel
        y = y[:, :out_features]
    if bias is not None:
        y = y + bias.detach()
    return y.view(*x.shape[:-1], out_features)     # splits the row dimension only: always a view


# ---------------------------------------------------------------------------------------------
# Block-quantized panels: fp32 weights that are exactly d q + m per block of 32 k values


@dataclass(frozen=True)
class BlockPanels:
    """A float32 weight ``W [N, K]`` stored exactly as small integers and per-block scales.

    ``W[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]`` holds bit for bit (checked when
    packed). ``blob`` is uint8 ``[P, K / 32, record]``: for each 16-column panel and block of 32
    k values one record, read as one sequential stream: ``d`` (16 float32), ``m`` (16 float32,
    4 bits only; 0 for 8 bits), then ``q`` for the 32 rows: for 4 bits 16 bytes a pair of rows
    k, k + 1 (byte j = column j, row k in its low nibble and row k + 1 in its high one: one
    load and one widening serve two rows), for 8 bits 16 signed bytes a row. ``bits`` 6 is GGUF
    Q6_K's form: q as for 8 bits, m = 0, and two ``d`` (16 float32 each), for k rows 0-15 and
    16-31 of the block (a 640-byte record: 1.25 bytes a weight).
    ``half_scales`` (4 bits only): ``d`` and ``m`` stored as fp16 numbers, 32 bytes each, where
    every scale and offset of the weight is one (GGUF Q4_1's are; Q4_K's fp32 scales are not):
    a 320-byte record instead of 384, converted back exactly by the kernels.
    """

    blob: torch.Tensor
    bits: int
    out_features: int
    half_scales: bool = False
    layout: str = "vector"     # "x8", "x8k": for the 8-bit-activation kernel (x8_records)

    @property
    def nbytes(self) -> int:
        return self.blob.numel()

    @property
    def q_bytes(self) -> int:
        """Bytes of a record's ``q`` (after its scales): 16 a k row, 8 for 4 bits."""
        return BLOCK * PANEL * (4 if self.bits == 4 else 8) // 8


def _fp16_steps(x: torch.Tensor, steps: int) -> torch.Tensor:
    """``x`` (float32, fp16-representable) moved ``steps`` fp16 ulps, as float32."""
    return (x.half().view(torch.int16) + steps).view(torch.float16).float() if steps else x


# Candidate scales: the one the block's range implies, rounded to fp16 as GGUF stores it, then
# its fp16 neighbours (the quantizer rounds its own fp32 scale, not the range's).
_SCALE_STEPS = (0, -1, 1, -2, 2)


def _fp32_steps(x: torch.Tensor, steps: int) -> torch.Tensor:
    """``x`` (positive float32) moved ``steps`` fp32 ulps."""
    return (x.view(torch.int32) + steps).view(torch.float32) if steps else x


def _smallest_gap(blocks: torch.Tensor) -> torch.Tensor:
    """[..., 1] the smallest gap between two distinct values of each block (0 for a constant one)."""
    ordered = blocks.sort(-1).values
    gaps = ordered[..., 1:] - ordered[..., :-1]
    least = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf"))).amin(-1, keepdim=True)
    return torch.where(torch.isfinite(least), least, torch.zeros_like(least))


def _level_scale(blocks: torch.Tensor, m: torch.Tensor, top: int) -> torch.Tensor:
    """[N, K/32, 1] scale of blocks whose values sit on levels ``m + d q``, q in 0..top, when the
    block need not use every level (GGUF Q4_K: ``d`` = an fp16 number times a 6-bit integer, an
    fp32 number): the number of steps from the minimum to the maximum is the range over the
    smallest gap between sorted values (a gap of one level), then d = range / steps."""
    ordered = blocks.sort(-1).values
    span = ordered[..., -1:] - ordered[..., :1]
    gaps = ordered[..., 1:] - ordered[..., :-1]
    # gaps of round-off size (equal levels) are not level steps
    gaps = torch.where(gaps > span * 1e-3, gaps, torch.full_like(gaps, float("inf")))
    steps = torch.round(span / gaps.amin(-1, keepdim=True)).clamp_(1, top)
    return span / steps


def _q8_0_scale(blocks: torch.Tensor) -> torch.Tensor:
    """[N, K/32, 1] GGUF Q8_0 scale of blocks [N, K/32, 32]: the largest magnitude / 127, as an
    fp16 number (in float32)."""
    return (blocks.abs().amax(-1, keepdim=True) / 127).half().float()


def _scale_families(bits: int):
    """The scale families tried for ``bits`` in order, each a function of (blocks [B, L], the
    blocks' minimum [B, 1]) -> (scale, offset) [B, 1] each, and how a scale's neighbour is taken
    (fp16 or fp32 ulps). Any scale and offset that rebuild every value exactly are right ones."""
    if bits == 4:
        yield (lambda b, lo: (((b.amax(-1, keepdim=True) - lo) / 15).half().float(), lo)), _fp16_steps  # Q4_1
        yield (lambda b, lo: (_level_scale(b, lo, 15), lo)), _fp32_steps      # Q4_K: an fp32 scale
        # Q4_K blocks of few distinct values (a smallest gap of several levels)
        for level in range(2, 16):
            yield (lambda b, lo, j=level: (_smallest_gap(b) / j, lo)), _fp32_steps
    elif bits == 8:
        yield (lambda b, lo: (_q8_0_scale(b), _zeros(b))), _fp16_steps        # Q8_0: fp16 scale
        yield (lambda b, lo: ((b.abs().amax(-1, keepdim=True) / 16).half().float(), _zeros(b))), _fp16_steps  # Q5_0
        yield (lambda b, lo: (_level_scale(b, _zeros(b), 31), _zeros(b))), _fp32_steps  # Q5_0 missing level -16
    else:
        # blocks of 16 (one sub-block each; GGUF Q6_K: d = an fp16 number times an int8 sub-scale,
        # q in -32..31): the level spacing first; then, for a block whose values are never one
        # level apart, its smallest nonzero magnitude over each level it can be (1..32)
        yield (lambda b, lo: (_level_scale(b, _zeros(b), 255), _zeros(b))), _fp32_steps
        for level in range(1, 33):
            yield (lambda b, lo, j=level: (_smallest_magnitude(b) / j, _zeros(b))), _fp32_steps


def _zeros(blocks: torch.Tensor) -> torch.Tensor:
    """[B, 1] zero offsets (the symmetric formats)."""
    return torch.zeros_like(blocks[:, :1])


def _smallest_magnitude(blocks: torch.Tensor) -> torch.Tensor:
    """[B, 1] the smallest nonzero |value| of each block (0 for a zero block)."""
    mag = blocks.abs()
    least = torch.where(mag > 0, mag, torch.full_like(mag, float("inf"))).amin(-1, keepdim=True)
    return torch.where(torch.isfinite(least), least, torch.zeros_like(least))


def _fit_blocks(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``blocks`` [N, K/32, 32] float32 -> (q, d, m) reproducing every value exactly, or None.

    4 bits: q in 0..15, m = the block's minimum, d an fp16 number near range / 15 (GGUF Q4_1)
    or, for blocks that fit no such scale, an fp32 number from the block's level spacing (GGUF
    Q4_K: d = d16 * sc with a 6-bit sc, so up to 17 significant bits), or from its smallest gap
    over 2..15 (a block of few distinct values). 8 bits: q in -128..127,
    m = 0, d from its largest magnitude / 127 (GGUF Q8_0), or / 16 (GGUF Q5_0: d (q - 16) with
    q in 0..31 and an fp16 d, which may be negative: |d| (16 - q) is the same value), or, for a
    Q5_0 block whose values miss the extreme level, from its level spacing. 6 bits: GGUF Q6_K's
    form, q a signed byte (-32..31 in Q6_K) with m = 0 and an fp32 ``d`` per 16 values (Q6_K's
    fp16 super-scale times an 8-bit sub-scale): d [N, K/32, 2], one per half block. Every
    candidate is checked element by element: ``q * d`` must be exact in float32 and ``q * d + m``
    (one rounding, of the sum) must equal the weight bit for bit, so the blocks hold exactly the
    fp32 weights the kernel's sums stand for. Each candidate is tried on the blocks no earlier
    one fitted.
    """
    n, nb, size = blocks.shape
    per = 2 if bits == 6 else 1                       # scales a block of 32
    flat = blocks.reshape(n * nb * per, size // per)
    least = flat.amin(-1, keepdim=True)
    lo, hi = (0, 15) if bits == 4 else (-128, 127)
    q_out = torch.zeros_like(flat, dtype=torch.int16)
    d_out = torch.zeros_like(least)
    m_out = torch.zeros_like(least)
    left = torch.arange(len(flat))
    for family, step in _scale_families(bits):
        sub = flat[left]
        base, m = family(sub, least[left])
        for i, steps in enumerate(_SCALE_STEPS):
            d = step(base, steps)
            if not torch.isfinite(d).all():
                return None
            safe = torch.where(d > 0, d, torch.ones_like(d))
            q = torch.where(d > 0, torch.round((sub - m) / safe), torch.zeros_like(sub)).clamp_(lo, hi)
            product = q * d
            exact = (product.double() == q.double() * d.double()).all(-1)
            ok = exact & ((product + m) == sub).all(-1)
            fitted = int(ok.sum())
            q_out[left[ok]] = q[ok].to(torch.int16)
            d_out[left[ok]] = d[ok]
            m_out[left[ok]] = m[ok]
            if fitted == len(left):
                return (q_out.reshape(n, nb, size), d_out.reshape(n, nb, per),
                        m_out.reshape(n, nb, per)[..., :1])
            keep = ~ok
            left, sub, m, base = left[keep], sub[keep], m[keep], base[keep]
            # a family whose own scale fits under half the blocks is not this format: its
            # neighbours only mend a few rounding cases, so go on to the next family
            if i == 0 and fitted < (fitted + len(left)) / 2:
                break
    return None


# Rows fitted at a time: the fit sorts and compares in float64, ~20 bytes of temporaries a weight.
_FIT_ROWS = 2048
_PROBE_ROWS = 16     # rows tried first: a format they miss is not the weight's


def _aligned_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts, -1)`` (uint8) in storage whose first byte is 64-byte aligned."""
    shape = (*parts[0].shape[:-1], sum(t.shape[-1] for t in parts))
    nbytes = int(torch.Size(shape).numel())
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    skip = -raw.data_ptr() % 64
    out = raw[skip:skip + nbytes].view(shape)
    return torch.cat(parts, -1, out=out)


# Records kept on disk (``block_store``): pack_blocks checks every value of a weight, about 2.5
# minutes for Qwen2.5-Coder-1.5B on one core, and a later load of the same weights reads its
# records back in seconds. Bumped whenever a record's layout changes: older files are never read.
_RECORD_FORMAT = 1
_STORE: list[Path] = []        # the directories block_store opened, innermost last
_STORE_MIN_WEIGHTS = 1 << 18   # smaller weights are fitted anew (faster than a file; test models)


@contextmanager
def block_store(directory: str | os.PathLike) -> Iterator[Path]:
    """Within this block :func:`pack_blocks` keeps its result for each weight in ``directory``
    (one file per weight of at least 2^18 values, named by a hash of the weight's bytes, its
    shape, the record format and the scale kind) and reads it back for the same weight: the
    loaders open it around packing a target or a drafter. A weight that is not blocks is
    remembered as such too."""
    path = Path(directory)
    _STORE.append(path)
    try:
        yield path
    finally:
        _STORE.pop()


def _stored_blocks(weight: torch.Tensor, half_scales: bool, pack, layout: str = "vector") -> BlockPanels | None:
    """``pack()`` (pack_blocks' own work, or ``layout`` "x8": pack_x8's) for ``weight``, through
    the innermost block store."""
    w = weight.detach().contiguous()
    digest = hashlib.blake2b(w.numpy().data, digest_size=16).hexdigest()
    kind = ("-half" if half_scales else "") + ("" if layout == "vector" else f"-{layout}")
    name = f"{digest}-{'x'.join(map(str, w.shape))}-v{_RECORD_FORMAT}{kind}.pt"
    path = _STORE[-1] / name
    try:
        kept = torch.load(path, weights_only=True)
    except Exception:                         # not kept yet, or a torn or foreign file (the unpickler
        kept = None                           # raises what it meets): pack again
    if kept is not None:
        if kept["bits"] == 0:
            return None
        return BlockPanels(_aligned_cat([kept["blob"]]), int(kept["bits"]), int(kept["out_features"]),
                           bool(kept["half_scales"]), str(kept.get("layout", "vector")))
    blocks = pack()
    record = ({"bits": 0} if blocks is None else
              {"blob": blocks.blob, "bits": blocks.bits, "out_features": blocks.out_features,
               "half_scales": blocks.half_scales, "layout": blocks.layout})
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        torch.save(record, f)                 # written whole, then renamed: a reader never sees half
    os.replace(f.name, path)
    return blocks


def pack_blocks(weight: torch.Tensor, half_scales: bool = True) -> BlockPanels | None:
    """``weight`` [N, K] float32 (CPU) -> :class:`BlockPanels` if it is exactly 4-bit (tried
    first), 8-bit or (a scale per 16 values, GGUF Q6_K) 6-bit block-quantized, else None. K must
    be a multiple of 32.

    ``half_scales``: store a 4-bit weight's scales and offsets as fp16 numbers where every one
    is (``BlockPanels.half_scales``). Both codes convert them with one instruction (vcvtph2ps)
    and read 17 % fewer bytes of a 4-bit record for it (AVX-512, 1-3 rows: 0.91-0.93 of the
    time; AVX2, 1 row: 0.80-0.87; docs/cpu-fast-path.md). Either code reads either kind, with
    the same bits."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack_blocks takes a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                         f"{weight.dtype} on {weight.device}")
    if _STORE and weight.numel() >= _STORE_MIN_WEIGHTS:
        return _stored_blocks(weight, half_scales, lambda: _pack_blocks(weight, half_scales))
    return _pack_blocks(weight, half_scales)


def _pack_blocks(weight: torch.Tensor, half_scales: bool) -> BlockPanels | None:
    n, k = weight.shape
    if k % BLOCK or n == 0:
        return None
    w = weight.detach()
    pad = -n % PANEL
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    for bits in (4, 8, 6):
        if _fit_blocks(blocks[:_PROBE_ROWS], bits) is None:    # every row must fit: a few tell most misses
            continue
        fits = []
        for row in range(0, n, _FIT_ROWS):
            fit = _fit_blocks(blocks[row:row + _FIT_ROWS], bits)
            if fit is None:
                break
            fits.append(fit)
        else:
            fit = tuple(torch.cat(parts) for parts in zip(*fits))
        if fit is None:
            continue
        q, d, m = (t if not pad else torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in fit)
        p, nb = (n + pad) // PANEL, k // BLOCK
        # [N', K/32, 32] -> [P, 16, K/32, 32] -> [P, K/32, 32, 16]: rows of q per block
        q = q.reshape(p, PANEL, nb, BLOCK).permute(0, 2, 3, 1)
        if bits == 4:   # [P, K/32, 16, 16]: rows k (low nibble) and k + 1 (high) of a column in one byte
            q = q.to(torch.uint8)
            q = q[..., 0::2, :] | (q[..., 1::2, :] << 4)
        else:
            q = q.to(torch.int8).view(torch.uint8)
        # [N', K/32, 1] -> [P, K/32, 16] float32 (or fp16 where every one is an fp16 number, 4 bits)
        # -> bytes [P, K/32, 64 (32)]
        pair = (d, m) if bits == 4 else (d,)
        half = half_scales and bits == 4 and all(bool((t.half().float() == t).all()) for t in pair)
        # [N', K/32, s] -> [P, K/32, s, 16]: s = 1 scale a block, or (6 bits) 2, one per half
        scales = [t.reshape(p, PANEL, nb, -1).permute(0, 2, 3, 1).contiguous()
                  .to(torch.float16 if half else torch.float32).view(torch.uint8).reshape(p, nb, -1) for t in pair]
        parts = [*scales, q.reshape(p, nb, -1)]
        return BlockPanels(_aligned_cat(parts), bits, n, half)
    return None


def pack_x8(weight: torch.Tensor) -> BlockPanels | None:
    """``x8_records(pack_blocks(weight))`` (None where the weight is not blocks), kept in the
    block store like pack_blocks' records: finding K-quants' shared scales takes about 40 s for
    Qwen2.5-Coder-1.5B on one core, a later load reads the records back."""
    def pack() -> BlockPanels | None:
        blocks = pack_blocks(weight)
        return None if blocks is None else x8_records(blocks)
    if _STORE and weight.numel() >= _STORE_MIN_WEIGHTS:
        return _stored_blocks(weight, True, pack, layout="x8")
    return pack()


def round_to_blocks8(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight nearest to ``weight`` [N, K] that 8-bit blocks hold exactly: GGUF
    Q8_0's rounding, per row and block of 32 k values ``d`` = the largest magnitude / 127 as an
    fp16 number and ``q = round(w / d)``; returns ``q d`` (a new tensor). :func:`pack_blocks`
    stores the result as 8-bit blocks (or 4-bit ones where a block happens to fit them), a
    quarter of fp32's bytes. Lossy, ``|w - q d| <= d / 2``: for a drafter's weights, whose
    numbers only steer the proposals, never for a target's."""
    q, d = quantize_blocks8(weight)
    return dequantize_blocks8(q, d)


def quantize_blocks8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] float32 as GGUF Q8_0 blocks: (q int8 [N, K], d float16 [N, K/32]) with
    ``dequantize_blocks8(q, d) == round_to_blocks8(weight)`` exactly (an fp16 number times an
    integer of at most 128 in magnitude is exact in float32)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"round_to_blocks8 takes a 2-D float32 weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"round_to_blocks8 needs in_features a multiple of {BLOCK}, got {k}")
    blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
    if not torch.isfinite(blocks).all():
        raise ValueError("round_to_blocks8: the weight has inf or NaN values")
    d = _q8_0_scale(blocks)   # the scale pack_blocks tries first for 8 bits, so its fit is exact
    if not torch.isfinite(d).all():
        raise ValueError("round_to_blocks8: a block's largest magnitude / 127 overflows fp16 (> 65504)")
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, torch.round(blocks / safe), torch.zeros_like(blocks)).clamp_(-128, 127)
    return q.to(torch.int8).reshape(n, k), d.reshape(n, k // BLOCK).half()


def dequantize_blocks8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] from Q8_0 blocks q int8 [N, K] and d float16 [N, K/32] (exact)."""
    if q.dim() != 2 or q.dtype != torch.int8 or d.dtype != torch.float16 or d.shape != (q.shape[0], q.shape[1] // BLOCK) \
            or q.shape[1] % BLOCK:
        raise ValueError(f"8-bit blocks need q int8 [N, K] (K a multiple of {BLOCK}) and d float16 [N, K/{BLOCK}], "
                         f"got q {q.dtype} {tuple(q.shape)} and d {d.dtype} {tuple(d.shape)}")
    n, k = q.shape
    return (q.reshape(n, k // BLOCK, BLOCK).float() * d.float().unsqueeze(-1)).reshape(n, k)


def block_linear(x: torch.Tensor, blocks: BlockPanels, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``blocks = pack_blocks(W)``, summed block by block (the
    module's glossary: *exact blocks*); the same bits on either ISA and for a row alone or among
    others. x [..., K] float32 on the CPU."""
    code = _isa_index(isa)
    return _linear(x, blocks.blob.shape[1] * BLOCK, blocks.out_features, bias,
                   lambda x2: _kernel().panel_linear_blocks(x2, blocks.blob, blocks.bits, code, blocks.half_scales))


def amx_linear(x: torch.Tensor, blocks: BlockPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``blocks = pack_blocks(W)`` on the AMX tile unit, with x
    rounded to bf16: per block of 32 k values one tile product of the rounded x with the integers
    ``q`` (exact as bf16), scaled into y as :func:`block_linear` does. Not the fp32 product: x
    keeps 8 significant bits (the weights stay exact, the sums fp32), so a model on it is a
    different target, like a bf16 one; a row's result is the same bits alone or among any
    others (a tile row depends on that row only). Any number of rows, 16 per tile. Only where
    :func:`amx_status` says it runs. x [..., K] float32 on the CPU."""
    return _linear(x, blocks.blob.shape[1] * BLOCK, blocks.out_features, bias,
                   lambda x2: _kernel().amx_linear_blocks(x2, blocks.blob, blocks.bits, blocks.half_scales))


def x8_records(blocks: BlockPanels, sub_scales: bool = True) -> BlockPanels:
    """``blocks`` (``pack_blocks``' records) with each record's ``q`` regrouped for
    :func:`x8_linear`: 8 groups of 4 k values; 4 bits: 32 bytes a group, byte ``4 c + i``
    holding column ``c``'s value at k = 4 g + i in its low nibble and column ``8 + c``'s in its
    high one; 8 bits: 64 bytes a group, byte ``4 c + i`` column ``c``'s value. The same bytes
    and scales, in another order (``layout="x8"``).

    ``sub_scales``: where the weight's block scales are GGUF K-quants' (Q4_K, Q6_K: a scale per
    256 k values times a small integer per block, :mod:`treespec.fastpath.subscales`), records
    in that form instead (``layout="x8k"``, :func:`_x8k_blob`): 0.59 bytes a weight for 4 bits
    (0.75 above) and 0.83 for 6 bits (1.25), the 6-bit integers in 6 bits. Same weights; the
    kernel forms each block's scale by the one fp32 product the form was checked with."""
    if blocks.layout != "vector":
        raise ValueError(f"x8_records takes pack_blocks' records (layout 'vector'), got layout {blocks.layout!r}")
    p, nb, size = blocks.blob.shape
    head = size - blocks.q_bytes
    q = blocks.blob[..., head:]
    if blocks.bits == 4:    # [P, nb, 16 pairs, 16 columns] -> [P, nb, 32 k, 16 columns]
        pairs = q.reshape(p, nb, BLOCK // 2, PANEL)
        q = torch.stack([pairs & 15, pairs >> 4], dim=3).reshape(p, nb, BLOCK, PANEL)
    else:
        q = q.reshape(p, nb, BLOCK, PANEL)
    if sub_scales and not blocks.half_scales and blocks.bits in (4, 6):
        scales = blocks.blob[..., :head].contiguous().view(torch.float32)
        if blocks.bits == 4:                                  # d [P, nb, 1, 16], m [P, nb, 16]
            form = sub_scaled(scales[..., None, :PANEL], scales[..., PANEL:], q, 4)
        else:                                                 # d [P, nb, 2, 16]
            form = sub_scaled(scales.reshape(p, nb, 2, PANEL), None, q.view(torch.int8), 6)
        if form is not None:
            return dataclasses.replace(blocks, blob=_x8k_blob(form, blocks.bits), layout="x8k")
    blob = _aligned_cat([blocks.blob[..., :head], _x8_groups(q, blocks.bits)])
    return dataclasses.replace(blocks, blob=blob, layout="x8")


def _x8_groups(q: torch.Tensor, bits: int, shift: int = 4) -> torch.Tensor:
    """q [P, nb, 32 k, 16 columns] (uint8: 4-bit values, or the bytes of 8-bit ones) -> the x8
    groups [P, nb, 256 (4 bits) or 512 bytes] (4 bits: column 8 + c's value ``shift`` bits up)."""
    p, nb = q.shape[:2]
    # [P, nb, 8 groups, 4 k, 16 columns] -> [P, nb, 8, 16 columns, 4 k]: 4 bytes a column
    grouped = q.reshape(p, nb, 8, 4, PANEL).transpose(3, 4).reshape(p, nb, 8, 4 * PANEL)
    if bits == 4:    # columns 0-7 in the low nibbles, 8-15 in the high ones
        grouped = grouped[..., :2 * PANEL] | (grouped[..., 2 * PANEL:] << shift)
    return grouped.reshape(p, nb, -1)


def _x8k_blob(form: SubScaled, bits: int) -> torch.Tensor:
    """The ``x8k`` records of a weight in the shared-scale form: uint8 [P, nb / 8, super-record],
    per panel and super-block of 256 k values (csrc/panel_gemm.cpp, ``x8k``):

    - 4 bits: s_d[16], s_m[16] fp32 (128 bytes), then per block of 32 a[16], b[16] int8 and the
      x8 groups of q (256 bytes): 288 bytes; d = s_d a, m = s_m b.
    - 6 bits: s_d[16] fp32 (64 bytes), then per block a[2][16] int8 (k 0-15, 16-31), the low
      4 bits of q + 32 as 4-bit x8 groups (256 bytes) and its top 2 bits (128 bytes): for the
      groups 2 j and 2 j + 1, byte ``4 c + i`` holds column c's bits of group 2 j in bits 0-1,
      column 8 + c's in bits 2-3, and those of group 2 j + 1 in bits 4-5 and 6-7: 416 bytes."""
    p, nb = form.q.shape[:2]
    sup = nb // SUPER
    scale = [form.scale_d] + ([form.scale_m] if bits == 4 else [])
    header = torch.cat([t.contiguous().view(torch.uint8) for t in scale], -1)    # [P, S, 64 per scale]
    subs = [form.sub_d.reshape(p, nb, -1)] + ([form.sub_m] if bits == 4 else [])
    parts = [t.contiguous().view(torch.uint8) for t in subs]
    if bits == 4:
        parts.append(_x8_groups(form.q.to(torch.uint8), 4))
    else:
        u = (form.q + 32).to(torch.uint8)                                   # 0..63
        parts.append(_x8_groups(u & 15, 4))
        top = _x8_groups(u >> 4, 4, shift=2).reshape(p, nb, 8, 2 * PANEL)   # bits 0-1: column c, 2-3: 8 + c
        parts.append((top[:, :, 0::2] | (top[:, :, 1::2] << 4)).reshape(p, nb, -1))
    records = torch.cat(parts, -1).reshape(p, sup, -1)                      # [P, S, 8 records]
    return _aligned_cat([header, records])


def x8_linear(x: torch.Tensor, blocks: BlockPanels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``blocks = x8_records(pack_blocks(W))`` with x rounded to
    8-bit integers per block of 32 k values, as llama.cpp multiplies its quantized weights: per
    row and block, ``dx = max |x| / 127`` and ``qx = round(x / dx)`` (ties to even); each block of
    the weight's integers times ``qx`` summed exactly in 32 bits, then scaled into y as
    :func:`block_linear` does (``csrc/panel_gemm.cpp``, namespace ``x8``: the exact order). Not
    the fp32 product: x keeps 8 bits a block (the weights stay exact), so a model on it is a
    target of its own, like amx's; a row's result is the same bits alone or among any others.
    AVX2; x [..., K] float32 on the CPU."""
    if blocks.layout not in X8_LAYOUTS:
        raise ValueError("x8_linear reads x8_records(pack_blocks(W)), not pack_blocks' own records: "
                         "pass x8_records(blocks)")
    sub = blocks.layout == "x8k"
    return _linear(x, blocks.blob.shape[1] * BLOCK * (SUPER if sub else 1), blocks.out_features, bias,
                   lambda x2: _kernel().x8_linear_blocks(x2, blocks.blob, blocks.bits, blocks.half_scales, sub))


# The head sizes row_attention_kernel is compiled for (``row_attn::rows_for`` in csrc/panel_gemm.cpp);
# callers fall back to SDPA for any other.
ROW_HEAD_DIMS = frozenset(16 * v for v in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))


def row_attention_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         scale: float, isa: str | None = None) -> torch.Tensor:
    """softmax(scale q K^T) V, each query row over the keys its bool ``mask`` allows (empty mask:
    a causal pass over the last rows), in key order: query [B, Hq, T, d], key/value [B, Hkv, S, d]
    -> [B, T, Hq, d] float32 (:func:`treespec.fastpath.attention.row_attention`). d one of
    :data:`ROW_HEAD_DIMS`. ``isa`` (None: the CPU's best): each ISA's code has its own order of
    operations, so a row's bits depend on it, and on nothing else (not on the other rows)."""
    return _kernel().row_attention(query, key, value, mask, float(scale), _isa_index(isa))


def _layer_args(layers: Sequence[BlockPanels]) -> tuple[list, list, list, list]:
    return ([b.blob for b in layers], [b.bits for b in layers], [b.half_scales for b in layers],
            [b.out_features for b in layers])


def draft_block_pre(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, heads: int, kv_heads: int,
                    head_dim: int, layers: Sequence[BlockPanels], isa: str | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A feature head block's first half for a few drafting rows, in one call: x [T, Din] float32
    through the q, k, v layers (``layers``, as :func:`block_linear` reads them), then q and k
    rotated to ``pos`` (LongTensor[T]; angles ``pos * inv_freq``, rotate-half layout) ->
    (q [T, heads d], k [T, kv_heads d], v [T, kv_heads d])."""
    return tuple(_kernel().draft_block_pre(x, pos, inv_freq, heads, kv_heads, head_dim, *_layer_args(layers),
                                           _isa_index(isa)))


def draft_block_post(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, heads: int, head_dim: int,
                     layers: Sequence[BlockPanels], isa: str | None = None) -> torch.Tensor:
    """Its second half: attention of q [T, heads d] over keys / values [1, Hkv, S, d] (the cache,
    the T new rows last) under the bool ``mask`` [1, 1, T, >= S] by the row kernel, the o layer
    plus ``residual`` [T, H], then the MLP (gate, up, down layers) on its RMS norm
    (``norm_weight``, ``eps``) added -> [T, H]. AVX-512 F only, as :func:`row_attention_kernel`."""
    return _kernel().draft_block_post(q, keys, values, mask, residual, norm_weight, float(eps), heads, head_dim,
                                      *_layer_args(layers), _isa_index(isa))
