"""Cost model: expected tokens, optimal trees and tree sizing."""

from __future__ import annotations

import itertools

import pytest

from treespec.planning import (
    DrafterSpec,
    RooflineCost,
    acceptance_vector,
    batch_limits,
    best_choice,
    best_tree,
    expected_chain_tokens,
    expected_tokens_positional,
    get_hardware,
    model_shape,
    optimal_tree,
    optimal_trees,
    plan_curve,
)


def test_chain_formula_by_hand():
    assert expected_chain_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_chain_tokens(1.0, 4) == 5.0
    # A chain-only acceptance vector (β,) gives chains, with the same τ.
    tree = optimal_tree((0.5,), budget=4, depth=5)
    assert tree.parents == (-1, 0, 1, 2) and tree.tau == pytest.approx(1.875)
    assert tree.level_sizes == (1, 1, 1, 1) and tree.draft_widths == (1, 1, 1)


def test_optimal_tree_by_hand():
    # Root children are worth 0.6, 0.3; the first child's children 0.36, 0.18.
    # Three draft nodes (budget 4, the root included): take 0.6, 0.36, 0.3 -> τ = 2.26, 2 levels.
    tree = optimal_tree((0.6, 0.3), budget=4, depth=4)
    assert tree.tau == pytest.approx(1 + 0.6 + 0.36 + 0.3)
    assert tree.level_sizes == (1, 2, 1) and tree.budget == 4 and tree.drafts == 3
    assert tree.choices == ((0,), (1,), (0, 0))
    assert expected_tokens_positional(tree.parents, (0.6, 0.3)) == pytest.approx(tree.tau)


def _brute_force_tau(p: tuple[float, ...], drafts: int, depth: int) -> float:
    """Best τ over every parent array with ``drafts`` draft nodes and depth <= ``depth``."""
    best = 1.0
    for tail in itertools.product(*(range(i) for i in range(1, drafts + 1))):
        parents = (-1, *tail)
        depths = [0]
        for i in range(1, len(parents)):
            depths.append(depths[parents[i]] + 1)
        if max(depths) <= depth:
            best = max(best, expected_tokens_positional(parents, p))
    return best


@pytest.mark.parametrize("p", [(0.7, 0.2, 0.05), (0.5, 0.25, 0.125, 0.0625), (0.9,), (0.4, 0.4, 0.2)])
def test_best_first_tree_is_optimal(p):
    trees = optimal_trees(p, max_drafts=6, max_depth=3)
    for drafts in range(1, 7):
        if drafts < len(trees):
            assert trees[drafts].tau == pytest.approx(_brute_force_tau(p, drafts, 3))
            assert optimal_tree(p, drafts + 1, 3).tau == pytest.approx(_brute_force_tau(p, drafts, 3))


@pytest.mark.parametrize("p", [(0.7, 0.2, 0.05), (0.6, 0.15, 0.1, 0.05, 0.05), (0.9,), (0.3, 0.5, 0.1)])
def test_best_first_agrees_with_the_sequoia_dp(p):
    for depth in (1, 3, 6):
        trees = optimal_trees(p, max_drafts=24, max_depth=depth)
        for drafts in (1, 5, 12, 24):
            dp_tau = optimal_tree(p, drafts + 1, depth).tau
            tau = trees[min(drafts, len(trees) - 1)].tau
            if list(p) == sorted(p, reverse=True):
                assert tau == pytest.approx(dp_tau)  # exact
            else:
                assert tau <= dp_tau + 1e-12  # best-first is a lower bound for increasing vectors


def test_scalar_beta_expands_to_a_geometric_vector():
    assert acceptance_vector(0.5, siblings=3) == pytest.approx((0.5, 0.25, 0.125))


def test_expected_tokens_agree_with_per_node_confidences():
    import torch

    from treespec import DraftTree
    from treespec.planning import expected_tree_tokens

    parents = (-1, 0, 0, 1, 1, 3)
    p = (0.6, 0.3)
    ranks = [0, 0, 1, 0, 1, 0]
    tree = DraftTree(torch.arange(6), torch.tensor(parents))
    confidences = torch.tensor([1.0] + [p[r] for r in ranks[1:]])
    assert expected_tree_tokens(tree, confidences) == pytest.approx(expected_tokens_positional(parents, p))


