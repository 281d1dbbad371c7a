"""The 8-bit-input block kernel (``kernel="x8"``, ``kernels.x8_linear``): exact integer blocks times x rounded
to 8-bit integers per block of 32, as llama.cpp multiplies its quantized weights.

It is not the fp32 product: each block of a layer's input keeps 8 bits. What it must be: exactly
the arithmetic its comment states (``rounded_reference``: the rounding of x, the integer sums, the
scaling order), the same bits for a row alone or among any others, and a refusal of records in the
other kernels' layout (read as x8 records they would give wrong numbers silently). A model on it
is a target of its own: near the fp32 one, and with row attention a tree's rows are the bits of its
one-token steps, so greedy speculation emits plain decoding's tokens on the same path.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from treespec import Target
from treespec.builders import ChainBuilder, DynamicTreeBuilder
from treespec.core.sampling import SamplingConfig
from treespec.fastpath import kernels, packing
from treespec.fastpath.kernels import block_linear, pack_blocks, panel_status, x8_linear, x8_records
from treespec.fastpath.packing import PackedLinear, pack_linears
from treespec.planning.calibration import default_calibration_path
from treespec.runtime.verifier import TreeVerifier

from _rounded_targets import assert_chain_rows_are_one_token_steps, assert_greedy_speculation_is_plain, rounded_copy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_blocks import fma32, gguf_k_quant, gguf_q4_1, gguf_q6_k, gguf_q8_0, packed_blocks_copy, quantized_llama
from test_fastpath import prefix_and_tree, tree_logits

pytestmark = pytest.mark.skipif(not panel_status(build=False)[0], reason=panel_status(build=False)[1])


def rounded_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] rounded per block of 32: (qx [M, K/32, 32] integers as floats, dx, sx [M, K/32, 1]),
    dx = max |x| / 127, qx = x (127 / max |x|) rounded to nearest, ties to even (0 where the block
    is 0), sx = dx times the sum of qx. Tensor-by-tensor divisions: torch's ``127.0 / t`` is
    ``reciprocal(t) * 127``, one rounding more than the kernel's."""
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    qx = torch.round(b * inv)
    dx = amax / torch.full_like(amax, 127.0)
    return qx, dx, dx * qx.sum(-1, keepdim=True)


def rounded_reference(x: torch.Tensor, weight: torch.Tensor, bits: int) -> torch.Tensor:
    """The kernel's arithmetic one operation at a time: per block, t = the exact integer sum of
    q qx, then y = fma(d, dx t, fma(m, sx, y)) (8 bits: y = fma(d, dx t, y)) from y = 0 (6 bits:
    each half block's sum on its own, y = fma(d[half], dx t, y), first half first), with q, d, m
    the ones ``pack_blocks`` stores."""
    n, k = weight.shape
    q, d, m = kernels._fit_blocks(weight.reshape(n, k // 32, 32), bits)
    qx, dx, sx = rounded_rows(x)
    y = torch.zeros(x.shape[0], n)
    if bits == 6:
        for b in range(k // 32):
            for h in (slice(0, 16), slice(16, 32)):
                t = (qx[:, b, h].double() @ q[:, b, h].double().T).float()
                y = fma32(d[None, :, b, 0 if h.start == 0 else 1], dx[:, b] * t, y)
        return y
    for b in range(k // 32):
        t = (qx[:, b].double() @ q[:, b].double().T).float()     # integers below 2^24: exact
        if bits == 4:
            y = fma32(m[None, :, b, 0], sx[:, b], y)
        y = fma32(d[None, :, b, 0], dx[:, b] * t, y)
    return y


@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0, gguf_q6_k])
@pytest.mark.parametrize("n_out", [16, 40, 300])
def test_x8_linear_computes_its_arithmetic_exactly(fmt, n_out) -> None:
    """Groups of 1-4 rows and the rest, K of 1, 3 and 18 blocks, N not a multiple of 16, a bias,
    both 4-bit record kinds, zero blocks of x and of the weight: the bits of ``rounded_reference``."""
    torch.manual_seed(n_out)
    for k in (32, 96, 576):
        weight = fmt(torch.randn(n_out, k) * 0.05)
        if k > 32:
            weight[:, :32] = 0.0   # a zero block of the weight: d = m = 0
        bias = torch.randn(n_out)
        blocks = pack_blocks(weight)
        kinds = [blocks] + ([pack_blocks(weight, half_scales=not blocks.half_scales)] if blocks.bits == 4 else [])
        for rows in (1, 2, 3, 4, 5, 7, 9, 17, 64):
            x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
            x[0, -32:] = 0.0      # a zero block: dx = 0
            want = rounded_reference(x, weight, blocks.bits) + bias
            for kind in kinds:
                got = x8_linear(x, x8_records(kind), bias)
                assert got.shape == (rows, n_out)
                assert torch.equal(got, want), (k, rows, kind.half_scales)


@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0, gguf_q6_k])
def test_int8_rows_have_the_same_bits_alone_or_together(fmt) -> None:
    torch.manual_seed(1)
    weight = fmt(torch.randn(72, 160) * 0.05)
    blocks = x8_records(pack_blocks(weight))
    x = torch.randn(23, 160)
    together = x8_linear(x, blocks)
    for i in range(23):
        assert torch.equal(x8_linear(x[i:i + 1], blocks), together[i:i + 1]), i
    assert torch.equal(x8_linear(x[5:11], blocks), together[5:11])


