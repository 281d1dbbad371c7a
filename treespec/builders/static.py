"""StaticTreeBuilder: a fixed topology given as Medusa-style path tuples of child ranks.

``(0, 1)`` is "the second child of the first child of the root". Every prefix of a choice must
itself be a choice. The topology is filled level by level: all nodes of one depth that have
children are expanded in ONE batched drafter call (q is path-dependent in general, so every
node gets its own q), and the slot of rank r below a node takes the r-th ranked token of that
node's q. Drafters whose q depends only on depth (``path_independent``) need nothing special.

Stochastic modes (also used by ``SequoiaBuilder``): ranks become draw order. A node with c
children in the topology gets c draws from its q (i.i.d. or without replacement), all kept;
the count is fixed by the topology, so the exactness constraint of trees.base holds trivially.
Only the number of children per node matters then, not the rank values.

The default topologies (``default_choices``) are Medusa-style: the ``budget - 1`` rank paths of
highest prior value Π MEDUSA_PRIOR[rank] along the path, depth <= 5 — how Medusa's
``mc_sim`` choice lists were chosen from head accuracies, with a fixed prior instead of measured
accuracies (``SequoiaBuilder`` plugs in a measured acceptance vector).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import (
    BuiltTree, DraftMode, DraftQ, check_int, check_mode, check_width, effective_mode, expand_step, finish,
    run_alone,
)

Choice = tuple[int, ...]

# Prior P(the accepted token is the drafter's rank-r candidate), used only to shape the default
# topologies. Hand-set to the usual shape of measured vectors: a dominant rank 0, a fast tail.
MEDUSA_PRIOR: tuple[float, ...] = (0.55, 0.12, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)
DEFAULT_MAX_DEPTH = 5


def validate_choices(choices: Sequence[Sequence[int]]) -> tuple[Choice, ...]:
    """Normalise path tuples and check them; returns them sorted by (depth, ranks).

    Errors: not a list of int sequences, an empty path, a negative rank, a duplicate, or a
    missing prefix.
    """
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise TypeError(f"choices must be a list of rank tuples such as [(0,), (1,), (0, 0)], "
                        f"got {type(choices).__name__}")
    norm: list[Choice] = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
            raise TypeError(f"each choice must be a tuple of child ranks, got {c!r}")
        if any(isinstance(r, bool) or not isinstance(r, int) for r in c):
            raise TypeError(f"choice {tuple(c)!r} must contain ints (child ranks)")
        norm.append(tuple(c))
    seen: set[Choice] = set()
    for c in norm:
        if len(c) == 0:
            raise ValueError("choices must not contain the empty path (the root is implicit)")
        if min(c) < 0:
            raise ValueError(f"choice {c} has a negative rank; ranks start at 0")
        if c in seen:
            raise ValueError(f"choice {c} appears twice")
        seen.add(c)
    for c in norm:
        if len(c) > 1 and c[:-1] not in seen:
            raise ValueError(f"choice {c} has no parent choice {c[:-1]}; add every prefix")
    return tuple(sorted(norm, key=lambda c: (len(c), c)))


@lru_cache(maxsize=64)
def default_choices(budget: int, max_depth: int = DEFAULT_MAX_DEPTH,
                    prior: tuple[float, ...] = MEDUSA_PRIOR) -> tuple[Choice, ...]:
    """The ``budget - 1`` rank paths of highest prior value (see module docstring)."""
    check_int("budget", budget)
    check_int("max_depth", max_depth)
    out: list[Choice] = []
    heap: list[tuple[float, int, Choice]] = [(-prior[0], 1, (0,))]
    while heap and len(out) < budget - 1:
        neg, _, c = heapq.heappop(heap)
        out.append(c)
        if len(c) < max_depth:
            heapq.heappush(heap, (neg * prior[0], len(c) + 1, c + (0,)))
        if c[-1] + 1 < len(prior):  # next sibling
            sib = c[:-1] + (c[-1] + 1,)
            heapq.heappush(heap, (neg / prior[c[-1]] * prior[c[-1] + 1], len(sib), sib))
    return validate_choices(out)


@dataclass(frozen=True)
class StaticConfig:
    """A fixed topology."""

    choices: tuple[Choice, ...]            # Medusa-style rank paths (validated, sorted)
    mode: DraftMode = "deterministic"      # how children are chosen (see trees.base)

    def __post_init__(self) -> None:
        object.__setattr__(self, "choices", validate_choices(self.choices))
        check_mode(self.mode)


class StaticTreeBuilder:
    """Fixed topology filled with ranked (or drawn) tokens; one drafter call per depth."""

    def __init__(self, choices: Sequence[Sequence[int]], mode: DraftMode = "deterministic"):
        self.config = StaticConfig(validate_choices(choices), mode)
        choices = self.config.choices
        # rank path -> its children's rank paths, in rank order (choices are sorted)
        self._kids: dict[Choice, list[Choice]] = {(): []}
        for c in choices:
            self._kids.setdefault(c, [])
            self._kids[c[:-1]].append(c)
        self._max_rank = max((c[-1] for c in choices), default=-1)
        self._max_kids = max(len(k) for k in self._kids.values())

    @classmethod
    def default(cls, budget: int = 16, mode: DraftMode = "deterministic") -> "StaticTreeBuilder":
        """A Medusa-style default topology of ``budget`` nodes (``default_choices``)."""
        return cls(default_choices(budget), mode)

    @property
    def choices(self) -> tuple[Choice, ...]:
        return self.config.choices

    @property
    def budget(self) -> int:
        return len(self.config.choices) + 1

    @property
    def max_depth(self) -> int:
        return max((len(c) for c in self.config.choices), default=0)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(N={self.budget}, depth={self.max_depth}, "
                f"mode={self.config.mode!r})")

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        return run_alone(self.grow(drafter, root_token, sampling, generator), drafter)

    def grow(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
             generator: torch.Generator | None):
        """``build`` as a generator of drafter calls (``TreeBuilder``)."""
        mode = effective_mode(self.config.mode, sampling)
        width = self._max_rank + 1 if mode == "deterministic" else self._max_kids
        check_width("the largest child rank + 1" if mode == "deterministic"
                    else "children per node", width, drafter)
        tree = PartialTree.rooted(root_token)
        rows: dict[int, DraftQ] = {}
        level: dict[Choice, int] = {(): 0}  # rank path -> partial id, one depth at a time
        calls = 0
        while level:
            inner = [(c, n) for c, n in level.items() if self._kids[c]]
            if not inner:
                break
            nodes = [n for _, n in inner]
            q, exps = yield from expand_step(drafter, tree, nodes, sampling, mode, width, generator)
            calls += 1
            rows.update(zip(nodes, q))
            nxt: dict[Choice, int] = {}
            for (c, n), exp in zip(inner, exps):
                for pos, kid in enumerate(self._kids[c]):
                    j = kid[-1] if mode == "deterministic" else pos
                    if j < len(exp.tokens):  # else: q has too small a support for this slot
                        nxt[kid] = tree.add(n, exp.tokens[j], tree.score[n] + exp.logq[j])
            level = nxt
        return finish(tree, rows, mode, calls=calls)
