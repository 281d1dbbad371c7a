"""The hybrid drafter's q keeps every token rule exact: an exact computation on tiny vocabularies.

The world of tests/test_exact_law.py (fixed random p tables of the context, V in 4..5, random
tree topologies up to depth 3), with q taken from a real ``HybridDrafter``: a committed history
with repeats (so the lookup matches at many nodes, at several n-gram lengths, and at others not
at all) and a table head that, in half the worlds, cannot propose the last token id at all (like
an EAGLE-3 draft vocabulary), so lookup tokens outside the head's support are drafted. Each node's
q is the hybrid's logits processed as a builder processes them (``draft_distribution``). We
enumerate every drafting outcome (the top-m children, i.i.d. draws, or draws without
replacement, all from that q) and every accept / reject branch (``verify_law``), and check that
the law of the first L emitted tokens equals the target's to 1e-9.

The same q through the block and traversal rules' own enumerations
(tests/test_exact_law_joint.py) matches the target's law to 1e-9 as well.

Two deliberately wrong merges must fail the token check: the lookup's top token spliced in as the
first child with the rest drawn from the head while the tree reports the head's q ("splice"),
and children drawn from the mixture while the tree reports the head's q ("report_head").
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch

from treespec.drafters import HybridConfig, HybridDrafter, PartialTree, TargetFeatures
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import draft_distribution

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_exact_law import CONFIGS, L, MAX_DEPTH, TOL, World, draft_outcomes, random_shape, verify_law
from test_exact_law_joint import Traversal, _block_law

WORLDS_PER_CASE = 40
CASES = [
    ("deterministic", "T1"),
    ("deterministic", "greedy"),
    ("with_replacement", "T1"),
    ("with_replacement", "T0.7_top_p0.8"),
    ("without_replacement", "T1"),
    ("without_replacement", "T1.3_top_k3_min_p0.2"),
]


class TableHead:
    """A model-head stand-in: logits = a seeded N(0, 1.5) row per token path; with ``reduced`` the
    last token id is outside its support (-inf), like a token outside a draft vocabulary."""

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = False

    def __init__(self, vocab: int, seed: int, reduced: bool):
        self.vocab_size, self.seed, self.reduced = vocab, seed, reduced

    def begin(self, prompt_ids, features) -> None:
        pass

    def commit(self, path, tokens, features) -> None:
        pass

    def row(self, path: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(repr((self.seed, path)).encode()))
        row = torch.randn(self.vocab_size, generator=g) * 1.5
        if self.reduced:
            row[-1] = -torch.inf
        return row

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        return torch.stack([self.row(tuple(tree.tokens[i] for i in tree.path_to(n))) for n in nodes])


class HybridTables:
    """q(.|ctx) of a HybridDrafter (and of its head alone) for every context of a World."""

    def __init__(self, world: World, config: str, rng: random.Random):
        v, self.world = world.vocab, world
        self.head = TableHead(v, rng.randrange(2**31), reduced=rng.random() < 0.5)
        cfg = HybridConfig(min_ngram=rng.choice([1, 2]), max_ngram=3, weight=rng.choice([0.3, 0.7, 1.0]),
                           adapt=rng.random() < 0.5)
        self.drafter = HybridDrafter(self.head, cfg)
        # a history with repeats that ends at the root; the last 6 tokens arrive by commit, so an
        # adapting drafter has scored its lookup at several match lengths
        history = [rng.randrange(v) for _ in range(4)] * 3 + [rng.randrange(v) for _ in range(2)]
        history += [world.root]
        self.drafter.begin(torch.tensor(history[:-6]), TargetFeatures.empty())
        self.drafter.commit(torch.zeros(0, dtype=torch.long), torch.tensor(history[-6:]), TargetFeatures.empty())
        self.sampling = SamplingConfig(**CONFIGS[config][1]) if config != "greedy" else SamplingConfig(0.0)
        self._q: dict[tuple[int, ...], list[float]] = {}
        self._head_q: dict[tuple[int, ...], list[float]] = {}
        self.lookup_contexts = 0

    def _tree(self, ctx: tuple[int, ...]) -> tuple[PartialTree, int]:
        tree = PartialTree.rooted(ctx[0])
        node = 0
        for t in ctx[1:]:
            node = tree.add(node, t)
        return tree, node

    @staticmethod
    def _probs(logits: torch.Tensor, sampling: SamplingConfig) -> list[float]:
        # float64 and renormalised: the enumeration's outcome weights must sum to 1 to 1e-12
        q = draft_distribution(logits[None], sampling)[0].double()
        return (q / q.sum()).tolist()

    def q(self, ctx: tuple[int, ...]) -> list[float]:
        if ctx not in self._q:
            tree, node = self._tree(ctx)
            before = self.drafter.lookup_nodes
            self._q[ctx] = self._probs(self.drafter.expand(tree, [node])[0], self.sampling)
            self.lookup_contexts += self.drafter.lookup_nodes > before
        return self._q[ctx]

    def head_q(self, ctx: tuple[int, ...]) -> list[float]:
        if ctx not in self._head_q:
            tree, node = self._tree(ctx)
            self._head_q[ctx] = self._probs(self.head.expand(tree, [node])[0], self.sampling)
        return self._head_q[ctx]

    def lookup_top(self, ctx: tuple[int, ...]) -> int | None:
        _, votes = self.drafter.lookup_votes(list(ctx[1:]))
        return max(votes, key=votes.get) if votes else None


class _QView:
    """What ``draft_outcomes`` reads of a world: q, vocab, seed."""

    def __init__(self, world: World, q):
        self.q, self.vocab, self.seed = q, world.vocab, world.seed


def outcomes(tables: HybridTables, mode: str, ctx: tuple[int, ...], m: int, variant: str):
    """(probability, children tokens) of every drafting outcome at a node with m children."""
    world = tables.world
    if variant == "splice":  # WRONG: lookup's top token first, then i.i.d. draws from the head
        top = tables.lookup_top(ctx)
        rest = draft_outcomes(_QView(world, tables.head_q), mode, ctx, m - (top is not None), "topk")
        return [(w, ([top] if top is not None else []) + xs) for w, xs in rest]
    return draft_outcomes(_QView(world, tables.q), mode, ctx, m, "topk")


def output_law(tables: HybridTables, mode: str, shape: tuple, ctx: tuple[int, ...], k: int,
               variant: str, memo: dict) -> np.ndarray:
    """Exact law of the next k tokens: draft children (``outcomes``), verify, extend with p."""
    key = (shape, ctx, k)
    if key in memo:
        return memo[key]
    world = tables.world
    if not shape:
        out = world.target(ctx, k)
    else:
        out = np.zeros(world.vocab**k)
        p = world.p(ctx)
        reported = None if mode == "deterministic" else (tables.q(ctx) if variant == "right" else tables.head_q(ctx))
        if mode == "deterministic":
            q_draw = tables.q(ctx)  # top-m by q: only tokens with q > 0, as the builders do
        tails = [world.target(ctx + (y,), k - 1) for y in range(world.vocab)]
        for weight, xs in outcomes(tables, mode, ctx, len(shape), variant):
            if mode == "deterministic":
                xs = [x for x in xs if q_draw[x] > 0.0]
            if weight == 0.0 or (reported is not None and any(reported[x] == 0.0 for x in xs)):
                if weight and variant != "right":  # the wrong merge drafts what its q calls impossible
                    out += weight * np.nan
                continue
            subs = [output_law(tables, mode, shape[i], ctx + (x,), k - 1, variant, memo) for i, x in enumerate(xs)]
            out += weight * verify_law(mode, p, reported, xs, subs, tails)
    memo[key] = out
    return out


def _worlds(mode: str, config: str, count: int):
    rng = random.Random(f"hybrid:{mode}:{config}")
    for _ in range(count):
        vocab = rng.choice([4, 5])
        world = World(rng.randrange(2**31), vocab, config, None, rng.randrange(vocab))
        yield world, HybridTables(world, config, rng), random_shape(rng, budget=8)


@pytest.mark.parametrize("mode,config", CASES)
def test_hybrid_q_keeps_the_token_rules_exact(mode, config) -> None:
    worst, lookup_contexts, outside_head = 0.0, 0, 0
    for world, tables, shape in _worlds(mode, config, WORLDS_PER_CASE):
        law = output_law(tables, mode, shape, (world.root,), L, "right", {})
        worst = max(worst, float(np.abs(law - world.target((world.root,), L)).max()))
        lookup_contexts += tables.lookup_contexts
        outside_head += sum(q[-1] > 0.0 for ctx, q in tables._q.items()
                            if tables.head.reduced and len(ctx) < L)
    assert worst <= TOL, f"{mode}/{config}: the hybrid's output law differs from the target's by {worst:.3e}"
    # the worlds must exercise the hybrid: lookup mass at many nodes, tokens only the lookup can draft
    assert lookup_contexts > WORLDS_PER_CASE, lookup_contexts
    assert outside_head > 0, "no node gave the lookup-only token q > 0"


@pytest.mark.parametrize("mode,variant", [("with_replacement", "splice"), ("without_replacement", "report_head"),
                                          ("with_replacement", "report_head")])
def test_wrong_merges_are_caught(mode, variant) -> None:
    """Reporting the head's q for a tree drafted otherwise is biased (or drafts tokens its q calls
    impossible, a NaN here); the check above would see it."""
    worst = 0.0  # over worlds where every drafted token has head q > 0: bias, not only impossibility
    for world, tables, shape in _worlds(mode, "T1", 15):
        law = output_law(tables, mode, shape, (world.root,), L, variant, {})
        err = float(np.abs(law - world.target((world.root,), L)).max())
        worst = worst if np.isnan(err) else max(worst, err)
    assert worst > 1e-3, f"the law check did not notice the wrong merge {variant!r} ({worst:.2e})"


def test_no_match_means_the_heads_own_q() -> None:
    """Where the lookup has nothing (no recurring suffix), q is exactly the head's."""
    head = TableHead(6, seed=3, reduced=True)
    hybrid = HybridDrafter(head, HybridConfig(min_ngram=2))
    hybrid.begin(torch.tensor([0, 1, 2, 3, 4]), TargetFeatures.empty())
    tree = PartialTree.rooted(4)
    q = draft_distribution(hybrid.expand(tree, [0]), SamplingConfig(0.7))
    ref = draft_distribution(head.expand(tree, [0]), SamplingConfig(0.7))
    torch.testing.assert_close(q, ref, atol=1e-6, rtol=0)
    assert hybrid.lookup_nodes == 0


