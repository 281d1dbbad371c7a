"""Switch drafter (lookup or model head, one per tree): its choice, its errors, exactness end to end.

- the choice: a lookup tree where the committed text's suffix recurs (the head does not run),
  a head tree elsewhere; the head catches up on skipped tokens at its next root;
- clear errors for a non-root first expansion, a stale root and a head that is not a model;
- sampling exactness end to end in the setting of tests/test_engine_exactness.py (tiny peaked
  Llama, V = 8, exact law of the first 3 tokens, pooled chi-square on seeded runs), with a
  repeating prompt so that both kinds of tree are drafted;
- greedy: token-identical to HF ``generate`` on a tiny model, with an independent tiny model as
  the head (a ``ModelDrafter``: the head's KV cache skips the lookup trees and catches up);
- ``SwitchBuilder``: each kind of tree built by its own builder, chosen before the tree from the
  committed text (``next_mode``), and its errors.
"""

from __future__ import annotations

import pytest
import torch

from treespec import SpeculativeGenerator, load_drafter
from treespec.builders import BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SwitchBuilder
from treespec.core.sampling import SamplingConfig
from treespec.drafters import HybridConfig, HybridDrafter, LookupConfig, ModelDrafter, PartialTree, SwitchDrafter
from treespec.drafters import TargetFeatures
from treespec.targets.loader import tiny_llama

from _engine_helpers import NoisyTargetDrafter, hf_greedy, one_thread, peaky_target  # noqa: F401
from test_builders import TableDrafter
from test_engine_exactness import P_MIN, SAMPLES, SAMPLINGS, SMOKE_SAMPLES, exact_law, pooled_chisquare, sample_counts

pytestmark = pytest.mark.usefixtures("one_thread")

EMPTY = TargetFeatures.empty()


def root_tree(token: int) -> PartialTree:
    return PartialTree(tokens=[token], parents=[-1], depth=[0])


def switch_of(history: list[int], **config) -> tuple[SwitchDrafter, TableDrafter]:
    head = TableDrafter(10, seed=0, scale=1.0)
    switch = SwitchDrafter(head, LookupConfig(**{"max_ngram": 3, "min_ngram": 2, **config}))
    switch.begin(torch.tensor(history), EMPTY)
    return switch, head


# ---------------------------------------------------------------- the choice
def test_a_recurring_suffix_makes_a_lookup_tree_and_the_head_does_not_run() -> None:
    switch, head = switch_of([4, 7, 2, 9, 4, 7])          # "4 7" recurs: 2 followed it
    q = switch.expand(root_tree(7), [0])
    assert switch.mode == "lookup" and head.calls == 0
    assert int(q[0].argmax()) == 2
    assert torch.equal(q, switch.lookup.expand(root_tree(7), [0]))
    assert (switch.lookup_trees, switch.head_trees) == (1, 0)


def test_no_recurring_suffix_makes_a_head_tree() -> None:
    switch, head = switch_of([4, 7, 2, 9, 3, 8])
    q = switch.expand(root_tree(8), [0])
    assert switch.mode == "head" and head.calls == 1
    assert torch.equal(q, head.logits((8,))[None])
    switch.commit(torch.tensor([], dtype=torch.long), torch.tensor([8, 4]), EMPTY)
    assert switch.mode is None and switch.lookup.history[-2:] == [8, 4]


def test_min_ngram_sets_how_long_a_repeat_must_be() -> None:
    assert switch_of([4, 7, 2, 9, 4, 7], min_ngram=2, max_ngram=3)[0].expand(root_tree(7), [0]) is not None
    long, _ = switch_of([4, 7, 2, 9, 4, 7], min_ngram=3, max_ngram=3)   # "9 4 7" never occurred before
    long.expand(root_tree(7), [0])
    assert long.mode == "head"


def test_head_depth_gives_deeper_nodes_a_uniform_q_without_running_the_head() -> None:
    head = TableDrafter(10, seed=0, scale=1.0)
    switch = SwitchDrafter(head, LookupConfig(max_ngram=3, min_ngram=2), head_depth=2)
    switch.begin(torch.tensor([4, 7, 2, 9, 3, 8]), EMPTY)
    tree = PartialTree(tokens=[8, 1, 2, 5], parents=[-1, 0, 1, 1], depth=[0, 1, 2, 2])
    switch.expand(tree, [0])
    q = switch.expand(tree, [1])
    assert switch.mode == "head" and head.calls == 2 and torch.equal(q, head.logits((8, 1))[None])
    deep = switch.expand(tree, [2, 3])
    assert head.calls == 2 and torch.equal(deep, torch.zeros(2, 10))
    with pytest.raises(ValueError, match="head_depth"):
        SwitchDrafter(head, head_depth=0)


