"""ModelDrafter: its tree expansions equal plain forwards, and after every commit its KV cache
equals a fresh cache of the accepted tokens (unexpanded accepted leaves and non-contiguous kept
slots included), so its next expansion matches a fresh drafter's. Plus its errors and the
early-exit / "target" registered drafters.
"""

from __future__ import annotations

import random

import pytest
import torch

from treespec.drafters import ModelDrafter, PartialTree, TargetFeatures, early_exit_model, load_drafter
from treespec.fastpath.kvcache import GrowingLayer
from treespec.targets.loader import Target

from _engine_helpers import assert_cache_equal, fresh_cache, one_thread, peaky_llama  # noqa: F401

V = 16
NONE = TargetFeatures.empty()
pytestmark = pytest.mark.usefixtures("one_thread")


def plain_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def check_state(drafter: ModelDrafter, committed: list[int]) -> None:
    """Cache = fresh cache of the first prefix_len committed tokens; the rest is pending."""
    p = drafter.prefix_len
    assert drafter.pending == committed[p:]
    assert drafter.slots == {}
    assert_cache_equal(drafter.cache, fresh_cache(drafter.model, committed[:p]), p)


def grow_and_expand(drafter: ModelDrafter, rng: random.Random, committed: list[int],
                    max_nodes: int) -> tuple[PartialTree, set[int]]:
    """Grow a random tree, expanding batches of frontier nodes; every logits row is checked
    against a plain forward of committed[:-1] + the node's path."""
    model = drafter.model
    tree = PartialTree.rooted(committed[-1])
    expanded: set[int] = set()
    batch = [0]
    while batch:
        logits = drafter.expand(tree, batch)
        assert logits.shape == (len(batch), V)
        for row, n in enumerate(batch):
            want = plain_logits(model, committed[:-1] + [tree.tokens[i] for i in tree.path_to(n)])
            torch.testing.assert_close(logits[row], want, atol=1e-5, rtol=0)
        expanded.update(batch)
        for n in batch:
            for tok in rng.sample(range(V), rng.randint(0, 3)):
                if len(tree) < max_nodes:
                    tree.add(n, tok)
        frontier = [n for n in range(len(tree)) if n not in expanded]
        batch = sorted(rng.sample(frontier, min(len(frontier), rng.randint(0, 3))))
    return tree, expanded


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_commit_leaves_the_cache_of_the_accepted_tokens(attn: str) -> None:
    model = peaky_llama(V, seed=7, hidden_size=32, num_layers=2, std=0.2, attn_implementation=attn)
    drafter = ModelDrafter(model, V)
    rng = random.Random(attn)
    committed = [rng.randrange(V) for _ in range(5)]
    drafter.begin(torch.tensor(committed), NONE)
    check_state(drafter, committed)
    # rows written in place; the compaction writes through the layers' views into their buffers
    assert all(type(layer) is GrowingLayer for layer in drafter.cache.layers)
    unexpanded_leaf = scattered = 0
    for step in range(10):
        tree, expanded = grow_and_expand(drafter, rng, committed, max_nodes=12)
        node = rng.randrange(len(tree))
        path = tree.path_to(node)[1:]
        slots = [drafter.slots[n] for n in [0] + path if n in expanded]
        unexpanded_leaf += any(n not in expanded for n in path)
        scattered += slots != list(range(slots[0], slots[0] + len(slots)))
        new = rng.randrange(V)
        tokens = [tree.tokens[n] for n in path] + [new]
        drafter.commit(torch.tensor(path, dtype=torch.long), torch.tensor(tokens), NONE)
        committed += tokens
        check_state(drafter, committed)
    assert unexpanded_leaf >= 2 and scattered >= 2, (unexpanded_leaf, scattered)

    # The next expansions equal a fresh drafter's, begun on all committed tokens.
    fresh = ModelDrafter(model, V)
    fresh.begin(torch.tensor(committed), NONE)
    tree = PartialTree.rooted(committed[-1])
    torch.testing.assert_close(drafter.expand(tree, [0]), fresh.expand(tree, [0]), atol=1e-5, rtol=0)
    a, b = tree.add(0, 3), tree.add(0, 5)
    torch.testing.assert_close(drafter.expand(tree, [a, b]), fresh.expand(tree, [a, b]),
                               atol=1e-5, rtol=0)


def test_commit_of_a_scattered_path_ending_in_an_unexpanded_leaf() -> None:
    """The two hard cases on a fixed tree: kept slots {root, 1, 5} are not contiguous (3 and 4
    were fed in between), and the accepted leaf 6 was never fed."""
    model = peaky_llama(V, seed=8, hidden_size=32, num_layers=2, std=0.2)
    drafter = ModelDrafter(model, V)
    committed = [4, 9, 2]
    drafter.begin(torch.tensor(committed), NONE)
    tree = PartialTree.rooted(2)
    drafter.expand(tree, [0])
    n1, n2 = tree.add(0, 7), tree.add(0, 8)
    drafter.expand(tree, [n1, n2])
    n3, n4, n5 = tree.add(n1, 1), tree.add(n2, 1), tree.add(n1, 6)
    drafter.expand(tree, [n3, n4, n5])
    n6 = tree.add(n5, 11)
    assert [drafter.slots[n] for n in (0, n1, n5)] == [2, 3, 7]
    drafter.commit(torch.tensor([n1, n5, n6]), torch.tensor([7, 6, 11, 13]), NONE)
    committed += [7, 6, 11, 13]
    assert drafter.prefix_len == 5 and drafter.pending == [11, 13]
    check_state(drafter, committed)
    got = drafter.expand(PartialTree.rooted(13), [0])
    torch.testing.assert_close(got[0], plain_logits(model, committed), atol=1e-5, rtol=0)


