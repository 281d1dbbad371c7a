"""Tree builders: turn a drafter's distributions into a draft tree within a budget."""

from treespec.trees.base import BuiltTree, TreeBuilder
from treespec.trees.chain import ChainBuilder
from treespec.trees.dynamic import DynamicTreeBuilder

__all__ = ["BuiltTree", "ChainBuilder", "DynamicTreeBuilder", "TreeBuilder"]
