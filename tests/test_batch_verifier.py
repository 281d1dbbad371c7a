"""BatchVerifier: one forward for B ragged requests equals each request verified alone, and
per-row compaction leaves each row's valid KV equal to sequential decoding of its request.

Also the external-stack path: ``prepare_verify``'s flat inputs and packed mask, run through a
small reference Llama forward whose attention unpacks the bits (per request: its prefix KV ‖ its
tree's KV, FlashInfer's view), give the same logits as the HF batched path.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from treespec.core.tree_batch import TreeBatch, accept_batch, prepare_verify
from treespec.core.masks import unpack_masks
from treespec.core.sampling import SamplingConfig
from treespec.runtime.batch_verifier import BatchVerifier
from treespec.runtime.verifier import TreeVerifier

from _engine_helpers import assert_cache_equal, fresh_cache, one_thread, peaky_llama  # noqa: F401
from test_verifier import greedy_continuation, tree_with_path

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")
PRECISIONS = {"fp32": (torch.float32, 0.2, 1e-5), "fp64": (torch.float64, 0.5, 1e-10)}
BACKENDS = [("sdpa", "fp32"), ("eager", "fp32"), ("sdpa", "fp64")]
CONFIGS = [SamplingConfig(0.0), SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9), SamplingConfig(1.0)]


def ragged_requests(rng: random.Random, model, prompt_lens, tree_sizes):
    """Prompts of the given lengths and one tree per request holding its greedy continuation."""
    prompts = [[rng.randrange(V) for _ in range(n)] for n in prompt_lens]
    trees = [tree_with_path(rng, p[-1], size, greedy_continuation(model, p, rng.randint(1, 3)))
             for p, size in zip(prompts, tree_sizes)]
    return prompts, trees


def verify_alone(model, prompt: list[int], tree, config: SamplingConfig):
    v = TreeVerifier(model, config, target_layers=(1,))
    v.prefill(torch.tensor(prompt))
    return v.score(tree)


@pytest.mark.parametrize("attn,precision", BACKENDS, ids=[f"{a}-{p}" for a, p in BACKENDS])
def test_batched_scores_equal_each_request_alone(attn: str, precision: str) -> None:
    dtype, std, atol = PRECISIONS[precision]
    model = peaky_llama(V, seed=3, hidden_size=32, num_layers=2, attn_implementation=attn, std=std, dtype=dtype)
    rng = random.Random(f"{attn}-{precision}")
    # ragged: a 1-token prompt (empty prefix), a root-only tree, the longest prompt with the
    # smallest real tree
    prompts, trees = ragged_requests(rng, model, [1, 6, 11, 3], [5, 1, 2, 9])
    batch = TreeBatch.from_trees(trees, CONFIGS)
    bv = BatchVerifier(model, target_layers=(1,))
    feats = bv.prefill([torch.tensor(p) for p in prompts])
    assert bv.prefix_lens == [0, 5, 10, 2] and bv.cache_len == 10
    out = bv.score(batch)
    assert out.probs.shape == (batch.num_nodes, V) and out.logits.shape == (batch.num_nodes, V)
    ptr = batch.req_indptr.tolist()
    for b, (p, tree, cfg) in enumerate(zip(prompts, trees, CONFIGS)):
        want = verify_alone(model, p, tree, cfg)
        torch.testing.assert_close(out.probs[ptr[b]:ptr[b + 1]], want.probs, atol=atol, rtol=0,
                                   msg=lambda m: f"request {b} probs: {m}")
        torch.testing.assert_close(out.features[b].hidden[1], want.features.hidden[1], atol=atol, rtol=0)
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([p])[:, :-1] if len(p) > 1 else torch.tensor([p]),
                        output_hidden_states=True).hidden_states[1][0]
        assert feats[b].length == len(p) - 1
        if len(p) > 1:
            torch.testing.assert_close(feats[b].hidden[1], ref, atol=atol, rtol=0)


# ---------------------------------------------------------------- packed-mask reference path
def reference_packed_forward(model, inputs, prefix_caches, qo_lens, prefix_lens) -> torch.Tensor:
    """Logits [T, V] of the flat tree tokens, computed with the model's own modules but our own
    attention: request r's queries attend over [its prefix KV ‖ its tree KV] where the bit
    unpacked from ``packed_mask`` is set. No padding, no HF mask, no batched cache."""
    ids, pos, qo_indptr, packed, mask_indptr = inputs
    kv_lens = [p + n for p, n in zip(prefix_lens, qo_lens)]
    masks = unpack_masks(packed, mask_indptr, qo_lens, kv_lens)
    lm = model.model
    h = lm.embed_tokens(ids)[None]                                     # [1, T, H]
    cos, sin = lm.rotary_emb(h, position_ids=pos[None])
    ptr = qo_indptr.tolist()
    for li, layer in enumerate(lm.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        d = attn.head_dim
        q = attn.q_proj(x).view(1, -1, model.config.num_attention_heads, d).transpose(1, 2)
        k = attn.k_proj(x).view(1, -1, model.config.num_key_value_heads, d).transpose(1, 2)
        v = attn.v_proj(x).view(1, -1, model.config.num_key_value_heads, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs = []
        for r in range(len(qo_lens)):
            s, e = ptr[r], ptr[r + 1]
            cache = prefix_caches[r]
            if prefix_lens[r]:
                kr = torch.cat([cache.layers[li].keys, k[:, :, s:e]], 2)
                vr = torch.cat([cache.layers[li].values, v[:, :, s:e]], 2)
            else:
                kr, vr = k[:, :, s:e], v[:, :, s:e]
            kr = kr.repeat_interleave(attn.num_key_value_groups, 1)        # [1, Hq, P + N, d]
            vr = vr.repeat_interleave(attn.num_key_value_groups, 1)
            scores = q[:, :, s:e] @ kr.transpose(-1, -2) * attn.scaling   # [1, Hq, N, P + N]
            scores = scores.masked_fill(~masks[r], float("-inf"))
            outs.append(scores.softmax(-1) @ vr)
        o = torch.cat(outs, 2).transpose(1, 2).reshape(1, ids.numel(), -1)
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(lm.norm(h))[0]


@pytest.mark.parametrize("attn,precision", BACKENDS, ids=[f"{a}-{p}" for a, p in BACKENDS])
def test_packed_mask_path_equals_hf_batched_path(attn: str, precision: str) -> None:
    dtype, std, atol = PRECISIONS[precision]
    model = peaky_llama(V, seed=5, hidden_size=32, num_layers=2, attn_implementation=attn, std=std, dtype=dtype)
    rng = random.Random(f"packed-{attn}-{precision}")
    prompts, trees = ragged_requests(rng, model, [7, 1, 4, 12], [6, 8, 1, 3])
    batch = TreeBatch.from_trees(trees, CONFIGS)
    prefix = [len(p) - 1 for p in prompts]
    inputs = prepare_verify(batch, prefix)
    with torch.inference_mode():
        want = reference_packed_forward(model, inputs, [fresh_cache(model, p[:-1]) for p in prompts],
                                        batch.sizes, prefix)
    bv = BatchVerifier(model)
    bv.prefill([torch.tensor(p) for p in prompts])
    got = bv.score(batch).logits
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    # and the reference is not trivially equal: a wrong mask bit changes its logits
    ids, pos, qo, packed, mptr = inputs
    flipped = packed.clone()
    flipped[mptr[0]] ^= 2          # request 0 (prefix 6), row 0: prefix slot 1 hidden
    flipped[mptr[1]] ^= 1          # request 1 (empty prefix): its root no longer sees itself...
    flipped[mptr[1]] ^= 1 << 1     # ...but sees node 1, a descendant
    with torch.inference_mode():
        bad = reference_packed_forward(model, (ids, pos, qo, flipped, mptr),
                                       [fresh_cache(model, p[:-1]) for p in prompts], batch.sizes, prefix)
    assert (bad - want).abs().max() > 1e-3


# ---------------------------------------------------------------- compaction
def assert_rows_equal_sequential(model, bv: BatchVerifier, committed: list[list[int]], atol: float) -> None:
    """Row b's first P_b slots equal a fresh prefill of committed[b][:-1]; the rest are zero."""
    for b, toks in enumerate(committed):
        n = len(toks) - 1
        assert bv.prefix_lens[b] == n
        ref = fresh_cache(model, toks[:-1])
        for li, (layer, want) in enumerate(zip(bv.cache.layers, ref.layers)):
            keys, values = layer.keys[b:b + 1], layer.values[b:b + 1]
            if n:
                torch.testing.assert_close(keys[:, :, :n], want.keys, atol=atol, rtol=0,
                                           msg=lambda m: f"row {b} layer {li} keys: {m}")
                torch.testing.assert_close(values[:, :, :n], want.values, atol=atol, rtol=0)
            assert not keys[:, :, n:].any() and not values[:, :, n:].any(), f"row {b}: padding not zero"
    assert bv.cache_len == max(bv.prefix_lens)


