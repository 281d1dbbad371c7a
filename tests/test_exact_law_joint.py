"""Block and traversal verification are lossless: the exact output law, by enumeration.

Same synthetic worlds as tests/test_exact_law.py (fixed random p / q tables of the context, tiny
V, with and without temperature / top-k / top-p / min-p, greedy one-hot p). For a random
topology we enumerate every drafting outcome and every accept / reject branch, extend the
emitted tokens with p to L tokens, and compare with the target's law to 1e-9.

The enumerations re-derive the rules in plain floats and never call ``treespec.core``:
    block      the paper's forward form: p_i = min(p_{i-1} p(x_i)/q(x_i), 1), h_γ = p_γ,
               h_i = r_i / (r_i + 1 - p_i), P(τ = i) = h_i Π_{j > i} (1 - h_j), new token from p
               at γ, else from norm(max(p_τ p - q, 0)).
    traversal  post-order recursion; a child's rejection probability is read off the enumerated
               law of its subtree (1 - its total mass), not assumed.
Then the real ``accept`` is tied to the per-tree law by sampling, the law checks are shown to
catch wrong rules, block's expected accepted length is checked against token-level and the
paper's optimum, and the refusals are checked.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from treespec.core.tree import DraftTree
from treespec.core import VERIFY_RULES, accept
from treespec.core.joint import accept_block, accept_traversal

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_exact_law import L, MAX_DEPTH, World, assert_counts_follow_law, deterministic_draft, random_shape
from test_exact_law import _drafted_tree as _token_drafted_tree
from test_exact_law import _fixed_tree_law as _token_fixed_tree_law

TOL = 1e-9
MODES = ("deterministic", "with_replacement", "without_replacement")
CONFIGS = ("T1", "T0.7_top_p0.8", "T1.3_top_k3_min_p0.2", "greedy")
CASES = [(m, c) for m in MODES for c in CONFIGS]
TREES_PER_CASE = 40


# ------------------------------------------------------------------ the rules, re-derived
def _block(xs_law, p_of, q_of, ctx, gamma, k, tail, mutant=None):
    """Law over V^k of block verification of a chain drafted with law ``xs_law`` (a list of
    (weight, tokens x_1..x_γ)); p_of / q_of(ctx) give p(.|ctx) / the law x_{i+1} was drawn
    from (a point mass for deterministic drafts); tail(ctx, j) the law of j more tokens."""
    V = len(p_of(ctx))
    out = np.zeros(V**k)
    for w, xs in xs_law:
        ctxs = [ctx + tuple(xs[:i]) for i in range(gamma + 1)]
        p = [1.0]
        for i in range(gamma):
            pi, qi = p_of(ctxs[i]), q_of(ctxs[i], xs[i])
            p.append(min(p[i] * pi[xs[i]] / qi[xs[i]], 1.0))
        h = [1.0] * (gamma + 1)  # h_0 = 1: the root always stops the walk
        res = [None] * (gamma + 1)
        h[gamma], res[gamma] = p[gamma], list(p_of(ctxs[gamma]))
        for i in range(1, gamma):
            pi, qi = p_of(ctxs[i]), q_of(ctxs[i], xs[i])
            m = [max(p[i] * a - b, 0.0) for a, b in zip(pi, qi)]
            r = sum(m)
            h[i] = r / (r + 1.0 - p[i]) if r + 1.0 - p[i] > 0.0 else 0.0
            if mutant == "h_is_p":  # wrong: stop with the path weight, not the residual ratio
                h[i] = p[i]
            res[i] = [a / r for a in m] if r > 0.0 else list(pi)
        p0, q0 = p_of(ctx), q_of(ctx, xs[0])
        m = [max(a - b, 0.0) for a, b in zip(p0, q0)]
        res[0] = [a / sum(m) for a in m] if sum(m) > 0.0 else list(p0)
        if mutant == "plain_residual":  # wrong: residual from p, not from p_i p
            for i in range(1, gamma):
                pi, qi = p_of(ctxs[i]), q_of(ctxs[i], xs[i])
                m = [max(a - b, 0.0) for a, b in zip(pi, qi)]
                res[i] = [a / sum(m) for a in m] if sum(m) > 0.0 else list(pi)
        later = 1.0  # Π_{j > i} (1 - h_j)
        for i in range(gamma, -1, -1):
            stop = later * h[i]
            later *= 1.0 - h[i]
            if stop <= 0.0:
                continue
            for y in range(V):
                if res[i][y] > 0.0:
                    seq = tuple(xs[:i]) + (y,)
                    idx = int(np.ravel_multi_index(seq, (V,) * len(seq))) if seq else 0
                    block = V ** (k - len(seq))
                    out[idx * block:(idx + 1) * block] += w * stop * res[i][y] * tail(ctxs[i] + (y,), k - len(seq))
    return out


class Traversal:
    """Exact law of traversal verification of randomly drafted trees (memoised recursion)."""

    def __init__(self, world: World, mode: str, style: str, mutant: str | None = None):
        self.w, self.mode, self.style, self.mutant = world, mode, style, mutant
        self.memo: dict = {}

    def node(self, shape: tuple, ctx: tuple, alpha: float, k: int) -> np.ndarray:
        """Sub-probability law over V^k: the subtree at ctx, entered with weight α, is accepted."""
        p = list(self.w.p(ctx))
        q = list(self.w.q(ctx)) if self.mode != "deterministic" else None
        fixed = deterministic_draft(self.w, ctx, len(shape), self.style) if q is None else None
        return self.kids(shape, ctx, alpha, tuple(p), None if q is None else tuple(q), fixed, k)

    def kids(self, shape, ctx, alpha, r, q, fixed, k) -> np.ndarray:
        """The children ``shape`` still to try at ctx, with state (α, r) and draft law q."""
        key = (shape, ctx, alpha, r, q, None if fixed is None else tuple(fixed), k)
        if key in self.memo:
            return self.memo[key]
        V, out = self.w.vocab, np.zeros(self.w.vocab**k)
        block = V ** (k - 1)
        if not shape or (q is not None and sum(q) <= 0.0):  # a leaf now: accept w.p. α, draw from r
            for y in range(V):
                if r[y] > 0.0:
                    out[y * block:(y + 1) * block] += (1.0 if len(ctx) == 1 else alpha) * r[y] * self.w.target(ctx + (y,), k - 1)
            self.memo[key] = out
            return out
        outcomes = [(1.0, fixed[0])] if q is None else [(q[x], x) for x in range(V) if q[x] > 0.0]
        for wx, x in outcomes:
            qhat = [float(y == x) for y in range(V)] if q is None else list(q)
            if self.mutant == "keep_q":  # wrong: verifies against the node's first q, drafts from q
                qhat = list(self.w.q(ctx))
            a_c = min(alpha * r[x] / qhat[x], 1.0)
            sub = self.node(shape[0], ctx + (x,), a_c, k - 1)
            out[x * block:(x + 1) * block] += wx * sub
            reject = 1.0 - sub.sum()
            m = [max(alpha * a - b, 0.0) for a, b in zip(r, qhat)]
            rm = sum(m)
            if self.mutant == "no_residual" or rm <= 0.0:  # (mutant: wrong, keeps α and r)
                a2, r2 = (alpha, r) if self.mutant == "no_residual" else (0.0, r)
            else:
                a2, r2 = rm / (1.0 - alpha + rm), tuple(v / rm for v in m)
            q2 = q
            if self.mode == "without_replacement":
                q2 = list(q)
                q2[x] = 0.0
                s = sum(q2)
                q2 = tuple(v / s for v in q2) if s > 0 else tuple(q2)
            if reject > 0.0:
                out += wx * reject * self.kids(shape[1:], ctx, a2, r2, q2, None if fixed is None else fixed[1:], k)
        self.memo[key] = out
        return out


def _chain_shape(depth: int) -> tuple:
    return () if depth == 0 else (_chain_shape(depth - 1),)


def _block_law(world: World, mode: str, gamma: int, style: str, mutant=None) -> np.ndarray:
    root = (world.root,)
    if mode == "deterministic":
        xs, ctx = [], root
        for _ in range(gamma):
            xs.append(deterministic_draft(world, ctx, 1, style)[0])
            ctx = ctx + (xs[-1],)
        law = [(1.0, xs)]
        q_of = lambda c, x: [float(y == x) for y in range(world.vocab)]  # noqa: E731
    else:  # one child per node: with and without replacement both draw x_{i+1} ~ q(.|x^i)
        law = []
        for xs in itertools.product(range(world.vocab), repeat=gamma):
            w = np.prod([world.q(root + xs[:i])[xs[i]] for i in range(gamma)])
            if w > 0.0:
                law.append((float(w), list(xs)))
        q_of = lambda c, x: world.q(c)  # noqa: E731
    return _block(law, world.p, q_of, root, gamma, L, world.target, mutant)


def _worlds(tag: str, mode: str, config: str, count: int = TREES_PER_CASE):
    rng = random.Random(f"joint:{tag}:{mode}:{config}")
    for _ in range(count):
        vocab = rng.choice([3, 4] if mode == "without_replacement" else [3, 4, 5])
        closeness = rng.choice([None, 0.0, 0.3, 1.0, 3.0])
        world = World(rng.randrange(2**31), vocab, config, closeness, rng.randrange(vocab))
        yield world, rng


@pytest.mark.parametrize("mode,config", CASES)
def test_block_output_law_equals_target_law(mode, config):
    worst = 0.0
    for world, rng in _worlds("block", mode, config):
        law = _block_law(world, mode, rng.randint(1, MAX_DEPTH), rng.choice(["topk", "random"]))
        worst = max(worst, float(np.abs(law - world.target((world.root,), L)).max()))
    assert worst <= TOL, f"block {mode}/{config}: output law differs from the target's by {worst:.3e}"


@pytest.mark.parametrize("mode,config", CASES)
def test_traversal_output_law_equals_target_law(mode, config):
    worst = 0.0
    for world, rng in _worlds("traversal", mode, config):
        shape = random_shape(rng, budget=7)
        law = Traversal(world, mode, rng.choice(["topk", "random"])).node(shape, (world.root,), 1.0, L)
        worst = max(worst, float(np.abs(law - world.target((world.root,), L)).max()))
    assert worst <= TOL, f"traversal {mode}/{config}: output law differs from the target's by {worst:.3e}"


@pytest.mark.parametrize("rule,mutant,mode", [
    ("block", "h_is_p", "with_replacement"),
    ("block", "plain_residual", "with_replacement"),
    ("traversal", "no_residual", "with_replacement"),
    ("traversal", "no_residual", "deterministic"),
    ("traversal", "keep_q", "without_replacement"),
])
def test_law_check_catches_wrong_rules(rule, mutant, mode):
    worst = 0.0
    for world, rng in _worlds(f"mutant:{mutant}", mode, "T1", count=15):
        if rule == "block":
            law = _block_law(world, mode, 3, "random", mutant)
        else:
            shape = ((((),), ()), ((),), ())  # three children at the root, depth 3
            law = Traversal(world, mode, "random", mutant).node(shape, (world.root,), 1.0, L)
        worst = max(worst, float(np.abs(law - world.target((world.root,), L)).max()))
    assert worst > 1e-3, f"the law check did not notice the wrong {rule} rule {mutant!r} ({worst:.2e})"


# ------------------------------------------------------------------ the real accept
def _drafted_tree(world: World, mode: str, shape: tuple, rng: random.Random):
    """One drafted tree (as the enumeration drafts) from ``world``'s root, and every node's context."""
    return _token_drafted_tree(world, mode, shape, world.root, rng)


def _fixed_tree_law(world: World, mode: str, tree: DraftTree, ctx_of) -> np.ndarray:
    """Exact law of traversal verification of one *fixed* tree over (V + 1)^L (symbol V: end).
    On a chain this is also block verification's law."""
    V = world.vocab

    def pad(k: int) -> np.ndarray:  # k end symbols
        out = np.zeros((V + 1) ** k)
        out[-1] = 1.0
        return out

    def node(i: int, alpha: float, k: int) -> np.ndarray:
        r = list(world.p(ctx_of[i]))
        q = list(world.q(ctx_of[i])) if mode != "deterministic" else None
        out, reach = np.zeros((V + 1) ** k), 1.0  # reach: every earlier child was rejected
        block = (V + 1) ** (k - 1)
        for c in tree.children[i]:
            x = int(tree.tokens[c])
            qhat = [float(y == x) for y in range(V)] if q is None else q
            sub = node(c, min(alpha * r[x] / qhat[x], 1.0), k - 1)
            out[x * block:(x + 1) * block] += reach * sub
            reach *= 1.0 - sub.sum()
            m = [max(alpha * a - b, 0.0) for a, b in zip(r, qhat)]
            alpha, r = (sum(m) / (1.0 - alpha + sum(m)), [v / sum(m) for v in m]) if sum(m) > 0 else (0.0, r)
            if mode == "without_replacement":
                q = [0.0 if y == x else v for y, v in enumerate(q)]
                q = [v / sum(q) for v in q] if sum(q) > 0 else q
        stop = 1.0 if i == 0 else alpha  # the root always stops the walk
        for y in range(V):
            out[y * block:(y + 1) * block] += reach * stop * r[y] * pad(k - 1)
        return out

    return node(0, 1.0, L)


