"""The panel GEMM over exact integer blocks (``kernel="blocks"``).

A weight dequantized from a GGUF Q4_1 / Q8_0 checkpoint is, value for value, ``d q + m`` per
block of 32; ``pack_blocks`` must find that form only where it reproduces every fp32 value bit
for bit. ``block_linear`` then multiplies by those same fp32 weights with its own order of
additions (each block's integer products summed, then scaled once: ``blocks_reference``), and
must return exactly that order's bits for every row count and row position, on either ISA. A
model packed this way is the same fp32 target, summed in another order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from treespec.fastpath.packing import PANEL_MAX_ROWS, PackedLinear, linear_isa, linear_kernel, pack_linears
from treespec.fastpath import kernels
from treespec.fastpath.cpu import CpuInfo
from treespec.fastpath.kernels import (ISAS, block_linear, kernel_isa, pack_blocks, pack_panels, panel_linear,
                                      panel_status)

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_fastpath import AVX2_ONLY, prefix_and_tree, small_llama, tree_logits

needs_panel = pytest.mark.skipif(not panel_status(build=False)[0], reason=panel_status(build=False)[1])


def gguf_q4_1(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] through GGUF Q4_1 and back, as llama.cpp quantizes and dequantizes it: per
    block of 32, d = (max - min) / 15 and m = min stored as fp16, q = trunc((x - min) / d + 0.5)."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.trunc((b - lo) * inv + 0.5).clamp(max=15)
    return (q * d.half().float() + lo.half().float()).reshape(n, k)


def gguf_q8_0(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] through GGUF Q8_0 and back: d = max |x| / 127 as fp16, q = round(x / d)."""
    n, k = w.shape
    b = w.reshape(n, k // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv)
    return (q * d.half().float()).reshape(n, k)


def gguf_q6_k(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] through GGUF Q6_K's form and back, for any K (a multiple of 16; Q6_K's
    super-block of 256 values is one row here): a scale per 16 values, an fp16 row scale times a
    signed 8-bit sub-scale, and q = round(x / scale) in -32..31."""
    n, k = w.shape
    b = w.reshape(n, k // 16, 16)
    sub = b.abs().amax(-1, keepdim=True) / 32
    row = (sub.amax(1, keepdim=True) / 127).half().float()
    sc = torch.round(sub / torch.where(row > 0, row, torch.ones_like(row))).clamp(1, 127)
    d = row * sc
    q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d))).clamp(-32, 31)
    return (q * d).reshape(n, k)


def test_pack_blocks_finds_exact_blocks_and_nothing_else() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96)
    assert pack_blocks(gguf_q4_1(w)).bits == 4
    assert pack_blocks(gguf_q8_0(w)).bits == 8
    assert pack_blocks(gguf_q6_k(w)).bits == 6
    assert pack_blocks(w) is None                        # plain fp32 weights: not blocks
    assert pack_blocks(torch.randn(40, 100)) is None     # K not a multiple of 32
    one_off = gguf_q4_1(w)
    one_off[7, 50] = torch.nextafter(one_off[7, 50], torch.tensor(1e9))
    assert pack_blocks(one_off) is None      # one value off the grid keeps the weight in fp32
    # zero blocks (d = 0) and a constant block are blocks too
    z = gguf_q4_1(w)
    z[:, :32] = 0.0
    z[3, 32:64] = 0.25
    assert pack_blocks(z).bits == 4
    with pytest.raises(ValueError, match="float32"):
        pack_blocks(torch.zeros(16, 32, dtype=torch.float64))


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c): a b is exact in float64 here (a small integer or an fp16-sized scale
    times a float32), so the sum is rounded once to float32 but for a float64 rounding first,
    whose effect (a double rounding) needs a float64 sum within 2^-29 of a float32 midpoint."""
    return (a.double() * b.double() + c.double()).float()


