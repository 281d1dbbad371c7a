"""ChainBuilder: a single path of k drafted tokens (classic speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.sampling import SamplingConfig
from treespec.trees.base import (
    BuiltTree, DraftMode, DraftQ, check_int, check_mode, effective_mode, expand_step, finish, run_alone,
)


@dataclass(frozen=True)
class ChainConfig:
    """k: draft tokens per step (>= 1). mode: how each token is chosen (see trees.base)."""

    k: int = 4
    mode: DraftMode = "deterministic"

    def __post_init__(self) -> None:
        check_int("k (chain length)", self.k)
        check_mode(self.mode)


class ChainBuilder:
    """One drafter call per token; the draft is the argmax (or one draw from q) each time.

    A chain is a tree whose nodes have one child each, so every sampling mode is trivially
    exact: the child count (1) never depends on the draw.
    """

    def __init__(self, k: int = 4, mode: DraftMode = "deterministic"):
        self.config = ChainConfig(k, mode)

    @property
    def budget(self) -> int:
        return self.config.k + 1

    @property
    def max_depth(self) -> int:
        return self.config.k

    def __repr__(self) -> str:
        return f"ChainBuilder(k={self.config.k}, mode={self.config.mode!r})"

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        return run_alone(self.grow(drafter, root_token, sampling, generator), drafter)

    def grow(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
             generator: torch.Generator | None):
        """``build`` as a generator of drafter calls (``TreeBuilder``)."""
        mode = effective_mode(self.config.mode, sampling)
        tree = PartialTree.rooted(root_token)
        rows: dict[int, DraftQ] = {}
        node = 0
        for _ in range(self.config.k):
            q, (exp,) = yield from expand_step(drafter, tree, [node], sampling, mode, 1, generator)
            rows[node] = q[0]
            if not exp.tokens:
                break
            node = tree.add(node, exp.tokens[0], tree.score[node] + exp.logq[0])
        return finish(tree, rows, mode, calls=len(rows))
