"""Hybrid drafter (lookup + model head): its q, its λ, bad config, and end to end through the engine.

- the mixture: q = λ·v + (1 − λ)·q_head on the nodes where the lookup matches, the head's own q
  elsewhere; λ learnt per match length from the committed text (or fixed);
- clear errors for bad config and a head that is not a model drafter;
- sampling exactness end to end (the setting of tests/test_engine_exactness.py: a tiny peaked
  Llama, V = 8, the exact law of the first 3 tokens, pooled chi-square on seeded runs) with a
  repeating prompt, so the lookup proposes at most nodes;
- greedy: token-identical to HF ``generate`` on a tiny model (a random EAGLE-3 head, whose
  drafts are mostly wrong, so accepted drafts come from the lookup), and on SmolLM2-135M with
  the shipped eagle3 head (slow).
"""

from __future__ import annotations

import math

import pytest
import torch

from treespec import SpeculativeGenerator, load_drafter
from treespec.drafters import HybridConfig, HybridDrafter, LookupDrafter, PartialTree, TargetFeatures
from treespec.drafters.eagle import random_feature_drafter
from treespec.builders import BestFirstBuilder, ChainBuilder, DynamicTreeBuilder

from _engine_helpers import NoisyTargetDrafter, hf_greedy, one_thread, peaky_target  # noqa: F401
from test_builders import TableDrafter
from test_engine_exactness import (
    HORIZON, P_MIN, SAMPLES, SAMPLINGS, SMOKE_SAMPLES, V, exact_law, pooled_chisquare, sample_counts,
)

pytestmark = pytest.mark.usefixtures("one_thread")

EMPTY = TargetFeatures.empty()


def hybrid_of(history: list[int], vocab: int = 10, **config) -> tuple[HybridDrafter, TableDrafter]:
    head = TableDrafter(vocab, seed=0, scale=1.0)
    hybrid = HybridDrafter(head, HybridConfig(**config))
    hybrid.begin(torch.tensor(history), EMPTY)
    return hybrid, head


# ---------------------------------------------------------------- q and λ
def test_q_is_the_mixture_of_lookup_votes_and_head() -> None:
    # suffix "1 2" occurred twice, followed by 3 and by 4: v = {3: 1/2, 4: 1/2}
    hybrid, head = hybrid_of([1, 2, 3, 7, 1, 2, 4, 8, 1, 2], weight=0.6, adapt=False)
    tree = PartialTree.rooted(2)
    q = hybrid.expand(tree, [0]).exp()[0].double()
    q_head = head.q((2,)).double()
    want = 0.4 * q_head
    want[3] += 0.3
    want[4] += 0.3
    torch.testing.assert_close(q, want, atol=1e-6, rtol=0)
    assert math.isclose(float(q.sum()), 1.0, abs_tol=1e-6)
    assert hybrid.lookup_nodes == 1


def test_path_extends_the_lookup_context_into_a_chain() -> None:
    hybrid, _ = hybrid_of([5, 6, 7, 8, 9, 1, 5, 6], weight=0.9, adapt=False)
    tree = PartialTree.rooted(6)
    a = tree.add(0, 7)
    b = tree.add(a, 8)
    q = [hybrid.expand(tree, [n]).exp()[0] for n in (0, a, b)]  # parents before children
    assert [int(r.argmax()) for r in q] == [7, 8, 9]  # the earlier continuation, token by token


def test_lookup_token_outside_the_head_support_gets_mass() -> None:
    """An EAGLE-3-like head with -inf outside its draft vocabulary: the lookup still proposes."""
    head = TableDrafter(6, seed=0, override=lambda path: torch.tensor([0.0, 1.0, 2.0, 0.5, -math.inf, -math.inf]))
    hybrid = HybridDrafter(head, HybridConfig(weight=0.5, adapt=False))
    hybrid.begin(torch.tensor([1, 2, 5, 3, 1, 2]), EMPTY)
    q = hybrid.expand(PartialTree.rooted(2), [0]).exp()[0]
    assert math.isclose(float(q[5]), 0.5, rel_tol=1e-6) and float(q[4]) == 0.0


