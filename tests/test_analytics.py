"""Closed-form acceptance analytics: hand computation, and Monte Carlo of ``accept``."""

from __future__ import annotations

import math

import pytest
import torch

from treespec.planning.tau import acceptance_rate, expected_chain_tokens, expected_tree_tokens
from treespec.core.tree import DraftTree
from treespec.core import accept

from _tiny import one_thread  # noqa: F401  (autouse fixture)

F64 = torch.float64


def test_acceptance_rate_by_hand():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    # Σ min = 0.2 + 0.3 + 0.2 = 0.7 = 1 - TVD = 1 - (0.3 + 0 + 0.3) / 2
    assert acceptance_rate(p, q).item() == pytest.approx(0.7, abs=1e-15)
    assert acceptance_rate(p, p).item() == pytest.approx(1.0, abs=1e-15)
    disjoint = torch.tensor([0.0, 0.0, 1.0], dtype=F64)
    assert acceptance_rate(torch.tensor([0.5, 0.5, 0.0], dtype=F64), disjoint).item() == 0.0
    batch = acceptance_rate(torch.stack([p, p]), torch.stack([q, p]))
    assert batch.shape == (2,) and batch.tolist() == pytest.approx([0.7, 1.0], abs=1e-15)
    with pytest.raises(ValueError, match=r"p and q must have the same shape, got \(3,\) and \(2,\)"):
        acceptance_rate(p, q[:2])


def test_expected_chain_tokens_by_hand():
    assert expected_chain_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125, abs=1e-15)
    assert expected_chain_tokens(0.8, 1) == pytest.approx(1.8, abs=1e-15)
    assert expected_chain_tokens(1.0, 4) == 5.0
    assert expected_chain_tokens(0.0, 4) == 1.0
    assert expected_chain_tokens(0.7, 0) == 1.0
    # close to beta = 1 the closed form stays continuous
    assert expected_chain_tokens(1 - 1e-9, 4) == pytest.approx(5.0, abs=1e-6)


@pytest.mark.parametrize(
    "beta,k,match",
    [(-0.1, 2, r"beta must be in \[0, 1\], got -0.1"), (1.5, 2, r"beta must be in \[0, 1\]"),
     (0.5, -1, r"k \(chain length\) must be >= 0, got -1")],
)
def test_expected_chain_tokens_errors(beta, k, match):
    with pytest.raises(ValueError, match=match):
        expected_chain_tokens(beta, k)


#        0
#       / \
#      1   2
#     / \
#    3   4
TREE = DraftTree(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1, 1]))


def test_expected_tree_tokens_by_hand():
    a = torch.tensor([0.0, 0.6, 0.3, 0.5, 0.25], dtype=F64)
    # reach: 1: 0.6, 2: 0.3, 3: 0.6*0.5 = 0.3, 4: 0.6*0.25 = 0.15; τ = 1 + 1.35
    assert expected_tree_tokens(TREE, a) == pytest.approx(2.35, abs=1e-12)
    assert expected_tree_tokens(TREE, torch.zeros(5)) == 1.0
    chain = DraftTree(torch.arange(4), torch.arange(-1, 3))
    b = 0.7
    assert expected_tree_tokens(chain, torch.full((4,), b, dtype=F64)) == pytest.approx(
        expected_chain_tokens(b, 3), abs=1e-12)


def test_expected_tree_tokens_errors():
    with pytest.raises(ValueError, match=r"node_accept_probs must have shape \[N=5\], got \(4,\)"):
        expected_tree_tokens(TREE, torch.zeros(4))
    with pytest.raises(ValueError, match=r"node_accept_probs must lie in \[0, 1\]"):
        expected_tree_tokens(TREE, torch.tensor([0.0, 1.2, 0.0, 0.0, 0.0]))


def _mean_within(samples: list[int], mean: float, sigmas: float = 5.0) -> None:
    x = torch.tensor(samples, dtype=F64)
    sem = x.std().item() / math.sqrt(len(samples))
    assert abs(x.mean().item() - mean) <= sigmas * sem + 1e-12, (x.mean().item(), mean, sem)


def test_chain_tau_matches_monte_carlo_of_accept():
    """i.i.d. draft tokens, the same p and q at every depth: each level accepts w.p. β."""
    V, k, draws = 8, 4, 6000
    g = torch.Generator().manual_seed(0)
    p = torch.rand(V, generator=g, dtype=F64).softmax(0)
    q = torch.rand(V, generator=g, dtype=F64).pow(3)
    q /= q.sum()
    beta = acceptance_rate(p, q).item()
    drafted = torch.multinomial(q, draws * k, replacement=True, generator=g).view(draws, k)
    trees: dict[tuple[int, ...], DraftTree] = {}
    emitted = []
    for toks in map(tuple, drafted.tolist()):
        if toks not in trees:
            trees[toks] = DraftTree(torch.tensor((0,) + toks), torch.arange(-1, k),
                                    q.expand(k + 1, V), "with_replacement")
        emitted.append(accept(trees[toks], p.expand(k + 1, V), g).tokens.numel())
    _mean_within(emitted, expected_chain_tokens(beta, k))


def test_tree_tau_matches_monte_carlo_of_accept():
    """Deterministic children: P(child i accepted | parent reached) = p(x_i | parent path)."""
    V, draws = 6, 6000
    g = torch.Generator().manual_seed(1)
    p = torch.rand(5, V, generator=g, dtype=F64).softmax(-1)
    a = torch.zeros(5, dtype=F64)
    for i, par in enumerate(TREE.parents.tolist()[1:], start=1):
        a[i] = p[par, TREE.tokens[i]]
    emitted = [accept(TREE, p, g).tokens.numel() for _ in range(draws)]
    _mean_within(emitted, expected_tree_tokens(TREE, a))