@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0, gguf_q6_k])
def test_x8_linear_is_near_the_fp32_product(fmt) -> None:
    """Rounding x to 8 bits a block moves each output by a small fraction of its scale (llama.cpp's
    error), not more: a misplaced nibble or column would be off by the outputs' own size."""
    torch.manual_seed(2)
    weight = fmt(torch.randn(256, 576) * 0.05)
    blocks = pack_blocks(weight)
    x = torch.randn(8, 576)
    exact = block_linear(x, blocks)
    err = (x8_linear(x, x8_records(blocks)) - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.01, err


def test_a_non_finite_input_gives_nan_rows_and_spares_the_others() -> None:
    torch.manual_seed(3)
    blocks = x8_records(pack_blocks(gguf_q4_1(torch.randn(32, 96) * 0.05)))
    x = torch.randn(3, 96)
    x[1, 40] = float("inf")
    y = x8_linear(x, blocks)
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[[0, 2]]).all()
    assert torch.equal(y[[0, 2]], x8_linear(x[[0, 2]], blocks))


def test_records_of_the_wrong_layout_are_refused() -> None:
    blocks = pack_blocks(gguf_q4_1(torch.randn(16, 64)))
    with pytest.raises(ValueError, match="pass x8_records"):
        x8_linear(torch.randn(1, 64), blocks)
    with pytest.raises(ValueError, match="layout 'vector'"):
        x8_records(x8_records(blocks))


