"""Grouped sdpa (``treespec.fastpath.attention``): the same numbers as HF's stock sdpa, without its copies.

Two tiny Llamas with the same weights, one on stock ``sdpa`` and one switched to the grouped
implementation, score the same trees after the same cached prompts, alone and batched (ragged
rows, padding): logits, features and the cache rows written must be *bit-identical*, because
the switch is sold as a pure speed change. Also: which models are switched and which are not,
and that a registered name survives a model built from its config.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from treespec.fastpath.attention import GROUPED_SDPA, grouped_sdpa_attention, use_grouped_attention
from treespec.core.tree_batch import TreeBatch
from treespec.core.masks import attn_implementation_of
from treespec.targets.loader import tiny_llama
from treespec.core.sampling import SamplingConfig
from treespec.runtime.batch_verifier import BatchVerifier
from treespec.runtime.verifier import TreeVerifier

from _engine_helpers import one_thread  # noqa: F401
from test_batch_verifier import ragged_requests
from test_verifier import greedy_continuation, tree_with_path

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")


def peaky_gqa(seed: int = 3):
    """A tiny Llama with 4 query heads on 2 KV heads (so a wrong grouping shows) and weights
    ~ N(0, 0.2) (a context-dependent law, as ``peaky_llama``)."""
    model = tiny_llama(V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seed=seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def pair():
    """(stock sdpa model, grouped model) with the same weights."""
    stock, grouped = peaky_gqa(), peaky_gqa()
    switched, why = use_grouped_attention(grouped)
    assert switched and attn_implementation_of(grouped) == GROUPED_SDPA, why
    return stock, grouped


def test_a_tiny_gqa_model_is_switched_and_says_why() -> None:
    model = tiny_llama(V)                       # 4 query heads, 2 KV heads
    switched, why = use_grouped_attention(model)
    assert switched and "2 KV heads" in why and "2 query heads each" in why
    assert use_grouped_attention(model) == (True, "grouped sdpa (already)")


@pytest.mark.parametrize("kw,reason", [
    ({"attn_implementation": "eager"}, "stock eager"),
    ({"num_kv_heads": 4}, "no grouped KV heads"),
])
def test_models_it_cannot_help_are_left_alone(kw: dict, reason: str) -> None:
    model = tiny_llama(V, **{"num_heads": 4, **kw})
    before = attn_implementation_of(model)
    switched, why = use_grouped_attention(model)
    assert not switched and reason in why and attn_implementation_of(model) == before


@pytest.mark.parametrize("prompt_len", [1, 7])
def test_tree_scores_and_cache_rows_are_bit_identical(prompt_len: int) -> None:
    stock, grouped = pair()
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(V) for _ in range(prompt_len)]
    path = greedy_continuation(stock, prompt, 3)
    vs = [TreeVerifier(m, SamplingConfig(1.0), target_layers=(1, 2)) for m in (stock, grouped)]
    for v in vs:
        v.prefill(torch.tensor(prompt))
    for size in (1, 2, 3, 5, 9, 16):
        tree = tree_with_path(rng, prompt[-1], size, path[: min(3, size - 1)])
        outs = [v.score(tree) for v in vs]
        assert torch.equal(outs[0].probs, outs[1].probs), f"probs differ at {tree.num_nodes} nodes"
        for layer in (1, 2):
            assert torch.equal(outs[0].features.hidden[layer], outs[1].features.hidden[layer])
        for a, b in zip(vs[0].cache.layers, vs[1].cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        keep = torch.tensor([0] + list(range(1, min(3, tree.num_nodes))))
        for v in vs:
            v.compact(keep)


def test_batched_ragged_scores_are_bit_identical() -> None:
    stock, grouped = pair()
    rng = random.Random(5)
    prompts, trees = ragged_requests(rng, stock, [1, 6, 11, 3], [5, 1, 2, 9])
    configs = [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9), SamplingConfig(1.0)]
    batch = TreeBatch.from_trees(trees, configs)
    outs = []
    for model in (stock, grouped):
        bv = BatchVerifier(model, target_layers=(1,))
        bv.prefill([torch.tensor(p) for p in prompts])
        outs.append((bv.score(batch), bv))
    (a, bva), (b, bvb) = outs
    assert torch.equal(a.logits, b.logits) and torch.equal(a.probs, b.probs)
    for la, lb in zip(bva.cache.layers, bvb.cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_a_wrong_mask_would_be_seen() -> None:
    """The identity above is not vacuous: the grouped function with its mask dropped differs."""
    stock, _ = pair()
    attn = stock.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 8, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(1))
    v = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(2)
    masked, _ = grouped_sdpa_attention(attn, q, k, v, mask, scaling=attn.scaling)
    full, _ = grouped_sdpa_attention(attn, q, k, v, torch.ones_like(mask), scaling=attn.scaling)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=attn.scaling)
    assert torch.equal(masked, ref.transpose(1, 2))
    assert not torch.allclose(masked, full)


def test_the_name_works_for_a_model_built_from_config() -> None:
    _, grouped = pair()
    twin = AutoModelForCausalLM.from_config(grouped.config)
    assert attn_implementation_of(twin) == GROUPED_SDPA
    twin.load_state_dict(grouped.state_dict())
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        assert torch.equal(twin.eval()(input_ids=ids).logits, grouped(input_ids=ids).logits)


def test_a_grouped_model_is_calibrated_under_its_own_name(tmp_path, monkeypatch) -> None:
    """A calibration measured with stock attention must not size trees for grouped attention
    (its tree passes cost more): the grouped path has its own file."""
    from treespec.planning import default_calibration_path
    from treespec.runtime.generator import target_calibration
    from treespec.targets.loader import Target

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    assert default_calibration_path("m", "float32", "blocks", GROUPED_SDPA).name == "calibration-m-blocks-grouped.json"
    assert default_calibration_path("m", "float32", "blocks", "sdpa").name == "calibration-m-blocks.json"
    _, grouped = pair()
    with pytest.raises(ValueError, match="-grouped.json"):
        target_calibration(Target.from_hf(grouped, None, name="m", pack=False))


def test_a_position_bias_goes_to_hfs_own_sdpa() -> None:
    """A tensor keyword (a position bias) is handed to HF's sdpa, not tested for truth."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    stock, _ = pair()
    attn = stock.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, t, 8, generator=gen) for h, t in ((4, 3), (2, 5), (2, 5)))
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool).tril(2)
    bias = torch.randn(1, 4, 3, 5, generator=gen)
    got, _ = grouped_sdpa_attention(attn, q, k, v, mask, scaling=attn.scaling, position_bias=bias)
    want, _ = sdpa_attention_forward(attn, q, k, v, mask, scaling=attn.scaling, position_bias=bias)
    assert torch.equal(got, want)