def test_expanding_a_child_first_or_on_a_stale_root_is_an_error() -> None:
    switch, _ = switch_of([4, 7, 2, 9, 4, 7])
    tree = PartialTree(tokens=[7, 2], parents=[-1, 0], depth=[0, 1])
    with pytest.raises(ValueError, match="root first"):
        switch.expand(tree, [1])
    with pytest.raises(ValueError, match="last committed token"):
        switch.expand(root_tree(3), [0])


def test_bad_heads_and_registry() -> None:
    target = peaky_target(8, seed=1, std=0.3)
    with pytest.raises(TypeError, match="Drafter"):
        SwitchDrafter(object())
    hybrid = HybridDrafter(NoisyTargetDrafter(target.model), HybridConfig())
    with pytest.raises(ValueError, match="model drafter"):
        SwitchDrafter(hybrid)
    with pytest.raises(ValueError, match="model drafter"):
        load_drafter("switch", target, head="lookup")
    with pytest.raises(TypeError, match="LookupConfig"):
        SwitchDrafter(NoisyTargetDrafter(target.model), HybridConfig())
    drafter = load_drafter("switch", target, head=NoisyTargetDrafter(target.model), min_ngram=2)
    # a head passed as an object: no name rebuilds this drafter, so none keys its calibration
    assert isinstance(drafter, SwitchDrafter) and drafter.registry_name is None
    assert load_drafter("switch", target, head="target").registry_name == "switch[head=target]"
    assert drafter.lookup.config.min_ngram == 2 and drafter.vocab_size == 8


def test_next_mode_says_who_drafts_the_next_tree_without_counting_it() -> None:
    lookup, _ = switch_of([4, 7, 2, 9, 4, 7])
    head, _ = switch_of([4, 7, 2, 9, 3, 8])
    assert (lookup.next_mode(), head.next_mode()) == ("lookup", "head")
    assert lookup.lookup_trees == head.head_trees == 0
    head.expand(root_tree(8), [0])                  # a head tree; its commit makes "4 7" recur
    head.commit(torch.tensor([], dtype=torch.long), torch.tensor([4, 7]), EMPTY)
    assert head.next_mode() == "lookup"
    with pytest.raises(RuntimeError, match="begin"):
        SwitchDrafter(TableDrafter(10, seed=0)).next_mode()


# ---------------------------------------------------------------- SwitchBuilder
GREEDY = SamplingConfig(temperature=0.0)


def test_switch_builder_builds_each_kind_of_tree_with_its_own_builder() -> None:
    builder = SwitchBuilder(head=ChainBuilder(budget=3), lookup=ChainBuilder(budget=7))
    assert builder.budget == 7
    lookup, head_of_lookup = switch_of([4, 7, 2, 9, 4, 7, 2, 9, 4, 7])     # the text repeats: 2 9 4 7 ...
    built = builder.build(lookup, 7, GREEDY, None)
    assert lookup.mode == "lookup" and head_of_lookup.calls == 0
    assert built.tree.tokens.tolist() == [7, 2, 9, 4, 7, 2, 9]             # the lookup's chain of 6
    head, table = switch_of([4, 7, 2, 9, 3, 8])
    built = builder.build(head, 8, GREEDY, None)
    assert head.mode == "head" and table.calls == 2 and built.tree.num_nodes == 3   # the head's chain of 2


def test_switch_builder_refuses_other_drafters_and_non_builders() -> None:
    with pytest.raises(TypeError, match="SwitchDrafter"):
        SwitchBuilder(ChainBuilder(budget=3), ChainBuilder(budget=5)).build(TableDrafter(10, seed=0), 3, GREEDY, None)
    with pytest.raises(TypeError, match="lookup must be a tree builder"):
        SwitchBuilder(ChainBuilder(budget=3), object())
    with pytest.raises(TypeError, match="plain builder"):
        SwitchBuilder(SwitchBuilder(ChainBuilder(budget=3), ChainBuilder(budget=5)), ChainBuilder(budget=5))


