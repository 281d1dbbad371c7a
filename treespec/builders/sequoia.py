"""Sequoia (Chen et al. 2024): the optimal static topology for a positional acceptance vector.

Glossary:
    acceptance vector  a[i] = P(the i-th child of a node (0-based, trial order) is the accepted
                       one | the node was reached), assumed the same at every node. The events
                       are disjoint, so a is a sub-distribution: a[i] >= 0, Σ a <= 1 (the rest
                       is "no child accepted"). It need not be monotone.
    value of a node    P(node accepted) = Π a[rank] over its path; the root's value is 1.
    expected tokens    τ = Σ node values (root included: the one new token every step).
    shape              the topology as Medusa-style rank-path tuples (root excluded), usable by
                       ``StaticTreeBuilder``.

``optimal_tree(a, budget, depth)`` is the dynamic programme over (nodes, depth):
    T(n, d) = best τ of a tree with at most n nodes (root incl.) and depth <= d;
    T(1, d) = 1,  T(n, 0) = 1,  T(n, d) = 1 + G_d(0, n - 1)
    G_d(i, m) = best value of at most m nodes placed below children of rank >= i
              = max(0, max_{1<=s<=m} a[i]·T(s, d - 1) + G_d(i + 1, m - s)).
A child of rank i exists only if ranks < i exist (children are tried in order), which the
recursion over i encodes. Note: ``budget`` counts the root here (as in every builder); the cost
model (``treespec.planning``) counts draft nodes only. Results are cached per (a, budget, depth).

``SequoiaBuilder`` is a ``StaticTreeBuilder`` with that shape; in stochastic modes each node
draws exactly as many children as the shape gives it. ``treespec.calibrate.drafters.measure_acceptance_vector``
estimates a from real runs (it runs the engine, so it lives above it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from treespec.builders.base import DraftMode, check_int, check_mode
from treespec.builders.static import MEDUSA_PRIOR, Choice, StaticTreeBuilder

# Used when no measured vector is given (the Medusa-style prior of trees.static).
DEFAULT_ACCEPTANCE: tuple[float, ...] = MEDUSA_PRIOR
_SUM_ATOL = 1e-6


def validate_acceptance(acceptance: Sequence[float] | torch.Tensor) -> tuple[float, ...]:
    """A positional acceptance vector as a tuple; errors say what is wrong with it."""
    if isinstance(acceptance, torch.Tensor):
        acceptance = acceptance.detach().flatten().tolist()
    if isinstance(acceptance, (str, bytes)) or not isinstance(acceptance, Sequence):
        raise TypeError(f"acceptance must be a sequence of probabilities, got "
                        f"{type(acceptance).__name__}")
    a = tuple(float(x) for x in acceptance)
    if not a:
        raise ValueError("acceptance vector must not be empty")
    for i, x in enumerate(a):
        if not math.isfinite(x) or not 0.0 <= x <= 1.0:
            raise ValueError(f"acceptance vector entries must be probabilities in [0, 1]; "
                             f"a[{i}] = {x}")
    if math.fsum(a) > 1.0 + _SUM_ATOL:
        raise ValueError(f"acceptance vector sums to {math.fsum(a):.6g} > 1, so it is not a "
                         "distribution: a[i] is the probability that child i is THE accepted "
                         "one, and those events are disjoint")
    return a


def optimal_tree(acceptance: Sequence[float] | torch.Tensor, budget: int,
                 depth: int) -> tuple[float, tuple[Choice, ...]]:
    """(expected tokens τ, shape) of the best tree with <= ``budget`` nodes (root included) and
    depth <= ``depth`` under the positional acceptance vector (module docstring)."""
    a = validate_acceptance(acceptance)
    check_int("budget", budget)
    check_int("depth", depth)
    return _optimal_tree(a, budget, depth)


@lru_cache(maxsize=256)
def _optimal_tree(a: tuple[float, ...], budget: int, depth: int) -> tuple[float, tuple[Choice, ...]]:
    n_max = budget
    k = min(len(a), n_max - 1)
    # T[d][n], n = 0..n_max (n = 0 unused); split[d][i][m] = nodes given to rank i's subtree
    T = np.ones((depth + 1, n_max + 1))
    split = np.zeros((depth + 1, max(k, 1), n_max), dtype=np.int64)
    for d in range(1, depth + 1):
        g_next = np.zeros(n_max)  # G_d(k, m) = 0
        for i in range(k - 1, -1, -1):
            g = np.zeros(n_max)
            for m in range(1, n_max):
                s = np.arange(1, m + 1)
                cand = a[i] * T[d - 1][s] + g_next[m - s]
                best = int(np.argmax(cand))  # first maximum: the smallest subtree
                if cand[best] > g[m - 1] and cand[best] > 0:
                    g[m], split[d][i][m] = cand[best], best + 1
                else:  # one node fewer does as well: keep it unused
                    g[m], split[d][i][m] = g[m - 1], -1
            g_next = g
        T[d][1:] = 1.0 + g_next[np.arange(n_max)]
    shape: list[Choice] = []

    def place(prefix: Choice, n: int, d: int) -> None:
        """Emit the optimal subtree of <= n nodes and depth <= d rooted at ``prefix``."""
        m, i = n - 1, 0
        while d > 0 and i < k and m > 0:
            s = int(split[d][i][m])
            if s == -1:
                m -= 1
                continue
            if s == 0:
                break
            child = prefix + (i,)
            shape.append(child)
            place(child, s, d - 1)
            m, i = m - s, i + 1

    place((), n_max, depth)
    shape.sort(key=lambda c: (len(c), c))
    return float(T[depth][n_max]), tuple(shape)


def expected_tokens(acceptance: Sequence[float] | torch.Tensor, shape: Sequence[Choice]) -> float:
    """τ of a shape under the positional model (each node's rank = its position among siblings)."""
    a = validate_acceptance(acceptance)
    value: dict[Choice, float] = {(): 1.0}
    for c in sorted((tuple(c) for c in shape), key=lambda c: (len(c), c)):
        siblings = sorted(s for s in value if len(s) == len(c) and s[:-1] == c[:-1])
        rank = len(siblings)
        value[c] = value[c[:-1]] * (a[rank] if rank < len(a) else 0.0)
    return math.fsum(value.values())


@dataclass(frozen=True)
class SequoiaConfig:
    """Sequoia settings (the built topology lives in the StaticConfig ``builder.config``)."""

    budget: int = 16                  # tree nodes incl. the root
    depth: int = 5                    # max draft depth
    acceptance: tuple[float, ...] = DEFAULT_ACCEPTANCE   # positional acceptance vector
    mode: DraftMode = "deterministic"  # how children are chosen (see trees.base)

    def __post_init__(self) -> None:
        check_int("budget", self.budget)
        check_int("depth", self.depth)
        object.__setattr__(self, "acceptance", validate_acceptance(self.acceptance))
        check_mode(self.mode)


class SequoiaBuilder(StaticTreeBuilder):
    """Static tree with Sequoia's optimal shape for ``acceptance`` (default DEFAULT_ACCEPTANCE).

    ``budget``: tree nodes incl. the root; ``depth``: max draft depth. The shape may use fewer
    than ``budget`` nodes when extra nodes are worth nothing (zeros in the vector).
    """

    def __init__(self, budget: int = 16, depth: int = 5,
                 acceptance: Sequence[float] | torch.Tensor | None = None,
                 mode: DraftMode = "deterministic"):
        self.sequoia = SequoiaConfig(budget, depth,
                                     DEFAULT_ACCEPTANCE if acceptance is None else acceptance, mode)
        self.expected_tokens, shape = optimal_tree(self.sequoia.acceptance, budget, depth)
        super().__init__(shape, mode)

    @property
    def acceptance(self) -> tuple[float, ...]:
        return self.sequoia.acceptance

    @property
    def budget(self) -> int:
        return self.sequoia.budget

    def __repr__(self) -> str:
        return (f"SequoiaBuilder(budget={self.budget}, depth={self.max_depth}, "
                f"mode={self.config.mode!r}, expected_tokens={self.expected_tokens:.3f})")
