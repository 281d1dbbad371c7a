"""DynamicTreeBuilder: EAGLE-2's context-aware dynamic draft tree.

Expansion: the root is expanded, then at each further depth the ``top_k`` frontier nodes with
the highest cumulative draft log-probability (score) are expanded in ONE batched drafter call,
each proposing its ``top_k`` most likely children. Rerank: after the last depth, the best
``budget - 1`` scored nodes are kept (ties go to the shallower, then earlier node, so a kept
node's ancestors are always kept: a child's score never exceeds its parent's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.sampling import SamplingConfig
from treespec.trees.base import (
    BuiltTree, DraftMode, check_mode, choose_children, draft_distribution, effective_mode,
    finish, log_prob,
)


@dataclass(frozen=True)
class DynamicConfig:
    """budget: tree nodes incl. the root; depth: max draft depth; top_k: nodes expanded per
    depth and children per expanded node; mode: see trees.base."""

    budget: int = 16
    depth: int = 5
    top_k: int = 4
    mode: DraftMode = "deterministic"

    def __post_init__(self) -> None:
        for name in ("budget", "depth", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        check_mode(self.mode)


class DynamicTreeBuilder:
    """EAGLE-2 dynamic tree (see module docstring)."""

    def __init__(self, budget: int = 16, depth: int = 5, top_k: int = 4,
                 mode: DraftMode = "deterministic"):
        self.config = DynamicConfig(budget, depth, top_k, mode)

    @property
    def budget(self) -> int:
        return self.config.budget

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        cfg = self.config
        mode = effective_mode(cfg.mode, sampling)
        if mode != "deterministic":
            raise NotImplementedError("stochastic dynamic trees arrive with the full builder set")
        tree = PartialTree.rooted(root_token)
        rows: dict[int, torch.Tensor] = {}
        frontier, calls = [0], 0
        if cfg.budget > 1:
            for _ in range(cfg.depth):
                q = draft_distribution(drafter.expand(tree, frontier), sampling)
                calls += 1
                layer = []
                for row, node in enumerate(frontier):
                    rows[node] = q[row]
                    for tok in choose_children(q[row], cfg.top_k, mode, generator):
                        layer.append(tree.add(node, tok, tree.score[node] + log_prob(q[row], tok)))
                layer.sort(key=lambda n: (-tree.score[n], n))
                frontier = layer[: cfg.top_k]
                if not frontier:
                    break
        ranked = sorted(range(1, len(tree)), key=lambda n: (-tree.score[n], tree.depth[n], n))
        keep = [0] + ranked[: cfg.budget - 1]
        return finish(tree, rows, mode, keep=keep, calls=calls)