@pytest.mark.parametrize("attn,precision", BACKENDS, ids=[f"{a}-{p}" for a, p in BACKENDS])
def test_compaction_equals_sequential_decoding(attn: str, precision: str) -> None:
    dtype, std, atol = PRECISIONS[precision]
    model = peaky_llama(V, seed=3, hidden_size=32, num_layers=2, attn_implementation=attn, std=std, dtype=dtype)
    rng = random.Random(f"compact-{attn}-{precision}")
    committed = [[rng.randrange(V) for _ in range(n)] for n in (1, 8, 3, 5)]
    configs = list(CONFIGS)
    gens = [torch.Generator().manual_seed(b) for b in range(4)]
    bv = BatchVerifier(model)
    bv.prefill([torch.tensor(c) for c in committed])
    assert_rows_equal_sequential(model, bv, committed, atol)
    deep = rejected = 0
    for step in range(8):
        if step == 3:   # request 1 leaves, the others go on (rows reordered too)
            keep_rows = [3, 0, 5, 2, 4]
            bv.retain(keep_rows)
            committed = [committed[r] for r in keep_rows]
            configs = [configs[r] for r in keep_rows]
            gens = [gens[r] for r in keep_rows]
            assert_rows_equal_sequential(model, bv, committed, atol)
        if step in (2, 5):   # two requests join: a root-only prompt and one longer than any row
            longest = max(len(c) for c in committed)
            joining = [[rng.randrange(V)], [rng.randrange(V) for _ in range(longest + 3)]]
            bv.add([torch.tensor(c) for c in joining])
            committed += joining
            configs += [SamplingConfig(0.0), SamplingConfig(1.0)]
            gens += [torch.Generator().manual_seed(10 + step), torch.Generator().manual_seed(20 + step)]
            assert_rows_equal_sequential(model, bv, committed, atol)
        trees = [tree_with_path(rng, c[-1], rng.randint(1, 10), greedy_continuation(model, c, rng.randint(1, 4)))
                 for c in committed]
        batch = TreeBatch.from_trees(trees, configs)
        out = bv.score(batch)
        results = accept_batch(batch, out.probs, gens)
        bv.compact([r.keep_src for r in results])
        for b, r in enumerate(results):
            committed[b] += r.tokens.tolist()
            deep += r.path.numel() >= 2
            rejected += trees[b].num_nodes > r.path.numel() + 1
        assert_rows_equal_sequential(model, bv, committed, atol)
    assert deep >= 5 and rejected >= 5      # deep paths and rejected branches were exercised
    assert bv.batch_size == 7


