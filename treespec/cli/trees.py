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


def parse_budget(text: str) -> int | str:
    """``--budget``'s value: ``"auto"`` or a node count >= 1 (root included), else a ValueError
    in the flag's words (a command checks it before any model loads)."""
    if text == "auto":
        return text
    try:
        budget = int(text)
    except ValueError:
        budget = 0
    if budget < 1:
        raise ValueError(f"--budget must be an integer >= 1 (tree nodes incl. the root; 1 = plain decoding) "
                         f"or 'auto' (the cost model sizes the tree), got {text!r}")
    return budget


def check_tree_flags(tree: str, depth: int, top_k: int, verify: str = "token", numeric_budget: bool = True) -> None:
    """A command's tree flags (``--tree``, ``--depth``, ``--top-k-draft``, ``--verify``) checked in
    their own words before any model loads; the builders' and acceptance rules' own errors
    name their Python arguments instead (``top_k``, ``rule='traversal'``)."""
    if tree in ("dynamic", "best-first") and top_k < 1:
        raise ValueError(f"--top-k-draft must be >= 1 (children per expanded node of the {tree} tree), got {top_k}")
    if tree in ("dynamic", "best-first", "sequoia") and depth < 1:
        raise ValueError(f"--depth must be >= 1 (draft tokens on the longest path of the {tree} tree), got {depth}")
    if verify == "block" and not (tree == "chain" and numeric_budget):
        which = "--budget auto may build trees" if not numeric_budget else f"--tree {tree} branches"
        raise ValueError(f"--verify block verifies a chain (--tree chain with a --budget number), but {which}; "
                         f"use --verify traversal for trees, or --verify token")
