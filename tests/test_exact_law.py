"""The acceptance rules of DESIGN.md are lossless: an exact computation, not a sampling test.

A synthetic world where p(.|context) and q(.|context) are fixed random tables of the context
(tiny V, processed by ``logits_to_probs`` with and without temperature / top-k / top-p / min-p,
greedy one-hot p for the deterministic rule). For a random tree *topology* (depth <= 3, <= 3
children per node) we enumerate every outcome of the drafting draws (i.i.d. draws from q for
"with_replacement", sequential draws without replacement for "without_replacement", a fixed
choice of distinct tokens for "deterministic") and every accept / reject branch of the rules,
extend each emitted sequence with p to a fixed length L, and check that the resulting law over
V^L sequences equals the target's autoregressive law to 1e-9.

The enumeration re-derives the rules in plain float64 (numpy for the per-sequence sums); it never
calls ``treespec.core.rejection``. The last test ties the real ``accept`` to the same
enumeration on fixed trees, by sampling.
"""

from __future__ import annotations

import itertools
import random
from functools import lru_cache

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from treespec.core.sampling import logits_to_probs
from treespec.core.tree import DraftTree
from treespec.core import accept

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

MAX_DEPTH = 3  # draft levels below the root
MAX_KIDS = 3
L = MAX_DEPTH + 1  # the most tokens one verification can emit
TREES_PER_CASE = 200
TOL = 1e-9

# name -> (target processing, draft processing)
CONFIGS = {
    "T1": (dict(temperature=1.0), dict(temperature=1.0)),
    "T0.7_top_p0.8": (dict(temperature=0.7, top_p=0.8), dict(temperature=0.7, top_p=0.8)),
    "T1.3_top_k3_min_p0.2": (
        dict(temperature=1.3, top_k=3, min_p=0.2),
        dict(temperature=1.3, top_k=3, min_p=0.2),
    ),
    "greedy": (dict(temperature=0.0), dict(temperature=0.7, top_p=0.8)),
}
CASES = [
    ("deterministic", "T1"),
    ("deterministic", "T0.7_top_p0.8"),
    ("deterministic", "T1.3_top_k3_min_p0.2"),
    ("deterministic", "greedy"),
    ("with_replacement", "T1"),
    ("with_replacement", "T0.7_top_p0.8"),
    ("with_replacement", "T1.3_top_k3_min_p0.2"),
    ("without_replacement", "T1"),
    ("without_replacement", "T0.7_top_p0.8"),
    ("without_replacement", "T1.3_top_k3_min_p0.2"),
]


def _normalise(v: list[float]) -> list[float]:
    s = sum(v)
    return [x / s for x in v]


class World:
    """Fixed random tables p(.|ctx), q(.|ctx) of every context ``ctx = (root, x_1, .., x_d)``.

    q's logits are p's plus noise of scale ``closeness`` (0: q == p), or independent (None).
    Tables exist for d <= L - 1, all that a verification plus the extension to L tokens reads.
    """

    def __init__(self, seed: int, vocab: int, config: str, closeness: float | None, root: int):
        self.seed, self.vocab, self.root = seed, vocab, root
        p_cfg, q_cfg = CONFIGS[config]
        rng = np.random.default_rng(seed)
        n_ctx = sum(vocab**d for d in range(L))
        lp = rng.normal(0.0, 1.5, size=(n_ctx, vocab))
        noise = rng.normal(0.0, 1.5, size=(n_ctx, vocab))
        lq = noise if closeness is None else lp + closeness * noise
        p = logits_to_probs(torch.from_numpy(lp), **p_cfg).numpy()
        q = logits_to_probs(torch.from_numpy(lq), **q_cfg).numpy()
        starts = np.cumsum([0] + [vocab**d for d in range(L)])
        self._p = [p[starts[d]:starts[d + 1]] for d in range(L)]  # [V^d, V] per depth d
        self._p_lists = [t.tolist() for t in self._p]
        self._q_lists = [q[starts[d]:starts[d + 1]].tolist() for d in range(L)]
        # _target[d][i]: law over V^(L - d) of the next L - d tokens after depth-d context i.
        self._target = [None] * L
        self._target[L - 1] = self._p[L - 1]
        for d in range(L - 2, -1, -1):
            nxt = self._target[d + 1].reshape(vocab**d, vocab, -1)
            self._target[d] = (self._p[d][:, :, None] * nxt).reshape(vocab**d, -1)

    def _index(self, ctx: tuple[int, ...]) -> tuple[int, int]:
        assert ctx[0] == self.root
        i = 0
        for t in ctx[1:]:
            i = i * self.vocab + t
        return len(ctx) - 1, i

    def p(self, ctx: tuple[int, ...]) -> list[float]:
        d, i = self._index(ctx)
        return self._p_lists[d][i]

    def q(self, ctx: tuple[int, ...]) -> list[float]:
        d, i = self._index(ctx)
        return self._q_lists[d][i]

    def target(self, ctx: tuple[int, ...], k: int) -> np.ndarray:
        """Law of the next k tokens under autoregressive p: array [V^k], row-major sequences."""
        d, i = self._index(ctx)
        if k == 0:
            return np.ones(1)
        assert k == L - d, "the enumeration always extends to exactly L tokens"
        return self._target[d][i]


