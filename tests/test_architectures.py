"""Architecture conformance: treespec on every decoder family transformers runs with a DynamicCache.

Each family is a tiny random model built from its HF config (no download), weights re-drawn
with a large std (biases, q/k norms and scalings included) so its next-token law is peaked and
context-dependent. Per family:

- greedy equivalence with HF ``generate``, token for token: a chain and an EAGLE-2 dynamic tree
  with a noisy copy of the target as drafter (drafts both accepted and rejected), and a tree
  drafted by an independent ``ModelDrafter`` of the same family (what the real Qwen pair uses);
- the exact output law at T = 1 (first 3 tokens, V = 8, pooled chi-square; the law and the
  test statistics of ``tests/test_engine_exactness.py``) for the dynamic-tree builder (three
  families in the fast suite, every family in the slow one);
- KV compaction: after every step of a hand-driven verifier the cache equals the cache of
  plain decoding of the committed tokens (``tests/test_verifier.py``'s trees and checks);
- the packed CPU fast path (``pack_linears`` + grouped attention): greedy output still equals
  HF ``generate`` on the stock model.

What cannot be verified exactly is refused with a ``ValueError`` that says why: attention logit
softcapping under sdpa, cache layers without per-token KV rows (recurrent / convolutional
states), and contexts longer than a sliding window (a tree mask carries no window, so the
window must hold the whole context; ``Target.max_context`` says so and ``generate`` refuses
longer requests).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers import models as hf_models

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator, Target
from treespec.fastpath.attention import use_grouped_attention
from treespec.drafters import ModelDrafter
from treespec.fastpath.packing import pack_linears
from treespec.core.sampling import SamplingConfig, process
from treespec.core import accept
from treespec.runtime.verifier import TreeVerifier

from _engine_helpers import NoisyTargetDrafter, assert_cache_equal, fresh_cache, hf_greedy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_engine_exactness import P_MIN, SMOKE_SAMPLES, exact_law, pooled_chisquare, sample_counts
from test_verifier import greedy_continuation, tree_with_path

V_GREEDY = 16       # test_verifier's tree helper draws sibling tokens from range(16)
V_LAW = 8           # test_engine_exactness's exact law enumerates 8^3 sequences
STD = 0.3
NEW_TOKENS = 24
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # inside every tiny vocab
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _cfg(cls_name: str, module: str, **kw):
    config_cls = getattr(getattr(hf_models, module), cls_name)
    return lambda vocab, **more: config_cls(vocab_size=vocab, **{**SMALL, **IDS, **kw, **more})


# family -> (config factory of the vocab size, attention implementation)
ARCHS = {
    "llama": (_cfg("LlamaConfig", "llama"), "sdpa"),
    # attention biases on q/k/v, tied embeddings, 12 query heads on 2 KV heads (Qwen2.5-Coder-1.5B)
    "qwen2": (_cfg("Qwen2Config", "qwen2", hidden_size=96, num_attention_heads=12, num_key_value_heads=2,
                   tie_word_embeddings=True), "sdpa"),
    "qwen3": (_cfg("Qwen3Config", "qwen3", head_dim=8, tie_word_embeddings=True), "sdpa"),   # q/k norms
    "mistral": (_cfg("MistralConfig", "mistral", sliding_window=None), "sdpa"),
    # sliding and full layers mixed; the window (512) holds every context here
    "gemma3": (_cfg("Gemma3TextConfig", "gemma3", head_dim=8, query_pre_attn_scalar=8, sliding_window=512,
                    layer_types=["sliding_attention", "full_attention"]), "sdpa"),
    # attention and final logit softcapping: HF runs it on eager only
    "gemma2": (_cfg("Gemma2Config", "gemma2", head_dim=8, query_pre_attn_scalar=8, sliding_window=512), "eager"),
    "phi3": (_cfg("Phi3Config", "phi3"), "sdpa"),                                # fused qkv and gate/up
    "olmo2": (_cfg("Olmo2Config", "olmo2"), "sdpa"),                             # norms after the blocks
    "granite": (_cfg("GraniteConfig", "granite", embedding_multiplier=6.0, logits_scaling=4.0,
                     residual_multiplier=0.5, attention_multiplier=0.2), "sdpa"),
    "starcoder2": (_cfg("Starcoder2Config", "starcoder2"), "sdpa"),              # LayerNorm, biases, plain MLP
    "cohere": (_cfg("CohereConfig", "cohere", logit_scale=0.5, use_qk_norm=True), "sdpa"),  # parallel block
    "smollm3": (_cfg("SmolLM3Config", "smollm3", no_rope_layer_interval=2), "sdpa"),  # layers without RoPE
    "stablelm": (_cfg("StableLmConfig", "stablelm", use_qkv_bias=True, partial_rotary_factor=0.5), "sdpa"),
}


def tiny(arch: str, vocab: int, seed: int = 0, std: float = STD, eos: int | None = None, **overrides):
    """A tiny fp32 model of family ``arch`` with weights ~ N(0, std) (every matrix, bias and
    norm scale: a zero bias or a unit norm would leave that part of the family untested)."""
    make_config, attn = ARCHS[arch]
    config = make_config(vocab, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(noise if p.dim() >= 2 or name.endswith("bias") else 1.0 + noise)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=0)
    return model.eval().requires_grad_(False)


def target_of(model, arch: str) -> Target:
    return Target.from_hf(model, None, name=f"tiny-{arch}", pack=False)


PROMPTS = ([5, 1, 7, 3], [9], [4, 4, 8, 1, 6, 12, 3])
GREEDY_CONFIGS = {
    "chain": (lambda: ChainBuilder(budget=4), "noisy"),
    "tree": (lambda: DynamicTreeBuilder(budget=10, depth=4, top_k=3), "noisy"),
    "tree-model-drafter": (lambda: DynamicTreeBuilder(budget=10, depth=4, top_k=3), "model"),
}


def drafter_for(kind: str, target: Target, arch: str):
    if kind == "noisy":
        return NoisyTargetDrafter(target.model, noise=1.0, seed=1)
    # an independent model of the same family: a slightly perturbed copy, its own KV cache
    draft = tiny(arch, target.vocab_size, seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(7)
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return ModelDrafter(draft, target.vocab_size)


def check_greedy(target: Target, arch: str, config: str, label: str) -> None:
    make_builder, kind = GREEDY_CONFIGS[config]
    drafter = drafter_for(kind, target, arch)
    gen = SpeculativeGenerator(target, drafter, make_builder())
    accepted = rejected = 0
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        ref = hf_greedy(target.model, ids, target.eos_token_ids, NEW_TOKENS)
        res = gen.generate(ids, NEW_TOKENS, temperature=0.0)
        assert res.token_ids.tolist() == ref, f"{label} {config}: differs from HF greedy on prompt {prompt}"
        accepted += sum(res.stats.depth_accepts)
        rejected += sum(res.stats.depth_attempts) - sum(res.stats.depth_accepts)
    assert accepted > 0 and rejected > 0, (label, config, accepted, rejected)  # both paths ran


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request) -> str:
    return request.param


@pytest.mark.parametrize("config", sorted(GREEDY_CONFIGS))
def test_greedy_equals_hf_generate(arch, config) -> None:
    target = target_of(tiny(arch, V_GREEDY, eos=V_GREEDY - 1), arch)
    check_greedy(target, arch, config, arch)


def test_packed_fast_path_greedy_equals_hf_generate(arch) -> None:
    stock = tiny(arch, V_GREEDY, eos=V_GREEDY - 1)
    packed = copy.deepcopy(stock)
    report = pack_linears(packed)
    assert report.packed > 0, report
    use_grouped_attention(packed)
    target = target_of(packed, arch)
    drafter = NoisyTargetDrafter(stock, noise=1.0, seed=1)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=10, depth=4, top_k=3))
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        ref = hf_greedy(stock, ids, target.eos_token_ids, NEW_TOKENS)
        out = gen.generate(ids, NEW_TOKENS, temperature=0.0).token_ids.tolist()
        assert out == ref, f"{arch} on {report.path}: differs from stock HF greedy on prompt {prompt}"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_compaction_leaves_the_cache_of_sequential_decoding(arch, temperature) -> None:
    """Hand-driven verifier: every tree row is a plain forward's p, and after each acceptance the
    cache equals plain decoding's (deep greedy paths from scattered rows at T = 0)."""
    model = tiny(arch, V_GREEDY)
    sampling = SamplingConfig(temperature=temperature)
    rng = random.Random(arch)
    gen = torch.Generator().manual_seed(0)
    verifier = TreeVerifier(model, sampling)
    committed = [3, 1, 4, 1, 5]
    verifier.prefill(torch.tensor(committed))
    assert_cache_equal(verifier.cache, fresh_cache(model, committed[:-1]), len(committed) - 1)
    deep = non_contiguous = rejected = 0
    for _ in range(6):
        path = greedy_continuation(model, committed, rng.randint(2, 4))
        tree = tree_with_path(rng, committed[-1], rng.randint(6, 12), path)
        probs = verifier.score(tree).probs
        for i in range(tree.num_nodes):  # every row is p(. | path to the node) of a plain forward
            toks = committed[:-1] + [int(tree.tokens[j]) for j in tree.path_to(i)]
            with torch.inference_mode():
                want = process(model(input_ids=torch.tensor([toks])).logits[0, -1].float(), sampling)
            torch.testing.assert_close(probs[i], want, atol=1e-5, rtol=0)
        acc = accept(tree, probs, gen)
        keep = torch.cat([torch.zeros(1, dtype=torch.long), acc.path])
        verifier.compact(keep)
        committed += acc.tokens.tolist()
        assert verifier.prefix_len == len(committed) - 1
        assert_cache_equal(verifier.cache, fresh_cache(model, committed[:-1]), len(committed) - 1)
        deep += acc.num_accepted >= 2
        non_contiguous += not torch.equal(keep, torch.arange(keep.numel()))
        rejected += tree.num_nodes > keep.numel()
    assert non_contiguous >= 1 and rejected >= 3, (non_contiguous, rejected)
    assert deep >= 3 or temperature > 0, deep


