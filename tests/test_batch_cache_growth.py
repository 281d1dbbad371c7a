"""The batch verifier's in-place cache does not grow with the number of joins and leaves: rows
that join (``add``) or leave (``retain``) replace its tensors, which the next forward adopts
into a buffer of the capacity it had (a doubling at each adoption asked for 24 GiB after a few
dozen requests of a load test)."""

from __future__ import annotations

import torch

from treespec.core.sampling import SamplingConfig
from treespec.core.tree import DraftTree
from treespec.core.tree_batch import TreeBatch
from treespec.fastpath.kvcache import GrowingLayer
from treespec.runtime.batch_verifier import BatchVerifier
from treespec.targets.loader import tiny_target


def test_joins_and_leaves_keep_the_cache_capacity_bounded() -> None:
    target = tiny_target(vocab_size=32, seed=0)
    verifier = BatchVerifier(target.model, ())
    prompt = torch.tensor([1, 2, 3, 4, 5, 6])
    verifier.prefill([prompt])
    for i in range(40):
        verifier.add([prompt])                      # a request joins ...
        trees = [DraftTree(tokens=torch.tensor([7]), parents=torch.tensor([-1]), draft_probs=None,
                           sampling="deterministic")] * verifier.batch_size
        verifier.score(TreeBatch.from_trees(trees, [SamplingConfig()] * len(trees)))
        verifier.compact([torch.tensor([0])] * verifier.batch_size)
        verifier.retain([verifier.batch_size - 1])  # ... and one leaves
    longest = max(verifier.prefix_lens)
    layers = [layer for layer in verifier.cache.layers if isinstance(layer, GrowingLayer)]
    assert layers, "the batch verifier's cache layers grow in place"
    for layer in layers:
        assert layer._capacity() <= max(2 * longest, 64), (layer._capacity(), longest)