def blocks_reference(x: torch.Tensor, weight: torch.Tensor, bits: int) -> torch.Tensor:
    """The block kernels' arithmetic (``panel_gemm.cpp``, ``block_rows``), one operation at a time:
    per block of 32 k values, t = fma(x[k], q[k], t) over k in order from 0 and s = x's plain
    sum in k order, then y = fma(d, t, fma(m, s, y)) (8 bits: y = fma(d, t, y)), block after
    block from y = 0 (6 bits: each half block's t on its own, y = fma(d[half], t, y), first
    half first). q, d, m are the ones ``pack_blocks`` stores."""
    n, k = weight.shape
    q, d, m = kernels._fit_blocks(weight.reshape(n, k // 32, 32), bits)
    y = torch.zeros(x.shape[0], n)
    if bits == 6:
        for b in range(k // 32):
            for half in range(2):
                t = torch.zeros(x.shape[0], n)
                for j in range(16 * half, 16 * half + 16):
                    t = fma32(x[:, 32 * b + j][:, None], q[None, :, b, j].float(), t)
                y = fma32(d[None, :, b, half], t, y)
        return y
    for b in range(k // 32):
        t = torch.zeros(x.shape[0], n)
        s = torch.zeros(x.shape[0])
        for j in range(32):
            xk = x[:, 32 * b + j]
            t = fma32(xk[:, None], q[None, :, b, j].float(), t)
            s = s + xk
        if bits == 4:
            y = fma32(m[None, :, b, 0], s[:, None], y)
        y = fma32(d[None, :, b, 0], t, y)
    return y


@needs_panel
@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0, gguf_q6_k])
@pytest.mark.parametrize("n_out", [16, 40, 300])
def test_block_linear_computes_its_arithmetic_exactly(fmt, n_out) -> None:
    """Every fused group and tile shape (1..6 rows, groups of 4, 6 and 16 and the rest), K over
    several 64-wide chunks and a 32-wide tail (K = 96, 160), N not a multiple of 16, with a
    bias, both record kinds, the code this CPU runs: the bits of ``blocks_reference`` (plus the
    bias)."""
    torch.manual_seed(n_out)
    for k in (96, 160):
        weight = fmt(torch.randn(n_out, k) * 0.05)
        bias = torch.randn(n_out)
        blocks = pack_blocks(weight)
        padded = -(-n_out // 16) * 16
        # GGUF's Q4_1 scales and offsets are fp16 numbers, stored as such: 0.625 bytes a weight
        # (0.75 as floats, the other record kind, which every code also reads)
        assert blocks.half_scales == (blocks.bits == 4)
        per_weight = {8: 1.125, 6: 1.25}.get(blocks.bits, 0.625 if blocks.half_scales else 0.75)
        assert blocks.nbytes == padded * k * per_weight
        kinds = [blocks] + ([pack_blocks(weight, half_scales=not blocks.half_scales)] if blocks.bits == 4 else [])
        for rows in (1, 2, 3, 4, 5, 6, 7, 11, 13, 17, 64):
            x = torch.randn(rows, k)
            want = blocks_reference(x, weight, blocks.bits) + bias
            for kind in kinds:
                got = block_linear(x, kind, bias)
                assert got.shape == (rows, n_out)
                assert torch.equal(got, want), (k, rows, kind.half_scales)


@needs_panel
@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0, gguf_q6_k])
def test_block_sums_round_less_than_rebuilt_weights(fmt) -> None:
    """At SmolLM2's widths (K = 576 and 1536) the block order's mean error against the float64
    product is below the fp32 panel kernel's (each weight rebuilt, every product rounded)."""
    torch.manual_seed(7)
    for k in (576, 1536):
        weight = fmt(torch.randn(256, k) * 0.05)
        x = torch.randn(16, k)
        exact = x.double() @ weight.double().T
        err_blocks = (block_linear(x, pack_blocks(weight)).double() - exact).abs().mean()
        err_panels = (panel_linear(x, pack_panels(weight), 256).double() - exact).abs().mean()
        assert err_blocks < err_panels, (k, float(err_blocks), float(err_panels))


@needs_panel
def test_block_rows_are_batch_invariant() -> None:
    torch.manual_seed(1)
    blocks = pack_blocks(gguf_q4_1(torch.randn(200, 576)))
    x = torch.randn(64, 576)
    together = block_linear(x, blocks)
    alone = torch.stack([block_linear(x[i:i + 1], blocks)[0] for i in range(64)])
    assert torch.equal(alone, together)


needs_avx512 = pytest.mark.skipif(kernel_isa() != "avx512", reason="the CPU lacks AVX-512 F")


@needs_panel
@needs_avx512
@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0, gguf_q6_k])
def test_avx512_kernels_give_the_avx2_bits(fmt) -> None:
    """The AVX-512 kernels (one zmm a panel, 1-3 rows four panels at a time, up to 16 rows fused,
    8-row tiles over fp32 panels) against the AVX2 ones (up to 4 rows fused, groups of 6 over an
    unpacked chunk), bit for bit: every row count a tree pass can have (each fused group of 1-16
    rows and the remainders after 16 and 32), N not a multiple of 16, K over several chunks,
    blocks and fp32 panels, with a bias."""
    torch.manual_seed(3)
    for n_out, k in ((40, 96), (300, 160), (24, 576)):
        weight = fmt(torch.randn(n_out, k) * 0.05)
        bias = torch.randn(n_out)
        panels = pack_panels(weight)
        for half in (False, True):   # both record kinds (fp16 scales: 4 bits only)
            blocks = pack_blocks(weight, half_scales=half)
            for rows in (*range(1, 19), 31, 32, 33, 47, 64):
                x = torch.randn(rows, k)
                want = block_linear(x, blocks, bias, isa="avx2")
                assert torch.equal(block_linear(x, blocks, bias, isa="avx512"), want), (n_out, k, rows, half)
                fp32 = panel_linear(x, panels, n_out, bias, isa="avx2")
                assert torch.equal(panel_linear(x, panels, n_out, bias, isa="avx512"), fp32), (n_out, k, rows)