def verify_law(
    mode: str,
    p: list[float],
    q: list[float] | None,
    xs: list[int],
    sub_laws: list[np.ndarray],
    tails: list[np.ndarray],
) -> np.ndarray:
    """Law of the next k symbols when the children tokens ``xs`` of a node are verified.

    p, q: the node's target / draft distributions. ``sub_laws[i]`` is the law of the k - 1
    symbols after child i is accepted; ``tails[y]`` the law of the k - 1 symbols after the new
    token y (residual) is emitted. Rules (DESIGN.md), re-derived here on plain floats:
      deterministic:       accept x w.p. r(x); else r(x) = 0, renormalise.
      with_replacement:    accept x w.p. min(1, r(x)/q(x)); else r = norm(max(r - q, 0)).
      without_replacement: as with_replacement, and q(x) = 0, renormalise q.
    """
    alphabet = len(tails)
    block = tails[0].size
    out = np.zeros(alphabet * block)
    r = _normalise(list(p))
    q = list(q) if q is not None else None
    reach = 1.0  # probability that every child so far was rejected
    for x, sub in zip(xs, sub_laws):
        if mode == "deterministic":
            a = r[x]
        else:
            assert q[x] > 0.0, "the enumeration only drafts tokens with q > 0"
            a = min(1.0, r[x] / q[x])
        out[x * block:(x + 1) * block] += reach * a * sub
        reach *= 1.0 - a
        if reach <= 0.0:
            return out
        if mode == "deterministic":
            r[x] = 0.0
            s = sum(r)
        else:
            r = [max(ri - qi, 0.0) for ri, qi in zip(r, q)]
            s = sum(r)
            if mode == "without_replacement":
                q[x] = 0.0
                if sum(q) > 0.0:  # else x was the last token q could draw: no sibling follows
                    q = _normalise(q)
        if s <= 0.0:  # only round-off can leave a rejection with nothing behind
            return out
        r = [ri / s for ri in r]
    for y in range(len(r)):
        if r[y] > 0.0:
            out[y * block:(y + 1) * block] += reach * r[y] * tails[y]
    return out


def random_shape(rng: random.Random, budget: int = 9) -> tuple:
    """A random topology as nested tuples of children (leaf: ()); at most ``budget`` draft nodes.

    Breadth-first growth: each node gets 0..MAX_KIDS children (the root at least 1) while the
    budget lasts and the depth is < MAX_DEPTH.
    """
    kids: list[list[int]] = [[]]
    depth = [0]
    frontier = [0]
    for node in frontier:
        if depth[node] == MAX_DEPTH:
            continue
        lo = 1 if node == 0 else 0
        for _ in range(min(rng.randint(lo, MAX_KIDS), budget)):
            budget -= 1
            kids.append([])
            depth.append(depth[node] + 1)
            kids[node].append(len(kids) - 1)
            frontier.append(len(kids) - 1)

    def nest(i: int) -> tuple:
        return tuple(nest(c) for c in kids[i])

    return nest(0)


def deterministic_draft(world: World, ctx: tuple[int, ...], m: int, style: str) -> list[int]:
    """m distinct tokens fixed by the drafter: top-m of q (ties: lowest id) or random distinct."""
    if style == "topk":
        q = world.q(ctx)
        return sorted(range(world.vocab), key=lambda t: (-q[t], t))[:m]
    return random.Random(f"draft:{world.seed}:{ctx}").sample(range(world.vocab), m)


def draft_outcomes(world: World, mode: str, ctx: tuple[int, ...], m: int, style: str):
    """Every drafting outcome (probability, ordered children tokens) at a node with m children."""
    if mode == "deterministic":
        return [(1.0, deterministic_draft(world, ctx, m, style))]
    q = world.q(ctx)
    support = [t for t in range(world.vocab) if q[t] > 0.0]
    outcomes = []
    if mode == "with_replacement":  # m i.i.d. draws from q
        for xs in itertools.product(support, repeat=m):
            w = 1.0
            for x in xs:
                w *= q[x]
            outcomes.append((w, list(xs)))
    else:  # sequential draws without replacement; a drafter cannot draw more than |support|
        for xs in itertools.permutations(support, min(m, len(support))):
            w = 1.0
            for i, x in enumerate(xs):
                w *= q[x] / sum(q[t] for t in support if t not in xs[:i])
            outcomes.append((w, list(xs)))
    return outcomes