# ---------------------------------------------------------------- sampling exactness, end to end
BUILDERS = {
    "chain": lambda mode: ChainBuilder(budget=4, mode=mode),
    "chain_conf": lambda mode: ChainBuilder(budget=6, mode=mode, min_confidence=0.4),
    "dynamic": lambda mode: DynamicTreeBuilder(budget=10, depth=3, top_k=3, mode=mode),
    "best_first": lambda mode: BestFirstBuilder(budget=10, max_width=3, max_rounds=3, mode=mode),
    # head trees best-first, lookup trees a longer chain
    "switch": lambda mode: SwitchBuilder(BestFirstBuilder(budget=6, max_width=2, max_rounds=2, mode=mode),
                                         ChainBuilder(budget=6, mode=mode, min_confidence=0.4)),
}
PROMPT = [5, 1, 5, 1, 5]  # "1 5" recurs: the first tree is a lookup tree
CASES = [  # (builder, draft mode, sampling, verification rule)
    ("chain", "deterministic", "T1", "token"),
    ("chain_conf", "deterministic", "T0.7_top_p0.8", "token"),
    ("dynamic", "without_replacement", "T1", "token"),
    ("best_first", "with_replacement", "T1", "traversal"),
    ("switch", "without_replacement", "T0.7_top_p0.8", "token"),
]


def check_law(builder: str, mode: str, sampling_name: str, rule: str, samples: int, seed0: int) -> None:
    target = peaky_target(8, seed=1, std=0.3)
    sampling = SAMPLINGS[sampling_name]
    switch = SwitchDrafter(NoisyTargetDrafter(target.model, noise=0.5, seed=1),
                           LookupConfig(max_ngram=3, min_ngram=2), head_depth=2 if builder == "chain_conf" else None)
    gen = SpeculativeGenerator(target, switch, BUILDERS[builder](mode), verify=rule)
    law = exact_law(target.model, PROMPT, sampling)
    counts, steps, attempts, accepts = sample_counts(gen, PROMPT, sampling, samples, seed0)
    assert 0 < accepts < attempts, (accepts, attempts)
    assert switch.lookup_trees > samples // 2 and switch.head_trees > samples // 2, \
        (switch.lookup_trees, switch.head_trees)
    pvalue, cells = pooled_chisquare(counts, law)
    assert pvalue > P_MIN, (f"chi-square p = {pvalue:.2e} over {cells} cells: the switch with {builder}/"
                            f"{mode}, {rule} rule at {sampling_name} does not reproduce the target's law")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_switch_first_tokens_follow_the_target_law(case) -> None:
    check_law(*case, SAMPLES, seed0=7_000_000 * (1 + CASES.index(case)))


def test_switch_first_tokens_follow_the_target_law_smoke() -> None:
    check_law("dynamic", "without_replacement", "T1", "token", SMOKE_SAMPLES, seed0=0)


def test_switch_builder_first_tokens_follow_the_target_law_smoke() -> None:
    check_law("switch", "with_replacement", "T1", "traversal", SMOKE_SAMPLES, seed0=1)


# ---------------------------------------------------------------- greedy = HF generate
GREEDY_NEW = 40
EOS = 0


@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_greedy_equals_hf_generate_with_a_model_head(builder) -> None:
    target = peaky_target(32, seed=0, num_layers=2, std=0.3)
    prompt = torch.tensor([5, 9, 5, 9, 5, 1, 7, 5, 9, 5, 3, 11])
    ref = hf_greedy(target.model, prompt, (EOS,), GREEDY_NEW)
    assert EOS not in ref, "the target has no EOS: the reference must not stop early"
    head = ModelDrafter(tiny_llama(vocab_size=32, seed=3), target.vocab_size)
    switch = SwitchDrafter(head, LookupConfig(max_ngram=3, min_ngram=2), head_depth=2 if builder == "chain_conf" else None)
    gen = SpeculativeGenerator(target, switch, BUILDERS[builder]("deterministic"))
    out = gen.generate(prompt, max_new_tokens=GREEDY_NEW, temperature=0.0)
    assert out.token_ids.tolist() == ref, f"{builder}: the switch differs from HF greedy"
    assert switch.lookup_trees > 0 and switch.head_trees > 0, (switch.lookup_trees, switch.head_trees)
