"""Block and traversal verification: the papers' worked examples, optimality, refusals, greedy.

Worked examples (the numbers the papers state):
    Sun et al. 2025 (block), Section 1: V = {a, b}, context-independent p = (1/3, 2/3),
        q = (2/3, 1/3), blocks of γ = 2 draft tokens: expected accepted tokens 10/9 for
        token verification, 11/9 for block verification, 12/9 for an idealised verifier that
        knows the joint block probabilities (an upper bound, not an algorithm).
    Weng et al. 2025 (traversal), motivation: a parent accepted with token-level probability
        0.5 whose child has p/q = 4/3 is accepted with 0.5 x 1 = 0.5 token by token but
        min(0.5 x 4/3, 1) = 2/3 on the sequence level.
The real rules' acceptance thresholds are read off exactly by bisection on the uniforms they
consume (``accept_block`` / ``accept_traversal`` take the uniform stream directly).
"""

from __future__ import annotations

import copy
import itertools
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.drafters import ModelDrafter
from treespec.core.tree import DraftTree
from treespec.core import accept
from treespec.core.joint import accept_block, accept_traversal

from _engine_helpers import one_thread, peaky_target  # noqa: F401
from _tiny import random_tree

pytestmark = pytest.mark.usefixtures("one_thread")
TOP = 1.0 - 2.0**-53  # the largest uniform below 1: rejects unless the threshold is 1


def threshold(rule, tree, probs, before: int, accepted: int) -> float:
    """The real rule's acceptance threshold at its (before + 1)-th test, to 1e-15: the sup of u
    such that uniforms (TOP x before, u) end with ``accepted`` tokens accepted."""
    def hit(u: float) -> bool:
        us = iter([TOP] * before + [u] + [0.5] * tree.num_nodes)
        return rule(tree, probs, us).num_accepted == accepted
    lo, hi = 0.0, 1.0
    if not hit(lo):
        return 0.0
    for _ in range(52):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if hit(mid) else (lo, mid)
    return hi


def chain(tokens, p_rows, q_rows, mode="with_replacement") -> tuple[DraftTree, torch.Tensor]:
    n = len(tokens)
    q = torch.tensor(np.array(q_rows, dtype=np.float64))
    tree = DraftTree(torch.tensor(tokens), torch.arange(-1, n - 1), q, mode)
    return tree, torch.tensor(np.array(p_rows, dtype=np.float64))


# ------------------------------------------------------------------ Sun et al.: 10/9, 11/9, 12/9
P_AB, Q_AB = [1 / 3, 2 / 3], [2 / 3, 1 / 3]


def test_block_paper_example_accepts_11_9_tokens_token_level_10_9():
    """The real accept_block's stop thresholds give E[τ] = 11/9 exactly (to 1e-12)."""
    e_block = e_token = 0.0
    for xs in itertools.product([0, 1], repeat=2):
        w = Q_AB[xs[0]] * Q_AB[xs[1]]
        tree, probs = chain([0, *xs], [P_AB] * 3, [Q_AB] * 3)
        h2 = threshold(accept_block, tree, probs, 0, 2)  # whole block accepted
        h1 = threshold(accept_block, tree, probs, 1, 1)  # else: stop after x_1
        e_block += w * (2 * h2 + (1 - h2) * h1)
        a = [min(1.0, P_AB[x] / Q_AB[x]) for x in xs]  # token level: x_1, then x_2
        e_token += w * (a[0] + a[0] * a[1])
    assert e_block == pytest.approx(11 / 9, abs=1e-12)
    assert e_token == pytest.approx(10 / 9, abs=1e-15)
    # the idealised verifier: Σ_i Σ_{x^i} min(q(x^i), p(x^i)) (joint block probabilities)
    ideal = sum(min(np.prod([Fraction(1, 3) * (1 + (x == 1)) for x in xs]),
                    np.prod([Fraction(1, 3) * (1 + (x == 0)) for x in xs]))
                for i in (1, 2) for xs in itertools.product([0, 1], repeat=i))
    assert ideal == Fraction(12, 9)