class Enumerator:
    """Exact law of (verification of a randomly drafted tree, then autoregressive p) over V^L."""

    def __init__(self, world: World, mode: str, style: str):
        self.world, self.mode, self.style = world, mode, style
        self.memo: dict = {}
        self.zero_p_drafts = 0  # drafted children with p(x|ctx) == 0 (outcomes with weight > 0)
        self.repeats = 0  # drafting outcomes with a repeated sibling token

    def law(self, shape: tuple, ctx: tuple[int, ...], k: int) -> np.ndarray:
        key = (shape, ctx, k)
        if key in self.memo:
            return self.memo[key]
        w = self.world
        if not shape:  # a leaf: the bonus token comes from p, then p continues
            out = w.target(ctx, k)
        else:
            out = np.zeros(w.vocab**k)
            p = w.p(ctx)
            q = w.q(ctx) if self.mode != "deterministic" else None
            tails = [w.target(ctx + (y,), k - 1) for y in range(w.vocab)]
            sub_cache: dict[tuple[int, int], np.ndarray] = {}
            for weight, xs in draft_outcomes(w, self.mode, ctx, len(shape), self.style):
                if weight == 0.0:
                    continue
                self.zero_p_drafts += sum(p[x] == 0.0 for x in xs)
                self.repeats += len(set(xs)) < len(xs)
                subs = []
                for i, x in enumerate(xs):
                    if (i, x) not in sub_cache:
                        sub_cache[i, x] = self.law(shape[i], ctx + (x,), k - 1)
                    subs.append(sub_cache[i, x])
                out += weight * verify_law(self.mode, p, q, xs, subs, tails)
        self.memo[key] = out
        return out


def _case_worlds(mode: str, config: str):
    """TREES_PER_CASE (world, topology, drafting style) triples for one case, seeded by name."""
    rng = random.Random(f"case:{mode}:{config}")
    for _ in range(TREES_PER_CASE):
        vocab = rng.choice([3, 4, 5] if mode == "deterministic" else [3, 4, 4, 5])
        closeness = rng.choice([None, 0.0, 0.3, 1.0, 3.0])
        world = World(rng.randrange(2**31), vocab, config, closeness, rng.randrange(vocab))
        yield world, random_shape(rng), rng.choice(["topk", "random"]), world.root


@pytest.mark.parametrize("mode,config", CASES)
def test_output_law_equals_target_law(mode, config):
    worst = 0.0
    zero_p = repeats = 0
    for world, shape, style, root in _case_worlds(mode, config):
        enum = Enumerator(world, mode, style)
        law = enum.law(shape, (root,), L)
        target = world.target((root,), L)
        worst = max(worst, float(np.abs(law - target).max()))
        zero_p += enum.zero_p_drafts
        repeats += enum.repeats
    assert worst <= TOL, f"{mode}/{config}: output law differs from the target's by {worst:.3e}"
    # The worlds must exercise the hard cases, or the check above proves less than it says.
    if config != "T1":
        assert zero_p > 0, "no drafted token had target probability 0"
    if mode == "with_replacement":
        assert repeats > 0, "no i.i.d. drafting outcome repeated a sibling token"


# ---------------------------------------------------------------------- the check can fail
_RULES = verify_law


def _mutant_verify(rule: str):
    """A wrong rule; the law check must catch it."""

    def verify(mode, p, q, xs, sub_laws, tails):
        if rule == "no_residual":  # reject without updating the residual (plain resampling from p)
            block = tails[0].size
            out = np.zeros(len(tails) * block)
            reach = 1.0
            for x, sub in zip(xs, sub_laws):
                a = min(1.0, p[x] / q[x]) if q is not None else p[x]
                out[x * block:(x + 1) * block] += reach * a * sub
                reach *= 1.0 - a
            for y in range(len(tails)):
                out[y * block:(y + 1) * block] += reach * p[y] * tails[y]
            return out
        if rule == "wor_keeps_q":  # without replacement, but q not updated after a rejection
            return _RULES("with_replacement", p, q, xs, sub_laws, tails)
        raise AssertionError(rule)

    return verify


@pytest.mark.parametrize(
    "mode,rule",
    [
        ("deterministic", "no_residual"),
        ("with_replacement", "no_residual"),
        ("without_replacement", "wor_keeps_q"),
    ],
)
def test_law_check_catches_wrong_rules(mode, rule, monkeypatch):
    monkeypatch.setitem(globals(), "verify_law", _mutant_verify(rule))
    worst = 0.0
    for i, (world, shape, style, root) in enumerate(_case_worlds(mode, "T1")):
        if i == 30:
            break
        law = Enumerator(world, mode, style).law(shape, (root,), L)
        worst = max(worst, float(np.abs(law - world.target((root,), L)).max()))
    assert worst > 1e-3, f"the law check did not notice the wrong rule {rule!r} ({worst:.2e})"


