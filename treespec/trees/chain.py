"""ChainBuilder: a single path of k drafted tokens (classic speculative decoding)."""

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
class ChainConfig:
    """k: draft tokens per step (>= 1). mode: how each token is chosen (see trees.base)."""

    k: int = 4
    mode: DraftMode = "deterministic"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k (chain length) must be an int >= 1, got {self.k!r}")
        check_mode(self.mode)


class ChainBuilder:
    """One drafter call per token; the draft is the argmax (or a draw from q) each time."""

    def __init__(self, k: int = 4, mode: DraftMode = "deterministic"):
        self.config = ChainConfig(k, mode)

    @property
    def budget(self) -> int:
        return self.config.k + 1

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        mode = effective_mode(self.config.mode, sampling)
        tree = PartialTree.rooted(root_token)
        rows: dict[int, torch.Tensor] = {}
        node = 0
        for _ in range(self.config.k):
            q = draft_distribution(drafter.expand(tree, [node]), sampling)[0]
            rows[node] = q
            kids = choose_children(q, 1, mode, generator)
            if not kids:
                break
            node = tree.add(node, kids[0], tree.score[node] + log_prob(q, kids[0]))
        return finish(tree, rows, mode, calls=len(rows))