def test_block_paper_example_by_sampling_through_accept():
    """The public ``accept``: mean accepted tokens 11/9 (block) and 10/9 (token), 5 s.e."""
    gen = torch.Generator().manual_seed(0)
    n = 1000
    for rule, expected in (("block", 11 / 9), ("token", 10 / 9)):
        draws = []
        for xs in itertools.product([0, 1], repeat=2):
            tree, probs = chain([0, *xs], [P_AB] * 3, [Q_AB] * 3)
            k = round(n * Q_AB[xs[0]] * Q_AB[xs[1]] * 9)
            draws += [accept(tree, probs, gen, rule).num_accepted for _ in range(k)]
        mean, se = np.mean(draws), np.std(draws) / np.sqrt(len(draws))
        assert abs(mean - expected) < 5 * se, (rule, mean, expected, se)


# ------------------------------------------------------------------ Weng et al.: 0.5 -> 2/3
def _rescue_tree(mode="with_replacement"):
    """root -> [x1 (p/q = 0.5), x2]; x1 -> [x3 (p/q = 4/3)]. V = 3."""
    p0, q0 = [0.25, 0.25, 0.5], [0.5, 0.25, 0.25]  # p0(0) / q0(0) = 0.5
    p1, q1 = [0.1, 0.8, 0.1], [0.3, 0.6, 0.1]      # p1(1) / q1(1) = 4/3
    rows_p = [p0, p1, [1 / 3] * 3, [1 / 3] * 3]
    rows_q = [q0, q1, [1 / 3] * 3, [1 / 3] * 3]
    tree = DraftTree(torch.tensor([2, 0, 2, 1]), torch.tensor([-1, 0, 0, 1]),
                     torch.tensor(rows_q, dtype=torch.float64), mode)
    return tree, torch.tensor(rows_p, dtype=torch.float64)


def test_traversal_paper_example_child_rescues_parent():
    tree, probs = _rescue_tree()
    # post-order: the first test is the leaf x3 (path x1, x3), with α = min(0.5 * 4/3, 1)
    assert threshold(accept_traversal, tree, probs, 0, 2) == pytest.approx(2 / 3, abs=1e-12)
    gen = torch.Generator().manual_seed(1)
    n = 3000
    for rule, expected in (("traversal", 2 / 3), ("token", 0.5)):
        hits = sum(accept(tree, probs, gen, rule).path.tolist() == [1, 3] for _ in range(n))
        se = np.sqrt(expected * (1 - expected) / n)
        assert abs(hits / n - expected) < 5 * se, (rule, hits / n, expected)


# ------------------------------------------------------------------ optimality on chains
def _chain_expectations(rng: random.Random, with_real: bool = False):
    """(block E[τ], token E[τ], the paper's optimum, the real accept_block's E[τ] if
    ``with_real``) of one random chain, exactly.

    Context-dependent p, q tables over V^d; block's stop law from the paper's forward form
    (h_γ = p_γ, h_i = r_i / (r_i + 1 - p_i)); token: Π_k min(1, p/q); optimum:
    Σ_i E_q[p_i(X^i)] with p_i = min_{j <= i} Π_{k = j+1..i} p(x_k)/q(x_k), the bound on
    P(τ >= i) that Sun et al. prove for every valid verifier and block verification attains.
    """
    V, gamma = rng.choice([2, 3, 4]), rng.randint(1, 4)
    table: dict = {}

    def dist(kind, ctx):
        if (kind, ctx) not in table:
            w = np.array([rng.expovariate(1.0) ** rng.choice([1, 3]) for _ in range(V)])
            table[kind, ctx] = w / w.sum()
        return table[kind, ctx]

    block = token = optimum = real = 0.0
    for xs in itertools.product(range(V), repeat=gamma):
        ctxs = [xs[:i] for i in range(gamma + 1)]
        w = np.prod([dist("q", ctxs[i])[xs[i]] for i in range(gamma)])
        ratio = [dist("p", ctxs[i])[xs[i]] / dist("q", ctxs[i])[xs[i]] for i in range(gamma)]
        p = [1.0]
        for i in range(gamma):
            p.append(min(p[-1] * ratio[i], 1.0))
        h = [0.0] * (gamma + 1)
        h[gamma] = p[gamma]
        for i in range(1, gamma):
            r = np.maximum(p[i] * dist("p", ctxs[i]) - dist("q", ctxs[i]), 0.0).sum()
            h[i] = r / (r + 1.0 - p[i]) if r + 1.0 - p[i] > 0 else 0.0
        later = 1.0
        for i in range(gamma, 0, -1):
            block += w * i * later * h[i]
            later *= 1.0 - h[i]
        token += w * sum(np.prod([min(1.0, r) for r in ratio[:i]]) for i in range(1, gamma + 1))
        optimum += w * sum(min(np.prod(ratio[j:i]) for j in range(i + 1)) for i in range(1, gamma + 1))
        if with_real:  # the real accept_block's stop law, thresholds read off by bisection
            tree, probs = chain([0, *xs], [dist("p", c) for c in ctxs], [dist("q", c) for c in ctxs])
            later = 1.0
            for j in range(gamma):  # the (j + 1)-th test stops at position γ - j
                t = threshold(accept_block, tree, probs, j, gamma - j)
                real += w * (gamma - j) * later * t
                later *= 1.0 - t
    return block, token, optimum, real