# ~15 s each (10^3 seeded generations): three families in the fast suite, the rest in `make test-slow`
LAW_FAST = ("gemma3", "phi3", "qwen2")


@pytest.mark.parametrize("arch_law", [pytest.param(a, marks=() if a in LAW_FAST else pytest.mark.slow)
                                      for a in sorted(ARCHS)])
def test_sampling_follows_the_exact_law_at_t1(arch_law) -> None:
    arch = arch_law
    target = target_of(tiny(arch, V_LAW, seed=1), arch)
    sampling = SamplingConfig(temperature=1.0)
    gen = SpeculativeGenerator(target, NoisyTargetDrafter(target.model, noise=0.5, seed=1),
                               DynamicTreeBuilder(budget=10, depth=2, top_k=3))
    prompt = [5, 1]
    law = exact_law(target.model, prompt, sampling)
    counts, steps, attempts, accepts = sample_counts(gen, prompt, sampling, SMOKE_SAMPLES, seed0=0)
    assert 0 < accepts < attempts, (accepts, attempts)
    pvalue, cells = pooled_chisquare(counts, law)
    assert pvalue > P_MIN, f"{arch}: chi-square p = {pvalue:.2e} over {cells} cells: not the target's law"


# ------------------------------------------------------------------------ what is refused, and why
def test_sliding_window_caps_the_context_and_longer_requests_are_refused() -> None:
    """A window of 12 tokens: contexts up to 11 tokens decode exactly; a longer request is
    refused with the reason. The cap is needed: past the window, HF's own decoding (windowed)
    departs from decoding of the same weights without a window, which is what a tree mask does."""
    windowed = tiny("mistral", V_GREEDY, eos=V_GREEDY - 1, sliding_window=12)
    target = target_of(windowed, "mistral")
    assert target.max_context == 11 and "sliding-window" in target.max_context_reason
    gen = SpeculativeGenerator(target, NoisyTargetDrafter(windowed, noise=1.0, seed=1), ChainBuilder(budget=3))
    ids = torch.tensor([3, 9, 2])
    assert gen.generate(ids, 5, temperature=0.0).token_ids.tolist() == hf_greedy(windowed, ids, target.eos_token_ids, 5)
    with pytest.raises(ValueError, match="sliding-window attention over 12 tokens"):
        gen.generate(ids, 6, temperature=0.0)
    unwindowed = tiny("mistral", V_GREEDY, eos=V_GREEDY - 1, sliding_window=None)
    eos = target.eos_token_ids
    inside, past = hf_greedy(windowed, ids, eos, 30), hf_greedy(unwindowed, ids, eos, 30)
    assert inside[:8] == past[:8] and inside != past


