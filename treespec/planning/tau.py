"""Expected tokens per step (τ) for chains and trees, and the optimal tree of each budget.

Glossary:
    β (beta)            per-token acceptance rate of one draft token drawn from q against
                        target p: β = Σ_x min(p(x), q(x)) = 1 − TVD(p, q).
    τ (tau)             expected tokens emitted per target forward (accepted + the new token).
    acceptance vector   Sequoia's positional acceptance (Chen et al. 2024, "Sequoia", §3):
                        p[i] = P(the (i+1)-th child of a node is the one accepted | the node was
                        reached), the same at every node. The events are disjoint, so
                        Σ p[i] <= 1. Usually non-increasing (the drafter's best candidates are
                        tried first), though measured vectors may have noisy tails.
    budget              tree nodes, the root included: the tokens of one verify pass (the
                        word means this everywhere in treespec). Budget 1 is plain decoding.
    drafts              draft nodes, the root excluded: budget − 1.
    value of a node     P(node accepted) = product of p[rank] over the path from the root.
                        τ = 1 + Σ values (each accepted node is a token, plus the new token).

Optimal tree: with a non-increasing p every child is worth at most its parent and every later
sibling at most the earlier one, so the d most valuable nodes of the infinite depth-limited
tree form a valid tree, and no tree of that size is worth more. Best-first growth (a heap on
value) therefore yields Sequoia's DP optimum for *every* size at once, in O(d · log d)
(``optimal_trees``). For a vector that increases somewhere, best-first growth still
gives valid trees but only a lower bound of the optimum; ``optimal_tree`` is exact for any vector,
one size at a time, with Sequoia's dynamic programme over (nodes, depth):
    T(n, d) = best τ of a tree with at most n nodes (root incl.) and depth <= d;
    T(1, d) = 1,  T(n, 0) = 1,  T(n, d) = 1 + G_d(0, n - 1)
    G_d(i, m) = best value of at most m nodes placed below children of rank >= i
              = max(0, max_{1<=s<=m} a[i]·T(s, d - 1) + G_d(i + 1, m - s)).
A child of rank i exists only if ranks < i exist (children are tried in order), which the
recursion over i encodes. The tests cross-check the two.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import torch

from treespec.core.tree import DraftTree

__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_SIBLINGS",
    "OptimalTree",
    "acceptance_rate",
    "acceptance_vector",
    "expected_chain_tokens",
    "expected_tokens_positional",
    "expected_tree_tokens",
    "optimal_tree",
    "optimal_trees",
    "validate_acceptance",
]


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """β = Σ_x min(p(x), q(x)) = 1 − TVD(p, q) over the last dim; [..., V] -> [...].

    This is the probability that standard speculative sampling accepts one token drawn from q
    (accept w.p. min(1, p/q): Σ_x q(x)·min(1, p(x)/q(x)) = Σ_x min(p(x), q(x))).
    """
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)


def expected_chain_tokens(beta: float, k: int) -> float:
    """τ of a chain of k draft tokens with i.i.d. per-token acceptance β.

    Token i (1-based) is emitted iff the first i are all accepted (prob β^i), plus the one new
    token always: τ = Σ_{i=0..k} β^i = (1 − β^(k+1)) / (1 − β), and k + 1 at β = 1.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if k < 0:
        raise ValueError(f"k (chain length) must be >= 0, got {k}")
    if beta == 1.0:
        return float(k + 1)
    return (1.0 - beta ** (k + 1)) / (1.0 - beta)