def test_block_is_optimal_and_never_worse_than_token_level():
    rng = random.Random(13)
    gains = 0
    for i in range(150):
        block, token, optimum, real = _chain_expectations(rng, with_real=i < 5)
        assert block >= token - 1e-12, (block, token)
        assert block == pytest.approx(optimum, abs=1e-12)
        if i < 5:
            assert real == pytest.approx(optimum, abs=1e-12)
        gains += block > token + 1e-9
    assert gains > 50, "random chains should often gain from block verification"


# ------------------------------------------------------------------ chains, greedy, refusals
@pytest.mark.parametrize("mode", ["deterministic", "with_replacement", "without_replacement"])
def test_traversal_on_a_chain_is_block_verification_uniform_for_uniform(mode):
    rng = random.Random(f"chain:{mode}")
    for _ in range(20):
        n, V = rng.randint(1, 7), 6
        q = torch.softmax(torch.randn(n, V, dtype=torch.float64) * 2, -1)
        p = torch.softmax(torch.randn(n, V, dtype=torch.float64) * 2, -1)
        toks = [0] + [int(torch.multinomial(q[i], 1)) for i in range(n - 1)]
        tree = DraftTree(torch.tensor(toks), torch.arange(-1, n - 1), None if mode == "deterministic" else q, mode, V)
        for seed in range(10):  # the functions themselves (accept runs the token walk on deterministic trees)
            us = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).tolist()
            a, b = accept_block(tree, p, iter(us)), accept_traversal(tree, p, iter(us))
            assert a.tokens.tolist() == b.tokens.tolist() and a.children_tried == b.children_tried


@pytest.mark.parametrize("mode", ["deterministic", "with_replacement", "without_replacement"])
def test_greedy_one_hot_p_all_rules_agree(mode):
    """One-hot p: every rule emits the greedy tokens along the tree, so all agree exactly."""
    rng = random.Random(f"greedy:{mode}")
    for _ in range(30):
        n = rng.randint(1, 20)
        tree = random_tree(rng, n, 24, mode)
        p = torch.zeros(n, 24, dtype=torch.float64)
        for i in range(n):  # argmax: often a child's token, so paths get accepted
            kids = tree.children[i]
            p[i, int(tree.tokens[rng.choice(kids)]) if kids and rng.random() < 0.7 else rng.randrange(24)] = 1.0
        token = accept(tree, p, torch.Generator().manual_seed(0), "token").tokens.tolist()
        assert accept(tree, p, torch.Generator().manual_seed(0), "traversal").tokens.tolist() == token
        assert accept_traversal(tree, p, iter([0.5] * n)).tokens.tolist() == token


def test_refusals_name_what_works():
    rng = random.Random(0)
    tree = random_tree(rng, 6, 10, "with_replacement")
    while all(len(k) <= 1 for k in tree.children):
        tree = random_tree(rng, 6, 10, "with_replacement")
    p = torch.full((6, 10), 0.1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rule='block' verifies a chain.*rule='traversal'"):
        accept(tree, p, None, "block")
    with pytest.raises(ValueError, match=r"unknown acceptance rule 'blocks'.*'token', 'block', 'traversal'"):
        accept(tree, p, None, "blocks")
    with pytest.raises(TypeError, match="rule must be one of"):
        accept(tree, p, None, 1)


def test_a_child_q_cannot_have_drawn_is_refused():
    tree, probs = _rescue_tree()
    q = tree.draft_probs.clone()
    q[0] = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)  # token 0 (x1) has q = 0
    bad = DraftTree(tree.tokens, tree.parents, q, "with_replacement")
    with pytest.raises(ValueError, match="cannot have been drawn"):
        accept(bad, probs, None, "traversal")