SHAPES = {"block": (((((),),),)), "traversal": ((((),), ()), ((),), ())}


@pytest.mark.parametrize("rule", ["block", "traversal"])
@pytest.mark.parametrize("mode", MODES)
def test_accept_matches_exact_law_of_fixed_trees(rule, mode):
    """Sampling cross-check: the real ``accept`` follows the enumerated per-tree law."""
    rng = random.Random(f"fixed:{rule}:{mode}")
    gen = torch.Generator().manual_seed(99)
    draws, checked = 2000, 0
    while checked < 2:
        world = World(rng.randrange(2**31), 4, "T0.7_top_p0.8", rng.choice([None, 0.3, 1.0]), rng.randrange(4))
        tree, target, ctx_of = _drafted_tree(world, mode, SHAPES[rule], rng)
        law = _fixed_tree_law(world, mode, tree, ctx_of)
        assert abs(law.sum() - 1.0) < 1e-12
        if law.max() > 0.99:  # a tree whose outcome is certain tests nothing
            continue
        V, counts = world.vocab, np.zeros_like(law)
        run = lambda: accept(tree, target, gen, rule)  # noqa: E731
        if mode == "deterministic":  # accept runs the token walk (same law): test ours directly
            fn = accept_block if rule == "block" else accept_traversal
            run = lambda: fn(tree, target, iter(torch.rand(tree.num_nodes, dtype=torch.float64,  # noqa: E731
                                                           generator=gen).tolist()))
        for _ in range(draws):
            out = run().tokens.tolist()
            counts[int(np.ravel_multi_index(out + [V] * (L - len(out)), (V + 1,) * L))] += 1
        assert_counts_follow_law(counts, law, draws, f"{rule}/{mode}: {tree}")
        checked += 1


def test_rules_are_listed():
    assert VERIFY_RULES == ("token", "block", "traversal")


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_trees_have_the_token_law_exactly(mode):
    """Why ``accept`` runs the token walk for block / traversal on deterministic trees: per
    fixed tree, the two laws agree to round-off; with drawn children they differ (a check
    with power)."""
    worst = 0.0
    rng = random.Random(f"same-law:{mode}")
    for _ in range(40):
        config = rng.choice(["T1", "T0.7_top_p0.8", "greedy"] if mode == "deterministic" else ["T1"])
        world = World(rng.randrange(2**31), 4, config, rng.choice([None, 0.3, 1.0]), rng.randrange(4))
        tree, _, ctx_of = _drafted_tree(world, mode, random_shape(rng, budget=9), rng)
        diff = np.abs(_token_fixed_tree_law(world, mode, tree, ctx_of) - _fixed_tree_law(world, mode, tree, ctx_of))
        worst = max(worst, float(diff.max()))
    if mode == "deterministic":
        assert worst <= TOL
    else:
        assert worst > 1e-2
