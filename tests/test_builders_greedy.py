"""Greedy equivalence on the real model: every builder reproduces HF ``generate`` token for token.

SmolLM2-135M target, the "early-exit" drafter, 3 MT-bench prompts x 32 tokens per builder.
Marked slow (a real model on CPU); the engine's own test covers 5 prompts x 64 tokens.
"""

from __future__ import annotations

import pytest
import torch

from treespec import SpeculativeGenerator, load_drafter
from treespec.builders import (
    BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, StaticTreeBuilder,
)

from _engine_helpers import hf_greedy

BUILDERS = {
    "chain": lambda: ChainBuilder(budget=5),
    "static": lambda: StaticTreeBuilder.default(16),
    "dynamic": lambda: DynamicTreeBuilder(16, 5, 4),
    "best_first": lambda: BestFirstBuilder(16, max_width=4, max_rounds=5),
    "sequoia": lambda: SequoiaBuilder(16, 5),
}
MAX_NEW = 32


@pytest.fixture(scope="module")
def smollm():
    from treespec.targets.loader import load_target

    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def references(smollm):
    """(prompt ids, HF greedy continuation) for 3 MT-bench prompts."""
    from treespec.data import chat_prompt, mtbench_questions

    out = []
    for q in mtbench_questions()[:3]:
        ids = torch.tensor(chat_prompt(smollm.tokenizer, q.turns[0]))
        out.append((ids, hf_greedy(smollm.model, ids, smollm.eos_token_ids, MAX_NEW)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_greedy_equals_hf_generate(name, smollm, references) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = SpeculativeGenerator(smollm, load_drafter("early-exit", smollm), BUILDERS[name]())
        for ids, ref in references:
            out = gen.generate(ids, max_new_tokens=MAX_NEW, temperature=0.0)
            assert out.token_ids.tolist() == ref, f"{name}: differs from HF greedy"
    finally:
        torch.set_num_threads(before)
