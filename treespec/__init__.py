"""treespec: tree-based speculative decoding with exact multi-branch rejection sampling."""

from treespec.analytics import acceptance_rate, expected_chain_tokens, expected_tree_tokens
from treespec.sampling import SamplingConfig, logits_to_probs
from treespec.tree import DraftTree
from treespec.verifiers import Acceptance, accept

__all__ = [
    "Acceptance",
    "DraftTree",
    "SamplingConfig",
    "accept",
    "acceptance_rate",
    "expected_chain_tokens",
    "expected_tree_tokens",
    "logits_to_probs",
]
