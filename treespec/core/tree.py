"""DraftTree: a candidate tree of draft tokens as flat parent-pointer arrays.

Glossary (see DESIGN.md):
    root         node 0, the last committed token (not yet in the target's KV cache).
    parents      ``parents[i]`` is the index of node i's parent; ``parents[0] == -1`` and
                 ``parents[i] < i`` (topological order).
    draft_probs  row i is the drafter's q(.|path to i) from which i's children were drawn.
    sampling     how children were chosen: "deterministic" (distinct tokens fixed by the
                 drafter), "with_replacement" (i.i.d. draws from q), "without_replacement"
                 (sequential draws without replacement from q, e.g. Gumbel-top-k).

Everything structural (depth, children, ancestor mask, root-to-leaf paths) is derived from
``parents`` once, here, and cached.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    import networkx

Sampling = Literal["deterministic", "with_replacement", "without_replacement"]
SAMPLING_MODES: tuple[str, ...] = ("deterministic", "with_replacement", "without_replacement")

# Tolerance on the row sums of draft_probs (float32 softmax rows sum to 1 within ~1e-6 * V^0.5).
_ROW_SUM_ATOL = 1e-3


def row_sums(probs: torch.Tensor) -> torch.Tensor:
    """Sums over the last dimension, accumulated in float32 at least (a bf16 accumulation rounds
    the total itself) and float64 for float64 rows: what a row-sum tolerance is checked on."""
    return probs.sum(-1, dtype=torch.float64 if probs.dtype == torch.float64 else torch.float32)


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree in topological order; validated on construction.

    Attributes:
        tokens:      LongTensor[N]; ``tokens[0]`` is the root token.
        parents:     LongTensor[N]; ``parents[0] == -1``, ``0 <= parents[i] < i`` for i > 0.
        draft_probs: FloatTensor[N, V] or None; q(.|path to i) per node (required unless
                     ``sampling == "deterministic"``).
        sampling:    one of SAMPLING_MODES.
        vocab_size:  V, the token range; taken from ``draft_probs`` when given. When both are
                     None, tokens are only checked to be non-negative.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None
    sampling: Sampling = "deterministic"
    vocab_size: int | None = field(default=None)
    # False only for trees made by treespec's own builders (``from_builder``)
    scan_probs: InitVar[bool] = True

    def __post_init__(self, scan_probs: bool) -> None:
        _validate(self, scan_probs)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_builder(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        draft_probs: torch.Tensor | None,
        sampling: Sampling,
    ) -> "DraftTree":
        """A tree made by treespec's own builders: validated like any tree except for the
        O(N·V) scan of ``draft_probs`` (finite, non-negative, rows summing to 1), which their
        softmax rows satisfy by construction, so they skip that pass over the whole [N, V] block."""
        return cls(tokens, parents, draft_probs, sampling, scan_probs=False)

    @classmethod
    def from_paths(
        cls,
        root_token: int,
        paths: Sequence[Sequence[int]],
        draft_probs: torch.Tensor | None = None,
        sampling: Sampling = "deterministic",
        vocab_size: int | None = None,
    ) -> "DraftTree":
        """Build a tree from root-to-leaf token paths (root excluded); shared prefixes merge.

        Node order is breadth-first by depth, then first appearance, so it is topological.
        ``draft_probs`` (if given) must already be indexed in that node order. Repeated sibling
        tokens only make sense for "with_replacement" trees, so paths are merged on tokens.
        """
        if not isinstance(paths, (list, tuple)):
            raise TypeError(f"paths must be a list of token sequences, got {type(paths).__name__}")
        prefixes: dict[tuple[int, ...], int] = {(): 0}
        order: list[tuple[int, ...]] = [()]
        max_len = max((len(p) for p in paths), default=0)
        for depth in range(1, max_len + 1):
            for p in paths:
                if len(p) >= depth:
                    key = tuple(int(t) for t in p[:depth])
                    if key not in prefixes:
                        prefixes[key] = len(order)
                        order.append(key)
        tokens = [int(root_token)] + [key[-1] for key in order[1:]]
        parents = [-1] + [prefixes[key[:-1]] for key in order[1:]]
        return cls(
            torch.tensor(tokens, dtype=torch.long, device="cpu"),
            torch.tensor(parents, dtype=torch.long, device="cpu"),
            draft_probs,
            sampling,
            vocab_size,
        )

    @classmethod
    def from_choices(
        cls,
        root_token: int,
        choices: Sequence[Sequence[int]],
        ranked_tokens: torch.Tensor,
    ) -> "DraftTree":
        """Medusa-style static tree from path tuples of child *ranks*.

        ``(0, 1)`` means "the second-ranked candidate below the top-ranked candidate of depth 1".
        ``ranked_tokens``: LongTensor[D, K], row d = the ranked candidates for depth d + 1
        (positional heads: the same ranking whatever the path). Every prefix of a choice must
        itself be a choice. For path-dependent rankings use ``StaticTreeBuilder``.
        """
        if ranked_tokens.dim() != 2:
            raise ValueError(
                f"ranked_tokens must be LongTensor[D, K] (ranked tokens per depth), got shape "
                f"{tuple(ranked_tokens.shape)}"
            )
        depth_avail, k_avail = ranked_tokens.shape
        norm = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        known = set(norm)
        for c in norm:
            if len(c) == 0:
                raise ValueError("choices must not contain the empty path (the root is implicit)")
            if c[:-1] and c[:-1] not in known:
                raise ValueError(f"choice {c} has no parent choice {c[:-1]}; add every prefix")
            if len(c) > depth_avail or max(c) >= k_avail or min(c) < 0:
                raise ValueError(
                    f"choice {c} needs depth {len(c)} and rank {max(c)}, but ranked_tokens has "
                    f"shape [D={depth_avail}, K={k_avail}]"
                )
        index = {(): 0}
        tokens, parents = [int(root_token)], [-1]
        for c in norm:
            index[c] = len(tokens)
            tokens.append(int(ranked_tokens[len(c) - 1, c[-1]]))
            parents.append(index[c[:-1]])
        return cls(torch.tensor(tokens, device="cpu"), torch.tensor(parents, device="cpu"))

    # ------------------------------------------------------------------ derived structure
    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @cached_property
    def _parents_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def _tokens_list(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def _child_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(parents[1:], tokens[1:]): index [parent of i, token of i] for every non-root node."""
        return self.parents[1:], self.tokens[1:]

    @cached_property
    def _child_draft_probs(self) -> list[float]:
        """q(x_i | path to parent of i) for every node i (0.0 for the root), from draft_probs."""
        par, tok = self._child_index
        return [0.0] + self.draft_probs[par, tok].tolist()

    @cached_property
    def _ancestry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth LongTensor[N], ancestor mask BoolTensor[N, N]) in one topological sweep.

        Row i of the mask is row parents[i] plus i itself: O(N) numpy row copies (one torch op
        per step would cost more than the whole sweep).
        """
        par = self._parents_list
        n = len(par)
        mask = np.zeros((n, n), dtype=np.bool_)
        depth = [0] * n
        mask[0, 0] = True
        for i in range(1, n):
            p = par[i]
            mask[i] = mask[p]
            mask[i, i] = True
            depth[i] = depth[p] + 1
        return torch.tensor(depth, dtype=torch.long, device="cpu"), torch.from_numpy(mask)

    @property
    def depth(self) -> torch.Tensor:
        """LongTensor[N]: root has depth 0."""
        return self._ancestry[0]

    @cached_property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[i]: node indices whose parent is i, in increasing index (trial) order."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self._parents_list[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @property
    def ancestor_mask(self) -> torch.Tensor:
        """BoolTensor[N, N]: ``mask[i, j]`` is True iff j is i or an ancestor of i."""
        return self._ancestry[1]

    @cached_property
    def subtree_sizes(self) -> tuple[int, ...]:
        """subtree_sizes[i]: nodes in the subtree rooted at i, i included."""
        par = self._parents_list
        size = [1] * len(par)
        for i in range(len(par) - 1, 0, -1):  # children come after their parents
            size[par[i]] += size[i]
        return tuple(size)

    @cached_property
    def is_chain(self) -> bool:
        """Every node has at most one child."""
        return all(len(k) <= 1 for k in self.children)

    @cached_property
    def leaves(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.children) if not k)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf node-index paths (root included), one per leaf, in leaf order."""
        par = self._parents_list
        out = []
        for leaf in self.leaves:
            path = [leaf]
            while par[path[-1]] >= 0:
                path.append(par[path[-1]])
            out.append(tuple(reversed(path)))
        return tuple(out)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` (both included)."""
        par = self._parents_list
        path = [node]
        while par[path[-1]] >= 0:
            path.append(par[path[-1]])
        return path[::-1]

    def to_networkx(self) -> "networkx.DiGraph":
        """A DiGraph with edges parent -> child; node attributes ``token`` and ``depth``."""
        import networkx as nx

        g = nx.DiGraph()
        toks, depth = self.tokens.tolist(), self.depth.tolist()
        for i in range(self.num_nodes):
            g.add_node(i, token=toks[i], depth=depth[i])
        for i, p in enumerate(self._parents_list[1:], start=1):
            g.add_edge(p, i)
        return g

    def __repr__(self) -> str:
        return (
            f"DraftTree(N={self.num_nodes}, depth={self.max_depth}, sampling={self.sampling!r}, "
            f"tokens={self.tokens.tolist()}, parents={self.parents.tolist()})"
        )


def check_long_vector(name: str, t, shape: str = "") -> None:
    """``t`` must be a 1-D torch.long tensor; else a TypeError/ValueError naming ``name``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.LongTensor, got {type(t).__name__}")
    if t.dtype != torch.long:
        raise ValueError(f"{name} must have dtype torch.long, got {t.dtype}; use .long()")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D{' ' + shape if shape else ''}, got shape {tuple(t.shape)}")


def _validate(tree: DraftTree, scan_probs: bool = True) -> None:
    tokens, parents, probs = tree.tokens, tree.parents, tree.draft_probs
    for name, t in (("tokens", tokens), ("parents", parents)):
        check_long_vector(name, t, "[N]")
    n = tokens.shape[0]
    if n < 1:
        raise ValueError("a DraftTree needs at least the root node (N >= 1)")
    if parents.shape[0] != n:
        raise ValueError(f"parents has {parents.shape[0]} entries but tokens has {n}; they must match")
    if int(parents[0]) != -1:
        raise ValueError(f"parents[0] must be -1 (the root), got {int(parents[0])}")
    if n > 1:
        idx = torch.arange(1, n, device=parents.device)
        bad = (parents[1:] < 0) | (parents[1:] >= idx)
        if bool(bad.any()):
            i = int(idx[bad][0])
            raise ValueError(
                f"parents must be topological (0 <= parents[i] < i); node {i} has parent "
                f"{int(parents[i])}"
            )
    if tree.sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {tree.sampling!r}")
    vocab = tree.vocab_size
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise TypeError("draft_probs must be a floating-point tensor [N, V]")
        if probs.dim() != 2 or probs.shape[0] != n:
            raise ValueError(f"draft_probs must have shape [N={n}, V], got {tuple(probs.shape)}")
        if vocab is not None and vocab != probs.shape[1]:
            raise ValueError(f"vocab_size={vocab} disagrees with draft_probs' V={probs.shape[1]}")
        vocab = probs.shape[1]
    if probs is not None and scan_probs:
        # One min/max pass (NaN propagates into both) and a sum in the input dtype: far cheaper
        # than `(probs < 0).any()`, `isfinite().all()` and a float64 sum at serving sizes.
        # The row-sum tolerance is 1e-3; float32 sums are far closer than that.
        lo, hi = torch.aminmax(probs) if probs.numel() else (torch.zeros((), device=probs.device),) * 2
        if not (float(lo) >= 0.0 and math.isfinite(float(hi))):
            raise ValueError("draft_probs must be finite and non-negative (rows are distributions)")
        sums = row_sums(probs).double()
        bad_rows = (sums - 1.0).abs() > _ROW_SUM_ATOL
        # Rows of leaves may be all-zero (never used to draw children); inner rows must sum to 1.
        has_kids = torch.zeros(n, dtype=torch.bool, device="cpu")
        if n > 1:
            has_kids[parents[1:].cpu()] = True
        bad_rows = bad_rows.cpu() & (has_kids | (sums.cpu() != 0))
        if bool(bad_rows.any()):
            i = int(bad_rows.nonzero()[0])
            raise ValueError(
                f"draft_probs row {i} sums to {float(sums[i]):.6f}; each row must be a "
                "probability distribution (sum 1)"
            )
    if probs is None and tree.sampling != "deterministic":
        raise ValueError(
            f"a {tree.sampling!r} tree needs draft_probs [N, V] (the q its children were drawn "
            "from); pass draft_probs or use sampling='deterministic'"
        )
    if vocab is not None:
        object.__setattr__(tree, "vocab_size", int(vocab))
    if bool((tokens < 0).any()) or (vocab is not None and bool((tokens >= vocab).any())):
        raise ValueError(f"tokens must lie in [0, V={vocab}), got {tokens.tolist()}")
    if tree.sampling == "deterministic" and n > 1:
        # Sibling tokens must be distinct: a repeated candidate would be tested twice.
        keys = parents[1:] * (int(tokens.max()) + 1) + tokens[1:]
        if keys.unique().numel() != n - 1:
            raise ValueError("deterministic trees need distinct sibling tokens; found a repeat")
