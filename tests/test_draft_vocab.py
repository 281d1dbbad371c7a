"""ModelDrafter's reduced draft vocabulary (``draft_vocab``): its logits are the model's on the
kept ids and 30 below the row's lowest kept logit elsewhere (full support, argmax always kept);
decoding with it stays exact (greedy = HF ``generate``; the first tokens' law at T = 1 is the
target's, by a seeded chi-square test); its errors name the fix; and the ranking it is built from
counts the replies' tokens. ``context_vocab``: the prompt's ids and those committed since get the
model's own logits too, and decoding stays exact."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.core.sampling import SamplingConfig
from treespec.drafters import ModelDrafter, PartialTree, TargetFeatures

from _engine_helpers import hf_greedy, one_thread, peaky_llama, peaky_target  # noqa: F401
from test_engine_exactness import P_MIN, assert_follows_law, exact_law, pooled_chisquare

pytestmark = pytest.mark.usefixtures("one_thread")
KEPT = [0, 2, 3, 5, 7]


def noisy_copy(model, scale: float = 0.1, seed: int = 1):
    """The target with noisy weights: a fair independent drafter."""
    draft = copy.deepcopy(model)
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn(p.shape, generator=noise))
    return draft


def test_kept_ids_carry_the_models_logits_and_the_rest_sit_30_below() -> None:
    model = peaky_llama(16, seed=3, hidden_size=32, num_layers=2, std=0.3)
    full, sliced = ModelDrafter(model, 16), ModelDrafter(model, 16, draft_vocab=[9, 1, 4, 4, 12])
    assert sliced.draft_vocab.tolist() == [1, 4, 9, 12]           # sorted, duplicates dropped
    prompt = torch.tensor([3, 8, 1, 6])
    for d in (full, sliced):
        d.begin(prompt, TargetFeatures.empty())
    tree = PartialTree.rooted(6)
    want, got = full.expand(tree, [0]), sliced.expand(tree, [0])
    a, b = tree.add(0, 2), tree.add(0, 5)
    want, got = torch.cat([want, full.expand(tree, [a, b])]), torch.cat([got, sliced.expand(tree, [a, b])])
    kept = sliced.draft_vocab
    torch.testing.assert_close(got[:, kept], want[:, kept], atol=1e-5, rtol=0)
    rest = torch.ones(16, dtype=torch.bool)
    rest[kept] = False
    floor = want[:, kept].amin(-1, keepdim=True) - 30.0
    torch.testing.assert_close(got[:, rest], floor.expand(-1, int(rest.sum())), atol=1e-5, rtol=0)
    assert set(got.argmax(-1).tolist()) <= set(kept.tolist())


@pytest.mark.parametrize("builder", [ChainBuilder(budget=5), DynamicTreeBuilder(budget=8, depth=3, top_k=3)],
                         ids=["chain", "tree"])
def test_greedy_output_equals_hf_generate(builder) -> None:
    target = peaky_target(16, seed=5, std=0.3, num_layers=2)
    target.model.generation_config.eos_token_id = 15
    drafter = ModelDrafter(noisy_copy(target.model), 16, draft_vocab=list(range(0, 16, 2)))
    prompt = torch.tensor([3, 8, 1])
    res = SpeculativeGenerator(target, drafter, builder).generate(prompt, 24, temperature=0.0)
    assert res.token_ids.tolist() == hf_greedy(target.model, prompt, target.eos_token_ids, 24)
    assert 0 < sum(res.stats.depth_accepts) < sum(res.stats.depth_attempts)


def test_first_tokens_follow_the_target_law_at_t1() -> None:
    """Tokens outside the draft vocabulary still come out at the target's rate: the residual
    after a rejection carries them."""
    target = peaky_target(8, seed=1, std=0.3)
    drafter = ModelDrafter(noisy_copy(target.model, 0.2), 8, draft_vocab=KEPT)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=10, depth=2, top_k=3))
    sampling = SamplingConfig(temperature=1.0)
    law = exact_law(target.model, [5, 1], sampling)
    outside = law[[t for t in range(8) if t not in KEPT]].sum()
    assert outside > 0.1, outside           # the target often wants a token the drafter cannot propose
    counts = assert_follows_law(gen, [5, 1], sampling, 1_500, seed0=7)
    assert counts[[t for t in range(8) if t not in KEPT]].sum() > 0


def test_the_law_test_sees_a_drafter_whose_q_is_used_wrongly() -> None:
    """Power check for the test above: sampling the first token from the draft vocabulary alone
    (what a lossy 'drafts only' decoder would do) is rejected."""
    target = peaky_target(8, seed=1, std=0.3)
    law = exact_law(target.model, [5, 1], SamplingConfig(temperature=1.0))
    lossy = law.copy()
    lossy[[t for t in range(8) if t not in KEPT]] = 0.0
    lossy /= lossy.sum()
    counts = np.random.default_rng(0).multinomial(1_500, lossy.ravel()).reshape(law.shape)
    assert pooled_chisquare(counts, law)[0] < P_MIN


@pytest.mark.parametrize("bad, match", [([], "non-empty"), ([0.5, 1.0], "token ids"), ([3, 16], "outside 0..15"),
                                        ([[1, 2]], "1-D")])
def test_bad_draft_vocab_is_refused(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelDrafter(peaky_llama(16), 16, draft_vocab=bad)


def test_the_batched_form_refuses_a_draft_vocab() -> None:
    with pytest.raises(ValueError, match="without draft_vocab"):
        ModelDrafter(peaky_llama(16), 16, draft_vocab=[1, 2]).batched()


def test_reply_token_ranking_counts_the_replies() -> None:
    from treespec.data import reply_token_ranking, sharegpt_conversations

    from _engine_helpers import word_tokenizer

    conversations = list(sharegpt_conversations(5))
    words = sorted({w for c in conversations for _, text in c.turns for w in text.split()})
    tok = word_tokenizer(words)
    ranking = reply_token_ranking(tok, 5)
    replies = [w for c in conversations for role, text in c.turns if role == "assistant" for w in text.split()]
    counts = {tok.convert_tokens_to_ids(w): replies.count(w) for w in set(replies)}
    assert sorted(ranking) == sorted(counts)                        # every used id, only those
    assert [counts[t] for t in ranking] == sorted(counts.values(), reverse=True)
    with pytest.raises(ValueError, match="conversations"):
        reply_token_ranking(tok, 0)


def test_a_head_with_scaled_logits_is_refused() -> None:
    """A sliced head would skip the model's own logit scaling (Gemma 2's soft-capping)."""
    model = peaky_llama(16)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ModelDrafter(model, 16, draft_vocab=[1, 2])


# ---------------------------------------------------------------- context_vocab
def test_context_vocab_scores_the_prompts_and_the_committed_ids_with_the_model() -> None:
    model = peaky_llama(16, seed=3, hidden_size=32, num_layers=2, std=0.3)
    full, grown = ModelDrafter(model, 16), ModelDrafter(model, 16, draft_vocab=[1, 4], context_vocab=True)
    prompt = torch.tensor([3, 8, 1, 6, 3])
    for d in (full, grown):
        d.begin(prompt, TargetFeatures.empty())
    assert grown.context_ids == [3, 8, 6]            # the prompt's ids outside draft_vocab, first use first
    tree = PartialTree.rooted(3)
    want, got = full.expand(tree, [0]), grown.expand(tree, [0])
    scored = [1, 3, 4, 6, 8]
    torch.testing.assert_close(got[:, scored], want[:, scored], atol=1e-5, rtol=0)
    rest = [t for t in range(16) if t not in scored]
    floor = want[:, scored].amin(-1, keepdim=True) - 30.0
    torch.testing.assert_close(got[:, rest], floor.expand(-1, len(rest)), atol=1e-5, rtol=0)
    # a committed token new to the context (11, the bonus) is scored from the next tree on
    for d in (full, grown):
        d.commit(torch.tensor([], dtype=torch.long), torch.tensor([11]), TargetFeatures.empty())
    assert grown.context_ids == [3, 8, 6, 11]
    tree = PartialTree.rooted(11)
    want, got = full.expand(tree, [0]), grown.expand(tree, [0])
    torch.testing.assert_close(got[:, scored + [11]], want[:, scored + [11]], atol=1e-5, rtol=0)
    grown.begin(torch.tensor([2, 6]), TargetFeatures.empty())       # a new request starts afresh
    assert grown.context_ids == [2, 6]


def test_context_vocab_greedy_output_equals_hf_generate_and_drafts_the_committed_ids() -> None:
    target = peaky_target(16, seed=7, std=0.3, num_layers=2)
    target.model.generation_config.eos_token_id = 15
    prompt = torch.tensor([3, 8, 1, 3, 8])
    ref = hf_greedy(target.model, prompt, target.eos_token_ids, 24)
    assert ref[3:] == [5] * 21            # the reply repeats an id neither the prompt nor [0, 2] holds
    accepted = {}
    for context_vocab in (False, True):
        drafter = ModelDrafter(noisy_copy(target.model, 0.02), 16, draft_vocab=[0, 2], context_vocab=context_vocab)
        res = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=8, depth=3, top_k=3)).generate(
            prompt, 24, temperature=0.0)
        assert res.token_ids.tolist() == ref, context_vocab
        accepted[context_vocab] = sum(res.stats.depth_accepts)
    # draft_vocab alone can never propose 5; once committed, the context's ids include it
    assert accepted == {False: 0, True: accepted[True]} and accepted[True] >= 10, accepted


def test_context_vocab_first_tokens_follow_the_target_law_at_t1() -> None:
    target = peaky_target(8, seed=1, std=0.3)
    drafter = ModelDrafter(noisy_copy(target.model, 0.2), 8, draft_vocab=[0, 2], context_vocab=True)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=10, depth=2, top_k=3))
    assert_follows_law(gen, [5, 1], SamplingConfig(temperature=1.0), 1_500, seed0=11)


def test_context_vocab_needs_a_draft_vocab_and_a_bool() -> None:
    with pytest.raises(ValueError, match="pass draft_vocab"):
        ModelDrafter(peaky_llama(16), 16, context_vocab=True)
    with pytest.raises(TypeError, match="context_vocab must be a bool"):
        ModelDrafter(peaky_llama(16), 16, draft_vocab=[1, 2], context_vocab=1)
