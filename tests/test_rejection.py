"""``accept``: seeded statistics against the target law, determinism, edge cases, bad input.

The exact output law of the rules is proved by enumeration in test_exact_law.py; here the real
code is sampled (chi-square, fixed seeds, p-value threshold 1e-3: a correct implementation
fails with probability 1e-3, but for the fixed seeds below the outcome is deterministic).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from treespec.core.sampling import logits_to_probs
from treespec.core.tree import SAMPLING_MODES, DraftTree
from treespec.core import Acceptance, accept
from treespec.core.rejection import accept_root

from _tiny import one_thread, random_tree  # noqa: F401  (one_thread: autouse fixture)

P_MIN = 1e-3
F64 = torch.float64


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of counts against probs; cells of probability 0 must be empty."""
    assert counts[probs == 0].sum() == 0, "a sequence of target probability 0 was emitted"
    keep = probs > 0
    return float(chisquare(counts[keep], probs[keep] * counts.sum()).pvalue)


# ---------------------------------------------------------------------------- statistics
class TinyWorld:
    """V = 4; p(.|ctx) (temperature 0.8, top-p 0.9: some zeros) and q(.|ctx) (temperature 1,
    full support) are fixed random tables of the context; depth <= 2 below the root."""

    V = 4

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.root = 1
        ctxs = [(self.root,)]
        ctxs += [(self.root, a) for a in range(self.V)]
        ctxs += [(self.root, a, b) for a in range(self.V) for b in range(self.V)]
        self.index = {c: i for i, c in enumerate(ctxs)}
        logits = torch.from_numpy(rng.normal(0.0, 1.5, size=(len(ctxs), self.V)))
        self.p = logits_to_probs(logits, temperature=0.8, top_p=0.9)
        q_logits = logits + torch.from_numpy(rng.normal(0.0, 1.0, size=logits.shape))
        self.q = logits_to_probs(q_logits, temperature=1.0)

    def rows(self, table: torch.Tensor, ctxs: list[tuple[int, ...]]) -> torch.Tensor:
        return table[[self.index[c] for c in ctxs]]

    def two_step_law(self) -> np.ndarray:
        """[V, V]: P(y1, y2) = p(y1|root) p(y2|root, y1)."""
        p1 = self.p[self.index[(self.root,)]].numpy()
        p2 = np.stack([self.p[self.index[(self.root, a)]].numpy() for a in range(self.V)])
        return p1[:, None] * p2


