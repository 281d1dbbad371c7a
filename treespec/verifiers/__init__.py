"""Verification: acceptance rules (pure tensor math) and the tree-attention target pass."""

from treespec.verifiers.rejection import VERIFY_RULES, Acceptance, VerifyRule, accept

__all__ = ["Acceptance", "VERIFY_RULES", "VerifyRule", "accept"]