def test_commit_without_any_expansion_keeps_everything_pending() -> None:
    """A builder may skip the drafter for a step (budget 1): the tokens just queue up."""
    model = peaky_llama(V, seed=9)
    drafter = ModelDrafter(model, V)
    drafter.begin(torch.tensor([1, 2]), NONE)
    drafter.commit(torch.zeros(0, dtype=torch.long), torch.tensor([5]), NONE)
    check_state(drafter, [1, 2, 5])
    got = drafter.expand(PartialTree.rooted(5), [0])
    torch.testing.assert_close(got[0], plain_logits(model, [1, 2, 5]), atol=1e-5, rtol=0)


def test_vocab_mismatch_names_both_sizes() -> None:
    with pytest.raises(ValueError, match="drafter vocab size 16 != target vocab size 32"):
        ModelDrafter(peaky_llama(V), target_vocab_size=32)


def test_expand_order_errors() -> None:
    drafter = ModelDrafter(peaky_llama(V), V)
    tree = PartialTree.rooted(3)
    with pytest.raises(RuntimeError, match="begin"):
        drafter.expand(tree, [0])
    drafter.begin(torch.tensor([1, 3]), NONE)
    a = tree.add(0, 4)
    b = tree.add(a, 5)
    with pytest.raises(ValueError, match="root must be expanded on its own"):
        drafter.expand(tree, [0, a])
    with pytest.raises(ValueError, match=r"nodes \[1\] cannot be expanded"):
        drafter.expand(tree, [a])  # before its parent, the root
    with pytest.raises(ValueError, match="not the last committed token"):
        drafter.expand(PartialTree.rooted(7), [0])
    drafter.expand(tree, [0])
    with pytest.raises(ValueError, match="already expanded"):
        drafter.expand(tree, [0])
    with pytest.raises(ValueError, match=r"nodes \[2\] cannot be expanded"):
        drafter.expand(tree, [b])  # parent a not expanded yet
    drafter.expand(tree, [a])
    with pytest.raises(ValueError, match=r"nodes \[1\] cannot be expanded"):
        drafter.expand(tree, [a])  # twice


def test_early_exit_model_is_the_targets_first_layers() -> None:
    model = peaky_llama(V, seed=10, hidden_size=32, num_layers=3, std=0.2)
    ids = torch.tensor([[1, 5, 2, 7]])
    with torch.inference_mode():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        for k in (1, 2):
            draft = early_exit_model(model, k)
            assert draft.model.embed_tokens is model.model.embed_tokens  # shared, not copied
            # hidden_states[k] is the residual stream after layer k (HF adds the norm only last).
            want = model.lm_head(model.model.norm(hidden[k]))
            torch.testing.assert_close(draft(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    for bad in (0, 3):
        with pytest.raises(ValueError, match=r"num_layers must be in \[1, 2\]"):
            early_exit_model(model, bad)


def test_registered_model_drafters() -> None:
    target = Target.from_hf(peaky_llama(V, seed=11, num_layers=2), None, "t", pack=False)
    mine = load_drafter("target", target)
    assert isinstance(mine, ModelDrafter) and mine.model is target.model
    early = load_drafter("early-exit", target)
    assert len(early.model.model.layers) == 1 and early.vocab_size == V


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_state_in_the_engine_loop(temperature: float) -> None:
    """Inside SpeculativeGenerator, after every step the drafter holds exactly the committed
    tokens (cache + pending), also when EAGLE-2's rerank drops drafted nodes, so that tree ids
    and drafter ids differ (``BuiltTree.source``). A wrong mapping would not change the output
    (it only costs acceptance), so it is checked here directly."""
    import copy

    from treespec import DynamicTreeBuilder, SpeculativeGenerator

    target = Target.from_hf(peaky_llama(V, seed=12, num_layers=2, std=0.3), None, "t", pack=False)
    draft = copy.deepcopy(target.model)  # the target with noisy weights: a fair drafter
    noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=noise))
    drafter = ModelDrafter(draft, V)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=6, depth=4, top_k=3))
    prompt = [3, 8, 1]
    committed = list(prompt)
    seen = {"remapped": 0, "accepted": 0}

    def on_step(built, acc, step) -> None:
        committed.extend(acc.tokens.tolist())
        check_state(drafter, committed)
        seen["remapped"] += not torch.equal(built.source, torch.arange(built.source.numel()))
        seen["accepted"] += acc.num_accepted

    gen.generate(prompt, 40, temperature=temperature, seed=0, on_step=on_step)
    assert seen["remapped"] > 0 and seen["accepted"] > 0, seen