def test_the_int8_operator_gives_the_eager_bits_for_any_leading_shape() -> None:
    from treespec.fastpath import ops

    torch.manual_seed(4)
    blocks = x8_records(pack_blocks(gguf_q8_0(torch.randn(40, 96) * 0.05)))
    x = torch.randn(2, 3, 96)
    got = ops.x8_linear(x, blocks.blob, blocks.bits, blocks.half_scales, False, blocks.out_features)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got, x8_linear(x, blocks))
    sub = x8_records(pack_blocks(gguf_k_quant("Q6_K", 40, 512)))
    assert sub.layout == "x8k"
    x = torch.randn(2, 3, 512)
    got = ops.x8_linear(x, sub.blob, sub.bits, sub.half_scales, True, sub.out_features)
    assert torch.equal(got, x8_linear(x, sub))
    torch.library.opcheck(ops.x8_linear, (x, sub.blob, sub.bits, False, True, 40),
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------- K-quants' scales: the x8k records


def form_reference(x: torch.Tensor, form, bits: int) -> torch.Tensor:
    """``rounded_reference``'s arithmetic over a shared-scale form's integers and scales (d and m
    each the fp32 product of a super-block scale and a block's sub-scale)."""
    from treespec.fastpath.subscales import SUPER

    p, nb = form.q.shape[:2]
    n, k = 16 * p, 32 * nb
    d = (form.scale_d.repeat_interleave(SUPER, 1)[:, :, None] * form.sub_d.float())      # [P, nb, H, 16]
    d = d.permute(0, 3, 1, 2).reshape(n, nb, -1)
    q = form.q.permute(0, 3, 1, 2).reshape(n, nb, 32).double()
    qx, dx, sx = rounded_rows(x)
    y = torch.zeros(x.shape[0], n)
    if bits == 4:
        m = (form.scale_m.repeat_interleave(SUPER, 1) * form.sub_m.float()).permute(0, 2, 1).reshape(n, nb)
    for b in range(nb):
        if bits == 4:
            y = fma32(m[None, :, b], sx[:, b], y)
            y = fma32(d[None, :, b, 0], dx[:, b] * (qx[:, b].double() @ q[:, b].T).float(), y)
        else:
            for i, h in enumerate((slice(0, 16), slice(16, 32))):
                y = fma32(d[None, :, b, i], dx[:, b] * (qx[:, b, h].double() @ q[:, b, h].T).float(), y)
    return y


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_weights_take_sub_scaled_records_with_the_same_bits(kind) -> None:
    """Q4_K and Q6_K weights (GGUF's own blocks, dequantized) take the x8k records: a scale per
    256 k values times an int8 per block, 6-bit integers in 6 bits (0.59 and 0.83 bytes a weight,
    against 0.75 and 1.25), and give the per-block records' bits for any row count (each block's
    scale is formed by the fp32 product it was checked with; Q6_K's negative super-scales and
    sub-scales of -128 included). A bias and N not a multiple of 16 too."""
    bits, size = (4, 0.59375) if kind == "Q4_K" else (6, 0.828125)
    for seed, (n, k) in enumerate(((48, 1024), (40, 512))):
        weight = gguf_k_quant(kind, n, k, seed=seed)
        blocks = pack_blocks(weight)
        assert blocks.bits == bits
        plain, sub = x8_records(blocks, sub_scales=False), x8_records(blocks)
        assert (plain.layout, sub.layout) == ("x8", "x8k")
        assert sub.nbytes == -(-n // 16) * 16 * k * size
        bias = torch.randn(n)
        for rows in (1, 2, 3, 4, 5, 9, 17, 64):
            x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
            x[0, -32:] = 0.0
            assert torch.equal(x8_linear(x, sub, bias), x8_linear(x, plain, bias)), (k, rows)


def test_q4_k_blocks_fitted_another_way_are_moved_to_the_shared_scales() -> None:
    """Q4_K blocks whose integers skip level 0 (levels 3..9: pack_blocks' offset is the block's
    smallest value, GGUF's is 3 levels lower) or take only levels 0, 4, 8, 12 (fitted with 4 times
    the step, more than a sub-scale holds): x8k shifts them to GGUF's offset and divides their
    scale (by 2 here: 2 sc <= 126), which holds the same weights, and
    computes its arithmetic over those integers exactly (``form_reference``); near the per-block
    records' result (the sums of other integers round elsewhere)."""
    from treespec.fastpath.subscales import sub_scaled

    torch.manual_seed(0)
    n, k = 32, 512
    big_d = (torch.rand(n, k // 256, 1, 1) * 1e-3 + 1e-4).half().float()     # GGUF's fp16 D, Dmin
    big_m = (torch.rand(n, k // 256, 1, 1) * 1e-3 + 1e-4).half().float()
    sc, mc = torch.randint(32, 64, (2, n, k // 256, 8, 1)).float()
    q = torch.randint(0, 16, (n, k // 256, 8, 32))
    kind = torch.randint(0, 3, (n, k // 256, 8, 1))       # 0: levels 0..15, 1: 3..9, 2: 0, 4, 8, 12
    q = torch.where(kind == 1, 3 + q % 7, torch.where(kind == 2, 4 * (q % 4), q))
    q[..., :2] = torch.where(kind == 0, torch.tensor([0, 15]), q[..., :2])
    q[..., :2] = torch.where(kind == 1, torch.tensor([3, 9]), q[..., :2])
    q[..., :2] = torch.where(kind == 2, torch.tensor([0, 12]), q[..., :2])
    weight = ((big_d * sc) * q.float() - big_m * mc).reshape(n, k)            # as gguf dequantizes Q4_K
    blocks = pack_blocks(weight)
    assert blocks is not None and blocks.bits == 4 and not blocks.half_scales
    sub, plain = x8_records(blocks), x8_records(blocks, sub_scales=False)
    assert sub.layout == "x8k"
    scales = blocks.blob[..., :128].contiguous().view(torch.float32)
    pairs = blocks.blob[..., 128:].reshape(2, 16, 16, 16)
    q = torch.stack([pairs & 15, pairs >> 4], dim=3).reshape(2, 16, 32, 16)
    form = sub_scaled(scales[..., None, :16], scales[..., 16:], q, 4)
    assert (form.q.amin(2) > 0).any()                         # some blocks shifted ...
    assert ((form.q % 2 == 0).all(2) & (form.q.amax(2) == 6)).any()   # ... some divided
    for rows in (1, 4, 7):
        x = torch.randn(rows, 512)
        got = x8_linear(x, sub)
        assert torch.equal(got, form_reference(x, form, 4)), rows
        torch.testing.assert_close(got, x8_linear(x, plain), rtol=0, atol=1e-5)


def test_weights_without_shared_scales_keep_the_per_block_records() -> None:
    """4-bit blocks with unrelated fp32 scales (no common scale per 256 values), K not a multiple
    of 256, fp16 scales (Q4_1) and 8-bit blocks keep layout x8."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (32, 16, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    # scales of 15 significant bits (q d exact in fp32), unrelated to one another
    d = torch.randint(2**14, 2**15, (32, 16, 1)).float() * 2.0 ** -torch.randint(20, 24, (32, 16, 1)).float()
    m = -torch.rand(32, 16, 1).half().float() * 0.05
    exact = pack_blocks((q * d + m).reshape(32, 512))
    assert exact is not None and exact.bits == 4 and not exact.half_scales
    assert x8_records(exact).layout == "x8"
    assert x8_records(pack_blocks(gguf_q6_k(torch.randn(32, 480) * 0.05))).layout == "x8"   # 15 blocks
    assert x8_records(pack_blocks(gguf_q4_1(torch.randn(32, 512)))).layout == "x8"
    assert x8_records(pack_blocks(gguf_q8_0(torch.randn(32, 512)))).layout == "x8"


def test_shared_scales_are_exact_common_divisors() -> None:
    """The scale found is the values' greatest common divisor (so every value is the fp32 product
    of it and an integer, bit for bit), across exponents and for subnormal values; -0.0 becomes
    +0.0 (the kernels' sums never hold -0.0); a group whose values are no common scale's
    multiples below 2^24 is not found."""
    from treespec.fastpath.subscales import shared_scales

    base = torch.tensor([3.0 * 2.0**-20, 5.0 * 2.0**-30, 1e-40])
    mult = torch.tensor([[1, 63, 2, -5], [7, 0, 128, 12], [1, 2, 3, 4]])
    values = base[:, None] * mult
    values[1, 1] = -0.0
    s, k, found = shared_scales(values)
    assert found.all()
    rebuilt = s[:, None] * k.float()
    assert torch.equal(rebuilt.view(torch.int32), (values + 0.0).view(torch.int32))   # -0.0 + 0.0 = +0.0
    assert torch.equal(k[0], torch.tensor([1, 63, 2, -5]))
    assert torch.equal(k[2], torch.tensor([1, 2, 3, 4])) and s[2] == torch.tensor(1e-40)    # subnormal
    s, k, found = shared_scales(torch.tensor([[1.0, 1.0 + 2.0**-23]]))
    assert found.all() and k.tolist() == [[2**23, 2**23 + 1]]
    assert not shared_scales(torch.tensor([[1.0, 1.0 + 2.0**-23, 3.0]]))[2].any()   # 3 * 2^23 multiples
    assert not shared_scales(torch.tensor([[1.0, 2.0**-40]]))[2].any()           # 2^40 apart


# ----------------------------------------------------------------------------- a model on it


@pytest.mark.parametrize("n", [1, 5, 17])
def test_x8_model_scores_trees_near_the_fp32_model(n) -> None:
    """Each linear input rounded to 8 bits a block moves a small model's logits by a few hundredths."""
    stock = quantized_llama()
    packed = packed_blocks_copy(stock, "x8")
    prefix, tree = prefix_and_tree(n)
    got, ref = tree_logits(packed, prefix, tree), tree_logits(stock, prefix, tree)
    assert not torch.equal(got, ref)                      # a different target...
    torch.testing.assert_close(got, ref, rtol=0, atol=0.05)   # ...close to the fp32 one


def test_x8_model_scores_a_tree_as_one_token_steps() -> None:
    """With row attention (what ``load_target(..., pack="x8")`` sets up), each node of a chain
    scored in one tree pass has the bits of the one-token step after its ancestors."""
    assert_chain_rows_are_one_token_steps(rounded_copy(quantized_llama(seed=2), "x8"))


def test_x8_model_greedy_speculation_emits_plain_decodings_tokens() -> None:
    """On the x8 path with row attention, greedy trees and chains emit treespec's plain
    decoding's tokens on the same path (same prompt pass, then one-token steps)."""
    stock = quantized_llama(seed=3)
    target = Target.from_hf(rounded_copy(stock, "x8"), tokenizer=None, name="small", pack=False)
    assert_greedy_speculation_is_plain(target, stock)


def test_x8_is_refused_where_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(packing, "panel_status", lambda cpu=None: (False, "CPU lacks avx2 (test)"))
    with pytest.raises(ValueError, match="kernel='x8' is not available here: CPU lacks avx2"):
        pack_linears(quantized_llama(), kernel="x8")
    with pytest.raises(ValueError, match="float32 only"):
        PackedLinear(nn.Linear(64, 32).to(torch.bfloat16), kernel="x8")


def test_x8_targets_have_their_own_calibration_file() -> None:
    rows = default_calibration_path("smollm2-135m", torch.float32, "x8", "treespec_row_attention", None)
    assert rows.name == "calibration-smollm2-135m-x8-rows.json"


def test_the_row_attention_operator_gives_the_kernels_bits_and_passes_opcheck() -> None:
    from treespec.fastpath import ops
    from treespec.fastpath.kernels import ISAS, kernel_isa, row_attention_kernel

    torch.manual_seed(5)
    q = torch.randn(1, 7, 4, 16).transpose(1, 2)           # HF's layout: a transposed view
    k, v = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    mask = torch.rand(1, 1, 7, 12) < 0.6
    mask[..., torch.arange(7), 5 + torch.arange(7)] = True
    code = ISAS.index(kernel_isa())
    assert torch.equal(ops.row_attention(q, k, v, mask, 0.25, code), row_attention_kernel(q, k, v, mask, 0.25))
    torch.library.opcheck(ops.row_attention, (q, k, v, mask, 0.25, code), test_utils=("test_schema", "test_faketensor"))


def test_greedy_on_the_compiled_x8_path_equals_plain_decoding_there() -> None:
    """Compiled passes (row attention and the x8 kernel as operators inside the graph): greedy
    trees and chains emit the tokens of plain decoding on the same compiled path, and a compiled
    pass scores like the eager one up to fp32 rounding grown through the 8-bit inputs."""
    from treespec.runtime.compiled import compile_target

    stock = quantized_llama(seed=3)
    packed = rounded_copy(stock, "x8")
    target = Target.from_hf(packed, tokenizer=None, name="small", pack=False)
    fast = compile_target(target, buckets=(1, 4), max_len=256)
    assert_greedy_speculation_is_plain(fast, stock, max_new_tokens=30,
                                       trees=(ChainBuilder(budget=4), DynamicTreeBuilder(budget=4, depth=3, top_k=2)))
    prefix, tree = prefix_and_tree(4)
    eager = TreeVerifier(packed, SamplingConfig(0.0))
    eager.prefill(prefix)
    comp = TreeVerifier(fast.model, SamplingConfig(0.0), passes=fast.passes)
    comp.prefill(prefix)
    torch.testing.assert_close(comp.score(tree).probs, eager.score(tree).probs, rtol=0, atol=0.02)


def test_an_independent_drafter_of_an_x8_target_runs_x8_and_changes_no_token() -> None:
    """``load_drafter`` packs a drafter like its target; an independent model drafting for an x8
    target takes the x8 kernel too (its drafts need no exact product), a block target's drafter
    the CPU's default; greedy speculation with it still emits plain decoding's tokens on the x8
    path."""
    import copy

    from treespec import SpeculativeGenerator
    from treespec.drafters import _pack_like_target
    from treespec.drafters.model import ModelDrafter
    from treespec.fastpath.packing import linear_kernel

    stock = quantized_llama(seed=3)
    ids = torch.tensor([5, 17, 200, 42, 7])
    for kernel in ("x8", "blocks"):
        target = Target.from_hf(copy.deepcopy(stock), tokenizer=None, name="small", pack=kernel)
        drafter = ModelDrafter(quantized_llama(seed=4), target.vocab_size)
        _pack_like_target(drafter, target)
        assert linear_kernel(drafter.model) == kernel
        if kernel == "x8":
            plain = SpeculativeGenerator(target, drafter, ChainBuilder(budget=1)).generate(
                ids, max_new_tokens=24, temperature=0.0).token_ids.tolist()
            for builder in (ChainBuilder(budget=4), DynamicTreeBuilder(budget=6, depth=3, top_k=2)):
                out = SpeculativeGenerator(target, drafter, builder).generate(ids, max_new_tokens=24, temperature=0.0)
                assert out.token_ids.tolist() == plain, builder


def test_x8_records_are_kept_in_the_block_store(tmp_path, monkeypatch) -> None:
    """``pack_x8`` inside ``block_store`` keeps its records (the layout with them) in a file of
    their own and reads them back without converting again: the same bytes, the same layout."""
    weight = gguf_k_quant("Q4_K", 512, 512)                   # 2^18 values: kept
    with kernels.block_store(tmp_path):
        first = kernels.pack_x8(weight)
        assert first.layout == "x8k" and len(list(tmp_path.glob("*-x8.pt"))) == 1
        monkeypatch.setattr(kernels, "x8_records", lambda *a, **k: pytest.fail("converted again"))
        again = kernels.pack_x8(weight)
    assert again.layout == "x8k" and torch.equal(again.blob, first.blob)
    x = torch.randn(3, 512)
    assert torch.equal(x8_linear(x, again), x8_linear(x, first))