# ---------------------------------------------------------------------- the real accept
def assert_counts_follow_law(counts: np.ndarray, law: np.ndarray, draws: int, label: str) -> None:
    """Chi-square of observed outcome ``counts`` against the exact ``law`` (cells with fewer than
    5 expected draws pooled); nothing of probability 0 may occur."""
    assert counts[law == 0.0].sum() == 0, f"{label}: accept emitted a sequence of probability 0"
    keep = law * draws >= 5
    f_obs = np.append(counts[keep], counts[~keep].sum())
    f_exp = np.append(law[keep], law[~keep].sum()) * draws
    if f_exp[-1] == 0:
        f_obs, f_exp = f_obs[:-1], f_exp[:-1]
    pvalue = chisquare(f_obs, f_exp * f_obs.sum() / f_exp.sum()).pvalue
    assert pvalue > 1e-3, f"{label}: accept disagrees with the exact law (p={pvalue:.2e})"


def _fixed_tree_law(world: World, mode: str, tree: DraftTree, ctx_of: list[tuple[int, ...]]):
    """Exact law of ``accept``'s emitted tokens for a *fixed* tree, padded to length L.

    Alphabet V + 1 (symbol V = end of emission); uses the same ``verify_law`` as above.
    """
    V = world.vocab

    @lru_cache(maxsize=None)
    def pad_tail(k: int) -> np.ndarray:  # k end symbols
        out = np.zeros((V + 1) ** k)
        out[-1] = 1.0  # (V, V, ..., V) is the last sequence in row-major order
        return out

    def node(i: int, k: int) -> np.ndarray:
        ctx = ctx_of[i]
        p = world.p(ctx)
        tails = [pad_tail(k - 1)] * V + [np.zeros((V + 1) ** (k - 1))]
        kids = tree.children[i]
        if not kids:
            return verify_law("deterministic", p, None, [], [], tails)
        xs = [int(tree.tokens[c]) for c in kids]
        q = world.q(ctx) if mode != "deterministic" else None
        return verify_law(mode, p, q, xs, [node(c, k - 1) for c in kids], tails)

    return node(0, L)


def _drafted_tree(world: World, mode: str, shape: tuple, root: int, rng: random.Random):
    """One drafted tree (tokens drawn like the enumeration's drafter) and each node's context."""
    tokens, parents, ctx_of = [root], [-1], [(root,)]

    def grow(i: int, shape: tuple) -> None:
        ctx = ctx_of[i]
        if mode == "deterministic":
            xs = deterministic_draft(world, ctx, len(shape), "random")
        else:
            q = world.q(ctx)
            pool = list(range(world.vocab))
            weights = list(q)
            xs = []
            for _ in range(len(shape)):
                if sum(weights) <= 0.0:
                    break
                x = rng.choices(pool, weights)[0]
                xs.append(x)
                if mode == "without_replacement":
                    weights[x] = 0.0
        for x, sub in zip(xs, shape):
            tokens.append(x)
            parents.append(i)
            ctx_of.append(ctx + (x,))
            grow(len(tokens) - 1, sub)

    grow(0, shape)
    probs = None
    if mode != "deterministic":
        probs = torch.tensor([world.q(c) for c in ctx_of], dtype=torch.float64)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, mode, world.vocab)
    target = torch.tensor([world.p(c) for c in ctx_of], dtype=torch.float64)
    return tree, target, ctx_of


@pytest.mark.parametrize("mode", ["deterministic", "with_replacement", "without_replacement"])
def test_accept_matches_exact_law_of_fixed_trees(mode):
    """Sampling cross-check: ``accept`` on fixed trees follows the enumerated per-tree law."""
    rng = random.Random(f"fixed:{mode}")
    gen = torch.Generator().manual_seed(1234)
    draws = 3000
    checked = 0
    while checked < 3:
        closeness = rng.choice([None, 0.3, 1.0])
        world = World(rng.randrange(2**31), 4, "T0.7_top_p0.8", closeness, rng.randrange(4))
        shape = ((((),), ()), ((),), ())  # 3 children at the root, depth 3
        tree, target, ctx_of = _drafted_tree(world, mode, shape, world.root, rng)
        law = _fixed_tree_law(world, mode, tree, ctx_of)
        if law.max() > 0.999:  # a tree whose outcome is certain tests nothing
            continue
        counts = np.zeros_like(law)
        V = world.vocab
        for _ in range(draws):
            out = accept(tree, target, gen).tokens.tolist()
            out += [V] * (L - len(out))
            counts[int(np.ravel_multi_index(out, (V + 1,) * L))] += 1
        assert_counts_follow_law(counts, law, draws, f"{mode}: {tree}")
        checked += 1
