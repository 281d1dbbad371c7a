"""4-bit drafter weights (``treespec.fastpath.quant``): the codes reproduce each group within half
a step; both of Int4Linear's paths (the int4 kernel for few rows, the dense copy for many)
multiply by the same 4-bit weights; bad uses are refused with the fix; and a drafter with int4
weights leaves decoding exact (greedy = HF ``generate``; the first tokens' law at T = 1 is the
target's, by a seeded chi-square test)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.core.sampling import SamplingConfig
from treespec.drafters import ModelDrafter
from treespec.fastpath.packing import PackedLinear, pack_linears
from treespec.fastpath.quant import GROUP, INT4_MAX_ROWS, Int4Linear, dequantize, quantize_linears, quantize_weight

from _engine_helpers import hf_greedy, one_thread, peaky_target  # noqa: F401
from test_draft_vocab import noisy_copy
from test_engine_exactness import assert_follows_law

pytestmark = pytest.mark.usefixtures("one_thread")


def test_codes_reproduce_every_group_within_half_a_step() -> None:
    w = torch.randn(48, 4 * GROUP, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 48)[:, None]
    q, scales_and_zeros = quantize_weight(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scales_and_zeros.shape == (4, 48, 2)
    back = dequantize(q, scales_and_zeros)
    step = scales_and_zeros[..., 0].t().repeat_interleave(GROUP, 1)          # [N, K]
    assert bool(((back - w).abs() <= step / 2 + 1e-6 * w.abs().amax()).all())
    groups, got = w.reshape(48, 4, GROUP), back.reshape(48, 4, GROUP)
    torch.testing.assert_close(got.amin(-1), groups.amin(-1), atol=1e-6, rtol=1e-6)   # extremes kept
    torch.testing.assert_close(got.amax(-1), groups.amax(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_features, bias", [(64, False), (40, True)], ids=["aligned", "padded-rows+bias"])
def test_both_paths_multiply_by_the_same_4bit_weights(out_features, bias) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3 * GROUP, out_features, bias=bias).to(torch.bfloat16)
    layer = Int4Linear(linear)
    weight = layer.dense_weight.float()
    # the 4-bit weights, not the original ones: about 6 % of the weights' norm apart
    assert 0.01 < float((weight - linear.weight.float()).norm() / linear.weight.float().norm()) < 0.1
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 19):    # the int4 kernel, then the dense copy
        x = torch.randn(2, rows, 3 * GROUP).to(torch.bfloat16)
        got = layer(x)
        assert got.shape == (2, rows, out_features) and got.dtype == torch.bfloat16
        want = x.float() @ weight.t() + (linear.bias.float() if bias else 0.0)
        # bf16 outputs: a few parts in a thousand of the largest output
        assert float((got.float() - want).abs().max() / want.abs().max()) < 8e-3, rows


def test_a_draft_vocab_over_a_head_already_in_4_bits() -> None:
    """Two drafters over one 4-bit model (one full head, one over 32k ids, as the Qwen
    benchmark keeps them). A tied head is sliced from the input embeddings, which hold its rows:
    the head a fresh model with the same ids gets, bit for bit. An untied one from its dense copy
    of the 4-bit weights, quantized again: the same weights up to bf16 rounding."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = [1, 5, 17, 33]
    fresh = ModelDrafter(copy.deepcopy(model), 40, draft_vocab=ids, weights="int4")
    full = ModelDrafter(model, 40, weights="int4")
    assert isinstance(model.get_output_embeddings(), Int4Linear)
    sliced = ModelDrafter(full.model, 40, draft_vocab=ids, weights="int4")
    torch.testing.assert_close(sliced.vocab_head[0].dense_weight, fresh.vocab_head[0].dense_weight, atol=0, rtol=0)
    untied = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False})).to(torch.bfloat16)
    full = ModelDrafter(untied, 40, weights="int4")
    sliced = ModelDrafter(full.model, 40, draft_vocab=ids, weights="int4")
    want = untied.get_output_embeddings().dense_weight[ids].float()
    got = sliced.vocab_head[0].dense_weight.float()
    # one bf16 step of the largest weight at most (the rows are the 4-bit ones, not the originals)
    assert float((got - want).abs().max()) <= float(want.abs().max()) * 2 ** -7