def expected_tree_tokens(tree: DraftTree, node_accept_probs: torch.Tensor) -> float:
    """τ of a tree from per-node acceptance probabilities.

    ``node_accept_probs[i]`` (FloatTensor[N]) is P(node i is accepted | its parent was reached),
    e.g. p(x_i | path) for deterministic children under the target; entry 0 (the root) is
    ignored. Node i is on the accepted path with probability R_i = Π_{j on path(i), j≠root}
    a_j, and τ = 1 + Σ_{i≥1} R_i (each accepted node is one token, plus the new token).
    The a_i of siblings must sum to at most 1 (they are disjoint events).
    """
    if node_accept_probs.shape != (tree.num_nodes,):
        raise ValueError(f"node_accept_probs must have shape [N={tree.num_nodes}], got "
                         f"{tuple(node_accept_probs.shape)}")
    a = node_accept_probs.to(torch.float64)
    if bool((a < 0).any()) or bool((a > 1).any()):
        raise ValueError("node_accept_probs must lie in [0, 1]")
    reach = torch.ones(tree.num_nodes, dtype=torch.float64)
    par = tree.parents.tolist()
    for i in range(1, tree.num_nodes):
        reach[i] = reach[par[i]] * a[i]
    return float(1.0 + reach[1:].sum())

# Per-token acceptance β at temperature 0, per drafter kind (override with your measurement).
DEFAULT_BETA: dict[str, float] = {
    # EAGLE (Li et al., ICML 2024) reports acceptance rates α ≈ 0.7-0.8 on MT-bench at T=0 for
    # its one-layer feature drafters (Vicuna / LLaMA2-Chat 7B-70B).
    "eagle": 0.75,
    # Independent small drafts: Leviathan et al. 2023 (Table 3) measure α ≈ 0.5-0.8 for drafts
    # 100-1000x smaller than the target; a 68M draft for Llama-2-7B sits in that range.
    "model": 0.6,
    # First-k-layer self-speculation works only with early-exit training (LayerSkip, Elhoushi
    # et al. 2024, reports ~0.5-0.8 with it); untrained exits are far worse. Placeholder.
    "early_exit": 0.5,
    # Medusa (Cai et al. 2024): the first head's top-1 accuracy is ≈ 0.6 on Vicuna-7B.
    "medusa": 0.6,
    # Prompt / n-gram lookup: entirely task dependent (high when the output copies the
    # prompt). Placeholder.
    "lookup": 0.3,
}

# Siblings per node when a scalar β is expanded into a positional vector.
DEFAULT_SIBLINGS = 8


def acceptance_vector(acceptance: float | Sequence[float], siblings: int = DEFAULT_SIBLINGS) -> tuple[float, ...]:
    """A validated positional acceptance vector.

    A scalar β becomes ``p[i] = β · (1 − β)^i`` for i < ``siblings``: the approximation that
    each further candidate is accepted with probability β given the earlier ones were rejected
    (i.i.d. candidates). Measured vectors decay faster (the target's token is usually among the
    drafter's first few candidates or not at all); pass one when you have it.
    A vector is checked by ``validate_acceptance`` (empty, entries outside [0, 1], sum above 1).
    """
    if isinstance(acceptance, (int, float)):
        beta = float(acceptance)
        if not 0.0 <= beta <= 1.0 or math.isnan(beta):
            raise ValueError(f"acceptance rate β must be in [0, 1], got {acceptance}")
        if not isinstance(siblings, int) or siblings < 1:
            raise ValueError(f"siblings must be a positive int, got {siblings!r}")
        return tuple(beta * (1.0 - beta) ** i for i in range(siblings))
    return validate_acceptance(acceptance)


def expected_tokens_positional(parents: Sequence[int], acceptance: float | Sequence[float]) -> float:
    """τ of a given tree under positional acceptance.

    ``parents``: parent index per node, ``parents[0] == -1``, ``parents[i] < i`` (DraftTree
    order); a node's rank is its position among its parent's children in index order.
    """
    p = acceptance_vector(acceptance)
    if not parents or parents[0] != -1:
        raise ValueError("parents must start with the root's -1")
    value = [1.0] * len(parents)
    children_seen = [0] * len(parents)
    for i in range(1, len(parents)):
        parent = parents[i]
        if not 0 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent} must be in [0, {i})")
        rank = children_seen[parent]
        children_seen[parent] += 1
        value[i] = value[parent] * (p[rank] if rank < len(p) else 0.0)
    return math.fsum(value)


