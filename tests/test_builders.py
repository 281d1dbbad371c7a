"""Tree builders against references: call counts, EAGLE-2 rerank = brute-force top-N, best-first
= the exact best-first order of the infinite draft tree (and early stop), Sequoia's DP = brute
force over all trees, draws follow q, seeded determinism, and clear errors.

The drafter here is ``TableDrafter``: q(.|path) is a fixed random table of the root-to-node
token path, no model; it checks the expand contract (root alone first, each node once, parents
before children) and records every batch, so tests can count calls and see every scored node.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.core.sampling import SamplingConfig
from treespec.builders import (
    BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, StaticTreeBuilder,
    default_choices, draw_children,
)
from treespec.builders.sequoia import expected_tokens
from treespec.planning import optimal_tree, optimal_trees, validate_acceptance
from treespec.builders.static import validate_choices

GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors gain nothing from threads; on a busy 2-core box threads cost ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)



T1 = SamplingConfig(temperature=1.0)
STOCHASTIC = ("with_replacement", "without_replacement")


class TableDrafter:
    """q(.|path) = softmax(scale * N(0, 1) table keyed by the token path); see module docstring.

    ``override(path) -> logits | None`` replaces rows (to build ties or peaked regions).
    """

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = False

    def __init__(self, vocab: int = 8, seed: int = 0, scale: float = 2.0, override=None):
        self.vocab_size, self.seed, self.scale, self.override = vocab, seed, scale, override
        self.calls = 0
        self.batches: list[list[int]] = []
        self.tree: PartialTree | None = None
        self._expanded: set[int] = set()
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        if path not in self._memo:
            row = self.override(path) if self.override is not None else None
            if row is None:
                g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, path)).encode()))
                row = torch.randn(self.vocab_size, generator=g) * self.scale
            self._memo[path] = row
        return self._memo[path]

    def q(self, path: tuple[int, ...]) -> torch.Tensor:
        return self.logits(path).float().softmax(-1)

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        pass

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        if tree is not self.tree:
            self.tree, self._expanded = tree, set()
        assert nodes, "empty expand call"
        assert (0 in nodes) == (not self._expanded), "the root must be expanded first, alone"
        for n in nodes:
            assert n not in self._expanded, f"node {n} expanded twice"
            assert n == 0 or tree.parents[n] in self._expanded, f"node {n} before its parent"
        self._expanded.update(nodes)
        self.calls += 1
        self.batches.append(list(nodes))
        return torch.stack([self.logits(path_tokens(tree, n)) for n in nodes])

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        pass


def path_tokens(tree: PartialTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[i] for i in tree.path_to(node))


def tree_paths(built) -> set[tuple[int, ...]]:
    t = built.tree
    toks = t.tokens.tolist()
    return {tuple(toks[i] for i in t.path_to(n)) for n in range(t.num_nodes)}


def build(builder, drafter, sampling=GREEDY, seed=0, root=3):
    gen = torch.Generator().manual_seed(seed)
    return builder.build(drafter, root, sampling, gen)


# ---------------------------------------------------------------- efficiency: calls
def test_one_batched_call_per_depth_or_round() -> None:
    d = TableDrafter()
    built = build(ChainBuilder(budget=6), d)
    assert d.calls == built.drafter_calls == 5 and all(len(b) == 1 for b in d.batches)

    d = TableDrafter()
    builder = StaticTreeBuilder.default(32)
    built = build(builder, d)
    assert built.tree.num_nodes == 32
    assert d.calls == built.drafter_calls == builder.max_depth
    depth = built.tree.depth
    inner = {int(built.source[i]) for i in range(built.tree.num_nodes) if built.tree.children[i]}
    assert sum(len(b) for b in d.batches) == len(inner)  # each inner node once
    for level, batch in enumerate(d.batches):  # call k expands exactly the inner nodes of depth k
        assert {int(depth[built.source.tolist().index(n)]) for n in batch} == {level}

    d = TableDrafter()
    built = build(DynamicTreeBuilder(budget=32, depth=5, top_k=4), d)
    assert d.calls == built.drafter_calls == 5
    assert [len(b) for b in d.batches] == [1, 4, 4, 4, 4]
    assert built.drafted == 1 + 4 + 4 * 16

    for mode in ("deterministic",) + STOCHASTIC:
        d = TableDrafter(scale=1.0)
        sampling = GREEDY if mode == "deterministic" else T1
        built = build(BestFirstBuilder(budget=32, max_width=4, max_rounds=6, mode=mode), d, sampling)
        assert d.calls == built.drafter_calls <= 6
        assert all(len(b) <= 4 for b in d.batches)
        assert d.calls < sum(len(b) for b in d.batches)  # several nodes per call, not one per node


# ---------------------------------------------------------------- EAGLE-2
@pytest.mark.parametrize("budget,depth,top_k,seed", [(16, 5, 4, 0), (8, 3, 2, 1), (32, 6, 4, 2),
                                                     (4, 5, 4, 3), (60, 4, 3, 4)])
def test_dynamic_rerank_is_brute_force_top_n(budget, depth, top_k, seed) -> None:
    d = TableDrafter(seed=seed, scale=1.5)
    built = build(DynamicTreeBuilder(budget, depth, top_k), d)
    scored = d.tree  # every node the builder scored
    assert scored is not None and built.drafted == len(scored)
    kept = set(built.source.tolist()) - {0}
    # brute force: all scored nodes by score (ties: shallower, then earlier)
    everyone = sorted(range(1, len(scored)), key=lambda n: (-scored.score[n], scored.depth[n], n))
    assert kept == set(everyone[: budget - 1])
    assert len(kept) == min(budget - 1, len(scored) - 1)
    worst_kept = min(scored.score[n] for n in kept)
    assert all(scored.score[n] <= worst_kept for n in set(everyone) - kept)
    for n in kept:  # ancestor-closed
        assert scored.parents[n] == 0 or scored.parents[n] in kept
    assert built.source.tolist() == sorted(built.source.tolist())  # topological order kept
    assert built.tree.max_depth <= depth


def test_dynamic_rerank_keeps_ancestors_under_ties() -> None:
    """One-hot rows (a child scores exactly its parent's score) and uniform rows (equal
    siblings): selected nodes still have all their ancestors."""
    def override(path):
        if len(path) % 2 == 1:
            return torch.tensor([60.0] + [0.0] * 7)  # q(0) == 1.0 in float32: log q == 0
        return torch.zeros(8)  # uniform: 8 tied siblings

    for budget in range(2, 20):
        d = TableDrafter(override=override)
        built = build(DynamicTreeBuilder(budget, depth=4, top_k=3), d)
        t = built.tree
        assert t.num_nodes == budget
        kept = set(built.source.tolist())
        assert all(d.tree.parents[n] in kept for n in kept if n)
        assert t.max_depth <= 4


# ---------------------------------------------------------------- best-first
def brute_best_first(d: TableDrafter, root: int, n: int, max_depth: int = 99) -> set[tuple[int, ...]]:
    """The n best nodes of the infinite draft tree, by exhaustive best-first search: pop the
    best node, push ALL its children. Keys (-score, depth, insertion order) like the builder."""
    counter = itertools.count()
    heap = [(0.0, 0, next(counter), (root,))]
    out: set[tuple[int, ...]] = set()
    while heap and len(out) < n + 1:
        neg, depth, _, path = heapq.heappop(heap)
        out.add(path)
        if depth < max_depth:
            q = d.q(path).double().log().tolist()
            for tok, lq in enumerate(q):
                heapq.heappush(heap, (neg - lq, depth + 1, next(counter), path + (tok,)))
    return out


@pytest.mark.parametrize("budget,width,seed", [(8, 1, 0), (16, 3, 1), (16, 8, 2), (32, 4, 3),
                                               (24, 16, 4)])
def test_best_first_equals_the_best_nodes_of_the_infinite_tree(budget, width, seed) -> None:
    d = TableDrafter(seed=seed, scale=2.5)
    built = build(BestFirstBuilder(budget, max_width=width, max_rounds=100), d)
    assert tree_paths(built) == brute_best_first(d, 3, budget - 1)
    assert built.tree.num_nodes == budget
    assert d.calls < 100  # stopped by itself, not by max_rounds
    # it stopped when nothing could change: more rounds give the same tree and calls
    d2 = TableDrafter(seed=seed, scale=2.5)
    again = build(BestFirstBuilder(budget, max_width=width, max_rounds=1000), d2)
    assert tree_paths(again) == tree_paths(built) and d2.calls == d.calls


def test_best_first_stops_as_soon_as_no_node_can_enter() -> None:
    # Uniform q: after the root's expansion the best budget-1 nodes are root children, and a
    # grandchild (score 2 log 1/8) can never beat them: one call, no speculative expansion.
    d = TableDrafter(override=lambda path: torch.zeros(8))
    built = build(BestFirstBuilder(budget=6, max_width=4, max_rounds=10), d)
    assert d.calls == 1 and built.tree.max_depth == 1 and built.tree.num_nodes == 6
    # A peaked chain (q(0) ~ 0.99): the best nodes form a chain of depth budget - 1 and each
    # round can only confirm one more level, so the calls are exactly budget - 1.
    d = TableDrafter(override=lambda path: torch.tensor([5.0] + [0.0] * 7) * 1.0 + torch.arange(8) * 0.01)
    q0 = float(d.q((3,))[0])
    assert q0 > 0.9
    built = build(BestFirstBuilder(budget=5, max_width=4, max_rounds=10), d)
    assert built.tree.max_depth == 4 and d.calls == 4 + 1 - 1  # depths 0..3 expanded


def test_best_first_respects_max_rounds_and_depth() -> None:
    for rounds in (1, 2, 3):
        d = TableDrafter(scale=3.0, seed=5)
        built = build(BestFirstBuilder(budget=20, max_width=2, max_rounds=rounds), d)
        assert d.calls <= rounds and built.tree.max_depth <= rounds
        # the budget is filled with the best drafted nodes (one round drafts only V = 8)
        assert built.tree.num_nodes == (9 if rounds == 1 else 20)
    d = TableDrafter(override=lambda path: torch.tensor([9.0] + [0.0] * 7))
    built = build(BestFirstBuilder(budget=20, max_width=2, max_rounds=50, max_depth=3), d)
    assert built.tree.max_depth == 3


# ---------------------------------------------------------------- adaptive termination
def test_adaptive_termination_stops_growth() -> None:
    # Confidence halves-ish each level (q(0) ~ 0.6): with a 0.3 threshold growth stops early.
    d_row = torch.tensor([2.0, 0.9, 0.5, 0.2, 0.1, 0.0, -0.5, -1.0])
    assert 0.3 < float(d_row.softmax(-1)[0]) < 0.6
    for builder, full in ((DynamicTreeBuilder(16, depth=6, top_k=2, min_confidence=0.2),
                           DynamicTreeBuilder(16, depth=6, top_k=2)),
                          (BestFirstBuilder(16, max_width=2, max_rounds=8, min_confidence=0.2),
                           BestFirstBuilder(16, max_width=2, max_rounds=8))):
        d, d_full = TableDrafter(override=lambda p: d_row), TableDrafter(override=lambda p: d_row)
        short, long_ = build(builder, d), build(full, d_full)
        assert d.calls < d_full.calls
        assert short.tree.max_depth < long_.tree.max_depth
        for mode in STOCHASTIC:  # the same option in stochastic modes
            cfg = dict(builder.config.__dict__, mode=mode)
            d_s = TableDrafter(override=lambda p: d_row)
            built = build(type(builder)(**cfg), d_s, T1)
            assert d_s.calls < d_full.calls


def test_adaptive_chain_stops_where_the_path_confidence_falls_below_the_threshold() -> None:
    """Each draft's top q is 0.999 at the root, then 0.6, then flat: the path's best confidence
    runs 0.999, 0.6, 0.6 / 8, so a 0.5 threshold keeps two drafts of four, in every mode (the
    second draft is kept whichever token is drawn: the stop reads q, not the draw)."""
    def row(path: tuple[int, ...]) -> torch.Tensor:
        top = {1: 0.999, 2: 0.6}.get(len(path), 1 / 8)
        q = torch.full((8,), (1 - top) / 7)
        q[0] = top
        return q.log()

    for sampling, modes in ((GREEDY, ("deterministic",)), (T1, STOCHASTIC)):
        for mode in modes:
            d = TableDrafter(override=row)
            built = build(ChainBuilder(budget=5, mode=mode, min_confidence=0.5), d, sampling, seed=2)
            assert built.tree.num_nodes == 3 and built.tree.is_chain, mode
            assert d.calls == 3 and built.drafter_calls == 3      # the third call's top q stopped it
            full = build(ChainBuilder(budget=5, mode=mode), TableDrafter(override=row), sampling, seed=2)
            assert full.tree.num_nodes == 5


@pytest.mark.parametrize("sampling,mode", [(GREEDY, "deterministic"), (T1, "with_replacement"),
                                           (T1, "without_replacement")])
def test_adaptive_chain_with_an_unsure_first_draft_is_the_root_alone(sampling, mode) -> None:
    d = TableDrafter(override=lambda path: torch.zeros(8))      # flat q: top q 1/8
    built = build(ChainBuilder(budget=5, mode=mode, min_confidence=0.2), d, sampling)
    assert built.tree.num_nodes == 1 and d.calls == 1
    assert built.tree.sampling == "deterministic"              # no draft: the same tree in every mode


# ---------------------------------------------------------------- static trees
def test_static_tree_fills_ranks_from_each_node_own_q() -> None:
    choices = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 3)]
    d = TableDrafter(seed=7)
    built = build(StaticTreeBuilder(choices), d)
    t = built.tree
    assert t.num_nodes == 9 and d.calls == 3
    toks = t.tokens.tolist()
    index = {(): 0}
    for c in validate_choices(choices):  # the builder's node order: by depth, then ranks
        index[c] = len(index)
        parent_path = tuple(toks[i] for i in t.path_to(index[c[:-1]]))
        ranked = torch.argsort(d.q(parent_path), descending=True, stable=True).tolist()
        assert toks[index[c]] == ranked[c[-1]]
    assert t.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4, 5]


def test_choices_validation_and_defaults() -> None:
    with pytest.raises(ValueError, match="no parent choice"):
        StaticTreeBuilder([(0,), (1, 0)])
    with pytest.raises(ValueError, match="empty path"):
        StaticTreeBuilder([(0,), ()])
    with pytest.raises(ValueError, match="negative"):
        StaticTreeBuilder([(0,), (-1,)])
    with pytest.raises(ValueError, match="twice"):
        StaticTreeBuilder([(0,), (0,)])
    with pytest.raises(TypeError, match="rank tuples"):
        StaticTreeBuilder("0,1")
    with pytest.raises(TypeError, match="ints"):
        StaticTreeBuilder([(0.5,)])
    for n in (1, 4, 8, 16, 32, 64):
        ch = default_choices(n)
        assert len(ch) == n - 1 and validate_choices(ch) == ch
        assert max((len(c) for c in ch), default=0) <= 5
        assert StaticTreeBuilder.default(n).budget == n
    assert default_choices(64)[:3] == ((0,), (1,), (2,))
    with pytest.raises(ValueError, match="exceeds the drafter's vocabulary"):
        build(StaticTreeBuilder([(0,), (8,)]), TableDrafter(vocab=8))


# ---------------------------------------------------------------- Sequoia
def all_trees(n: int, depth: int):
    """Every ordered tree with exactly n nodes and depth <= depth, as nested child lists."""
    if n == 1:
        yield ()
        return
    if depth == 0:
        return
    for first in range(1, n):  # nodes in the first child's subtree
        for sub in all_trees(first, depth - 1):
            for rest in all_trees(n - first, depth):
                yield (sub,) + rest


def tree_value(tree, a) -> float:
    return 1.0 + sum((a[i] if i < len(a) else 0.0) * tree_value(sub, a) for i, sub in enumerate(tree))


VECTORS = [(0.6, 0.2, 0.1), (0.3, 0.5, 0.1), (0.9,), (0.25, 0.25, 0.25, 0.25), (0.5, 0.0, 0.4),
           (0.05, 0.02)]


@pytest.mark.parametrize("a", VECTORS)
def test_optimal_tree_equals_brute_force(a) -> None:
    for budget in range(1, 8):
        for depth in range(1, 5):
            best = max(tree_value(t, a) for n in range(1, budget + 1) for t in all_trees(n, depth))
            best_tree = optimal_tree(a, budget, depth)
            tau, shape = best_tree.tau, best_tree.choices
            assert tau == pytest.approx(best, abs=1e-12), (a, budget, depth)
            assert len(shape) + 1 <= budget and max((len(c) for c in shape), default=0) <= depth
            assert validate_choices(shape) == shape
            assert expected_tokens(a, shape) == pytest.approx(tau, abs=1e-12)


def test_optimal_tree_cache_and_builder() -> None:
    a = (0.6, 0.2, 0.1)
    assert optimal_tree(a, 32, 6) is optimal_tree(list(a), 32, 6)  # cached
    tau, shape = optimal_tree(a, 16, 4).tau, optimal_tree(a, 16, 4).choices
    b = SequoiaBuilder(16, 4, acceptance=a)
    assert b.choices == shape and b.budget == 16 and b.expected_tokens == tau
    d = TableDrafter()
    built = build(b, d)
    assert built.tree.num_nodes == len(shape) + 1 and d.calls == max(len(c) for c in shape)
    for budget in (4, 9, 20):  # the best-first optimum of every size at once (monotone a) agrees
        assert optimal_tree(a, budget, 5).tau == pytest.approx(optimal_trees(a, budget - 1, 5)[budget - 1].tau)


@pytest.mark.parametrize("bad,match", [((-0.1, 0.5), "in \\[0, 1\\]"), ((0.7, 0.5), "not a distribution"),
                                       ((), "empty"), ((float("nan"),), "in \\[0, 1\\]"),
                                       ("0.5", "sequence")])
def test_bad_acceptance_vectors(bad, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        optimal_tree(bad, 8, 3)
    with pytest.raises((ValueError, TypeError), match=match):
        SequoiaBuilder(8, 3, acceptance=bad)
    assert validate_acceptance(torch.tensor([0.5, 0.25])) == (0.5, 0.25)


# ---------------------------------------------------------------- draws follow q
def test_draw_children_follow_q() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    qd = q.double().numpy() / q.double().sum().item()
    rows = q.expand(4000, -1).contiguous()
    iid = draw_children(rows, 3, "with_replacement", gen)
    counts = np.bincount([t for e in iid for t in e.tokens], minlength=6)
    assert chisquare(counts, qd * counts.sum()).pvalue > 1e-3
    for e in iid[:50]:  # log q of each draw is recorded, and slots plan with sorted q
        assert e.logq == pytest.approx([math.log(float(q[t])) for t in e.tokens])
        assert e.slot_logq == pytest.approx([math.log(float(x)) for x in q[:3]])
    wor = draw_children(rows, 2, "without_replacement", gen)
    assert all(len(set(e.tokens)) == 2 for e in wor)
    pairs = np.zeros((6, 6))
    for e in wor:
        pairs[e.tokens[0], e.tokens[1]] += 1
    law = qd[:, None] * qd[None, :] / (1 - qd[:, None])  # sequential draws w/o replacement
    np.fill_diagonal(law, 0.0)
    mask = law > 0
    assert chisquare(pairs[mask], law[mask] / law[mask].sum() * len(wor)).pvalue > 1e-3
    # and the test has power: a draw that always takes the larger of two i.i.d. draws fails
    biased = [max(e.tokens[:2], key=lambda t: float(q[t])) for e in iid]
    counts = np.bincount(biased, minlength=6)
    assert chisquare(counts, qd * counts.sum()).pvalue < 1e-3
    # a peaked q: the i.i.d. stream repeats the top token, so the draws continue from q with the
    # drawn tokens masked out; the order law must not change
    peaked = torch.tensor([0.96, 0.02, 0.01, 0.006, 0.004, 0.0])
    pk = peaked.double().numpy() / peaked.double().sum().item()
    wor = draw_children(peaked.expand(3000, -1).contiguous(), 5, "without_replacement", gen)
    assert all(sorted(e.tokens) == [0, 1, 2, 3, 4] for e in wor)  # capped by the support
    second = np.bincount([e.tokens[1] for e in wor], minlength=6)
    law2 = np.array([sum(pk[x] * pk[y] / (1 - pk[x]) for x in range(5) if x != y) for y in range(6)])
    assert second[5] == 0 and (law2[:5] * len(wor) > 5).all()
    assert chisquare(second[:5], law2[:5] / law2[:5].sum() * len(wor)).pvalue > 1e-3
    # drawing 1 up front and extending by 1 continues the same sequential law
    ext = [e.extended(q, 1, "without_replacement", gen)
           for e in draw_children(rows[:3000], 6, "without_replacement", gen, draws=1)]
    assert all(len(e.tokens) == 2 and len(e.slot_logq) == 6 and e.tokens[0] != e.tokens[1] for e in ext)
    pairs = np.zeros((6, 6))
    for e in ext:
        pairs[e.tokens[0], e.tokens[1]] += 1
    assert chisquare(pairs[mask], law[mask] / law[mask].sum() * len(ext)).pvalue > 1e-3
    assert e.logq == pytest.approx([math.log(float(q[t])) for t in e.tokens])
    det = draw_children(torch.tensor([[0.1, 0.0, 0.6, 0.3]]), 4, "deterministic", gen)[0]
    assert det.tokens == [2, 3, 0]  # top-k, capped by the support


# ---------------------------------------------------------------- determinism, modes, errors
ALL_BUILDERS = {
    "chain": lambda mode: ChainBuilder(budget=5, mode=mode),
    "static": lambda mode: StaticTreeBuilder(default_choices(12), mode=mode),
    "dynamic": lambda mode: DynamicTreeBuilder(12, 4, 3, mode=mode),
    "best_first": lambda mode: BestFirstBuilder(12, 3, 5, mode=mode),
    "sequoia": lambda mode: SequoiaBuilder(12, 4, mode=mode),
}


@pytest.mark.parametrize("name", sorted(ALL_BUILDERS))
def test_seeded_builds_repeat_and_greedy_is_deterministic(name) -> None:
    for mode in STOCHASTIC:
        a = build(ALL_BUILDERS[name](mode), TableDrafter(scale=1.0), T1, seed=11)
        b = build(ALL_BUILDERS[name](mode), TableDrafter(scale=1.0), T1, seed=11)
        assert a.tree.tokens.tolist() == b.tree.tokens.tolist()
        assert a.tree.parents.tolist() == b.tree.parents.tolist()
        assert a.tree.num_nodes <= ALL_BUILDERS[name](mode).budget
        # a greedy target turns every mode into deterministic candidates
        g = build(ALL_BUILDERS[name](mode), TableDrafter(scale=1.0), GREEDY, seed=11)
        assert g.tree.sampling == "deterministic" and g.tree.draft_probs is None


def test_budget_one_is_just_the_root() -> None:
    for b in (DynamicTreeBuilder(1), BestFirstBuilder(1), SequoiaBuilder(1, 3),
              StaticTreeBuilder.default(1)):
        d = TableDrafter()
        built = build(b, d)
        assert built.tree.num_nodes == 1 and d.calls == 0


@pytest.mark.parametrize("make,match", [
    (lambda: DynamicTreeBuilder(budget=0), "budget must be an int >= 1"),
    (lambda: DynamicTreeBuilder(depth=0), "depth must be an int >= 1"),
    (lambda: DynamicTreeBuilder(top_k=0), "top_k must be an int >= 1"),
    (lambda: DynamicTreeBuilder(budget=True), "budget must be an int"),
    (lambda: DynamicTreeBuilder(mode="greedy"), "sampling mode must be one of"),
    (lambda: DynamicTreeBuilder(min_confidence=1.0), "min_confidence"),
    (lambda: BestFirstBuilder(budget=0), "budget must be an int >= 1"),
    (lambda: BestFirstBuilder(max_width=0), "max_width must be an int >= 1"),
    (lambda: BestFirstBuilder(max_rounds=0), "max_rounds must be an int >= 1"),
    (lambda: BestFirstBuilder(max_depth=0), "max_depth must be an int >= 1"),
    (lambda: BestFirstBuilder(min_confidence=-0.1), "min_confidence"),
    (lambda: SequoiaBuilder(budget=0), "budget must be an int >= 1"),
    (lambda: SequoiaBuilder(depth=0), "depth must be an int >= 1"),
    (lambda: ChainBuilder(budget=0), "budget \\(chain nodes incl. the root\\) must be an int >= 1"),
    (lambda: ChainBuilder(budget=5, min_confidence=1.0), "min_confidence"),
    (lambda: StaticTreeBuilder([(0,)], mode="iid"), "sampling mode must be one of"),
])
def test_bad_config_raises_clear_errors(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_top_k_above_vocab_raises_at_build() -> None:
    with pytest.raises(ValueError, match="top_k=9 exceeds the drafter's vocabulary V=8"):
        build(DynamicTreeBuilder(16, 3, top_k=9), TableDrafter(vocab=8))


@pytest.mark.parametrize("mode", STOCHASTIC)
def test_stochastic_dynamic_and_best_first_fill_the_budget_in_depth(mode) -> None:
    """Without a final cut, stochastic trees still use the whole budget and grow deep where
    the drafter is confident (the allocation plans deeper levels instead of filling the first
    ones)."""
    for budget, top_k in ((16, 4), (64, 8)):
        for builder in (DynamicTreeBuilder(budget, 6, top_k, mode=mode),
                        BestFirstBuilder(budget, max_width=top_k, max_rounds=7, mode=mode)):
            d = TableDrafter(vocab=64, scale=4.0, seed=budget)
            built = build(builder, d, T1)
            assert built.tree.num_nodes == budget and built.drafted == budget
            assert built.tree.max_depth >= 4, (builder, torch.bincount(built.tree.depth).tolist())


def test_measure_acceptance_vector() -> None:
    from _engine_helpers import NoisyTargetDrafter, peaky_target

    from treespec.calibrate.drafters import measure_acceptance_vector

    target = peaky_target(8, seed=0, num_layers=2, std=0.3)
    # the target drafting for itself at T = 0: its top candidate is always the accepted one
    assert measure_acceptance_vector("target", target, [[1, 2, 3]], width=3, max_new_tokens=12) \
        == (1.0, 0.0, 0.0)
    drafter = NoisyTargetDrafter(target.model, noise=2.0, seed=0)
    a = measure_acceptance_vector(drafter, target, [[1, 2, 3], [4, 5]], width=4, max_new_tokens=40,
                                  temperature=1.0, mode="without_replacement")
    assert len(a) == 4 and all(x >= 0 for x in a) and 0 < sum(a) <= 1
    assert a[1] > 0  # a noisy drafter's second draw is sometimes the accepted one
    assert optimal_tree(a, 8, 3).tau > 1.0
    with pytest.raises(ValueError, match="at least one prompt"):
        measure_acceptance_vector("target", target, [], width=2)