@needs_panel
def test_fp16_scales_convert_exactly_subnormal_and_zero_included() -> None:
    """Both codes turn fp16 scales into floats with vcvtph2ps (F16C on AVX2): exact for normal,
    subnormal and zero scales and offsets,
    which a tiny weight's blocks have (a flat block: d = 0; an all-zero one: m = 0)."""
    torch.manual_seed(5)
    weight = torch.randn(48, 128) * torch.logspace(-7, -1, 48)[:, None]   # fp16-subnormal d and m at the top
    weight[3, :32] = 0.0                    # d = 0, m = 0
    weight[5, 32:64] = -3e-6                # d = 0, m a negative subnormal
    weight = gguf_q4_1(weight)
    blocks, floats = pack_blocks(weight, half_scales=True), pack_blocks(weight, half_scales=False)
    assert blocks.bits == 4 and blocks.half_scales and not floats.half_scales
    d = (weight.reshape(48, 4, 32).amax(-1) - weight.reshape(48, 4, 32).amin(-1)) / 15
    assert bool(((d > 0) & (d < 6.1e-5)).any()) and bool((d == 0).any())   # subnormal and zero scales present
    bias = torch.randn(48)
    for rows in (1, 2, 3, 4, 5, 9, 17):
        x = torch.randn(rows, 128)
        want = F.linear(x, weight, bias)
        for isa in ISAS if kernel_isa() == "avx512" else ("avx2",):
            got = block_linear(x, blocks, bias, isa=isa)
            assert torch.equal(got, block_linear(x, floats, bias, isa=isa)), (isa, rows)   # same numbers
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_kernel_isa_follows_the_cpu_and_refuses_what_it_lacks(monkeypatch) -> None:
    assert kernel_isa(CpuInfo("x", ("avx2", "fma", "f16c", "avx512f"), "AVX512")) == "avx512"
    assert kernel_isa(CpuInfo("x", ("avx2", "fma", "f16c"), "AVX2")) == "avx2"
    blocks = pack_blocks(gguf_q4_1(torch.randn(16, 32)))
    with pytest.raises(ValueError, match="isa must be"):
        block_linear(torch.randn(1, 32), blocks, isa="avx1024")
    # on a CPU without AVX-512 F the AVX-512 kernels are refused before they run (SIGILL)
    monkeypatch.setattr(kernels, "cpu_info", lambda: CpuInfo("an AVX2 EPYC", ("avx2", "fma", "f16c"), "AVX2"))
    with pytest.raises(ValueError, match="needs AVX-512 F"):
        block_linear(torch.randn(1, 32), blocks, isa="avx512")