def test_lambda_learns_the_lookups_hit_rate_per_match_length() -> None:
    hybrid, _ = hybrid_of([1, 2, 3, 1, 2], weight=0.5, prior_strength=2.0, min_ngram=1, max_ngram=2)
    assert hybrid.weight(2) == 0.5
    # committed 3 (lookup "1 2" -> 3: a hit), then 9 (lookup "2 3" -> 1: a miss)
    hybrid.commit(torch.zeros(0, dtype=torch.long), torch.tensor([3, 9]), EMPTY)
    assert (hybrid.hits[2], hybrid.trials[2]) == (1, 2)
    assert math.isclose(hybrid.weight(2), (1 + 0.5 * 2) / (2 + 2))
    assert hybrid.history[-2:] == [3, 9]
    fixed, _ = hybrid_of([1, 2, 3, 1, 2], weight=0.5, adapt=False)
    fixed.commit(torch.zeros(0, dtype=torch.long), torch.tensor([3, 9]), EMPTY)
    assert fixed.weight(2) == 0.5 and fixed.trials == [0] * 5


def eagle3_hybrid_pair() -> list[HybridDrafter]:
    """Two copies of one hybrid over a random EAGLE-3 head (draft ids 0..11 of 32), begun on the
    same prompt ("3 20 25" three times, then 3 20) and features: one answers ``expand``, the other
    ``expand_compact`` (a feature head expands each node once)."""
    target = peaky_target(32, seed=0, num_layers=2, std=0.3)
    prompt = torch.tensor([3, 20, 25, 3, 20, 25, 3, 20])
    feats = TargetFeatures({l: torch.randn(len(prompt) - 1, 16) for l in (2, 1, 0)})
    pair = []
    for _ in range(2):
        hybrid = HybridDrafter(random_feature_drafter(target, "eagle3", draft_vocab=12), HybridConfig(min_ngram=1))
        hybrid.begin(prompt, feats)
        pair.append(hybrid)
    return pair


def test_expand_compact_agrees_with_expand() -> None:
    """With an EAGLE-3 head (draft ids 0..11 of 32) the compact columns are draft ids ∪ committed
    tokens, and q there equals ``expand``'s; ``expand`` is -inf everywhere else."""
    pair = eagle3_hybrid_pair()
    trees = [PartialTree.rooted(20) for _ in pair]
    for t in trees:
        t.add(t.add(0, 25), 3)
    full = torch.cat([pair[0].expand(trees[0], [0]), pair[0].expand(trees[0], [1]), pair[0].expand(trees[0], [2])])
    parts = [pair[1].expand_compact(trees[1], [n]) for n in (0, 1, 2)]
    ids = parts[0][1]
    assert all(torch.equal(i, ids) for _, i in parts)
    assert ids.tolist() == list(range(12)) + [20, 25]
    compact = torch.cat([lg for lg, _ in parts])
    torch.testing.assert_close(compact.exp(), full[:, ids].exp(), atol=1e-6, rtol=0)
    outside = torch.ones(32, dtype=torch.bool)
    outside[ids] = False
    assert bool(full[:, outside].isneginf().all())
    assert pair[1].lookup_nodes == 3 and float(full[0, 25].exp()) > 0.25  # "20" -> 25 by lookup


def test_compact_columns_grow_with_the_history() -> None:
    """The compact columns are the head's draft ids in their order, then each committed token
    outside them once, in order of first occurrence; a commit appends columns in a new tensor
    (trees already built keep theirs), and q on them still equals ``expand``'s."""
    pair = eagle3_hybrid_pair()
    new = torch.tensor([31, 30, 5, 31])   # 5 is a draft id; 31 twice, before 30
    new_feats = TargetFeatures({l: torch.randn(len(new), 16) for l in (2, 1, 0)})
    _, before = pair[1].expand_compact(PartialTree.rooted(20), [0])
    kept = before.clone()
    trees = []
    for hybrid in pair:
        hybrid.commit(torch.zeros(0, dtype=torch.long), new, new_feats)
        tree = PartialTree.rooted(31)
        tree.add(0, 30)
        trees.append(tree)
    full = torch.cat([pair[0].expand(trees[0], [n]) for n in (0, 1)])   # the root on its own first
    parts = [pair[1].expand_compact(trees[1], [n]) for n in (0, 1)]
    ids = parts[1][1]
    assert ids.tolist() == list(range(12)) + [20, 25, 31, 30]
    assert torch.equal(before, kept)
    torch.testing.assert_close(torch.cat([lg for lg, _ in parts]).exp(), full[:, ids].exp(), atol=1e-6, rtol=0)
    assert float(full[0, 30].exp()) > 0.25   # "31" -> 30 by lookup (column 15)


