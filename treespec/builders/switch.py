"""SwitchBuilder: one tree shape for a switch drafter's lookup trees, another for its head trees.

A ``SwitchDrafter`` drafts each tree with either prompt lookup (free: no model pass) or its
model head (one pass per expansion). The best shape differs:

- a lookup tree costs nothing to draft, so a long one pays wherever the text is restated, up to
  the verifier's next step in cost (on the Qwen 1.5B a pass over 32 tokens costs about what one
  over 24 does);
- a head tree pays a drafter pass for each expansion, so it should stop where the passes cost
  more than the tokens they add, and stay within the rows that the target verifies at the price
  of one.

Before each tree, ``SwitchBuilder`` asks the drafter which of the two will draft it
(``SwitchDrafter.next_mode``, a function of the committed text alone) and delegates to that
builder. Exact because each delegate is: the choice of builder depends on the committed text
only, never on this tree's draws.
"""

from __future__ import annotations

import torch

from treespec.builders.base import BuiltTree, TreeBuilder, run_alone
from treespec.core.sampling import SamplingConfig
from treespec.drafters.base import Drafter


class SwitchBuilder:
    """``lookup`` builds the trees a ``SwitchDrafter`` drafts by prompt lookup, ``head`` the rest.

    Attributes:
        head, lookup:  the two builders (any ``TreeBuilder``).
        budget:        the larger of their budgets (the engine reserves that much context).
    """

    def __init__(self, head: TreeBuilder, lookup: TreeBuilder):
        for name, builder in (("head", head), ("lookup", lookup)):
            if not callable(getattr(builder, "build", None)) or not isinstance(getattr(builder, "budget", None), int):
                raise TypeError(f"{name} must be a tree builder (build(...) and an int budget), got "
                                f"{type(builder).__name__}; pass e.g. BestFirstBuilder(16)")
            if isinstance(builder, SwitchBuilder):
                raise TypeError(f"{name} must be a plain builder, not another SwitchBuilder")
        self.head, self.lookup = head, lookup

    @property
    def budget(self) -> int:
        return max(self.head.budget, self.lookup.budget)

    def __repr__(self) -> str:
        return f"SwitchBuilder(head={self.head!r}, lookup={self.lookup!r})"

    def build(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
              generator: torch.Generator | None) -> BuiltTree:
        return run_alone(self.grow(drafter, root_token, sampling, generator), drafter)

    def grow(self, drafter: Drafter, root_token: int, sampling: SamplingConfig,
             generator: torch.Generator | None):
        """``build`` as a generator of drafter calls (``TreeBuilder``): the chosen builder's."""
        builder = self._builder(drafter)
        grow = getattr(builder, "grow", None)
        if grow is None:      # a builder without grow: its build, one drafter call at a time
            return builder.build(drafter, root_token, sampling, generator)
        return (yield from grow(drafter, root_token, sampling, generator))

    def _builder(self, drafter: Drafter) -> TreeBuilder:
        next_mode = getattr(drafter, "next_mode", None)
        if next_mode is None:
            raise TypeError(f"SwitchBuilder builds the trees of a SwitchDrafter (it asks which of lookup "
                            f"and head drafts the next tree), got a {type(drafter).__name__}; use one "
                            f"builder for other drafters")
        return self.lookup if next_mode() == "lookup" else self.head