@needs_panel
def test_calibration_file_follows_the_layers_isa() -> None:
    """A target on the AVX-512 kernels must not plan with a curve the AVX2 kernels measured (its
    tree passes are cheaper): the ISA the layers run on names the file."""
    from treespec.planning.calibration import model_calibration_path

    model = quantized_llama()
    pack_linears(model, kernel="blocks")
    assert linear_isa(model) == kernel_isa()
    for isa, suffix in (("avx2", "-blocks"), ("avx512", "-blocks-avx512")):
        for layer in model.modules():
            if isinstance(layer, PackedLinear):
                layer.isa = isa
        assert linear_isa(model) == isa
        assert model_calibration_path("m", model).name == f"calibration-m{suffix}.json"
    with pytest.raises(ValueError, match="isa must be None"):
        PackedLinear(nn.Linear(32, 16), kernel="onednn", isa="avx2")


def quantized_llama(seed: int = 0, tied: bool = False) -> nn.Module:
    """``small_llama`` with every linear weight put through Q4_1 (the LM head through Q8_0)."""
    model = small_llama(seed, tied=tied)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                fmt = gguf_q8_0 if name == "lm_head" else gguf_q4_1
                module.weight.copy_(fmt(module.weight))
    return model


def packed_blocks_copy(stock: nn.Module, kernel: str) -> nn.Module:
    """A copy of a ``quantized_llama`` packed on ``kernel`` ("blocks", "amx" or "x8"), its 14 layer
    weights stored as 4-bit blocks and its LM head as 8-bit ones."""
    packed = copy.deepcopy(stock)
    report = pack_linears(packed, kernel=kernel)
    assert linear_kernel(packed) == kernel
    assert "14 as 4-bit blocks" in report.path and "1 as 8-bit blocks" in report.path
    return packed


@needs_panel
@pytest.mark.parametrize("n", [1, 2, 5, 17, 64, 65])
def test_blocks_model_scores_trees_like_the_fp32_model(n) -> None:
    """The same fp32 target in another order of additions: every layer on blocks, a tree's
    logits within 1e-5 of the stock model's and of the fp32 panel model's, and, for passes the
    block kernel runs (up to 64 rows; 65 nodes go to PyTorch's GEMM over the same weights), bit
    for bit the model whose every layer computes ``blocks_reference``."""
    stock = quantized_llama()
    panel = copy.deepcopy(stock)
    pack_linears(panel, kernel="panel")
    blocks = packed_blocks_copy(stock, "blocks")
    prefix, tree = prefix_and_tree(n)
    got = tree_logits(blocks, prefix, tree)
    torch.testing.assert_close(got, tree_logits(panel, prefix, tree), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, tree_logits(stock, prefix, tree), rtol=0, atol=1e-5)
    if n <= PANEL_MAX_ROWS:   # the block kernel's passes: the bits of its arithmetic, layer after layer
        assert torch.equal(got, tree_logits(reference_blocks_model(stock), prefix, tree))


class ReferenceBlocks(nn.Module):
    """A linear layer computed by ``blocks_reference`` (the weight must be exact blocks)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear, self.bits = linear, pack_blocks(linear.weight).bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = blocks_reference(x.reshape(-1, x.shape[-1]), self.linear.weight, self.bits)
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.view(*x.shape[:-1], -1)


def reference_blocks_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose every linear layer runs ``blocks_reference``."""
    ref = copy.deepcopy(model)
    for parent in list(ref.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, ReferenceBlocks(child))
    return ref