@dataclass(frozen=True)
class OptimalTree:
    """The best tree of one size under a positional acceptance vector.

    Attributes:
        parents:     parent index per node (N = drafts + 1 = budget, root first, topological;
                     siblings in rank order, the first-tried child first).
        tau:         expected tokens per step, 1 + Σ node values.
        level_sizes: nodes per depth, depth 0 (the root) first; ``len - 1`` is the depth.
    """

    parents: tuple[int, ...]
    tau: float
    level_sizes: tuple[int, ...]

    @property
    def drafts(self) -> int:
        """Draft nodes, the root excluded (0 = plain decoding)."""
        return len(self.parents) - 1

    @property
    def budget(self) -> int:
        """Tree nodes, the root included: the ``budget`` of every builder, and the tokens of
        one verify pass."""
        return len(self.parents)

    @property
    def choices(self) -> tuple[tuple[int, ...], ...]:
        """The shape as rank paths from the root (root excluded), ``StaticTreeBuilder``'s form."""
        paths: list[tuple[int, ...]] = [()]
        children = [0] * len(self.parents)
        for parent in self.parents[1:]:
            paths.append(paths[parent] + (children[parent],))
            children[parent] += 1
        return tuple(paths[1:])

    @property
    def depth(self) -> int:
        return len(self.level_sizes) - 1

    @property
    def draft_widths(self) -> tuple[int, ...]:
        """Nodes each drafting pass expands: levels 0 .. depth − 1."""
        return self.level_sizes[:-1]


def optimal_trees(acceptance: float | Sequence[float], max_drafts: int, max_depth: int) -> list[OptimalTree]:
    """The best tree of every size at once: entry d has d draft nodes (d = 0 … ``max_drafts``)
    and depth <= ``max_depth``.

    Best-first growth (see the module docstring): exact for a non-increasing vector, a lower
    bound otherwise (``optimal_tree`` is exact for any vector, one size at a time). The list is
    shorter than max_drafts + 1 when larger trees gain nothing (all remaining nodes are worth 0
    or the depth/sibling limit is reached).
    """
    if not isinstance(max_drafts, int) or max_drafts < 0:
        raise ValueError(f"max_drafts must be an int >= 0, got {max_drafts!r}")
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be an int >= 0, got {max_depth!r}")
    return list(_optimal_trees(acceptance_vector(acceptance), max_drafts, max_depth))


@functools.lru_cache(maxsize=256)
def _optimal_trees(p: tuple[float, ...], max_drafts: int, max_depth: int) -> tuple[OptimalTree, ...]:
    parents, values, depths = [-1], [1.0], [0]
    level_sizes = [1]
    trees = [OptimalTree((-1,), 1.0, (1,))]
    # heap of candidates: (-value, depth, tie-break counter, parent, rank among siblings)
    heap: list[tuple[float, int, int, int, int]] = []
    counter = 0
    if max_depth >= 1:
        heap.append((-p[0], 1, counter, 0, 0))
    tau = 1.0
    while heap and len(parents) <= max_drafts:
        neg_value, depth, _, parent, rank = heapq.heappop(heap)
        if neg_value == 0.0:
            break
        node = len(parents)
        parents.append(parent)
        values.append(-neg_value)
        depths.append(depth)
        if depth == len(level_sizes):
            level_sizes.append(0)
        level_sizes[depth] += 1
        tau += -neg_value
        trees.append(OptimalTree(tuple(parents), tau, tuple(level_sizes)))
        counter += 1
        if depth < max_depth:  # first child of the new node
            heapq.heappush(heap, (neg_value * p[0], depth + 1, counter, node, 0))
        if rank + 1 < len(p):  # next sibling of the new node
            counter += 1
            heapq.heappush(heap, (-values[parent] * p[rank + 1], depth, counter, parent, rank + 1))
    return tuple(trees)


_SUM_ATOL = 1e-6


