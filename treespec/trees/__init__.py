"""Tree builders: turn a drafter's distributions into a draft tree within a budget.

Every builder drives every drafter (``build(drafter, root_token, sampling, generator)``) and has
a ``budget`` (max tree nodes, root included) and a ``max_depth``. All but the deterministic-only
settings take ``mode`` = "deterministic" | "with_replacement" | "without_replacement".
"""

from treespec.trees.base import BuiltTree, TreeBuilder, draw_children
from treespec.trees.best_first import BestFirstBuilder
from treespec.trees.chain import ChainBuilder
from treespec.trees.dynamic import DynamicTreeBuilder
from treespec.trees.sequoia import SequoiaBuilder, measure_acceptance_vector, optimal_tree
from treespec.trees.static import StaticTreeBuilder, default_choices

__all__ = [
    "BestFirstBuilder", "BuiltTree", "ChainBuilder", "DynamicTreeBuilder", "SequoiaBuilder",
    "StaticTreeBuilder", "TreeBuilder", "default_choices", "draw_children",
    "measure_acceptance_vector", "optimal_tree",
]