def test_a_drafter_model_with_a_shorter_window_caps_the_request_too() -> None:
    """An independent drafter with sliding-window attention drafts correctly only inside its
    window (its tree passes carry no window either): the generator, the server and
    generate_batch refuse a request that would pass it, naming the drafter."""
    from treespec.runtime.server import SpeculativeServer, generate_batch

    target = target_of(tiny("llama", V_GREEDY, eos=V_GREEDY - 1), "llama")
    windowed = tiny("mistral", V_GREEDY, eos=V_GREEDY - 1, sliding_window=12)
    drafter = ModelDrafter(windowed, V_GREEDY)
    assert drafter.max_context == 11 and "drafter model" in drafter.max_context_reason
    ids = torch.tensor([3, 9, 2])
    gen = SpeculativeGenerator(target, drafter, ChainBuilder(budget=3))
    assert gen.generate(ids, 5, temperature=0.0).token_ids.tolist() == \
        hf_greedy(target.model, ids, target.eos_token_ids, 5)
    with pytest.raises(ValueError, match="drafter model's sliding-window attention over 12 tokens"):
        gen.generate(ids, 6, temperature=0.0)
    with pytest.raises(ValueError, match="drafter model's sliding-window"):
        SpeculativeServer(target, drafter, ChainBuilder(budget=3)).add_request(ids, max_new_tokens=6)
    with pytest.raises(ValueError, match="request 0 .*drafter model's sliding-window"):
        generate_batch(target, drafter, ChainBuilder(budget=3), [ids], [6])


def test_attention_softcapping_needs_eager() -> None:
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0.*attn_implementation='eager'"):
        target_of(tiny("gemma3", V_GREEDY, attn_logit_softcapping=50.0), "gemma3")


def test_models_with_recurrent_state_layers_are_refused() -> None:
    from transformers.models.lfm2 import Lfm2Config

    config = Lfm2Config(vocab_size=V_GREEDY, layer_types=["conv", "full_attention"], **{**SMALL, **IDS})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with pytest.raises(ValueError, match="layer 0 keeps a LinearAttentionLayer cache .layer type 'conv'."):
        Target.from_hf(model, None, pack=False)
    with pytest.raises(ValueError, match="cannot drop its rejected branches"):
        ModelDrafter(model)
