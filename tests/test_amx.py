"""The AMX block kernel (``kernel="amx"``): exact integer blocks times x rounded to bf16.

It is not the fp32 product: each linear layer's input keeps 8 significant bits. What it must be:
the product of the *rounded* x with the exact weights, up to fp32 summation error (a wrong
nibble, a truncating rounding or a lost block would miss by orders of magnitude), and the same
bits for a row alone or among any others (so a tree pass scores each node as a one-token step
does, and greedy speculative decoding on that path emits plain decoding's tokens).
"""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from torch import nn

from treespec import Target
from treespec.cli.plan import target_pack
from treespec.fastpath import packing
from treespec.fastpath.cpu import CpuInfo
from treespec.core.masks import hf_tree_mask
from treespec.fastpath.kernels import (ROW_HEAD_DIMS, amx_linear, amx_status, kernel_isa, pack_blocks,
                                       panel_status, row_attention_kernel)
from treespec.fastpath.packing import PackedLinear, pack_linears
from treespec.planning.calibration import default_calibration_path

from _rounded_targets import assert_chain_rows_are_one_token_steps, assert_greedy_speculation_is_plain, rounded_copy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_blocks import gguf_q4_1, gguf_q8_0, packed_blocks_copy, quantized_llama
from test_fastpath import prefix_and_tree, random_tree, tree_logits

U = 2.0 ** -24   # fp32's unit round-off


@pytest.fixture
def amx() -> None:
    ok, why = amx_status()
    if not ok:
        pytest.skip(why)


