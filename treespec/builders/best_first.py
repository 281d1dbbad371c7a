"""BestFirstBuilder: SpecExec-style best-first growth (Svirschevski et al. 2024).

Deterministic mode (SpecExec): the kept set S is the ``budget - 1`` drafted nodes of highest
score (cumulative draft log-probability; ties to the shallower, then earlier node, so S is
ancestor-closed). Each round expands, in ONE batched drafter call, the best ``max_width``
unexpanded nodes of S whose children could still enter S, and adds each one's ranked children
(only those that could enter S). It stops early when no such node is left: then no undrafted
node can enter S (a child never scores above its parent, and every child of an expanded node
that could enter S was drafted), so S is exactly the best ``budget - 1`` nodes of the infinite
draft tree. ``max_rounds`` caps the drafter calls (the root's expansion is round 1).

Stochastic modes (our extension): children are draws, and a drawn child may not be dropped
because of its value (trees.base), so there is no final top-budget cut. Instead every child is
admitted *before* it is drawn, in best-first order of planning value: slot "j-th child of
expanded node u" is worth score(u) + log q_u^(j). A slot is admitted (its draw taken and kept)
while the budget lasts and its value beats the estimated best child of every unexpanded leaf,
score(leaf) + log(mean top-1 q seen so far); otherwise the round ends and the best
``max_width`` leaves are expanded. In the last round nothing is left to expand, so the best
slots fill the budget. Each child count is thus a stopping rule over slot values and earlier
draws, never the child's own draw.

Adaptive termination (``min_confidence`` > 0): nodes whose confidence exp(score) is below the
threshold are not expanded, and in stochastic modes slots below it are not admitted; growth
stops when the best candidate falls below it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import (
    BuiltTree, DraftMode, DraftQ, Expansion, check_confidence, check_int, check_mode, effective_mode,
    expand_step, finish, log_confidence, run_alone,
)


# Stochastic mode: children drawn up front per expanded node, in units of max_width (more are
# drawn on demand, continuing the same draw sequence).
DRAWS_AHEAD = 1


@dataclass(frozen=True)
class BestFirstConfig:
    """SpecExec settings."""

    budget: int = 16              # tree nodes incl. the root
    max_width: int = 8            # nodes expanded per round (one drafter call)
    max_rounds: int = 8           # drafter calls at most, the root's included
    mode: DraftMode = "deterministic"   # how children are chosen (see trees.base)
    min_confidence: float = 0.0   # adaptive termination threshold on exp(score); 0 = off
    max_depth: int | None = None  # optional depth cap (None: budget - 1)

    def __post_init__(self) -> None:
        for name in ("budget", "max_width", "max_rounds"):
            check_int(name, getattr(self, name))
        if self.max_depth is not None:
            check_int("max_depth", self.max_depth)
        check_mode(self.mode)
        check_confidence(self.min_confidence)


class BestFirstBuilder:
    """SpecExec best-first tree (see module docstring)."""

    def __init__(self, budget: int = 16, max_width: int = 8, max_rounds: int = 8,
                 mode: DraftMode = "deterministic", min_confidence: float = 0.0,
                 max_depth: int | None = None):
        self.config = BestFirstConfig(budget, max_width, max_rounds, mode, min_confidence, max_depth)

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def max_depth(self) -> int:
        c = self.config
        return min(c.budget - 1, c.max_rounds, c.max_depth if c.max_depth is not None else c.budget)

    def __repr__(self) -> str:
        c = self.config
        return (f"BestFirstBuilder(budget={c.budget}, max_width={c.max_width}, "
                f"max_rounds={c.max_rounds}, mode={c.mode!r}, min_confidence={c.min_confidence})")

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        return run_alone(self.grow(drafter, root_token, sampling, generator), drafter)

    def grow(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
             generator: torch.Generator | None):
        """``build`` as a generator of drafter calls (``TreeBuilder``)."""
        mode = effective_mode(self.config.mode, sampling)
        tree = PartialTree.rooted(root_token)
        if self.config.budget == 1:
            return finish(tree, {}, mode)
        grow = self._deterministic if mode == "deterministic" else self._stochastic
        return (yield from grow(drafter, tree, sampling, mode, generator))

    # ------------------------------------------------------------------ deterministic
    def _deterministic(self, drafter: Drafter, tree: PartialTree, sampling: SamplingConfig,
                       mode: DraftMode, generator: torch.Generator | None):
        cfg, keep = self.config, self.config.budget - 1
        floor = log_confidence(cfg.min_confidence)

        def key(n: int) -> tuple[float, int, int]:
            return (-tree.score[n], tree.depth[n], n)

        pool: list[int] = []           # drafted nodes, root excluded
        top: list[int] = []            # S: the best `keep` of the pool, best first
        expanded: set[int] = set()
        batch, rounds = [0], 0
        while batch:
            _, exps = yield from expand_step(drafter, tree, batch, sampling, mode, keep, generator)
            rounds += 1
            expanded.update(batch)
            worst = key(top[-1])[:2] if len(top) == keep else None
            for node, exp in zip(batch, exps):
                for tok, lq in zip(exp.tokens, exp.logq):  # best first
                    s = tree.score[node] + lq
                    if worst is not None and (-s, tree.depth[node] + 1) >= worst:
                        break  # neither this child nor a later sibling can enter S
                    pool.append(tree.add(node, tok, s))
            top = heapq.nsmallest(keep, pool, key=key)
            if rounds >= cfg.max_rounds:
                break
            worst = key(top[-1])[:2] if len(top) == keep else None
            batch = [n for n in top if n not in expanded and tree.depth[n] < self.max_depth
                     and tree.score[n] >= floor
                     and (worst is None or (-tree.score[n], tree.depth[n] + 1) < worst)]
            batch = batch[: cfg.max_width]  # `top` is sorted best first
        return finish(tree, {}, mode, keep=[0] + top, calls=rounds)

    # ------------------------------------------------------------------ stochastic
    def _stochastic(self, drafter: Drafter, tree: PartialTree, sampling: SamplingConfig,
                    mode: DraftMode, generator: torch.Generator | None):
        cfg = self.config
        floor = log_confidence(cfg.min_confidence)
        rows: dict[int, DraftQ] = {}
        exps: dict[int, Expansion] = {}
        slots: list[tuple[float, int, int, int]] = []  # (-value, depth, node, j): a heap
        leaves: set[int] = set()   # drafted, unexpanded, expandable nodes
        top1: list[float] = []     # top-1 draft probability of every expanded node

        def expand(batch: list[int]):
            # plan budget - 1 slots per node but draw only a few: most nodes get few children
            q, new = yield from expand_step(drafter, tree, batch, sampling, mode, cfg.budget - 1, generator,
                                            draws=min(cfg.budget - 1, DRAWS_AHEAD * cfg.max_width))
            for node, row, exp in zip(batch, q, new):
                rows[node], exps[node] = row, exp
                leaves.discard(node)
                if exp.slot_logq:
                    top1.append(math.exp(exp.slot_logq[0]))
                    push(node, 0)

        def push(node: int, j: int) -> None:
            v = tree.score[node] + exps[node].slot_logq[j]
            if v >= floor:
                heapq.heappush(slots, (-v, tree.depth[node] + 1, node, j))

        def admit(blocking: bool) -> None:
            # the best unexpanded leaf's estimated child; within one admit leaves are only
            # added (and top1 is fixed), so the bound is kept up to date incrementally
            log_top1 = math.log(sum(top1) / len(top1)) if top1 else 0.0
            bound = max((tree.score[n] for n in leaves), default=-math.inf) + log_top1
            while slots and len(tree) < cfg.budget:
                neg_v, _, node, j = slots[0]
                if blocking and -neg_v < bound:
                    return
                heapq.heappop(slots)
                exp = exps[node]
                if j >= len(exp.tokens):  # the next draws of this node, decided before seen
                    exp = exps[node] = exp.extended(rows[node], len(exp.tokens), mode, generator)
                    if j >= len(exp.tokens):  # no draw left (support exhausted)
                        continue
                child = tree.add(node, exp.tokens[j], tree.score[node] + exp.logq[j])
                if tree.depth[child] < self.max_depth and tree.score[child] >= floor:
                    leaves.add(child)
                    bound = max(bound, tree.score[child] + log_top1)
                if j + 1 < len(exp.slot_logq):
                    push(node, j + 1)

        yield from expand([0])
        rounds = 1
        while True:
            more = rounds < cfg.max_rounds
            admit(blocking=more)
            if len(tree) >= cfg.budget or not more or not leaves:
                break
            batch = sorted(leaves, key=lambda n: (-tree.score[n], n))[: cfg.max_width]
            yield from expand(batch)
            rounds += 1
        return finish(tree, rows, mode, calls=rounds)
