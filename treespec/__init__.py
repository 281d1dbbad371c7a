"""treespec: tree-based speculative decoding with exact multi-branch rejection sampling."""

from importlib.metadata import PackageNotFoundError as _NotInstalled, version as _version

try:
    __version__ = _version("treespec")
except _NotInstalled:  # a source checkout on sys.path without `pip install -e .`
    __version__ = "0+unknown"

from treespec.builders import (
    BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, StaticTreeBuilder, SwitchBuilder,
)
from treespec.core import (
    Acceptance, DraftTree, RequestAcceptance, SamplingConfig, TreeBatch, VerifyInputs, accept, accept_batch,
    logits_to_probs, prepare_verify,
)
from treespec.drafters import load_drafter, registered_drafters
from treespec.planning.tau import acceptance_rate, expected_chain_tokens, expected_tree_tokens, optimal_tree
from treespec.runtime import (
    BatchVerifier, BatchVerifyOutput, GenerationResult, GenerationStats, RequestResult, SpeculativeGenerator,
    SpeculativeServer, generate_batch,
)
from treespec.runtime.bench import sequoia_builder   # Sequoia shaped by this machine's calibrated vector
from treespec.targets import Target, load_target

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
    "SwitchBuilder",
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
    "sequoia_builder",
]