def _inverse_cdf(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Tokens for uniforms u [M] under per-draw CDF rows cdf [M, V]."""
    return np.minimum((u[:, None] >= cdf).sum(1), cdf.shape[1] - 1)


def _draft_tokens(world: TinyWorld, mode: str, rng: np.random.Generator, draws: int) -> np.ndarray:
    """[draws, 6]: a root with 3 children, each with one child, drafted like the mode says.

    deterministic: fixed distinct tokens, and below each q's top-1. with_replacement: i.i.d.
    draws from q. without_replacement: Gumbel-top-3, which is sequential sampling without
    replacement from q. Grandchildren: one draw from q(.|root, child).
    """
    V, root = world.V, world.root
    q_root = world.q[world.index[(root,)]].numpy()
    q_kid = np.stack([world.q[world.index[(root, a)]].numpy() for a in range(V)])
    if mode == "deterministic":  # q's best and two worst: the root's children miss sometimes
        ranked = np.argsort(-q_root, kind="stable")
        kids = np.concatenate([ranked[:1], ranked[-2:]])
        row = np.concatenate([kids, q_kid[kids].argmax(1)])
        return np.tile(row, (draws, 1))
    if mode == "with_replacement":
        u = rng.random((draws, 3))
        kids = np.stack([_inverse_cdf(np.tile(np.cumsum(q_root), (draws, 1)), u[:, j])
                         for j in range(3)], 1)
    else:
        gumbel = -np.log(-np.log(rng.random((draws, V))))
        kids = np.argsort(-(np.log(q_root) + gumbel), axis=1)[:, :3]
    cdf_kid = np.cumsum(q_kid, 1)
    u = rng.random((draws, 3))
    grand = np.stack([_inverse_cdf(cdf_kid[kids[:, j]], u[:, j]) for j in range(3)], 1)
    return np.concatenate([kids, grand], 1)


def _build(world: TinyWorld, mode: str, toks: tuple[int, ...]):
    root = world.root
    tokens = [root] + list(toks)
    parents = [-1, 0, 0, 0, 1, 2, 3]
    ctxs = [(root,)] + [(root, a) for a in toks[:3]] + [(root, a, b) for a, b in zip(toks[:3], toks[3:])]
    draft = None if mode == "deterministic" else world.rows(world.q, ctxs)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), draft, mode, world.V)
    return tree, world.rows(world.p, ctxs)


@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_emitted_tokens_follow_the_target_law(mode):
    """1e5 (drafting + accept) draws: first token ~ p(.|root), first two ~ the 2-step law."""
    draws = 100_000
    world = TinyWorld(seed=7)
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(13)
    V = world.V
    drafted = _draft_tokens(world, mode, rng, draws)
    keys, inverse = np.unique(drafted, axis=0, return_inverse=True)
    built = [_build(world, mode, tuple(int(t) for t in k)) for k in keys]
    first = np.empty(draws, dtype=np.int64)
    second = np.full(draws, -1, dtype=np.int64)  # -1: only one token was emitted
    for i, j in enumerate(inverse.ravel().tolist()):
        out = accept(built[j][0], built[j][1], gen).tokens.tolist()
        first[i] = out[0]
        if len(out) > 1:
            second[i] = out[1]
    accepted = (second >= 0).mean()
    assert 0.2 < accepted < 0.95, f"the world should accept sometimes, not always ({accepted})"
    # one emitted token: the target itself draws the next one from p(.|root, first)
    short = second < 0
    cdf_next = np.cumsum(np.stack([world.p[world.index[(world.root, a)]].numpy()
                                   for a in range(V)]), 1)
    second[short] = _inverse_cdf(cdf_next[first[short]], rng.random(int(short.sum())))
    pairs = np.zeros((V, V), dtype=np.int64)
    np.add.at(pairs, (first, second), 1)
    law = world.two_step_law()
    p_first = _chisquare_pvalue(pairs.sum(1), law.sum(1))
    p_pair = _chisquare_pvalue(pairs.ravel(), law.ravel())
    assert p_first > P_MIN, f"{mode}: first token deviates from p(.|root) (p-value {p_first:.2e})"
    assert p_pair > P_MIN, f"{mode}: first two tokens deviate from the target (p-value {p_pair:.2e})"


def test_chain_accept_counts_follow_beta_powers():
    """One draft token per level, the same p and q at every level: P(A >= i) = β^i."""
    V, k, draws = 6, 3, 10_000
    g = torch.Generator().manual_seed(3)
    p = torch.rand(V, generator=g, dtype=F64)
    p /= p.sum()
    q = torch.rand(V, generator=g, dtype=F64)
    q /= q.sum()
    beta = float(torch.minimum(p, q).sum())
    counts = np.zeros(k + 1)
    trees: dict[tuple[int, ...], DraftTree] = {}
    target = p.expand(k + 1, V)
    drafted = torch.multinomial(q, draws * k, replacement=True, generator=g).view(draws, k)
    for toks in map(tuple, drafted.tolist()):
        if toks not in trees:
            trees[toks] = DraftTree(torch.tensor((0,) + toks), torch.arange(-1, k),
                                    q.expand(k + 1, V), "with_replacement")
        counts[accept(trees[toks], target, g).num_accepted] += 1
    law = np.array([beta**i * (1 - beta) for i in range(k)] + [beta**k])
    assert _chisquare_pvalue(counts, law) > P_MIN


# ---------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("mode", SAMPLING_MODES)
def test_seeded_runs_are_bit_identical(mode):
    rng = random.Random(5)
    differs = 0
    for _ in range(10):
        tree = random_tree(rng, 24, 500, mode)
        logits = torch.randn(24, 500, generator=torch.Generator().manual_seed(rng.randrange(99)))
        # target close to the draft rows so the walk goes deep
        target = (0.5 * (tree.draft_probs if tree.draft_probs is not None else 0)
                  + 0.5 * logits.double().softmax(-1))
        if tree.draft_probs is None:
            target = logits.double().softmax(-1)
        a = accept(tree, target, torch.Generator().manual_seed(42))
        b = accept(tree, target, torch.Generator().manual_seed(42))
        assert torch.equal(a.path, b.path) and torch.equal(a.tokens, b.tokens)
        assert (a.depth_attempts, a.depth_accepts, a.children_tried) == (
            b.depth_attempts, b.depth_accepts, b.children_tried)
        runs = {tuple(accept(tree, target, torch.Generator().manual_seed(s)).tokens.tolist())
                for s in range(8)}
        differs += len(runs) > 1
    assert differs > 0, "the generator seed never changed the outcome"


# ---------------------------------------------------------------------------- behaviour
def _chain(tokens, draft=None, sampling="deterministic", vocab=None):
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.arange(-1, n - 1), draft, sampling, vocab)


def test_root_only_tree_emits_one_bonus_token():
    tree = DraftTree(torch.tensor([3]), torch.tensor([-1]))
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    a = accept(tree, p)
    assert a.path.tolist() == [] and a.tokens.tolist() == [2]
    assert a.depth_attempts == () and a.depth_accepts == () and a.children_tried == 0
    assert a.num_accepted == 0


def test_a_lone_root_draws_from_its_row_with_one_uniform():
    """``accept_root`` (a plain decoding step, ``accept``'s walk for a lone root): the token
    follows the row, and each step draws exactly one float64 uniform, the token being where
    that uniform falls in the row's cumulative sums."""
    p = torch.tensor([[0.1, 0.0, 0.6, 0.3]], dtype=F64)
    gen = torch.Generator().manual_seed(7)
    counts = np.zeros(4)
    for _ in range(4000):
        counts[int(accept_root(p, gen).tokens)] += 1
    assert _chisquare_pvalue(counts, p[0].numpy()) > P_MIN
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(20):
        got = accept_root(p.float(), a)
        u = torch.rand(1, dtype=F64, generator=b).item()
        assert got.tokens.tolist() == [int((p[0].cumsum(0) <= u).sum())] and got.path.numel() == 0
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_lone_roots_draw_from_logits_is_the_draw_from_its_processed_row(temperature):
    """``accept_root_logits`` (the plain decoding step's draw) against ``accept_root`` of the
    processed row, seed for seed: greedy takes the first maximal logit without building the
    one-hot row, and both move the generator by one uniform. Ties and a NaN row included."""
    from treespec.core.rejection import accept_root_logits
    from treespec.core.sampling import SamplingConfig, process

    cfg = SamplingConfig(temperature, top_k=50) if temperature else SamplingConfig(0.0)
    torch.manual_seed(0)
    rows = [torch.randn(1, 300) for _ in range(30)]
    rows[0][0, [17, 200]] = 9.0                            # a tie: the lowest index wins
    if not temperature:
        rows[1][0, 40] = float("nan")                      # NaN counts as the maximum (as max does)
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for logits in rows:
        got, want = accept_root_logits(logits, cfg, a), accept_root(process(logits, cfg), b)
        assert got.tokens.tolist() == want.tokens.tolist() and got.path.numel() == want.path.numel() == 0
    assert torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b))