@needs_panel
@needs_avx512
@pytest.mark.parametrize("n", [1, 3, 17])
def test_a_model_scores_trees_with_the_same_bits_on_either_isa(n) -> None:
    """The whole model, its layers on blocks (and one on fp32 panels), AVX-512 code against AVX2
    code: the same logits bit for bit, so a calibration or a greedy run does not depend on it."""
    models = {}
    for isa in ("avx2", "avx512"):
        model = quantized_llama()
        model.model.layers[0].mlp.up_proj.weight.data.add_(1e-3)      # one layer off the block grid
        pack_linears(model, kernel="blocks")
        for layer in model.modules():
            if isinstance(layer, PackedLinear):
                layer.isa = isa
        models[isa] = model
    assert {m.storage for m in models["avx2"].modules() if isinstance(m, PackedLinear)} == {
        "4-bit blocks", "8-bit blocks", "fp32 panels"}
    prefix, tree = prefix_and_tree(n)
    assert torch.equal(tree_logits(models["avx512"], prefix, tree), tree_logits(models["avx2"], prefix, tree))


@needs_panel
def test_blocks_kernel_keeps_fp32_panels_where_weights_are_not_blocks() -> None:
    model = small_llama()
    report = pack_linears(model, kernel="blocks")
    assert "15 as fp32 panels" in report.path
    assert {m.storage for m in model.modules() if isinstance(m, PackedLinear)} == {"fp32 panels"}
    # the CPU-based choice on an AVX2 machine is this kernel
    assert linear_kernel(_pack(small_llama(), cpu=AVX2_ONLY)) == "blocks"


def _pack(model, **kw):
    pack_linears(model, **kw)
    return model


