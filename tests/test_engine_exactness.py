"""Sampling exactness end to end: SpeculativeGenerator's output law equals the target's.

Target: a 1-layer, hidden-16 Llama with V = 8 and large random weights (a peaked,
context-dependent law), EOS disabled. Drafter: a *different* model, the target's logits plus a
fixed random perturbation per context (``NoisyTargetDrafter``), so drafts are often but not
always accepted.

For each configuration we compute the exact law of the first 3 generated tokens (8^3 sequences)
from the target's processed probabilities (``treespec.core.sampling.process``, one plain forward over
all 64 two-token extensions of the prompt) and run a chi-square goodness-of-fit test on 10^4
seeded generations. Cells whose expected count is below 5 are pooled; a sample in a cell of
probability 0 (cut by top-p) fails at once.

Cost: ~3-4 ms of CPU per generation (1-2 target forwards), so the 10^4-sample cases take
~40 s of CPU each and are marked slow; the fast suite runs one case with fewer samples.
Covered: chain and EAGLE-2 dynamic trees (deterministic rule), an i.i.d. chain (stochastic
rule), T = 1 and T = 0.7 with top-p 0.8, prompts of one token (empty prefix) and two.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.core.sampling import SamplingConfig, process

from _engine_helpers import NoisyTargetDrafter, one_thread, peaky_target  # noqa: F401

V = 8
HORIZON = 3
SAMPLES = 10_000
SMOKE_SAMPLES = 1_000
P_MIN = 1e-3
MIN_EXPECTED = 5.0

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return peaky_target(V, seed=1, std=0.3)


def exact_law(model, prompt: list[int], sampling: SamplingConfig) -> np.ndarray:
    """float64[V, V, V]: P(x1, x2, x3 | prompt) under plain autoregressive sampling."""
    ext = torch.cartesian_prod(torch.arange(V), torch.arange(V))  # [V^2, 2]
    ids = torch.cat([torch.tensor(prompt).expand(V * V, -1), ext], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.double()  # [V^2, P + 2, V]
    p = len(prompt)
    p1 = process(logits[0, p - 1], sampling)  # [V]
    p2 = process(logits[::V, p], sampling)  # [V, V]   row x1
    p3 = process(logits[:, p + 1], sampling).view(V, V, V)  # [x1, x2, V]
    law = p1[:, None, None] * p2[:, :, None] * p3
    return law.numpy()


def pooled_chisquare(counts: np.ndarray, law: np.ndarray) -> tuple[float, int]:
    """(p-value, cells) of a chi-square test, pooling the cells with expected count < 5."""
    counts, law = counts.ravel().astype(np.float64), law.ravel()
    n = counts.sum()
    zero = law <= 0
    assert counts[zero].sum() == 0, (
        f"{int(counts[zero].sum())} samples in cells of probability 0: "
        f"{np.flatnonzero(zero & (counts > 0))[:10]}"
    )
    expected = law[~zero] * n
    observed = counts[~zero]
    order = np.argsort(expected)
    expected, observed = expected[order], observed[order]
    # Pool the smallest cells until the pool's expected count reaches MIN_EXPECTED.
    cut = int(np.searchsorted(expected, MIN_EXPECTED))
    while cut < len(expected) and 0 < expected[:cut].sum() < MIN_EXPECTED:
        cut += 1
    if cut > 0:
        expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
        observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
    expected *= n / expected.sum()  # float round-off of the law's total
    return float(chisquare(observed, expected).pvalue), len(expected)


def sample_counts(gen: SpeculativeGenerator, prompt: list[int], sampling: SamplingConfig,
                  samples: int, seed0: int) -> tuple[np.ndarray, int, int, int]:
    """Counts[V, V, V] of the first 3 tokens of ``samples`` seeded runs, plus target forwards
    and draft (attempts, accepts) summed over the runs."""
    counts = np.zeros((V,) * HORIZON, dtype=np.int64)
    steps = attempts = accepts = 0
    for i in range(samples):
        r = gen.generate(prompt, HORIZON, temperature=sampling.temperature, top_k=sampling.top_k,
                         top_p=sampling.top_p, seed=seed0 + i)
        toks = r.token_ids.tolist()
        assert len(toks) == HORIZON
        counts[tuple(toks)] += 1
        steps += r.stats.steps
        attempts += sum(r.stats.depth_attempts)
        accepts += sum(r.stats.depth_accepts)
    return counts, steps, attempts, accepts


def assert_follows_law(gen: SpeculativeGenerator, prompt: list[int], sampling: SamplingConfig, samples: int,
                       seed0: int) -> np.ndarray:
    """Sample ``samples`` seeded runs of ``gen``; assert drafts were both accepted and rejected
    and the first tokens pass the chi-square test against the target's exact law. -> counts."""
    law = exact_law(gen.target.model, prompt, sampling)
    counts, _, attempts, accepts = sample_counts(gen, prompt, sampling, samples, seed0)
    assert 0 < accepts < attempts, (accepts, attempts)
    pvalue, cells = pooled_chisquare(counts, law)
    assert pvalue > P_MIN, f"chi-square p = {pvalue:.2e} over {cells} cells"
    return counts


