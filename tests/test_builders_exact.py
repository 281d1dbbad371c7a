"""Stochastic builders stay exact: the output law of speculative sampling equals the target's.

Fast (every stochastic builder x mode): one speculative step on a synthetic world, V = 8:
p(.|path) is a fixed random table of the token path, q = softmax(logits of p + noise), the step
is ``builder.build`` -> ``accept`` with the exact p rows, and a second token is drawn from p when
the step emitted one. The law of the first two tokens must equal p(x1) p(x2 | x1) (chi-square
over 64 cells, small cells pooled), and the root's first child must follow q (the draws follow
q). A deliberately biased builder (keeps the better of two i.i.d. draws: pruning by value)
fails the same test at the same sample size, so the test can fail.

Slow (every builder x every mode, deterministic included, through ``SpeculativeGenerator``): a
peaked 1-layer hidden-16 Llama target with V = 8 and a noisy copy as drafter; the law of the
first two generated tokens is computed exactly from the target (64 sequences) and compared with
seeded generations at T = 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from treespec import SpeculativeGenerator
from treespec.drafters.base import PartialTree
from treespec.core.sampling import SamplingConfig, process
from treespec.builders import (
    BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, StaticTreeBuilder,
)
from treespec.builders.base import expand_nodes, finish
from treespec.core import accept

from test_builders import TableDrafter, _one_thread  # noqa: F401  (autouse fixture)

V = 8
ROOT = 3
T1 = SamplingConfig(temperature=1.0)
P_MIN = 1e-3
MIN_EXPECTED = 5.0
FAST_SAMPLES = 800
SLOW_SAMPLES = 3000

BUILDERS = {
    "chain": lambda mode: ChainBuilder(budget=4, mode=mode),
    # stops where the drawn path's confidence falls below 0.05: 2 to 4 nodes in this world
    "chain_adaptive": lambda mode: ChainBuilder(budget=4, mode=mode, min_confidence=0.05),
    "static": lambda mode: StaticTreeBuilder([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)], mode=mode),
    "dynamic": lambda mode: DynamicTreeBuilder(budget=8, depth=3, top_k=3, mode=mode),
    "best_first": lambda mode: BestFirstBuilder(budget=8, max_width=2, max_rounds=3, mode=mode),
    # one round, width 1: the root gets all 7 children, most drawn on demand (Expansion.extended)
    "best_first_star": lambda mode: BestFirstBuilder(budget=8, max_width=1, max_rounds=1, mode=mode),
    "sequoia": lambda mode: SequoiaBuilder(budget=8, depth=3, acceptance=(0.5, 0.2, 0.1), mode=mode),
}


def pooled_chisquare(counts: np.ndarray, law: np.ndarray) -> float:
    """p-value of a chi-square test, pooling the smallest cells until each has >= 5 expected."""
    counts, law = counts.ravel().astype(np.float64), law.ravel() / law.sum()
    assert counts[law <= 0].sum() == 0, "samples in cells of probability 0"
    order = np.argsort(law)
    expected, observed = law[order] * counts.sum(), counts[order]
    cut = 0
    while cut < len(expected) and expected[:cut].sum() < MIN_EXPECTED:
        cut += 1
    expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    observed = np.concatenate([[observed[:cut].sum()], observed[cut:]])
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


# ---------------------------------------------------------------- fast: synthetic world
class World:
    """p(.|path) = softmax(table(path)); the drafter's q adds noise of scale ``noise``."""

    def __init__(self, seed: int = 0, noise: float = 1.0):
        self.p_table = TableDrafter(V, seed=seed, scale=1.5)
        noise_table = TableDrafter(V, seed=seed + 100, scale=noise)
        self.drafter = TableDrafter(
            V, override=lambda path: self.p_table.logits(path) + noise_table.logits(path))

        self._p: dict[tuple[int, ...], torch.Tensor] = {}

    def p(self, path: tuple[int, ...]) -> torch.Tensor:
        if path not in self._p:
            self._p[path] = process(self.p_table.logits(path), T1)
        return self._p[path]

    def law(self) -> np.ndarray:
        """float64[V, V]: P(x1, x2) = p(x1 | root) p(x2 | root, x1)."""
        p1 = self.p((ROOT,)).double()
        p2 = torch.stack([self.p((ROOT, x)).double() for x in range(V)])
        return (p1[:, None] * p2).numpy()