def error_bound(x: torch.Tensor, w: torch.Tensor, bits: int) -> torch.Tensor:
    """[M, N] bound on the kernel's distance from float64 (bf16(x) @ W^T): every block's tile sum
    (32 products), its scaling and the fp32 sum over blocks round at most (32 + K/32 + 4) times,
    each relative to the magnitudes summed: |x| times d |q| and |m| (W = d q + m)."""
    n, k = w.shape
    m = w.reshape(n, k // 32, 32).amin(-1, keepdim=True) if bits == 4 else torch.zeros(n, k // 32, 1)
    size = (w.reshape(n, k // 32, 32) - m).abs() + m.abs()
    xb = x.bfloat16().double().abs()
    return (32 + k // 32 + 4) * U * (xb @ size.reshape(n, k).double().T)


@pytest.mark.parametrize("fmt,half", [(gguf_q4_1, True), (gguf_q4_1, False), (gguf_q8_0, False)])
@pytest.mark.parametrize("n_out,k", [(16, 64), (40, 96), (300, 160)])
def test_amx_linear_is_the_product_of_the_rounded_x(amx, fmt, half, n_out, k) -> None:
    torch.manual_seed(n_out + k)
    w = fmt(torch.randn(n_out, k) * 0.1)
    blocks = pack_blocks(w, half_scales=half)
    assert blocks is not None and blocks.half_scales == half
    x = torch.randn(21, k) * 3
    got = amx_linear(x, blocks).double()
    ref = x.bfloat16().double() @ w.double().T
    err = (got - ref).abs()
    bound = error_bound(x, w, blocks.bits)
    assert bool((err <= bound).all()), f"largest error / bound {float((err / bound).max()):.3g}"
    # the rounding is to nearest: truncating x would miss by ~2^-9 of the magnitudes, far above it
    trunc = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).double() @ w.double().T
    assert bool(((trunc - ref).abs() > bound).any())


@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0])
def test_amx_rows_have_the_same_bits_alone_or_together(amx, fmt) -> None:
    torch.manual_seed(1)
    w = fmt(torch.randn(48, 128) * 0.1)
    blocks = pack_blocks(w)
    x = torch.randn(40, 128)
    together = amx_linear(x, blocks)
    for i in range(40):
        assert torch.equal(amx_linear(x[i:i + 1], blocks), together[i:i + 1]), i
    # 17 rows from row 5: two tiles (16 + 1) whose rows sat elsewhere in the 40-row pass
    assert torch.equal(amx_linear(x[5:22], blocks), together[5:22])


@pytest.mark.parametrize("n", [1, 4, 17, 40])
def test_amx_model_scores_trees_near_the_fp32_model(amx, n) -> None:
    """Each linear input rounded to bf16 moves logits by about bf16's precision, no more."""
    stock = quantized_llama()
    packed = packed_blocks_copy(stock, "amx")
    prefix, tree = prefix_and_tree(n)
    got, ref = tree_logits(packed, prefix, tree), tree_logits(stock, prefix, tree)
    assert not torch.equal(got, ref)                      # a different target...
    torch.testing.assert_close(got, ref, rtol=0, atol=0.05)   # ...close to the fp32 one


def test_amx_model_greedy_speculation_emits_plain_decodings_tokens(amx) -> None:
    """On the amx path (row attention, as ``load_target(..., pack="amx")`` sets up) greedy trees
    and chains emit treespec's plain decoding's tokens (same prompt pass, then one-token steps)."""
    stock = quantized_llama(seed=3)
    target = Target.from_hf(rounded_copy(stock, "amx"), tokenizer=None, name="small", pack=False)
    assert_greedy_speculation_is_plain(target, stock)


def test_amx_is_refused_where_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(packing, "amx_status", lambda cpu=None: (False, "CPU lacks amx_bf16 (test)"))
    with pytest.raises(ValueError, match="kernel='amx' is not available here: CPU lacks amx_bf16"):
        pack_linears(quantized_llama(), kernel="amx")
    with pytest.raises(ValueError, match="float32 only"):
        PackedLinear(nn.Linear(64, 32).to(torch.bfloat16), kernel="amx")


def test_amx_status_names_the_missing_flags() -> None:
    cpu = CpuInfo("AMD EPYC (test)", ("avx2", "fma", "f16c", "avx512f", "avx512_bf16"), "AVX512")
    ok, why = amx_status(cpu, build=False)
    assert not ok and "amx_tile" in why and "amx_bf16" in why


def test_amx_targets_have_their_own_calibration_file() -> None:
    path = default_calibration_path("smollm2-135m", torch.float32, "amx", "treespec_grouped_sdpa", None)
    assert path.name == "calibration-smollm2-135m-amx-grouped.json"
    rows = default_calibration_path("smollm2-135m", torch.float32, "amx", "treespec_row_attention", None)
    assert rows.name == "calibration-smollm2-135m-amx-rows.json"


def test_cli_kernel_and_no_pack_do_not_mix() -> None:
    assert target_pack(argparse.Namespace(no_pack=False, kernel="amx")) == "amx"
    assert target_pack(argparse.Namespace(no_pack=False, kernel="auto")) is True
    assert target_pack(argparse.Namespace(no_pack=True, kernel="auto")) is False
    with pytest.raises(ValueError, match="--no-pack"):
        target_pack(argparse.Namespace(no_pack=True, kernel="amx"))


# ----------------------------------------------------------------------------- row attention
needs_avx512 = pytest.mark.skipif(kernel_isa() != "avx512", reason="needs AVX-512 F")
needs_panel = pytest.mark.skipif(not panel_status(build=False)[0], reason=panel_status(build=False)[1])
# row attention's codes that run here: AVX2 wherever the vector kernels do, AVX-512 where the CPU has it
HERE = ("avx2", "avx512") if kernel_isa() == "avx512" else ("avx2",)


def tree_mask(tree, prefix: int) -> torch.Tensor:
    """[1, 1, N, P + N] bool: the verifier's mask for ``tree`` after ``prefix`` cached tokens."""
    return hf_tree_mask(tree, prefix, "sdpa", torch.float32, None)


@needs_panel
@pytest.mark.parametrize("isa", HERE)
@pytest.mark.parametrize("d,hq,hkv,n", [(64, 9, 3, 7), (128, 4, 4, 7), (16, 2, 1, 7),
                                        (16, 40, 2, 20)])   # 20 query heads a KV head, 20 rows: 16 + 4 of each
def test_row_attention_is_attention(d, hq, hkv, n, isa) -> None:
    torch.manual_seed(d)
    p = 45
    tree = random_tree(random.Random(d), n, 300)
    mask = tree_mask(tree, p)
    q = torch.randn(1, n, hq, d).transpose(1, 2)          # HF's layout: a transposed view
    k, v = torch.randn(1, hkv, p + n, d), torch.randn(1, hkv, p + n, d)
    got = row_attention_kernel(q, k, v, mask, d ** -0.5, isa=isa)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=hkv != hq).transpose(1, 2)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6)
    causal = row_attention_kernel(q, k, v, torch.empty(0, dtype=torch.bool), d ** -0.5, isa=isa)   # no mask: causal
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=torch.ones(n, p + n, dtype=torch.bool).tril(p),
        enable_gqa=hkv != hq).transpose(1, 2)
    torch.testing.assert_close(causal.double(), ref, rtol=0, atol=2e-6)