def test_sequoia_a100_grows_larger_trees_than_l40():
    # Sequoia (Chen et al. 2024): Llama-2-7B + JackFram/llama-68m, optimal trees of 128 nodes on
    # an A100 vs 64 on an L40. The L40 attains a lower ridge point, so its verify cost rises sooner.
    draft = DrafterSpec("model", shape=model_shape("llama-68m"))
    a100 = best_tree("llama-2-7b", draft, "a100", batch=1, context=256, acceptance=0.6, max_drafts=256)
    l40 = best_tree("llama-2-7b", draft, "l40", batch=1, context=256, acceptance=0.6, max_drafts=256)
    assert a100.drafts > l40.drafts
    assert 64 <= l40.drafts < a100.drafts <= 256  # large trees on both, as published


def test_best_tree_fields_are_consistent():
    choice = best_tree("llama-3-8b", "eagle", "h100", batch=1, context=2048)
    assert choice.drafts > 0 and choice.depth >= 1 and choice.speedup > 1
    assert sum(choice.level_sizes) == choice.budget == choice.drafts + 1 and len(choice.level_sizes) == choice.depth + 1
    assert choice.tokens_per_s == pytest.approx(choice.tau / (choice.verify_s + choice.draft_s))
    assert choice.tau == pytest.approx(optimal_trees(0.75, choice.drafts, choice.depth)[choice.drafts].tau)


def test_tree_shrinks_with_batch_to_chain_then_nothing():
    budgets = [best_tree("llama-3-8b", "eagle", "h100", batch=b, context=128).drafts for b in (1, 8, 64, 512)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    limits = batch_limits("llama-3-8b", "eagle", "h100", context=128)
    assert limits.verify_compute_bound is not None and limits.decode_compute_bound is not None
    assert limits.verify_compute_bound < limits.decode_compute_bound
    assert limits.chain is not None and limits.no_speculation is not None
    assert limits.chain <= limits.no_speculation
    assert best_tree("llama-3-8b", "eagle", "h100", batch=limits.chain, context=128).level_sizes == \
        (1,) * (best_tree("llama-3-8b", "eagle", "h100", batch=limits.chain, context=128).depth + 1)
    assert best_tree("llama-3-8b", "eagle", "h100", batch=limits.no_speculation, context=128).drafts == 0
    assert best_tree("llama-3-8b", "eagle", "h100", batch=limits.no_speculation - 1, context=128).drafts > 0


def test_no_speculation_is_a_valid_answer():
    assert best_tree("llama-3-8b", "eagle", "h100", acceptance=0.0).drafts == 0
    # A drafter as slow as the target: D + 1 passes for τ < D + 1 tokens never pays.
    target = model_shape("llama-3-8b")
    curve = plan_curve(RooflineCost(target, DrafterSpec("model", shape=target), get_hardware("h100")), 0.3)
    assert best_choice(curve).budget == 1 and curve[0].speedup == 1.0 and curve[0].tau == 1.0


def test_free_drafter_on_flat_verify_takes_the_largest_tree():
    # Lookup drafting costs 0 and at batch 1 a 70B verify is flat up to the ridge point.
    choice = best_tree("llama-3-70b", "lookup", get_hardware("h200"), acceptance=0.5, max_drafts=32)
    assert choice.drafts == 32 and choice.budget == 33


def test_planning_errors():
    with pytest.raises(ValueError, match=r"acceptance rate β must be in \[0, 1\], got 1.5"):
        best_tree("llama-3-8b", "eagle", "h100", acceptance=1.5)
    with pytest.raises(ValueError, match=r"sums to 1.2 > 1"):
        acceptance_vector((0.7, 0.5))
    with pytest.raises(ValueError, match=r"a\[1\] = -0.1"):
        acceptance_vector((0.7, -0.1))
    with pytest.raises(ValueError, match="must not be empty"):
        acceptance_vector(())
    with pytest.raises(ValueError, match="batch must be an int >= 1, got 0"):
        best_tree("llama-3-8b", "eagle", "h100", batch=0)
    with pytest.raises(ValueError, match="context must be an int >= 0, got -5"):
        best_tree("llama-3-8b", "eagle", "h100", context=-5)
    with pytest.raises(KeyError, match="unknown hardware 'b200'"):
        best_tree("llama-3-8b", "eagle", "b200")
    with pytest.raises(ValueError, match=r"budget \(tree nodes, root included\) must be an int >= 1, got 0"):
        optimal_tree((0.5,), budget=0, depth=2)
    # a chain-only vector cannot use a node beyond the depth: the tree leaves it unused
    assert optimal_tree((0.5,), budget=4, depth=2).budget == 3