def validate_acceptance(acceptance: Sequence[float] | torch.Tensor) -> tuple[float, ...]:
    """A positional acceptance vector as a tuple; errors say what is wrong with it."""
    if isinstance(acceptance, torch.Tensor):
        acceptance = acceptance.detach().flatten().tolist()
    if isinstance(acceptance, (str, bytes)) or not isinstance(acceptance, Sequence):
        raise TypeError(f"acceptance must be a sequence of probabilities, got "
                        f"{type(acceptance).__name__}")
    a = tuple(float(x) for x in acceptance)
    if not a:
        raise ValueError("acceptance vector must not be empty")
    for i, x in enumerate(a):
        if not math.isfinite(x) or not 0.0 <= x <= 1.0:
            raise ValueError(f"acceptance vector entries must be probabilities in [0, 1]; "
                             f"a[{i}] = {x}")
    if math.fsum(a) > 1.0 + _SUM_ATOL:
        raise ValueError(f"acceptance vector sums to {math.fsum(a):.6g} > 1, so it is not a "
                         "distribution: a[i] is the probability that child i is THE accepted "
                         "one, and those events are disjoint")
    return a


def optimal_tree(acceptance: float | Sequence[float] | torch.Tensor, budget: int, depth: int) -> OptimalTree:
    """The best tree of at most ``budget`` nodes (root included, as every builder counts) and
    depth <= ``depth`` under a positional acceptance vector (or a β, read as
    ``acceptance_vector(β)``): Sequoia's dynamic programme, exact for any vector, monotone or
    not. It may use fewer nodes than ``budget`` when more are worth nothing."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget (tree nodes, root included) must be an int >= 1, got {budget!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be an int >= 0, got {depth!r}")
    a = acceptance_vector(acceptance) if isinstance(acceptance, (int, float)) else validate_acceptance(acceptance)
    return _optimal_tree(a, budget, depth)


@functools.lru_cache(maxsize=256)
def _optimal_tree(a: tuple[float, ...], budget: int, depth: int) -> OptimalTree:
    n_max = budget
    k = min(len(a), n_max - 1)
    # T[d][n], n = 0..n_max (n = 0 unused); split[d][i][m] = nodes given to rank i's subtree
    T = np.ones((depth + 1, n_max + 1))
    split = np.zeros((depth + 1, max(k, 1), n_max), dtype=np.int64)
    for d in range(1, depth + 1):
        g_next = np.zeros(n_max)  # G_d(k, m) = 0
        for i in range(k - 1, -1, -1):
            g = np.zeros(n_max)
            for m in range(1, n_max):
                s = np.arange(1, m + 1)
                cand = a[i] * T[d - 1][s] + g_next[m - s]
                best = int(np.argmax(cand))  # first maximum: the smallest subtree
                if cand[best] > g[m - 1] and cand[best] > 0:
                    g[m], split[d][i][m] = cand[best], best + 1
                else:  # one node fewer does as well: keep it unused
                    g[m], split[d][i][m] = g[m - 1], -1
            g_next = g
        T[d][1:] = 1.0 + g_next[np.arange(n_max)]
    shape: list[tuple[int, ...]] = []

    def place(prefix: tuple[int, ...], n: int, d: int) -> None:
        """Emit the optimal subtree of <= n nodes and depth <= d rooted at ``prefix``."""
        m, i = n - 1, 0
        while d > 0 and i < k and m > 0:
            s = int(split[d][i][m])
            if s == -1:
                m -= 1
                continue
            if s == 0:
                break
            child = prefix + (i,)
            shape.append(child)
            place(child, s, d - 1)
            m, i = m - s, i + 1

    place((), n_max, depth)
    shape.sort(key=lambda c: (len(c), c))                 # parents first, siblings in rank order
    index = {(): 0}
    parents, level_sizes = [-1], [1]
    for c in shape:
        index[c] = len(parents)
        parents.append(index[c[:-1]])
        level_sizes += [0] * (len(c) + 1 - len(level_sizes))
        level_sizes[len(c)] += 1
    return OptimalTree(tuple(parents), float(T[depth][n_max]), tuple(level_sizes))