def one_step(world: World, builder, gen: torch.Generator) -> tuple[int, int, int]:
    """(x1, x2, the root's first drafted child) of one build + accept step."""
    built = builder.build(world.drafter, ROOT, T1, gen)
    t = built.tree
    toks = t.tokens.tolist()
    p = torch.stack([world.p(tuple(toks[i] for i in t.path_to(n))) for n in range(t.num_nodes)])
    out = accept(t, p, gen).tokens.tolist()[:2]
    if len(out) == 1:
        out.append(int(torch.multinomial(world.p((ROOT, out[0])), 1, generator=gen)))
    return out[0], out[1], toks[t.children[0][0]]


def check_exact(builder, samples: int, seed: int = 0) -> tuple[float, float]:
    """(p-value of the output law, p-value of the root's first child against q)."""
    world = World(seed)
    counts, first = np.zeros((V, V)), np.zeros(V)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(samples):
        x1, x2, c = one_step(world, builder, gen)
        counts[x1, x2] += 1
        first[c] += 1
    q = world.drafter.q((ROOT,)).double().numpy()
    return pooled_chisquare(counts, world.law()), pooled_chisquare(first, q)


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_stochastic_builder_is_exact(name, mode) -> None:
    p_law, p_draws = check_exact(BUILDERS[name](mode), FAST_SAMPLES, seed=len(name))
    assert p_draws > P_MIN, f"{name}/{mode}: the root's children do not follow q (p = {p_draws:.1e})"
    assert p_law > P_MIN, f"{name}/{mode}: output law differs from the target's (p = {p_law:.1e})"


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement"])
def test_the_adaptive_chain_varies_its_length_in_the_exactness_world(mode) -> None:
    """The stop rule is exercised by the law test above: the chain's length follows the draws."""
    world, gen = World(len("chain_adaptive")), torch.Generator().manual_seed(0)
    sizes = {BUILDERS["chain_adaptive"](mode).build(world.drafter, ROOT, T1, gen).tree.num_nodes
             for _ in range(200)}
    assert sizes == {2, 3, 4}, sizes


class PrunesByValue:
    """A WRONG builder: draws two i.i.d. children of the root, keeps the one with larger q."""

    budget = 2

    def build(self, drafter, root_token, sampling, generator):
        tree = PartialTree.rooted(root_token)
        q, (exp,) = expand_nodes(drafter, tree, [0], sampling, "with_replacement", 2, generator)
        best = max(range(2), key=lambda j: exp.logq[j])
        tree.add(0, exp.tokens[best], exp.logq[best])
        return finish(tree, {0: q[0]}, "with_replacement", calls=1)


def test_the_exactness_test_catches_pruning_by_value() -> None:
    p_law, p_draws = check_exact(PrunesByValue(), FAST_SAMPLES, seed=1)
    assert p_draws < P_MIN and p_law < P_MIN, (p_draws, p_law)


# ---------------------------------------------------------------- slow: through the engine
def engine_law(model, prompt: list[int]) -> np.ndarray:
    """float64[V, V]: P(x1, x2 | prompt) of plain autoregressive sampling at T = 1."""
    ids = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits.double()  # [V, P + 1, V]
    p1 = process(logits[0, len(prompt) - 1], T1)
    p2 = process(logits[:, len(prompt)], T1)  # [x1, V]
    return (p1[:, None] * p2).numpy()


ENGINE_CASES = [(name, mode) for name in sorted(BUILDERS)
                for mode in ("deterministic", "with_replacement", "without_replacement")]


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", ENGINE_CASES, ids=[f"{n}-{m}" for n, m in ENGINE_CASES])
def test_engine_sampling_is_exact_for_every_builder(name, mode) -> None:
    from _engine_helpers import NoisyTargetDrafter, peaky_target

    target = peaky_target(V, seed=1, std=0.3)
    drafter = NoisyTargetDrafter(target.model, noise=0.5, seed=1)
    gen = SpeculativeGenerator(target, drafter, BUILDERS[name](mode))
    prompt = [5, 1]
    counts = np.zeros((V, V))
    accepted = drafted = 0
    for i in range(SLOW_SAMPLES):
        r = gen.generate(prompt, max_new_tokens=2, temperature=1.0, seed=10_000 * len(name) + i)
        counts[tuple(r.token_ids.tolist())] += 1
        accepted += sum(r.stats.depth_accepts)
        drafted += sum(r.stats.depth_attempts)
    assert 0 < accepted < drafted  # both branches of the rule ran
    p_law = pooled_chisquare(counts, engine_law(target.model, prompt))
    assert p_law > P_MIN, f"{name}/{mode}: output law differs from the target's (p = {p_law:.1e})"
