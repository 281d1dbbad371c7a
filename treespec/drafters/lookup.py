"""Prompt-lookup drafter: n-gram matches in the context propose the next tokens; no model.

For a node, the context is the committed tokens plus the node's draft path. The longest suffix
n-gram (``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier in the context
votes for the tokens that followed its earlier occurrences (the most recent ``max_matches``).
q mixes those votes with a small uniform floor (``floor``), so q is a proper distribution with
full support: stochastic drafting modes stay exact, and a node without any match gets the
uniform q (whose top-k ranking then carries no information: builders give it a low score).
Cheap enough to run on every node; strong on summarising, rewriting and code-editing prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from treespec.drafters.base import PartialTree, TargetFeatures, register_drafter


@dataclass(frozen=True)
class LookupConfig:
    """max_ngram / min_ngram: suffix lengths tried, longest first; max_matches: earlier
    occurrences that vote (most recent first); floor: uniform probability mass mixed in."""

    max_ngram: int = 3
    min_ngram: int = 1
    max_matches: int = 8
    floor: float = 1e-3

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {self.max_matches}")
        if not 0.0 < self.floor < 1.0:
            raise ValueError(f"floor must be in (0, 1), got {self.floor}")


class LookupDrafter:
    """Prompt-lookup (n-gram) drafter; see the module docstring."""

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = False
    cost_kind = "lookup"

    def __init__(self, vocab_size: int, config: LookupConfig = LookupConfig()):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.config = config
        self.history: list[int] = []
        self.calls = 0

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        self.history = [int(t) for t in prompt_ids.tolist()]

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        self.calls += 1
        # [F, V] log q, built on the host (n-gram votes in numpy); builders move q to the
        # target's device. Only the voted entries differ from the row's constant, so a row is one
        # fill and a few writes, not a pass over V.
        v, floor = self.vocab_size, self.config.floor
        out = torch.empty(len(nodes), v, device="cpu")
        for row, node in enumerate(nodes):
            path = [tree.tokens[n] for n in tree.path_to(node)[1:]]  # root is history[-1]
            votes = self._votes(np.asarray(self.history + path, dtype=np.int64))
            if not votes:
                out[row].fill_(-math.log(v))
                continue
            out[row].fill_(math.log(floor / v))
            total = sum(votes.values())
            toks = list(votes)
            out[row, toks] = torch.tensor([math.log(floor / v + (1.0 - floor) * votes[t] / total) for t in toks])
        return out

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        self.history.extend(int(t) for t in tokens.tolist())

    def _votes(self, ctx: np.ndarray) -> dict[int, int]:
        cfg = self.config
        return suffix_votes(ctx, cfg.max_ngram, cfg.min_ngram, cfg.max_matches)[1]


def suffix_votes(ctx: np.ndarray, max_ngram: int, min_ngram: int, max_matches: int) -> tuple[int, dict[int, int]]:
    """(n, votes): the longest suffix n-gram of ``ctx`` (max_ngram down to min_ngram tokens) that
    occurred earlier, and token -> count of what followed its ``max_matches`` most recent earlier
    occurrences (most recent first). (0, {}) when no suffix of those lengths recurs."""
    n_ctx = ctx.shape[0]
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = ctx[n_ctx - n:]
        # windows starting at s = 0 .. n_ctx - n - 1 (an occurrence must have a follower)
        windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            votes: dict[int, int] = {}
            for s in hits[::-1][:max_matches]:
                tok = int(ctx[s + n])
                votes[tok] = votes.get(tok, 0) + 1
            return n, votes
    return 0, {}

@register_drafter("lookup")
def _lookup_factory(target, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8) -> LookupDrafter:
    """Prompt lookup over the target's vocabulary."""
    return LookupDrafter(target.vocab_size, LookupConfig(max_ngram, min_ngram, max_matches))



class SuffixIndex:
    """``suffix_votes`` of (committed tokens + a short path) without rescanning the committed
    tokens: every n-gram of them (min_ngram..max_ngram tokens) is indexed by its start positions
    as tokens are appended, so a query costs O(n · (path + n)) instead of O(context · n).

    Attributes:
        tokens: the committed tokens.
        starts: n-gram -> its start positions in ``tokens``, ascending.
    """

    def __init__(self, max_ngram: int, min_ngram: int, max_matches: int):
        self.max_ngram, self.min_ngram, self.max_matches = max_ngram, min_ngram, max_matches
        self.tokens: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self.starts.setdefault(tuple(self.tokens[end - n:]), []).append(end - n)

    def votes(self, path: list[int]) -> tuple[int, dict[int, int]]:
        """``suffix_votes(tokens + path, ...)``, the same (n, votes) in the same order."""
        h, total = len(self.tokens), len(self.tokens) + len(path)

        def at(i: int) -> int:
            return self.tokens[i] if i < h else path[i - h]

        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            gram = tuple(at(i) for i in range(total - n, total))
            last = total - n - 1   # the latest start with a follower
            found: list[int] = [s for s in range(last, max(0, h - n + 1) - 1, -1)  # reaching into path
                                if all(at(s + j) == gram[j] for j in range(n))]
            for s in reversed(self.starts.get(gram, ())):                    # inside the tokens
                if len(found) >= self.max_matches:
                    break
                if s <= last:
                    found.append(s)
            if found:
                votes: dict[int, int] = {}
                for s in found[: self.max_matches]:
                    tok = at(s + n)
                    votes[tok] = votes.get(tok, 0) + 1
                return n, votes
        return 0, {}
