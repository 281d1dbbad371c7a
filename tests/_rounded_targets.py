"""Checks shared by the targets whose linear layers round their inputs (``kernel="amx"``: bf16,
``kernel="x8"``: 8-bit integers): with row attention, a tree's rows are the bits of one-token
steps, so greedy speculation emits plain decoding's tokens on the same path.

- ``rounded_copy``: a ``quantized_llama``-style stock model packed on a rounding kernel, on row
  attention (as ``load_target(..., pack=kernel)`` sets it up).
- ``assert_chain_rows_are_one_token_steps``: each node of a chain scored in one tree pass against
  the one-token step after the verifier committed its ancestors, bit for bit.
- ``assert_greedy_speculation_is_plain``: greedy trees and chains against plain decoding on
  ``target`` (eager or compiled passes), token for token.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from treespec import SpeculativeGenerator
from treespec.builders import ChainBuilder, DynamicTreeBuilder
from treespec.core.sampling import SamplingConfig
from treespec.core.tree import DraftTree
from treespec.fastpath.attention import use_row_attention
from treespec.fastpath.packing import pack_linears
from treespec.runtime.verifier import TreeVerifier

from _engine_helpers import NoisyTargetDrafter


def rounded_copy(stock: nn.Module, kernel: str) -> nn.Module:
    packed = copy.deepcopy(stock)
    pack_linears(packed, kernel=kernel)
    assert use_row_attention(packed)[0]
    return packed


def assert_chain_rows_are_one_token_steps(model: nn.Module, passes=None) -> None:
    """``passes``: the model's compiled passes (``CompiledPasses``), else eager passes."""
    prefix = torch.tensor([5, 17, 200, 42, 7, 99, 3])
    chain = [11, 23, 57, 101]
    sampling = SamplingConfig(temperature=1.0)
    tree = DraftTree(torch.tensor(chain), torch.tensor([-1, 0, 1, 2]), sampling="deterministic")
    v = TreeVerifier(model, sampling, passes=passes)
    v.prefill(prefix)
    together = v.score(tree).probs
    step = TreeVerifier(model, sampling, passes=passes)
    step.prefill(prefix)
    for i, token in enumerate(chain):
        alone = step.score(DraftTree(torch.tensor([token]), torch.tensor([-1]), sampling="deterministic")).probs
        assert torch.equal(alone[0], together[i]), i
        step.compact(torch.zeros(1, dtype=torch.long))


def assert_greedy_speculation_is_plain(target, stock: nn.Module, max_new_tokens: int = 40,
                                       trees=(DynamicTreeBuilder(budget=16, depth=4, top_k=3),
                                              ChainBuilder(budget=5))) -> None:
    """``target`` runs the rounded model; its drafter is a noisy copy of ``stock`` (some drafts
    accepted, some not)."""
    ids = torch.tensor([5, 17, 200, 42, 7])

    def run(builder):
        drafter = NoisyTargetDrafter(copy.deepcopy(stock), noise=0.5, seed=1)
        return SpeculativeGenerator(target, drafter, builder).generate(ids, max_new_tokens=max_new_tokens,
                                                                       temperature=0.0).token_ids.tolist()

    plain = run(DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    assert len(plain) >= 10
    for builder in trees:
        assert run(builder) == plain, builder
