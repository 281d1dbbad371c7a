"""Tree builders by name and size, as every command (and ``treespec bench``) takes them."""

from __future__ import annotations

BUILDERS = ("dynamic", "chain", "static", "best-first", "sequoia")


ADAPTIVE = ("chain", "dynamic", "best-first")   # the builders with min_confidence


def make_builder(name: str, budget: int, depth: int, top_k: int, mode: str = "deterministic",
                 acceptance=None, min_confidence: float = 0.0):
    """A tree builder from CLI-style arguments (budget counts nodes incl. the root).
    ``acceptance``: Sequoia's positional acceptance vector (None: its default).
    ``min_confidence``: adaptive termination (chain, dynamic, best-first; 0 = off)."""
    from treespec import builders as trees

    if min_confidence and name not in ADAPTIVE:
        raise ValueError(f"min_confidence is an option of the {', '.join(ADAPTIVE)} builders, not {name!r}")
    if name == "chain":
        return trees.ChainBuilder(budget=budget, mode=mode, min_confidence=min_confidence)
    if name == "dynamic":
        return trees.DynamicTreeBuilder(budget=budget, depth=depth, top_k=top_k, mode=mode,
                                        min_confidence=min_confidence)
    if name == "best-first":
        return trees.BestFirstBuilder(budget=budget, max_width=top_k, mode=mode, max_depth=depth,
                                      min_confidence=min_confidence)
    if name == "sequoia":
        return trees.SequoiaBuilder(budget=budget, depth=depth, mode=mode, acceptance=acceptance)
    if name == "static":
        return trees.StaticTreeBuilder.default(budget, mode=mode)
    raise ValueError(f"unknown tree builder {name!r}; choose from {BUILDERS}")
