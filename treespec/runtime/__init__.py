"""Running speculation: the verifiers, the generation loop and the continuous-batching server.

    verifier        TreeVerifier: one target pass over a draft tree, then KV compaction
    batch_verifier  BatchVerifier: the same for many requests' trees in one ragged pass
    generator       SpeculativeGenerator (one request), ``builder="auto"``, stats, streaming
    server          SpeculativeServer (requests join and leave between steps), generate_batch
    streaming       incremental detokenisation for streamed text
"""

from treespec.runtime.batch_verifier import BatchVerifier, BatchVerifyOutput
from treespec.runtime.generator import GenerationResult, GenerationStats, SpeculativeGenerator
from treespec.runtime.server import RequestResult, SpeculativeServer, generate_batch
from treespec.runtime.verifier import TreeVerifier, VerifyOutput

__all__ = [
    "BatchVerifier", "BatchVerifyOutput", "GenerationResult", "GenerationStats", "RequestResult",
    "SpeculativeGenerator", "SpeculativeServer", "TreeVerifier", "VerifyOutput", "generate_batch",
]
