"""ChainBuilder: a single path of up to ``budget - 1`` drafted tokens (classic speculative decoding).

``budget`` counts tree nodes with the root, as every builder's does: ``ChainBuilder(budget=5)``
drafts at most 4 tokens (gamma = 4 in Leviathan et al.); ``budget=1`` is plain decoding.

Adaptive length (``min_confidence`` > 0): the chain stops before a node whose best draft would
have confidence exp(score) below the threshold, where score is the path's cumulative draft
log-probability; with a low first draft the tree is the root alone and the step decodes one
token. The stop depends on q and the draws already taken, never on the draw it would add, so
every sampling mode stays exact (trees.base).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import (
    BuiltTree, DraftMode, DraftQ, check_confidence, check_int, check_mode, effective_mode, expand_step, finish,
    log_confidence, run_alone,
)


@dataclass(frozen=True)
class ChainConfig:
    """budget: tree nodes incl. the root (>= 1), so at most budget - 1 draft tokens per step.
    mode: how each token is chosen (see trees.base). min_confidence: stop where the path's
    confidence would fall below it (0 = always budget - 1 drafts)."""

    budget: int = 5              # tree nodes incl. the root: 4 drafts
    mode: DraftMode = "deterministic"
    min_confidence: float = 0.0

    def __post_init__(self) -> None:
        check_int("budget (chain nodes incl. the root)", self.budget)
        check_mode(self.mode)
        check_confidence(self.min_confidence)


class ChainBuilder:
    """One drafter call per token; the draft is the argmax (or one draw from q) each time.

    A chain is a tree whose nodes have one child each, so every sampling mode is trivially
    exact: the child count (1, or 0 where ``min_confidence`` stops the chain from q and the
    draws above it) never depends on the draw it counts.
    """

    def __init__(self, budget: int = 5, mode: DraftMode = "deterministic", min_confidence: float = 0.0):
        self.config = ChainConfig(budget, mode, min_confidence)

    @property
    def budget(self) -> int:
        return self.config.budget

    @property
    def max_depth(self) -> int:
        return self.config.budget - 1

    def __repr__(self) -> str:
        c = self.config
        extra = f", min_confidence={c.min_confidence}" if c.min_confidence else ""
        return f"ChainBuilder(budget={c.budget}, mode={c.mode!r}{extra})"

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        return run_alone(self.grow(drafter, root_token, sampling, generator), drafter)

    def grow(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
             generator: torch.Generator | None):
        """``build`` as a generator of drafter calls (``TreeBuilder``)."""
        mode = effective_mode(self.config.mode, sampling)
        tree = PartialTree.rooted(root_token)
        rows: dict[int, DraftQ] = {}
        floor = log_confidence(self.config.min_confidence)
        node, calls = 0, 0
        for _ in range(self.config.budget - 1):
            q, (exp,) = yield from expand_step(drafter, tree, [node], sampling, mode, 1, generator)
            calls += 1
            # slot_logq[0] = log max q: the planned value, whatever was drawn
            if not exp.tokens or tree.score[node] + exp.slot_logq[0] < floor:
                break
            rows[node] = q[0]
            node = tree.add(node, exp.tokens[0], tree.score[node] + exp.logq[0])
        # a root alone has no draft to verify: the same tree in every mode
        return finish(tree, rows, mode if rows else "deterministic", calls=calls)