def test_greedy_is_the_deterministic_rule_with_one_hot_p():
    """T = 0: the walk follows the argmax chain exactly; the new token is the next argmax."""
    V = 7
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))
    p = logits_to_probs(logits, temperature=0.0)
    am = logits.argmax(-1).tolist()
    # root -> [wrong, argmax] ; argmax -> [argmax of row 2] ; a chain whose 3rd token is wrong
    wrong = (am[0] + 1) % V
    tokens = [0, wrong, am[0], am[2], (am[3] + 1) % V]
    parents = [-1, 0, 0, 2, 3]
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
    for seed in range(5):
        a = accept(tree, p[:5], torch.Generator().manual_seed(seed))
        assert a.path.tolist() == [2, 3]
        assert a.tokens.tolist() == [am[0], am[2], am[3]]
        assert a.depth_attempts == (1, 1, 1) and a.depth_accepts == (1, 1, 0)
        assert a.children_tried == 2 + 1 + 1


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement"])
def test_draft_equal_to_target_accepts_every_first_child(mode):
    V = 50
    g = torch.Generator().manual_seed(1)
    q = torch.rand(4, V, generator=g, dtype=F64).softmax(-1)
    tree = DraftTree(torch.tensor([0, 5, 6, 7]), torch.tensor([-1, 0, 0, 1]), q, mode)
    for seed in range(20):
        a = accept(tree, q.clone(), torch.Generator().manual_seed(seed))
        assert a.path.tolist() == [1, 3] and a.children_tried == 2


def test_deterministic_never_accepts_or_resamples_a_zero_probability_token():
    V = 6
    p = torch.tensor([[0.0, 0.0, 0.5, 0.5, 0.0, 0.0]] * 4, dtype=F64)
    tree = DraftTree(torch.tensor([0, 0, 1, 2]), torch.tensor([-1, 0, 0, 0]))  # children 0, 1, 2
    seen = set()
    for seed in range(200):
        a = accept(tree, p, torch.Generator().manual_seed(seed))
        assert a.tokens[0].item() in (2, 3)
        seen.add(tuple(a.tokens.tolist()))
    # token 2 drafted: accepted w.p. 0.5, else the residual puts everything on token 3
    assert seen == {(2, 2), (2, 3), (3,)}


