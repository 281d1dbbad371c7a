"""Block and traversal verification end to end: SpeculativeGenerator's output law is the target's.

The setting of tests/test_engine_exactness.py (tiny peaked Llama, V = 8, a noisy copy of the
target as drafter, exact law of the first 3 tokens, pooled chi-square on seeded generations),
with the acceptance rule passed to the engine (``verify=``). Chains for block verification
(argmax drafts and i.i.d. draws), EAGLE-2 dynamic trees for traversal verification in all three
draft modes. The 10^4-sample cases are slow; the fast suite runs one case with 10^3.
"""

from __future__ import annotations

import pytest

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator

from _engine_helpers import NoisyTargetDrafter, one_thread, peaky_target  # noqa: F401
from test_engine_exactness import (
    HORIZON, P_MIN, SAMPLES, SAMPLINGS, SMOKE_SAMPLES, V, exact_law, pooled_chisquare, sample_counts,
)

pytestmark = pytest.mark.usefixtures("one_thread")

BUILDERS = {
    "chain": lambda: ChainBuilder(budget=3),
    "chain_iid": lambda: ChainBuilder(budget=3, mode="with_replacement"),
    "dynamic": lambda: DynamicTreeBuilder(budget=10, depth=2, top_k=3),
    "dynamic_iid": lambda: DynamicTreeBuilder(budget=10, depth=2, top_k=3, mode="with_replacement"),
    "dynamic_wor": lambda: DynamicTreeBuilder(budget=10, depth=2, top_k=3, mode="without_replacement"),
}
CASES = [  # (rule, builder, sampling, prompt)
    ("block", "chain", "T1", [5]),
    ("block", "chain_iid", "T0.7_top_p0.8", [5, 1]),
    ("traversal", "dynamic", "T1", [5, 1]),
    ("traversal", "dynamic_iid", "T1", [5]),
    ("traversal", "dynamic_wor", "T0.7_top_p0.8", [5]),
]


@pytest.fixture(scope="module")
def target():
    return peaky_target(V, seed=1, std=0.3)


def check_law(target, rule: str, builder: str, sampling_name: str, prompt: list[int], samples: int,
              seed0: int) -> None:
    sampling = SAMPLINGS[sampling_name]
    drafter = NoisyTargetDrafter(target.model, noise=0.5, seed=1)
    gen = SpeculativeGenerator(target, drafter, BUILDERS[builder](), verify=rule)
    law = exact_law(target.model, prompt, sampling)
    counts, steps, attempts, accepts = sample_counts(gen, prompt, sampling, samples, seed0)
    assert 0 < accepts < attempts, (accepts, attempts)  # both branches exercised
    assert steps < samples * HORIZON
    pvalue, cells = pooled_chisquare(counts, law)
    assert pvalue > P_MIN, (f"chi-square p = {pvalue:.2e} over {cells} cells: {rule} verification of "
                            f"{builder} trees at {sampling_name} does not reproduce the target's law")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{r}-{b}-{s}-P{len(p)}" for r, b, s, p in CASES])
def test_first_tokens_follow_the_target_law(target, case) -> None:
    check_law(target, *case, SAMPLES, seed0=7_000_000 * (1 + CASES.index(case)))


def test_first_tokens_follow_the_target_law_smoke(target) -> None:
    check_law(target, "traversal", "dynamic_wor", "T0.7_top_p0.8", [5, 1], SMOKE_SAMPLES, seed0=0)
