"""treespec: tree-based speculative decoding with exact multi-branch rejection sampling."""

from importlib.metadata import PackageNotFoundError as _NotInstalled, version as _version

try:
    __version__ = _version("treespec")
except _NotInstalled:  # a source checkout on sys.path without `pip install -e .`
    __version__ = "0+unknown"

from treespec.batch import RequestAcceptance, TreeBatch, VerifyInputs, accept_batch, prepare_verify
from treespec.batch_engine import generate_batch
from treespec.analytics import acceptance_rate, expected_chain_tokens, expected_tree_tokens
from treespec.drafters import load_drafter, registered_drafters
from treespec.engine import GenerationResult, GenerationStats, SpeculativeGenerator
from treespec.models import Target, load_target
from treespec.sampling import SamplingConfig, logits_to_probs
from treespec.server import RequestResult, SpeculativeServer
from treespec.tree import DraftTree
from treespec.trees import (
    BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, StaticTreeBuilder, optimal_tree,
)
from treespec.verifiers import Acceptance, accept
from treespec.verifiers.batch_attention import BatchVerifier, BatchVerifyOutput

__all__ = [
    "Acceptance",
    "BatchVerifier",
    "BatchVerifyOutput",
    "RequestAcceptance",
    "RequestResult",
    "SpeculativeServer",
    "TreeBatch",
    "VerifyInputs",
    "accept_batch",
    "generate_batch",
    "prepare_verify",
    "BestFirstBuilder",
    "SequoiaBuilder",
    "StaticTreeBuilder",
    "optimal_tree",
    "ChainBuilder",
    "DraftTree",
    "DynamicTreeBuilder",
    "GenerationResult",
    "GenerationStats",
    "SamplingConfig",
    "SpeculativeGenerator",
    "Target",
    "accept",
    "acceptance_rate",
    "expected_chain_tokens",
    "expected_tree_tokens",
    "load_drafter",
    "load_target",
    "logits_to_probs",
    "registered_drafters",
]