def test_add_to_an_empty_cache() -> None:
    """Every first prompt is a root only (nothing cached, layers not even initialised): joining
    requests then bring the cache's first rows; a later step still verifies exactly."""
    model = peaky_llama(V, seed=3, hidden_size=32, num_layers=2, std=0.2)
    bv = BatchVerifier(model)
    committed = [[3], [5]]
    bv.prefill([torch.tensor(c) for c in committed])
    assert bv.cache_len == 0
    committed += [[1, 2, 3, 4], [9]]
    bv.add([torch.tensor(c) for c in committed[2:]])
    assert_rows_equal_sequential(model, bv, committed, 1e-5)
    rng = random.Random(0)
    trees = [tree_with_path(rng, c[-1], 5, greedy_continuation(model, c, 2)) for c in committed]
    batch = TreeBatch.from_trees(trees, [SamplingConfig(0.0)] * 4)
    out = bv.score(batch)
    for b, (c, t) in enumerate(zip(committed, trees)):
        want = verify_alone(model, c, t, SamplingConfig(0.0))
        s, e = batch.req_indptr[b], batch.req_indptr[b + 1]
        torch.testing.assert_close(out.probs[s:e], want.probs, atol=1e-5, rtol=0)
    results = accept_batch(batch, out.probs, [None] * 4)
    bv.compact([r.keep_src for r in results])
    assert_rows_equal_sequential(model, bv, [c + r.tokens.tolist() for c, r in zip(committed, results)], 1e-5)


