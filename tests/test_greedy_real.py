"""Greedy equivalence on the real model: at temperature 0, speculative decoding with SmolLM2-135M
(fp32, on each packed fast path of ``treespec.fastpath.packing``: the panel GEMM and oneDNN) and its early-exit drafter emits exactly
the tokens of ``model.generate(do_sample=False)`` on the stock HF model. The amx path, a target of
its own, is checked against its own plain loop instead (the last test).

Five MT-bench first turns (writing, roleplay, reasoning, math, coding), through the chat template
(``SpeculativeGenerator.encode``), 64 new tokens, two configurations: a chain with the default
early-exit drafter (7 of 30 layers: it agrees with the target on ~2% of tokens, so this checks
the all-rejected path) and the EAGLE-2 dynamic tree with a 20-layer early exit (drafts accepted
up to depth 3 or more, so KV compaction of real accepted paths is checked). The HF
reference runs with an explicit, neutral generation config and checks that its processed scores
equal its raw logits, i.e. no hidden logits processor applied; it stops at EOS and includes it,
as the engine does.

A divergence is tolerated only at a genuine near-tie: the top-2 logit gap of a plain forward over
the common prefix must be < 1e-4 there (batched tree attention and sequential decoding round
differently in the last bits); the test then says so with a warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator, load_drafter, load_target
from treespec.data import mtbench_questions
from treespec.fastpath.packing import KERNELS, PANEL_KERNELS, packing_available
from treespec.fastpath.kernels import amx_status, panel_status

from _engine_helpers import hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
QUESTIONS = (0, 10, 20, 30, 40)  # first question of five categories, file order
NEAR_TIE = 1e-4
# name -> (builder, early-exit layers; None = the registered default)
CONFIGS = {
    "chain-early-exit": (lambda: ChainBuilder(budget=3), None),
    "dynamic-early-exit-20": (lambda: DynamicTreeBuilder(budget=16, depth=5, top_k=4), 20),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on the shared 2-core box a 2-thread forward of this model is up to
    ~18x slower when the other core is busy (OpenMP workers spin waiting for each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=[k for k in KERNELS if k != "amx"])
def target(request, one_thread):
    """The engine's target: fp32 on each packed fast path (the panel GEMM, the default on AVX2
    CPUs, and oneDNN), which must stay exact. Not the amx path: it rounds each linear input to
    bf16, a target of its own (test_amx_greedy_equals_its_plain_loop)."""
    kernel = request.param
    available, why = panel_status() if kernel in PANEL_KERNELS else (packing_available(), "no oneDNN packing")
    if not available:
        pytest.skip(f"{kernel} kernel not available here: {why}")
    target = load_target("smollm2-135m", dtype=torch.float32, pack=kernel)
    assert target.speed_path.split("linear layers: ")[1].startswith(kernel), target.speed_path
    return target


@pytest.fixture(scope="module")
def stock(one_thread):
    """The reference: the same fp32 weights with HF's stock linear layers."""
    return load_target("smollm2-135m", dtype=torch.float32, pack=False)


@pytest.fixture(scope="module")
def prompts(target) -> list[torch.Tensor]:
    encoder = SpeculativeGenerator(target, "target")
    questions = mtbench_questions()
    return [encoder.encode(questions[i].turns[0]) for i in QUESTIONS]


@pytest.fixture(scope="module")
def references(stock, prompts) -> list[list[int]]:
    return [hf_greedy(stock.model, ids, stock.eos_token_ids, NEW_TOKENS) for ids in prompts]


def top2_gap(model, tokens: list[int]) -> tuple[float, list[int]]:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), top.indices.tolist()


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_hf_generate(target, stock, prompts, references, config) -> None:
    make_builder, layers = CONFIGS[config]
    drafter = "early-exit" if layers is None else load_drafter("early-exit", target, num_layers=layers)
    gen = SpeculativeGenerator(target, drafter, make_builder())
    accepted = 0
    for q, ids, ref in zip(QUESTIONS, prompts, references):
        res = gen.generate(ids, NEW_TOKENS, temperature=0.0)
        out = res.token_ids.tolist()
        accepted += sum(res.stats.depth_accepts)
        print(f"question {q} {config}: tau {res.stats.tau:.2f}, acceptance by depth "
              f"{[round(a, 2) for a in res.stats.depth_acceptance]}")
        if out == ref:
            continue
        j = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        assert j is not None, (f"question {q}: outputs agree on {min(len(out), len(ref))} tokens "
                               f"but have lengths {len(out)} (engine) and {len(ref)} (HF)")
        gap, top = top2_gap(stock.model, ids.tolist() + ref[:j])
        assert gap < NEAR_TIE and {out[j], ref[j]} == set(top), (
            f"question {q}: {config} diverges from HF greedy at new token {j} "
            f"(engine {out[j]}, HF {ref[j]}), not a near-tie: top-2 logit gap {gap:.3g}, top-2 {top}"
        )
        warnings.warn(f"question {q}: {config} diverged at token {j} at a near-tie "
                      f"(top-2 logit gap {gap:.2e}); the rest of that output was not compared")
    if layers is not None:  # the deep early exit gets drafts accepted: that path was exercised
        assert accepted > 20, accepted


def test_amx_greedy_equals_its_plain_loop(one_thread) -> None:
    """The amx path (``pack="amx"``: linear inputs rounded to bf16) is a target of its own, whose
    reference is treespec's plain loop on the same path (HF ``generate`` scores the prompt's last
    token inside the prompt's pass, so it may differ). Its tree rows are the bits of one-token
    steps (row attention), so the shipped eagle3 on a chain and on a deep dynamic tree must emit
    that loop's tokens exactly: no near-tie allowance. Every fourth MT-bench question: with
    grouped SDPA in place of row attention the dynamic tree left plain decoding on 3 of these 20
    (a scratch check), so the test can see that regression."""
    ok, why = amx_status()
    if not ok:
        pytest.skip(why)
    target = load_target("smollm2-135m", dtype=torch.float32, pack="amx")
    eagle3 = load_drafter("eagle3", target)
    plain = SpeculativeGenerator(target, eagle3, DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    trees = {"chain": SpeculativeGenerator(target, eagle3, ChainBuilder(budget=4)),
             "dynamic": SpeculativeGenerator(target, eagle3, DynamicTreeBuilder(budget=16, depth=5, top_k=4))}
    questions = mtbench_questions()
    accepted = 0
    for q in range(0, len(questions), 4):
        ids = plain.encode(questions[q].turns[0])
        ref = plain.generate(ids, NEW_TOKENS, temperature=0.0).token_ids.tolist()
        for name, gen in trees.items():
            res = gen.generate(ids, NEW_TOKENS, temperature=0.0)
            accepted += sum(res.stats.depth_accepts)
            assert res.token_ids.tolist() == ref, f"question {q}: {name} left the amx plain loop's tokens"
    assert accepted > 40, accepted   # drafts were accepted: compacted real paths were checked