def test_packing_a_head_already_in_4_bits_leaves_it_as_it_is() -> None:
    """load_drafter packs a drafter's modules like its target's; a sliced head already made of
    Int4Linear holds buffers only, and packing passes over it (it raised StopIteration)."""
    head = nn.Sequential(Int4Linear(nn.Linear(GROUP, 16).to(torch.bfloat16)))
    report = pack_linears(head)
    assert report.packed == 0 and isinstance(head[0], Int4Linear)


def test_quantize_linears_replaces_plain_and_packed_layers_and_names_what_it_left() -> None:
    model = nn.Sequential(nn.Linear(GROUP, 32), nn.Linear(32, 48), nn.Linear(48, 16)).to(torch.bfloat16)
    pack_linears(model)   # packed where this CPU has native bf16, left stock elsewhere
    report = quantize_linears(model)
    assert report.quantized == 2 and isinstance(model[0], Int4Linear) and isinstance(model[1], Int4Linear)
    assert isinstance(model[2], (nn.Linear, PackedLinear))          # 48 inputs: not whole groups
    assert report.skipped == ("2 (in_features 48 not a multiple of 32)",)
    assert report.bytes_before == (32 * 32 + 48 * 32) * 2 and report.bytes_after < report.bytes_before / 2
    assert model(torch.randn(3, GROUP).to(torch.bfloat16)).shape == (3, 16)


def test_bad_uses_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="bf16 or fp16 model.*float32"):
        quantize_linears(nn.Sequential(nn.Linear(GROUP, 16)))
    with pytest.raises(ValueError, match="in_features 48 is not a multiple of the group size 32"):
        quantize_weight(torch.randn(16, 48))
    draft = peaky_target(16, hidden_size=32).model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="weights must be None .* or 'int4', got 'int8'"):
        ModelDrafter(draft, 16, weights="int8")
    with pytest.raises(ValueError, match="bf16 or fp16 model"):
        ModelDrafter(peaky_target(16, hidden_size=32).model, 16, weights="int4")   # fp32


def test_the_qwen_factory_refuses_int4_for_a_float32_target_before_loading() -> None:
    from treespec.drafters import load_drafter

    target = peaky_target(16, hidden_size=32)                     # fp32: refused before any part is read
    with pytest.raises(ValueError, match="dtype='bfloat16' or drop weights"):
        load_drafter("qwen2.5-coder-0.5b", target, weights="int4")


def int4_drafter(target, scale: float = 0.1, **kw) -> ModelDrafter:
    """The target with noisy weights, in bf16 with 4-bit linear layers: an independent drafter."""
    draft = noisy_copy(target.model, scale).to(torch.bfloat16)
    drafter = ModelDrafter(draft, target.vocab_size, weights="int4", **kw)
    assert drafter.quant_report.quantized == sum(isinstance(m, Int4Linear) for m in draft.modules()) > 0
    return drafter


@pytest.mark.parametrize("builder", [ChainBuilder(budget=5), DynamicTreeBuilder(budget=8, depth=3, top_k=3)],
                         ids=["chain", "tree"])
def test_greedy_output_equals_hf_generate(builder) -> None:
    target = peaky_target(16, seed=5, std=0.3, num_layers=2, hidden_size=32)
    target.model.generation_config.eos_token_id = 15
    prompt = torch.tensor([3, 8, 1])
    res = SpeculativeGenerator(target, int4_drafter(target), builder).generate(prompt, 24, temperature=0.0)
    assert res.token_ids.tolist() == hf_greedy(target.model, prompt, target.eos_token_ids, 24)
    assert 0 < sum(res.stats.depth_accepts) < sum(res.stats.depth_attempts)


def test_first_tokens_follow_the_target_law_at_t1() -> None:
    target = peaky_target(8, seed=1, std=0.3, hidden_size=32)
    drafter = int4_drafter(target, 0.2, draft_vocab=[0, 2, 3, 5, 7])     # with a sliced (and 4-bit) head too
    assert isinstance(drafter.vocab_head[0], Int4Linear)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=10, depth=2, top_k=3))
    assert_follows_law(gen, [5, 1], SamplingConfig(temperature=1.0), 1_500, seed0=7)