BUILDERS = {
    "chain": lambda: ChainBuilder(budget=3),
    "chain_iid": lambda: ChainBuilder(budget=3, mode="with_replacement"),
    "dynamic": lambda: DynamicTreeBuilder(budget=10, depth=2, top_k=3),
}
SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.7_top_p0.8": SamplingConfig(temperature=0.7, top_p=0.8),
}
# (builder, sampling, prompt): a one-token prompt has an empty prefix (nothing to prefill).
CASES = [
    ("chain", "T1", [5]),
    ("chain", "T0.7_top_p0.8", [5, 1]),
    ("dynamic", "T1", [5, 1]),
    ("dynamic", "T0.7_top_p0.8", [5]),
    ("chain_iid", "T0.7_top_p0.8", [5]),  # stochastic rule: children drawn from q
]


def check_law(target, builder_name: str, sampling_name: str, prompt: list[int], samples: int,
              seed0: int) -> None:
    sampling = SAMPLINGS[sampling_name]
    drafter = NoisyTargetDrafter(target.model, noise=0.5, seed=1)
    gen = SpeculativeGenerator(target, drafter, BUILDERS[builder_name]())
    law = exact_law(target.model, prompt, sampling)
    assert abs(law.sum() - 1.0) < 1e-9
    counts, steps, attempts, accepts = sample_counts(gen, prompt, sampling, samples, seed0)
    # Drafts are both accepted and rejected, so both branches of the rule are exercised.
    assert 0 < accepts < attempts, (accepts, attempts)
    assert steps < samples * HORIZON
    pvalue, cells = pooled_chisquare(counts, law)
    assert pvalue > P_MIN, (f"chi-square p = {pvalue:.2e} over {cells} cells: the output law of "
                            f"{builder_name} at {sampling_name} differs from the target's")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[f"{b}-{s}-P{len(p)}" for b, s, p in CASES])
def test_first_tokens_follow_the_target_law(target, case) -> None:
    builder_name, sampling_name, prompt = case
    check_law(target, builder_name, sampling_name, prompt, SAMPLES,
              seed0=1_000_000 * (1 + CASES.index(case)))


def test_first_tokens_follow_the_target_law_smoke(target) -> None:
    """A quick version (fewer samples) for the fast suite: catches gross errors only."""
    check_law(target, "dynamic", "T0.7_top_p0.8", [5, 1], SMOKE_SAMPLES, seed0=0)


def test_pooled_chisquare_detects_a_wrong_law(target) -> None:
    """The test has power at SAMPLES: a plausible bug (temperature 0.9 applied instead of 1,
    TVD ~0.05 on this target) is rejected, the right law is not."""
    rng = np.random.default_rng(0)
    law = exact_law(target.model, [5], SAMPLINGS["T1"])
    wrong = exact_law(target.model, [5], SamplingConfig(temperature=0.9))
    good = rng.multinomial(SAMPLES, law.ravel()).reshape(law.shape)
    bad = rng.multinomial(SAMPLES, wrong.ravel()).reshape(law.shape)
    assert pooled_chisquare(good, law)[0] > P_MIN
    assert pooled_chisquare(bad, law)[0] < P_MIN
    top_p_law = exact_law(target.model, [5], SAMPLINGS["T0.7_top_p0.8"])
    zero_cell = np.unravel_index(np.argmin(top_p_law), law.shape)
    counts = rng.multinomial(SAMPLES, top_p_law.ravel()).reshape(law.shape)
    counts[zero_cell] += 1
    with pytest.raises(AssertionError, match="probability 0"):
        pooled_chisquare(counts, top_p_law)
