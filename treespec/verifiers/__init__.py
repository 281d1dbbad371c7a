"""Verification: acceptance rules (pure tensor math) and the tree-attention target pass."""

from treespec.verifiers.rejection import Acceptance, accept

__all__ = ["Acceptance", "accept"]