@needs_panel
def test_block_layer_follows_in_place_weight_changes() -> None:
    """Editing the weight in place re-packs it; a weight no longer on the grid leaves blocks."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 48).requires_grad_(False)
    linear.weight.copy_(gguf_q4_1(linear.weight))
    layer = PackedLinear(linear, kernel="blocks")
    assert layer.storage == "4-bit blocks"
    x = torch.randn(3, 64)
    with torch.no_grad():
        linear.weight.mul_(1.001)
        got = layer(x)
    assert layer.storage == "fp32 panels"
    torch.testing.assert_close(got, nn.functional.linear(x, linear.weight, linear.bias), rtol=0, atol=1e-5)


@needs_panel
@pytest.mark.parametrize("kernel", ["blocks", "panel"])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_layer_takes_any_input_layout(kernel: str, bias: bool) -> None:
    """Non-contiguous inputs (a transposed or strided view) and any leading shape give the same
    bits as a contiguous copy, with and without a bias, N off the 16-wide panel grid."""
    torch.manual_seed(3)
    linear = nn.Linear(64, 40, bias=bias).requires_grad_(False)
    linear.weight.copy_(gguf_q4_1(linear.weight))
    layer = PackedLinear(linear, kernel=kernel)
    base = torch.randn(2, 64, 5)
    views = [base.transpose(1, 2), torch.randn(2, 5, 128)[..., ::2], torch.randn(64), torch.randn(1, 1, 64)]
    with torch.no_grad():
        for x in views:
            got = layer(x)
            assert got.shape == (*x.shape[:-1], 40)
            assert torch.equal(got, layer(x.contiguous())), tuple(x.shape)
            torch.testing.assert_close(got, nn.functional.linear(x, linear.weight, linear.bias), rtol=0, atol=1e-5)


# ------------------------------------------------------------------ K-quants (Qwen2.5-Coder's Q4_K_M)
def gguf_k_quant(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A [n, k] weight as transformers loads a GGUF tensor of type ``kind``: random raw blocks
    (fp16 scales of weight size) dequantized by the ``gguf`` package, as transformers does.

    Q4_K: 256-value super-blocks of 8 sub-blocks of 32, value = d*sc * q - dmin*m with 6-bit sc, m;
    every sub-block uses levels 0 and 15, as a quantizer's rounding of its own min and max does.
    Q6_K: a signed 8-bit scale per 16 values. Q5_0: 5-bit q, one fp16 scale per 32."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from gguf.constants import GGML_QUANT_SIZES

    qtype = GGMLQuantizationType[kind]
    size, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)

    def fp16(col: int, lo: float, hi: float) -> None:
        raw[:, col:col + 2] = rng.uniform(lo, hi, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)

    if kind == "Q4_K":
        fp16(0, 1e-4, 1e-3)
        fp16(2, 1e-4, 1e-3)
        qs = raw[:, 16:].reshape(len(raw), 4, 32)    # 4 chunks of 32 bytes: low / high nibble sub-blocks
        qs[:, :, 0], qs[:, :, 1] = 0x00, 0xFF
        raw[:, 16:] = qs.reshape(len(raw), -1)
    elif kind == "Q6_K":
        fp16(nbytes - 2, 1e-4, 1e-3)
    else:
        fp16(0, 1e-3, 1e-2)
    weight = dequantize(raw.reshape(n, -1), qtype).astype(np.float32)
    return torch.from_numpy(weight.reshape(n, k).copy())


@needs_panel
def test_q4_k_weights_are_stored_as_exact_4_bit_blocks() -> None:
    """Q4_K's scale is an fp16 number times a 6-bit integer: not an fp16 number, so it is found
    from the level spacing; the rebuilt weights are bit for bit the dequantized ones."""
    weight = gguf_k_quant("Q4_K", 48, 512)
    blocks = pack_blocks(weight)
    assert blocks is not None and blocks.bits == 4
    for rows in (1, 3, 4, 7, 64):
        x = torch.randn(rows, 512)
        assert torch.equal(block_linear(x, blocks), blocks_reference(x, weight, 4)), rows


@needs_panel
def test_q4_k_blocks_of_few_levels_are_exact_4_bit_blocks() -> None:
    """Sub-blocks whose integers are only 0, 2 and 7 (a smallest gap of 2 levels and a range of
    7: the range over the smallest gap names no whole number of levels; 5 of Qwen2.5-Coder-1.5B's
    73728 blocks of one layer are such) and sub-blocks on levels 3..9 only (missing both ends):
    found, and rebuilt bit for bit."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize
    from gguf.constants import GGML_QUANT_SIZES

    qtype = GGMLQuantizationType.Q4_K
    size, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(48 * 512 // size, nbytes), dtype=np.uint8)
    for col in (0, 2):   # d, dmin
        raw[:, col:col + 2] = rng.uniform(1e-4, 1e-3, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    low = rng.choice([0, 2, 7], size=(len(raw), 128))
    high = rng.integers(3, 10, size=(len(raw), 128))
    raw[:, 16:] = (low | (high << 4)).astype(np.uint8)
    weight = torch.from_numpy(dequantize(raw.reshape(48, -1), qtype).astype(np.float32).reshape(48, 512).copy())
    blocks = pack_blocks(weight)
    assert blocks is not None and blocks.bits == 4
    for rows in (1, 5):
        x = torch.randn(rows, 512)
        assert torch.equal(block_linear(x, blocks), blocks_reference(x, weight, 4)), rows


@needs_panel
def test_q5_0_weights_are_stored_as_exact_8_bit_blocks() -> None:
    """Q5_0 is d (q - 16), q in 0..31, with a signed fp16 d: 8-bit blocks with the scale |d|
    (from the block's largest magnitude, or its level spacing where a block misses level -16),
    rebuilt bit for bit; the quantizer's own output (gguf's Q5_0) too."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    random_raw = gguf_k_quant("Q5_0", 48, 512)
    torch.manual_seed(0)
    w = torch.randn(48, 512)
    w[:, :32] *= -1                                       # blocks whose largest magnitude is negative
    qtype = GGMLQuantizationType.Q5_0
    quantized = torch.from_numpy(dequantize(quantize(w.numpy(), qtype), qtype).astype(np.float32).reshape(48, 512))
    for weight in (random_raw, quantized):
        blocks = pack_blocks(weight)
        assert blocks is not None and blocks.bits == 8
        for rows in (1, 3, 4, 7, 64):
            x = torch.randn(rows, 512)
            assert torch.equal(block_linear(x, blocks), blocks_reference(x, weight, 8)), rows


@needs_panel
def test_q6_k_weights_are_stored_as_exact_6_bit_blocks() -> None:
    """Q6_K (an fp16 super-scale times a signed 8-bit scale per 16 values, q in -32..31) fits no
    block of 32 with one scale: it is stored as 6-bit blocks (a byte a value, two fp32 scales a
    block: 1.25 bytes a weight), the scales found from each half block's levels, its rebuilt
    weights bit for bit the gguf package's dequantized ones, every row count the bits of
    ``blocks_reference``; a value off the grid keeps the weight in fp32."""
    for seed in range(3):
        weight = gguf_k_quant("Q6_K", 40, 512, seed=seed)
        blocks = pack_blocks(weight)
        assert blocks is not None and blocks.bits == 6 and blocks.nbytes == 48 * 512 * 1.25
        q, d, m = kernels._fit_blocks(weight.reshape(40, 16, 32), 6)
        assert q.abs().max() <= 32 and not m.any()
        rebuilt = (q.float().reshape(40, 16, 2, 16) * d.unsqueeze(-1)).reshape(40, 512)
        assert torch.equal(rebuilt, weight)
        for rows in (1, 3, 4, 7, 64):
            x = torch.randn(rows, 512)
            assert torch.equal(block_linear(x, blocks), blocks_reference(x, weight, 6)), rows
    off = gguf_k_quant("Q6_K", 40, 512)
    off[3, 100] = torch.nextafter(off[3, 100], torch.tensor(1e9))
    assert pack_blocks(off) is None


def test_the_exact_block_types_that_dtype_auto_reads_are_those_pack_blocks_stores() -> None:
    """``EXACT_BLOCK_GGUF_TYPES`` (of which ``dtype="auto"`` trusts all but Q6_K to run fp32 on
    the block kernel) names exactly the types whose dequantized weights ``pack_blocks`` stores as
    integer blocks."""
    from treespec.fastpath.packing import EXACT_BLOCK_GGUF_TYPES

    torch.manual_seed(0)
    w = torch.randn(32, 512)
    weights = {"Q4_1": gguf_q4_1(w), "Q8_0": gguf_q8_0(w),
               **{kind: gguf_k_quant(kind, 32, 512) for kind in ("Q4_K", "Q6_K", "Q5_0")}}
    stored = {kind for kind, weight in weights.items() if pack_blocks(weight) is not None}
    assert stored == EXACT_BLOCK_GGUF_TYPES


def test_block_store_keeps_records_and_reads_them_back(tmp_path, monkeypatch) -> None:
    """Inside ``block_store`` a weight's records are kept in a file named by its bytes and read
    back for the same weight without fitting again (the same bits); a weight that is not blocks
    is kept as such; another weight gets its own file; small weights and a torn file are fitted
    anew."""
    torch.manual_seed(0)
    q6 = gguf_q6_k(torch.randn(512, 512))               # 2^18 values: kept
    fp32 = torch.randn(512, 512)                        # not blocks: kept as such
    with kernels.block_store(tmp_path):
        first = pack_blocks(q6)
        assert pack_blocks(fp32) is None
        assert pack_blocks(gguf_q4_1(torch.randn(16, 64))).bits == 4   # small: not kept
    files = sorted(tmp_path.iterdir())
    assert len(files) == 2 and all("512x512" in f.name for f in files)

    def refit(*args):
        raise AssertionError("fitted again")

    with monkeypatch.context() as m, kernels.block_store(tmp_path):
        m.setattr(kernels, "_pack_blocks", refit)
        again = pack_blocks(q6)
        assert pack_blocks(fp32) is None
    assert (again.bits, again.out_features, again.half_scales) == (6, 512, first.half_scales)
    assert torch.equal(again.blob, first.blob) and again.blob.data_ptr() % 64 == 0
    x = torch.randn(3, 512)
    assert torch.equal(block_linear(x, again), block_linear(x, first))
    with kernels.block_store(tmp_path):
        other = gguf_q6_k(torch.randn(512, 512))
        assert torch.equal(pack_blocks(other).blob, kernels._pack_blocks(other, first.half_scales).blob)
        assert len(list(tmp_path.iterdir())) == 3
        for f in tmp_path.iterdir():
            f.write_bytes(b"torn")
        assert torch.equal(pack_blocks(q6).blob, first.blob)
