"""The exact core: draft trees, masks, sampling and the acceptance rules. Pure tensor math.

    tree         DraftTree: parent pointers; derived depth, ancestor mask, paths
    masks        ancestor masks, HF 4-D additive masks with a prefix, bit-packed ragged masks
    sampling     SamplingConfig and logits -> probabilities (temperature, top-k, top-p)
    acceptance   the Acceptance record and the rule names every rule shares
    rejection    token-level multi-branch rejection sampling (``accept``)
    joint        sequence-level rules: block verification (chains), traversal (trees)
    tree_batch   many requests' trees in one CSR batch; the batched verify inputs and accept

Nothing here imports a model, a drafter or another treespec package.
"""

from treespec.core.acceptance import VERIFY_RULES, Acceptance, VerifyRule
from treespec.core.rejection import accept
from treespec.core.sampling import SamplingConfig, logits_to_probs
from treespec.core.tree import DraftTree
from treespec.core.tree_batch import RequestAcceptance, TreeBatch, VerifyInputs, accept_batch, prepare_verify

__all__ = [
    "VERIFY_RULES", "Acceptance", "DraftTree", "RequestAcceptance", "SamplingConfig", "TreeBatch", "VerifyInputs",
    "VerifyRule", "accept", "accept_batch", "logits_to_probs", "prepare_verify",
]