def test_verifier_errors() -> None:
    model = peaky_llama(V, seed=1, hidden_size=16)
    rng = random.Random(9)
    prompts, trees = ragged_requests(rng, model, [3, 2], [3, 2])
    bv = BatchVerifier(model)
    batch = TreeBatch.from_trees(trees, CONFIGS[:2])
    with pytest.raises(RuntimeError, match="prefill"):
        bv.score(batch)
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a 1-D LongTensor"):
        bv.prefill([torch.tensor(prompts[0]), torch.tensor([1.0])])
    bv.prefill([torch.tensor(p) for p in prompts])
    with pytest.raises(ValueError, match="the batch has 1 requests but the cache holds 2"):
        bv.score(TreeBatch.from_trees(trees[:1], CONFIGS[:1]))
    with pytest.raises(RuntimeError, match="score"):
        bv.compact([torch.tensor([0]), torch.tensor([0])])
    out = bv.score(batch)
    with pytest.raises(RuntimeError, match="twice"):
        bv.score(batch)
    with pytest.raises(ValueError, match="keeps must be a list of 2"):
        bv.compact([torch.tensor([0])])
    with pytest.raises(ValueError, match=r"keeps\[1\] must be the root \(0\) then increasing"):
        bv.compact([torch.tensor([0]), torch.tensor([0, 5])])
    with pytest.raises(TypeError, match=r"keeps\[0\] must be a 1-D LongTensor"):
        bv.compact([[0], torch.tensor([0])])
    r = accept_batch(batch, out.probs, [torch.Generator(), torch.Generator()])
    bv.compact([x.keep_src for x in r])
    with pytest.raises(ValueError, match="rows must be distinct request indices"):
        bv.retain([1, 1])
    wide = peaky_llama(V + 1, seed=1, hidden_size=16)
    bw = BatchVerifier(wide)
    bw.prefill([torch.tensor(p) for p in prompts])
    probs_batch = TreeBatch.from_trees(
        [type(t)(t.tokens, t.parents, torch.full((t.num_nodes, V), 1.0 / V), "with_replacement") for t in trees],
        CONFIGS[:2])
    with pytest.raises(ValueError, match="the batch's vocab is 16 but the target's is 17"):
        bw.score(probs_batch)


def test_sliding_window_models_are_refused() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    bv = BatchVerifier(MistralForCausalLM(config).eval())
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        bv.prefill([torch.tensor([1, 2, 3])])


def test_discard_undoes_a_score() -> None:
    """After score + discard every row's cache is what it was, and the next pass verifies
    exactly as if the discarded one never ran."""
    model = peaky_llama(V, seed=3, hidden_size=32, num_layers=2, std=0.2)
    bv = BatchVerifier(model)
    committed = [[3, 4, 5], [6, 7], [1, 2, 3, 4, 5]]
    bv.prefill([torch.tensor(c) for c in committed])
    rng = random.Random(1)
    trees = [tree_with_path(rng, c[-1], 6, greedy_continuation(model, c, 2)) for c in committed]
    batch = TreeBatch.from_trees(trees, [SamplingConfig(0.0)] * 3)
    first = bv.score(batch)
    bv.discard()
    assert_rows_equal_sequential(model, bv, committed, 1e-5)
    with pytest.raises(RuntimeError, match="nothing to discard"):
        bv.discard()
    again = bv.score(batch)
    torch.testing.assert_close(again.probs, first.probs, atol=1e-6, rtol=0)
    results = accept_batch(batch, again.probs, [None] * 3)
    bv.compact([r.keep_src for r in results])
    assert_rows_equal_sequential(model, bv, [c + r.tokens.tolist() for c, r in zip(committed, results)], 1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_requests_cache_does_not_depend_on_who_joined_with_it(attn: str) -> None:
    """Prompts of different lengths prefilled together give each row the bits of its prompt
    prefilled alone (no padded, masked prompt pass whose attention rounds differently): on
    batch-invariant kernels (treespec's packed ones) greedy output then cannot depend on which
    requests joined together."""
    model = peaky_llama(V, seed=4, hidden_size=32, num_layers=2, attn_implementation=attn, std=0.3)
    prompts = [torch.tensor([1, 5, 7, 2, 9, 3, 11]), torch.tensor([4]), torch.tensor([3, 4, 6])]
    together = BatchVerifier(model, target_layers=(1,))
    feats = together.prefill(prompts)
    assert together.prefix_lens == [6, 0, 2]
    for b, p in enumerate(prompts):
        alone = BatchVerifier(model, target_layers=(1,))
        own = alone.prefill([p])
        n = p.numel() - 1
        for mine, theirs in zip(together.cache.layers, alone.cache.layers):
            assert not mine.keys[b, :, n:].any() and not mine.values[b, :, n:].any()   # zero padding
            if n:
                assert torch.equal(mine.keys[b, :, :n], theirs.keys[0, :, :n])
                assert torch.equal(mine.values[b, :, :n], theirs.values[0, :, :n])
        assert feats[b].length == n
        if n:
            assert torch.equal(feats[b].hidden[1], own[0].hidden[1])