def test_expand_before_begin_or_on_a_stale_root_is_an_error() -> None:
    hybrid = HybridDrafter(TableDrafter(10), HybridConfig())
    with pytest.raises(ValueError, match="begin"):
        hybrid.expand(PartialTree.rooted(2), [0])
    hybrid.begin(torch.tensor([1, 2]), EMPTY)
    with pytest.raises(ValueError, match="last committed token"):
        hybrid.expand(PartialTree.rooted(7), [0])


# ---------------------------------------------------------------- bad config
@pytest.mark.parametrize("kwargs, match", [
    (dict(min_ngram=3, max_ngram=2), "min_ngram <= max_ngram"),
    (dict(min_ngram=0), "min_ngram"),
    (dict(max_matches=True), "max_matches"),
    (dict(weight=1.5), "weight"),
    (dict(prior_strength=0.0), "prior_strength"),
    (dict(prior_strength=math.inf), "adapt=False"),
])
def test_bad_config(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        HybridConfig(**kwargs)


def test_bad_head() -> None:
    with pytest.raises(TypeError, match="head must be a Drafter"):
        HybridDrafter(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model drafter"):
        HybridDrafter(LookupDrafter(10))
    with pytest.raises(TypeError, match="HybridConfig"):
        HybridDrafter(TableDrafter(10), {"weight": 0.5})  # type: ignore[arg-type]


def test_registry_names_and_bad_head_names() -> None:
    target = peaky_target(V, seed=1, std=0.3)
    with pytest.raises(ValueError, match="model drafter"):
        load_drafter("hybrid", target, head="lookup")
    with pytest.raises(KeyError, match="registered"):
        load_drafter("hybrid", target, head="no-such-drafter")
    drafter = load_drafter("hybrid", target, head=NoisyTargetDrafter(target.model), weight=0.3)
    assert isinstance(drafter, HybridDrafter) and drafter.registry_name is None   # its head is an object
    assert drafter.config.weight == 0.3 and drafter.vocab_size == V
    with pytest.raises(ValueError, match="checkpoint"):
        load_drafter("hybrid", target, head=NoisyTargetDrafter(target.model), checkpoint="x.safetensors")


# ---------------------------------------------------------------- sampling exactness, end to end
class CountingHybrid(HybridDrafter):
    """Sums ``lookup_nodes`` over requests (``begin`` resets it)."""

    total_lookup_nodes = 0

    def begin(self, prompt_ids, features) -> None:
        self.total_lookup_nodes += self.lookup_nodes
        super().begin(prompt_ids, features)


BUILDERS = {
    "chain": lambda mode: ChainBuilder(budget=4, mode=mode),
    "dynamic": lambda mode: DynamicTreeBuilder(budget=10, depth=3, top_k=3, mode=mode),
    "best_first": lambda mode: BestFirstBuilder(budget=10, max_width=3, max_rounds=3, mode=mode),
}
PROMPT = [5, 1, 5, 1, 5]  # repeats: the lookup proposes "1" then "5" ...
CASES = [  # (builder, draft mode, sampling, verification rule)
    ("chain", "deterministic", "T1", "token"),
    ("chain", "with_replacement", "T0.7_top_p0.8", "block"),
    ("dynamic", "with_replacement", "T1", "token"),
    ("dynamic", "without_replacement", "T0.7_top_p0.8", "token"),
    ("best_first", "without_replacement", "T1", "traversal"),
    ("best_first", "deterministic", "T0.7_top_p0.8", "token"),
]


@pytest.fixture(scope="module")
def target():
    return peaky_target(V, seed=1, std=0.3)


def check_law(target, builder: str, mode: str, sampling_name: str, rule: str, samples: int, seed0: int) -> None:
    sampling = SAMPLINGS[sampling_name]
    hybrid = CountingHybrid(NoisyTargetDrafter(target.model, noise=0.5, seed=1),
                            HybridConfig(min_ngram=1, max_ngram=3, weight=0.5))
    gen = SpeculativeGenerator(target, hybrid, BUILDERS[builder](mode), verify=rule)
    law = exact_law(target.model, PROMPT, sampling)
    counts, steps, attempts, accepts = sample_counts(gen, PROMPT, sampling, samples, seed0)
    assert 0 < accepts < attempts, (accepts, attempts)  # both branches of the rule ran
    assert hybrid.total_lookup_nodes > samples, "the lookup hardly ever proposed"
    pvalue, cells = pooled_chisquare(counts, law)
    assert pvalue > P_MIN, (f"chi-square p = {pvalue:.2e} over {cells} cells: the hybrid with {builder}/"
                            f"{mode}, {rule} rule at {sampling_name} does not reproduce the target's law")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_hybrid_first_tokens_follow_the_target_law(target, case) -> None:
    check_law(target, *case, SAMPLES, seed0=9_000_000 * (1 + CASES.index(case)))


def test_hybrid_first_tokens_follow_the_target_law_smoke(target) -> None:
    check_law(target, "dynamic", "without_replacement", "T1", "token", SMOKE_SAMPLES, seed0=0)


# ---------------------------------------------------------------- greedy = HF generate
GREEDY_NEW = 40
EOS = 0  # HF generate needs one; this target never emits it in these 40 tokens


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_greedy_equals_hf_generate_on_a_tiny_model(builder) -> None:
    target = peaky_target(32, seed=0, num_layers=2, std=0.3)
    prompt = torch.tensor([5, 9, 5, 9, 5, 1, 7, 5, 9, 5])
    ref = hf_greedy(target.model, prompt, (EOS,), GREEDY_NEW)
    assert EOS not in ref, "the target has no EOS: the reference must not stop early"
    hybrid = HybridDrafter(random_feature_drafter(target, "eagle3", draft_vocab=24),
                           HybridConfig(min_ngram=1))
    gen = SpeculativeGenerator(target, hybrid, BUILDERS[builder]("deterministic"))
    out = gen.generate(prompt, max_new_tokens=GREEDY_NEW, temperature=0.0)
    assert out.token_ids.tolist() == ref, f"{builder}: the hybrid differs from HF greedy"
    assert hybrid.lookup_nodes > 0 and sum(out.stats.depth_accepts) > 0, "nothing was exercised"


@pytest.mark.slow
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_greedy_equals_hf_generate_on_smollm2(builder) -> None:
    """SmolLM2-135M fp32 with the shipped eagle3 head: 2 MT-bench prompts and a rewriting
    prompt (the lookup's case) x 32 tokens, token for token."""
    from treespec.data import chat_prompt, mtbench_questions
    from treespec.targets.loader import load_target

    smollm = load_target("smollm2-135m", dtype=torch.float32)
    texts = [q.turns[0] for q in mtbench_questions()[:2]]
    texts.append("Repeat this sentence word for word: the quick brown fox jumps over the lazy dog "
                 "while the cat sleeps on the warm mat.")
    hybrid = load_drafter("hybrid", smollm)
    gen = SpeculativeGenerator(smollm, hybrid, BUILDERS[builder]("deterministic"))
    for text in texts:
        ids = torch.tensor(chat_prompt(smollm.tokenizer, text))
        ref = hf_greedy(smollm.model, ids, smollm.eos_token_ids, 32)
        out = gen.generate(ids, max_new_tokens=32, temperature=0.0)
        assert out.token_ids.tolist() == ref, f"{builder}: differs from HF greedy on {text[:40]!r}"
