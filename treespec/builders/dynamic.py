"""DynamicTreeBuilder: EAGLE-2's context-aware dynamic draft tree (Li et al. 2024).

Expansion: the root is expanded, then at each further depth the ``top_k`` newest nodes with
the highest cumulative draft log-probability (score) are expanded in ONE batched drafter call.
So there are at most ``depth`` drafter calls, whatever the budget.

Deterministic mode (EAGLE-2 as published): each expanded node proposes its ``top_k`` most likely
children; after the last depth every scored node is reranked and the best ``budget - 1`` are
kept. Ties go to the shallower, then earlier node, so a kept node's ancestors are always kept
(a child's score never exceeds its parent's).

Stochastic modes (our extension): children are draws from q, and a drawn child may not be
dropped because of its value (trees.base), so the final rerank cannot prune. The rerank moves
*before* the draws: at each depth, every slot "j-th child of expanded node u" (j < top_k) is
valued score(u) + log q_u^(j) — what the deterministic builder would score that child. The
deeper levels are simulated (EAGLE-2's expansion continued with the mean per-rank log q seen
so far), and this depth draws the slots that rank among the best ``remaining budget`` of
this depth's slots plus the simulated deeper nodes. Each node's child count is thus fixed from
q and earlier draws only; the children are then drawn (i.i.d. or without replacement) and all
kept.

Adaptive termination (``min_confidence`` > 0): no further depth is expanded once the best
frontier node's confidence exp(score) is below ``min_confidence``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import (
    BuiltTree, DraftMode, DraftQ, Expansion, check_confidence, check_int, check_mode, check_width,
    effective_mode, expand_step, finish, log_confidence, run_alone,
)


@dataclass(frozen=True)
class DynamicConfig:
    """EAGLE-2 settings."""

    budget: int = 16             # tree nodes incl. the root
    depth: int = 5               # max draft depth = max drafter calls
    top_k: int = 4               # nodes expanded per depth, and children per expanded node
    mode: DraftMode = "deterministic"   # how children are chosen (see trees.base)
    min_confidence: float = 0.0  # adaptive termination threshold on exp(score); 0 = off

    def __post_init__(self) -> None:
        for name in ("budget", "depth", "top_k"):
            check_int(name, getattr(self, name))
        check_mode(self.mode)
        check_confidence(self.min_confidence)


class DynamicTreeBuilder:
    """EAGLE-2 dynamic tree (see module docstring)."""

    def __init__(self, budget: int = 16, depth: int = 5, top_k: int = 4,
                 mode: DraftMode = "deterministic", min_confidence: float = 0.0):
        self.config = DynamicConfig(budget, depth, top_k, mode, min_confidence)

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def max_depth(self) -> int:
        return self.config.depth

    def __repr__(self) -> str:
        c = self.config
        return (f"DynamicTreeBuilder(budget={c.budget}, depth={c.depth}, top_k={c.top_k}, "
                f"mode={c.mode!r}, min_confidence={c.min_confidence})")

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        return run_alone(self.grow(drafter, root_token, sampling, generator), drafter)

    def grow(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
             generator: torch.Generator | None):
        """``build`` as a generator of drafter calls (``TreeBuilder``)."""
        cfg = self.config
        check_width("top_k", cfg.top_k, drafter)
        mode = effective_mode(cfg.mode, sampling)
        tree = PartialTree.rooted(root_token)
        rows: dict[int, DraftQ] = {}
        if cfg.budget == 1:
            return finish(tree, rows, mode)
        floor = log_confidence(cfg.min_confidence)
        frontier, calls = [0], 0
        profile: list[list[float]] = [[] for _ in range(cfg.top_k)]  # slot_logq[j] seen so far
        for level in range(1, cfg.depth + 1):
            q, exps = yield from expand_step(drafter, tree, frontier, sampling, mode, cfg.top_k, generator)
            calls += 1
            rows.update(zip(frontier, q))
            if mode == "deterministic":
                counts = [len(e.tokens) for e in exps]
            else:
                for e in exps:
                    for j, v in enumerate(e.slot_logq[: cfg.top_k]):
                        profile[j].append(v)
                counts = self._allocate(tree, frontier, exps, cfg.budget - len(tree), level, profile)
            layer = []
            for node, exp, count in zip(frontier, exps, counts):
                for tok, lq in zip(exp.tokens[:count], exp.logq[:count]):
                    layer.append(tree.add(node, tok, tree.score[node] + lq))
            if mode != "deterministic" and len(tree) >= cfg.budget:
                break
            layer.sort(key=lambda n: (-tree.score[n], n))
            frontier = layer[: cfg.top_k]
            if not frontier or tree.score[frontier[0]] < floor:
                break
        if mode != "deterministic":
            return finish(tree, rows, mode, calls=calls)
        ranked = sorted(range(1, len(tree)), key=lambda n: (-tree.score[n], tree.depth[n], n))
        keep = [0] + ranked[: cfg.budget - 1]
        return finish(tree, rows, mode, keep=keep, calls=calls)

    def _allocate(self, tree: PartialTree, frontier: list[int], exps: list[Expansion],
                  remaining: int, level: int, profile: list[list[float]]) -> list[int]:
        """Children per frontier node in stochastic modes (see the module docstring).

        The deterministic rerank would keep the ``remaining`` best nodes among this level's
        slots and everything below them. The deeper nodes do not exist yet, so they are
        simulated: EAGLE-2's expansion continues from this level's best slots with the mean
        slot profile seen so far (mean log q^(j) per rank j). This level gets the slots that
        rank among the ``remaining`` best of the union (at least one). For one node the slot
        values decrease with j and ties go to the earlier slot, so the chosen slots of each
        node are a prefix: a child count, fixed from q alone, before any draw is looked at.
        """
        cfg = self.config
        slots = sorted((-(tree.score[u] + v), i, j)
                       for i, (u, e) in enumerate(zip(frontier, exps))
                       for j, v in enumerate(e.slot_logq[: cfg.top_k]))
        mean = [sum(vs) / len(vs) for vs in profile if vs]  # -inf stays -inf
        layer = [-s for s, _, _ in slots]
        union = list(layer)
        for _ in range(level + 1, cfg.depth + 1):
            layer = sorted((v + m for v in layer[: cfg.top_k] for m in mean), reverse=True)
            union += layer
        union.sort(reverse=True)
        theta = union[remaining - 1] if len(union) >= remaining else -math.inf
        take = min(remaining, max(1, sum(1 for s, _, _ in slots if -s >= theta)))
        counts = [0] * len(frontier)
        for _, i, _ in slots[:take]:
            counts[i] += 1
        return counts
