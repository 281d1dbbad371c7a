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

The shape is ``treespec.planning.optimal_tree(a, budget, depth).choices``: Sequoia's dynamic
programme, exact for any vector (its recursion is written out in ``treespec.planning.tau``).

``SequoiaBuilder`` is a ``StaticTreeBuilder`` with that shape; in stochastic modes each node
draws exactly as many children as the shape gives it. ``treespec.calibrate.drafters.measure_acceptance_vector``
estimates a from real runs (it runs the engine, so it lives above it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from treespec.builders.base import DraftMode, check_int, check_mode
from treespec.planning.tau import optimal_tree, validate_acceptance
from treespec.builders.static import MEDUSA_PRIOR, Choice, StaticTreeBuilder

# Used when no measured vector is given (the Medusa-style prior of trees.static).
DEFAULT_ACCEPTANCE: tuple[float, ...] = MEDUSA_PRIOR


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
        best = optimal_tree(self.sequoia.acceptance, budget, depth)
        self.expected_tokens = best.tau
        super().__init__(best.choices, mode)

    @property
    def acceptance(self) -> tuple[float, ...]:
        return self.sequoia.acceptance

    @property
    def budget(self) -> int:
        return self.sequoia.budget

    def __repr__(self) -> str:
        return (f"SequoiaBuilder(budget={self.budget}, depth={self.max_depth}, "
                f"mode={self.config.mode!r}, expected_tokens={self.expected_tokens:.3f})")