def test_stochastic_never_accepts_a_token_the_target_forbids():
    """Regression: q(x) = 1e-13 > p(x) = 0 and q ≈ p elsewhere leaves a residual of mass
    1e-13. The round-off shortcut used to *accept* x there (emitting a token of target
    probability 0); a forbidden token must always be rejected."""
    p = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]], dtype=F64)
    q = torch.tensor([[0.5, 0.5 - 1e-13, 1e-13], [1 / 3, 1 / 3, 1 / 3]], dtype=F64)
    for mode in ("with_replacement", "without_replacement"):
        tree = DraftTree(torch.tensor([0, 2]), torch.tensor([-1, 0]), q, mode)
        for seed in range(50):
            a = accept(tree, p, torch.Generator().manual_seed(seed))
            assert a.num_accepted == 0 and a.tokens.item() in (0, 1)


def test_rejected_with_replacement_sibling_may_repeat():
    """i.i.d. siblings can repeat a token; a repeat is tried again against the residual."""
    V = 3
    p = torch.tensor([[0.2, 0.8, 0.0]] + [[1.0, 0.0, 0.0]] * 2, dtype=F64)
    q = torch.tensor([[0.5, 0.5, 0.0]] + [[1.0, 0.0, 0.0]] * 2, dtype=F64)
    tree = DraftTree(torch.tensor([0, 0, 0]), torch.tensor([-1, 0, 0]), q, "with_replacement")
    # child 1 (token 0): accept w.p. 0.4; residual = norm(max(p - q, 0)) = [0, 1, 0]:
    # child 2 (token 0 again) is then always rejected and the new token is 1.
    outcomes = {tuple(accept(tree, p, torch.Generator().manual_seed(s)).path.tolist())
                for s in range(100)}
    assert outcomes == {(1,), ()}


def test_float32_rows_are_accepted():
    tree, p = _build(TinyWorld(0), "with_replacement", (0, 1, 0, 2, 3, 1))
    tree32 = DraftTree(tree.tokens, tree.parents, tree.draft_probs.float(), tree.sampling)
    a = accept(tree32, p.float(), torch.Generator().manual_seed(0))
    assert isinstance(a, Acceptance) and 1 <= a.tokens.numel() <= 3


# ---------------------------------------------------------------------------- bad input
def test_wrong_target_shape():
    tree = _chain([0, 1, 2])
    with pytest.raises(ValueError, match=r"target_probs must have shape \[N=3, V\]"):
        accept(tree, torch.rand(2, 5))
    with pytest.raises(ValueError, match=r"target_probs must have shape \[N=3, V\]"):
        accept(tree, torch.rand(3))


def test_target_vocab_disagrees_with_tree():
    tree = _chain([0, 1], vocab=5)
    with pytest.raises(ValueError, match="target_probs has V=4 but the tree's vocab is 5"):
        accept(tree, torch.rand(2, 4))
    with pytest.raises(ValueError, match="tree tokens exceed target vocab V=3"):
        accept(_chain([0, 7]), torch.rand(2, 3))


def test_zero_target_row():
    p = torch.zeros(2, 4)
    p[1, 0] = 1.0
    with pytest.raises(ValueError, match="target_probs row 0 sums to 0"):
        accept(_chain([0, 1]), p)


def test_child_outside_the_draft_support():
    q = torch.tensor([[0.0, 1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    tree = _chain([0, 2], q, "with_replacement")
    with pytest.raises(ValueError, match="child token 2 has draft probability 0.0"):
        accept(tree, torch.full((2, 3), 1 / 3))


def test_without_replacement_repeated_sibling():
    q = torch.tensor([[0.5, 0.5, 0.0]] + [[1 / 3] * 3] * 2)
    tree = DraftTree(torch.tensor([0, 1, 1]), torch.tensor([-1, 0, 0]), q, "without_replacement")
    p = torch.tensor([[0.0, 0.0, 1.0]] * 3)  # every child is rejected
    with pytest.raises(ValueError, match=r"\(after removing earlier siblings\)"):
        accept(tree, p)


def test_without_replacement_more_children_than_draft_support():
    q = torch.tensor([[0.5, 0.5, 0.0]] + [[1 / 3] * 3] * 3)
    tree = DraftTree(torch.tensor([0, 0, 1, 2]), torch.tensor([-1, 0, 0, 0]), q,
                     "without_replacement")
    p = torch.tensor([[0.0, 0.0, 1.0]] * 4)
    with pytest.raises(ValueError, match="more children than tokens with draft probability > 0"):
        accept(tree, p)