def _poisoned_chain(n: int, vocab: int, read: set[int], reject_first: bool):
    """A stochastic chain whose rows outside ``read`` are NaN except at the drafted tokens (the
    two gathers every rule makes); reject_first: p gives x_1 no mass, else p = q (all accepted)."""
    g = torch.Generator().manual_seed(n)
    q = torch.softmax(torch.randn(n, vocab, dtype=torch.float64, generator=g), -1)
    toks = [0] + [int(torch.multinomial(q[i], 1, generator=g)) for i in range(n - 1)]
    p = q.clone()
    if reject_first:
        p[0, toks[1]] = 0.0
        p[0] /= p[0].sum()
    for rows in (p, q):
        for i in set(range(n)) - read:
            keep = rows[i, toks[i + 1]].item() if i + 1 < n else None
            rows[i] = float("nan")
            if keep is not None:
                rows[i, toks[i + 1]] = keep
    tree = DraftTree.from_builder(torch.tensor(toks), torch.arange(-1, n - 1), q, "with_replacement")
    return tree, p


@pytest.mark.parametrize("rule", ["block", "traversal"])
def test_rows_the_rules_never_need_are_never_read(rule):
    """Like the token rule, the joint rules read a row only where they reject or draw: a 64-node
    chain rejected at its first draft reads row 0 alone; one accepted whole, the last row alone
    (rows are distributions, so no row is read for its mass)."""
    n = 64
    tree, p = _poisoned_chain(n, 300, {0}, reject_first=True)
    for seed in range(5):
        out = accept(tree, p, torch.Generator().manual_seed(seed), rule)
        assert out.num_accepted == 0 and out.tokens.tolist() != [int(tree.tokens[1])]
    tree, p = _poisoned_chain(n, 300, {n - 1}, reject_first=False)
    for seed in range(5):
        out = accept(tree, p, torch.Generator().manual_seed(seed), rule)
        assert out.tokens[:-1].tolist() == tree.tokens[1:].tolist()


@pytest.mark.parametrize("rule", ["block", "traversal"])
def test_a_target_row_that_is_not_a_distribution_is_refused_where_read(rule):
    tree, p = _poisoned_chain(6, 50, set(range(6)), reject_first=True)
    p[0] *= 0.9  # a top-p tail dropped without renormalising
    with pytest.raises(ValueError, match=r"target_probs row sums to 0\.9.*renormalise"):
        accept(tree, p, torch.Generator().manual_seed(0), rule)


# ------------------------------------------------------------------ the engine
V = 16


@pytest.fixture(scope="module")
def target():
    return peaky_target(V, seed=0, std=0.3)


def test_engine_refuses_an_unknown_rule(target):
    with pytest.raises(ValueError, match=r"verify must be one of \('token', 'block', 'traversal'\)"):
        SpeculativeGenerator(target, "target", ChainBuilder(budget=5), verify="tree")


@pytest.mark.parametrize("verify,builder", [("block", ChainBuilder(budget=4)), ("traversal", DynamicTreeBuilder(10, 4, 3))])
def test_engine_greedy_output_unchanged(target, verify, builder):
    """T = 0 with a poor drafter: the same tokens as the token rule (and plain greedy)."""
    draft = copy.deepcopy(target.model)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prm in draft.parameters():
            prm.add_(0.15 * torch.randn(prm.shape, generator=noise))
    outs = {v: SpeculativeGenerator(target, ModelDrafter(draft, V), builder, verify=v).generate([4, 4, 2], 30)
            for v in ("token", verify)}
    assert outs[verify].token_ids.tolist() == outs["token"].token_ids.tolist()
    assert sum(outs[verify].stats.depth_accepts) < sum(outs[verify].stats.depth_attempts)


def test_block_in_the_engine_refuses_a_tree_builder(target):
    gen = SpeculativeGenerator(target, "target", DynamicTreeBuilder(10, 3, 3), verify="block")
    with pytest.raises(ValueError, match="rule='block' verifies a chain"):
        gen.generate([4, 2], 8, temperature=1.0, seed=0)


def test_cli_verify_flag_offers_every_rule():
    from treespec.cli.main import build_parser
    from treespec.core import VERIFY_RULES

    for rule in VERIFY_RULES:
        assert build_parser().parse_args(["generate", "--prompt", "hi", "--verify", rule]).verify == rule
    assert build_parser().parse_args(["generate", "--prompt", "hi"]).verify == "token"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--verify", "joint"])