@needs_panel
@pytest.mark.parametrize("isa", HERE)
def test_row_head_dims_are_the_compiled_ones_and_others_fall_back(isa) -> None:
    """ROW_HEAD_DIMS, which the callers check, is the set the kernel was compiled for: every
    multiple of 16 up to 256 runs exactly when it is listed. Attention of a head size outside it
    (144) goes to SDPA instead of failing in the kernel."""
    from treespec.fastpath.attention import row_attention

    for d in range(16, 257, 16):
        q, k = torch.randn(1, 2, 1, d), torch.randn(1, 1, 3, d)
        if d in ROW_HEAD_DIMS:
            row_attention_kernel(q, k, k, torch.empty(0, dtype=torch.bool), d ** -0.5, isa=isa)
        else:
            with pytest.raises(RuntimeError, match="no kernel for head size"):
                row_attention_kernel(q, k, k, torch.empty(0, dtype=torch.bool), d ** -0.5, isa=isa)
    q, k = torch.randn(1, 2, 1, 144), torch.randn(1, 1, 3, 144)
    module = nn.Module()
    module.num_key_value_groups = 2
    got, _ = row_attention(module, q, k, k, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got, ref)


@needs_panel
@pytest.mark.parametrize("isa", HERE)
def test_row_attention_takes_a_mask_per_head_and_batch_entry(isa) -> None:
    torch.manual_seed(3)
    b, hq, hkv, n, s, d = 2, 6, 2, 5, 40, 32
    mask = torch.rand(b, hq, n, s) < 0.5
    mask[..., torch.arange(n), s - n + torch.arange(n)] = True   # each row sees at least its own key
    q = torch.randn(b, hq, n, d)
    k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    got = row_attention_kernel(q, k, v, mask, d ** -0.5, isa=isa)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6)


@needs_panel
@pytest.mark.parametrize("isa", HERE)
def test_row_attention_gives_a_tree_row_the_bits_of_its_one_token_step(isa) -> None:
    """Row i of a tree pass against a pass of that row alone over exactly the keys it may see
    (the cache a one-token step would hold after decoding its path): the same bits."""
    torch.manual_seed(0)
    p, n, d = 60, 12, 64
    tree = random_tree(random.Random(5), n, 300)
    mask = tree_mask(tree, p)
    q = torch.randn(1, 9, n, d)
    k, v = torch.randn(1, 3, p + n, d), torch.randn(1, 3, p + n, d)
    rows = row_attention_kernel(q, k, v, mask, 0.125, isa=isa)
    for i in range(n):
        seen = mask[0, 0, i].nonzero().flatten()
        alone = row_attention_kernel(q[:, :, i:i + 1], k[:, :, seen], v[:, :, seen],
                                     torch.empty(0, dtype=torch.bool), 0.125, isa=isa)
        assert torch.equal(alone[:, 0], rows[:, i]), i


@needs_avx512
def test_row_attention_model_scores_a_tree_as_one_token_steps(amx) -> None:
    """The amx target end to end: each node of a chain scored in one tree pass has the bits of
    the one-token step after the verifier committed its ancestors."""
    assert_chain_rows_are_one_token_steps(rounded_copy(quantized_llama(seed=2), "amx"))