class HybridWorld:
    """A World whose q is the hybrid's (what the joint rules' enumerations read)."""

    def __init__(self, world: World, tables: HybridTables):
        self.p, self.target, self.q = world.p, world.target, tables.q
        self.vocab, self.root, self.seed = world.vocab, world.root, world.seed


JOINT_CASES = [
    ("block", "deterministic", "T1"),
    ("block", "with_replacement", "T1"),
    ("block", "without_replacement", "T0.7_top_p0.8"),
    ("traversal", "deterministic", "greedy"),
    ("traversal", "with_replacement", "T1.3_top_k3_min_p0.2"),
    ("traversal", "without_replacement", "T1"),
]


@pytest.mark.parametrize("rule,mode,config", JOINT_CASES)
def test_hybrid_q_keeps_the_joint_rules_exact(rule, mode, config) -> None:
    worst, lookup_contexts = 0.0, 0
    rng = random.Random(f"hybrid-joint:{rule}:{mode}:{config}")
    for world, tables, shape in _worlds(f"{rule}:{mode}", config, 20):
        hw = HybridWorld(world, tables)
        if rule == "block":
            law = _block_law(hw, mode, rng.randint(1, MAX_DEPTH), "topk")
        else:
            law = Traversal(hw, mode, "topk").node(shape, (world.root,), 1.0, L)
        worst = max(worst, float(np.abs(law - world.target((world.root,), L)).max()))
        lookup_contexts += tables.lookup_contexts
    assert worst <= TOL, f"{rule} {mode}/{config}: the hybrid's output law differs from the target's by {worst:.3e}"
    assert lookup_contexts >= 10, f"the lookup proposed at only {lookup_contexts} contexts"
