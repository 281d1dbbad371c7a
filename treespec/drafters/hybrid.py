"""Two ways to join prompt lookup and a model head: mixed in one tree (``HybridDrafter``), or
one or the other per tree (``SwitchDrafter``).

``HybridDrafter``: prompt-lookup (n-gram) candidates and a model head's candidates in ONE tree.

Glossary:
    head        any model drafter (eagle3, eagle, small...): q_head(.|path), its own distribution.
    match       the longest suffix n-gram (``max_ngram`` down to ``min_ngram`` tokens) of the
                node's context (committed tokens + path) that occurred earlier in it; length n.
    votes v     the distribution of what followed the match's most recent occurrences
                (``treespec.drafters.lookup.suffix_votes``); none without a match.
    weight λ    how much of q the lookup gets at a node: 0 without a match, else λ_n, the
                lookup's estimated hit rate at match length n (see ``HybridConfig``).

At every node the drafter reports ONE distribution, the mixture

    q(.|path) = λ · v(.|path) + (1 − λ) · q_head(.|path)

as its logits (log q). Builders process it like any drafter's logits and draw the children
from exactly the q they put in the tree, so every acceptance rule stays exact; λ and v depend
only on the committed text and the node's path, never on a draw (why that suffices, and why
splicing the lookup token into the head's q would not: docs/exactness.md).
What the mixture does: when the text repeats, λ is high, the lookup's token is the top child
(deterministic) or the likely first draw, and its path keeps matching, so the tree grows a long
lookup chain; the head's candidates stay as siblings (without replacement: the next draws) and
elsewhere, where nothing matches, q is the head's own q.

λ is a speed heuristic, never a correctness one: by default it starts at ``weight`` and learns,
per match length, how often the lookup's top vote was the token the target then emitted
(a Beta-style running mean over the committed text; ``adapt=False`` keeps it fixed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import numpy as np

from treespec.drafters.base import Drafter, PartialTree, TargetFeatures, capabilities, register_drafter
from treespec.drafters.lookup import LookupConfig, LookupDrafter, SuffixIndex


@dataclass(frozen=True)
class HybridConfig:
    """How the lookup part matches and how much of q it gets."""

    min_ngram: int = 2            # shortest suffix match that lets the lookup propose
    max_ngram: int = 4            # longest suffix tried first
    max_matches: int = 8          # most recent earlier occurrences that vote
    weight: float = 0.5           # λ before any evidence (prior hit rate of the lookup)
    prior_strength: float = 4.0   # pseudo-observations behind ``weight`` when adapting
    adapt: bool = True            # learn λ per match length from the committed text

    def __post_init__(self) -> None:
        for name in ("min_ngram", "max_ngram", "max_matches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"need min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                             f"max_ngram={self.max_ngram}; lower min_ngram or raise max_ngram")
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"weight (the lookup's share λ of q) must be in [0, 1], got {self.weight!r}")
        if not self.prior_strength > 0.0 or math.isinf(self.prior_strength):
            raise ValueError(f"prior_strength must be a finite number > 0 (pseudo-observations behind "
                             f"weight; use adapt=False for a fixed λ), got {self.prior_strength!r}")


class HybridDrafter:
    """Lookup + model head in one q (see the module docstring). Wraps ``head``; the builders
    see one ordinary drafter.

    Attributes:
        head:          the wrapped model drafter (expanded on every node the builder asks for).
        history:       the committed tokens (prompt included); history[-1] is the root.
        index:         their n-gram index (``SuffixIndex``): one lookup per node costs O(path).
        hits, trials:  per match length n, the lookup's committed-text record (top vote right /
                       matched positions).
        lookup_nodes:  expanded nodes where the lookup proposed (λ > 0), since ``begin``.
    """

    path_independent = False

    def __init__(self, head: Drafter, config: HybridConfig = HybridConfig()):
        if not isinstance(head, Drafter):
            raise TypeError(f"head must be a Drafter (begin / expand / commit and its capability flags), "
                            f"got {type(head).__name__}; pass e.g. load_drafter('eagle3', target)")
        if isinstance(head, (HybridDrafter, LookupDrafter)):
            raise ValueError(f"head must be a model drafter, got a {type(head).__name__}: the lookup is "
                             f"already the hybrid's other part")
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        self.head, self.config = head, config
        self.needs_target_hidden = head.needs_target_hidden
        self.target_layers = head.target_layers
        self.vocab_size = head.vocab_size
        # the cost model prices the head's pass (the lookup is host work, modelled as free)
        self.cost_kind = getattr(head, "cost_kind", None) or ("eagle" if head.needs_target_hidden
                                                              else "early_exit")
        self.device = getattr(head, "device", None)
        self.index = SuffixIndex(config.max_ngram, config.min_ngram, config.max_matches)
        self.hits = [0] * (config.max_ngram + 1)
        self.trials = [0] * (config.max_ngram + 1)
        self.lookup_nodes = 0
        self.calls = 0
        # the compact columns (``_support``): the head's draft ids, then committed tokens outside them
        self._head_ids: torch.Tensor | None = None   # the draft ids the columns were laid out for
        self._support_ids: torch.Tensor | None = None   # LongTensor[S]: column -> token id
        self._column: dict[int, int] = {}               # token id -> column
        self._placed = 0                                # history tokens already given a column

    def __repr__(self) -> str:
        return f"HybridDrafter(head={type(self.head).__name__}, config={self.config})"

    # ------------------------------------------------------------------ protocol
    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        self.head.begin(prompt_ids, features)
        cfg = self.config
        self.index = SuffixIndex(cfg.max_ngram, cfg.min_ngram, cfg.max_matches)
        self.index.extend(prompt_ids.tolist())
        self.hits = [0] * (self.config.max_ngram + 1)
        self.trials = [0] * (self.config.max_ngram + 1)
        self.lookup_nodes = 0
        self._head_ids = None   # committed tokens of the last request leave the columns

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        """FloatTensor[F, V]: log of λ·v + (1 − λ)·q_head for each node (-inf: q = 0)."""
        self._check_root(tree)
        # [F, V] the head's own q
        q = self.head.expand(tree, nodes).float().softmax(-1)
        return self._mix(q, tree, nodes, None).log()

    def expand_compact(self, tree: PartialTree, nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``expand`` on the columns ``ids`` only: (logits [F, S], ids LongTensor[S] | None).

        With a reduced-vocabulary head (EAGLE-3) q is zero outside its draft ids and the tokens
        the lookup can vote for, which all occur in the context: committed tokens (fixed while
        a tree is built) or path tokens (drawn from these very columns). So ids = the draft ids
        (the head's own columns, in its order) then the committed tokens outside them, in order
        of first occurrence; the builders' O(V) passes run on S columns instead of V.
        """
        compact = getattr(self.head, "expand_compact", None)
        if compact is None:
            return self.expand(tree, nodes), None
        self._check_root(tree)
        logits, head_ids = compact(tree, nodes)
        q = logits.float().softmax(-1)
        if head_ids is None:
            return self._mix(q, tree, nodes, None).log(), None
        support = self._support(head_ids)
        # [F, S] the head's q on its own columns, zero on the committed tokens outside them
        wide = torch.nn.functional.pad(q, (0, support.numel() - q.shape[1]))
        return self._mix(wide, tree, nodes, support).log(), support

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        self.head.commit(path, tokens, features)
        for t in tokens.tolist():
            if self.config.adapt:
                self._score(int(t))
            self.index.extend([t])

    @property
    def history(self) -> list[int]:
        return self.index.tokens

    def lookup_votes(self, path: list[int]) -> tuple[int, dict[int, int]]:
        """(match length n, votes) of the lookup after the root and ``path`` (tokens below it)."""
        return self.index.votes(path)

    # ------------------------------------------------------------------ internals
    def _check_root(self, tree: PartialTree) -> None:
        if not self.history or tree.tokens[0] != self.history[-1]:
            raise ValueError("the tree's root is not the last committed token: call begin() before "
                             "expand(), and commit() after every verified tree")
        self.calls += 1

    def _mix(self, q: torch.Tensor, tree: PartialTree, nodes: list[int], support: torch.Tensor | None) -> torch.Tensor:
        """λ·v + (1 − λ)·q per row. q: FloatTensor[F, W], the head's q on W columns: token ids
        (support None) or ``support``'s ids."""
        keep = [1.0] * len(nodes)
        rows: list[int] = []
        toks: list[int] = []
        mass: list[float] = []
        for r, node in enumerate(nodes):
            path = [tree.tokens[n] for n in tree.path_to(node)[1:]]  # the root is history[-1]
            n, votes = self.index.votes(path)
            if not votes:
                continue
            lam = self.weight(n)
            total = sum(votes.values())
            keep[r] = 1.0 - lam
            rows += [r] * len(votes)
            toks += list(votes)
            mass += [lam * c / total for c in votes.values()]
            self.lookup_nodes += lam > 0.0
        if not rows:   # no node has votes: the head's q as it is
            return q
        # [F, W]: scale each row's head part, then add the lookup's point masses
        mix = q * torch.tensor(keep, dtype=q.dtype, device=q.device)[:, None]
        if support is not None:   # token ids -> their compact columns
            cols = [self._column.get(t) for t in toks]
            if None in cols:
                raise RuntimeError(f"lookup token {toks[cols.index(None)]} outside the compact support (a "
                                   f"path token not drawn from these columns?)")
            toks = cols
        index = (torch.tensor(rows, device=q.device), torch.tensor(toks, device=q.device))
        mix.index_put_(index, torch.tensor(mass, dtype=q.dtype, device=q.device), accumulate=True)
        return mix

    def _support(self, head_ids: torch.Tensor) -> torch.Tensor:
        """LongTensor[S], column -> token id: ``head_ids`` in their order, then the committed
        tokens outside them in order of first occurrence. Grown as the history grows (a new
        tensor each time, so trees already built keep theirs); laid out again for other ids."""
        if self._head_ids is not head_ids:
            self._head_ids, self._support_ids, self._placed = head_ids, head_ids.long(), 0
            self._column = {t: c for c, t in enumerate(head_ids.tolist())}
        history = self.history
        if self._placed < len(history):
            new: list[int] = []
            for t in history[self._placed:]:
                if t not in self._column:
                    self._column[t] = self._support_ids.numel() + len(new)
                    new.append(t)
            self._placed = len(history)
            if new:
                extra = torch.tensor(new, dtype=torch.long, device=head_ids.device)
                self._support_ids = torch.cat((self._support_ids, extra))
        return self._support_ids

    def weight(self, n: int) -> float:
        """λ at match length n: the prior ``weight`` or, adapting, the running hit rate."""
        cfg = self.config
        if not cfg.adapt:
            return cfg.weight
        return (self.hits[n] + cfg.weight * cfg.prior_strength) / (self.trials[n] + cfg.prior_strength)

    def _score(self, token: int) -> None:
        """Record whether the lookup's top vote on the committed text predicted ``token``."""
        n, votes = self.index.votes([])
        if votes:
            self.trials[n] += 1
            self.hits[n] += max(votes, key=votes.get) == token  # ties: the most recent follower


class SwitchDrafter:
    """Prompt lookup where the text repeats, the model head elsewhere: one of the two per tree.

    At each tree's root the drafter looks at the committed text: if its last ``min_ngram`` or
    more tokens occurred earlier (the lookup has votes), the lookup drafts the whole tree and the
    head does not run at all; otherwise the head drafts it. The head catches up on the tokens it
    skipped at its next root (its pending committed tokens, one pass). Where the text is being
    restated this costs nothing per draft, which the mixture of ``HybridDrafter`` cannot offer:
    it runs the head at every node.

    ``head_depth`` caps how deep the head drafts: in a head tree, nodes at that depth or deeper
    get a uniform q without running the head. Paired with a chain's ``min_confidence`` this lets
    one builder draft long lookup chains (free) and short head chains (one head pass per level).

    Exact for the same reason as every drafter: each node's q is a function of the committed
    text and the node's path alone (the choice of drafter is made from the committed text), and
    the builders draw from the q they record. Nodes of a lookup tree where the match ends get the
    lookup's uniform q; a chain with ``min_confidence`` stops there.

    Attributes:
        head, lookup:              the two drafters (``lookup`` a ``LookupDrafter`` over ``config``).
        mode:                      "lookup" or "head" for the tree being built (None between trees).
        lookup_trees, head_trees:  trees drafted by each, since construction.
    """

    path_independent = False

    def __init__(self, head: Drafter, config: LookupConfig = LookupConfig(max_ngram=4, min_ngram=3),
                 head_depth: int | None = None):
        if not isinstance(head, Drafter):
            raise TypeError(f"head must be a Drafter (begin / expand / commit and its capability flags), "
                            f"got {type(head).__name__}; pass e.g. load_drafter('eagle3', target)")
        if isinstance(head, (HybridDrafter, LookupDrafter, SwitchDrafter)):
            raise ValueError(f"head must be a model drafter, got a {type(head).__name__}: the lookup is "
                             f"already the switch's other part")
        if not isinstance(config, LookupConfig):
            raise TypeError(f"config must be a LookupConfig, got {type(config).__name__}")
        if head_depth is not None and (isinstance(head_depth, bool) or not isinstance(head_depth, int)
                                       or head_depth < 1):
            raise ValueError(f"head_depth must be None (no cap) or an int >= 1, got {head_depth!r}")
        self.head_depth = head_depth
        self.head, self.lookup = head, LookupDrafter(head.vocab_size, config)
        self.needs_target_hidden = head.needs_target_hidden
        self.target_layers = head.target_layers
        self.vocab_size = head.vocab_size
        self.cost_kind = capabilities(head).cost_kind     # the cost model prices the head's pass
        self.device = getattr(head, "device", None)
        limit = capabilities(head).max_context
        if limit is not None:
            self.max_context, self.max_context_reason = limit, capabilities(head).max_context_reason
        self.mode: str | None = None
        self._next_mode: str | None = None   # next_mode() for the committed text so far (None: not yet)
        self.lookup_trees = self.head_trees = 0

    def __repr__(self) -> str:
        return f"SwitchDrafter(head={type(self.head).__name__}, config={self.lookup.config})"

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        self.head.begin(prompt_ids, features)
        self.lookup.begin(prompt_ids, features)
        self.mode = self._next_mode = None

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        """FloatTensor[F, V]: the logits of this tree's drafter (chosen at the root)."""
        self._choose(tree, nodes)
        if self.mode == "lookup":
            return self.lookup.expand(tree, nodes)
        return self._capped(tree, nodes, lambda shallow: (self.head.expand(tree, shallow), None))[0]

    def expand_compact(self, tree: PartialTree, nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``expand`` on the head's compact columns in a head tree (lookup trees: all columns)."""
        self._choose(tree, nodes)
        compact = capabilities(self.head).expand_compact
        if self.mode == "lookup" or compact is None:
            return self.expand(tree, nodes), None
        return self._capped(tree, nodes, lambda shallow: compact(tree, shallow))

    def _capped(self, tree: PartialTree, nodes: list[int], run) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run(shallow nodes) -> (logits, ids)`` for the nodes above ``head_depth``; rows of the
        deeper ones are uniform over the same columns (the head does not run for them)."""
        cap = self.head_depth
        shallow = [n for n in nodes if cap is None or tree.depth[n] < cap]
        if len(shallow) == len(nodes):
            return run(nodes)
        if not shallow:       # every node is too deep: uniform over the whole vocabulary
            return torch.zeros(len(nodes), self.vocab_size), None
        logits, ids = run(shallow)
        out = logits.new_zeros(len(nodes), logits.shape[1])
        rows = torch.tensor([i for i, n in enumerate(nodes) if n in set(shallow)], device=logits.device)
        out[rows] = logits
        return out, ids

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        self.head.commit(path, tokens, features)
        self.lookup.commit(path, tokens, features)
        self.mode = self._next_mode = None

    def _choose(self, tree: PartialTree, nodes: list[int]) -> None:
        if 0 not in nodes:
            if self.mode is None:
                raise ValueError("expand the root first: the switch chooses its drafter there")
            return
        history = self.lookup.history
        if not history or tree.tokens[0] != history[-1]:
            raise ValueError("the tree's root is not the last committed token: call begin() before "
                             "expand(), and commit() after every verified tree")
        if self.next_mode() == "lookup":
            self.mode, self.lookup_trees = "lookup", self.lookup_trees + 1
        else:
            self.mode, self.head_trees = "head", self.head_trees + 1

    def next_mode(self) -> str:
        """"lookup" or "head": which drafter drafts the next tree, from the committed text alone
        (the lookup where its last ``min_ngram`` or more tokens occurred earlier). Searched once
        per committed text: a ``SwitchBuilder`` asks before the tree, the root expansion again."""
        if self._next_mode is None:
            history = self.lookup.history
            if not history:
                raise RuntimeError("call begin() before asking which drafter drafts the next tree")
            self._next_mode = "lookup" if self.lookup._votes(np.asarray(history, dtype=np.int64)) else "head"
        return self._next_mode


@register_drafter("hybrid")
def _hybrid_factory(target, head: "str | Drafter" = "eagle3", checkpoint: str | None = None,
                    weight: float = 0.5, min_ngram: int = 2, max_ngram: int = 4,
                    adapt: bool = True) -> HybridDrafter:
    """Prompt lookup + a model head (a registered name, default the shipped eagle3, or a Drafter)."""
    if isinstance(head, str):
        if head == "hybrid" or head.startswith("lookup"):
            raise ValueError(f"head={head!r}: the head must be a model drafter (e.g. 'eagle3', 'eagle', "
                             f"'mtp'); the lookup is already the hybrid's other part")
        from treespec.drafters import load_drafter

        head = load_drafter(head, target, **({} if checkpoint is None else {"checkpoint": checkpoint}))
    elif checkpoint is not None:
        raise ValueError("checkpoint is only used with a head given by name; load the head yourself "
                         "with that checkpoint instead")
    return HybridDrafter(head, HybridConfig(min_ngram=min_ngram, max_ngram=max_ngram, weight=weight,
                                            adapt=adapt))


@register_drafter("switch")
def _switch_factory(target, head: "str | Drafter" = "eagle3", checkpoint: str | None = None,
                    min_ngram: int = 3, max_ngram: int = 4, max_matches: int = 8,
                    head_depth: int | None = None) -> SwitchDrafter:
    """Prompt lookup where the text repeats (a suffix of >= ``min_ngram`` tokens recurs), else the
    head (a registered name, default the shipped eagle3, or a Drafter); one of the two per tree."""
    if isinstance(head, str):
        if head in ("hybrid", "switch") or head.startswith("lookup"):
            raise ValueError(f"head={head!r}: the head must be a model drafter (e.g. 'eagle3', "
                             f"'qwen2.5-coder-0.5b'); the lookup is already the switch's other part")
        from treespec.drafters import load_drafter

        head = load_drafter(head, target, **({} if checkpoint is None else {"checkpoint": checkpoint}))
    elif checkpoint is not None:
        raise ValueError("checkpoint is only used with a head given by name; load the head yourself "
                         "with that checkpoint instead")
    return SwitchDrafter(head, LookupConfig(max_ngram=max_ngram, min_ngram=min_ngram, max_matches=max_matches),
                         head_depth)


@register_drafter("lookup+eagle3")
def _lookup_eagle3_factory(target, checkpoint: str | None = None) -> HybridDrafter:
    """``hybrid`` with the eagle3 head, its defaults."""
    return _hybrid_factory(target, "eagle3", checkpoint)


@register_drafter("lookup+eagle")
def _lookup_eagle_factory(target, checkpoint: str | None = None) -> HybridDrafter:
    """``hybrid`` with the eagle head, its defaults."""
    return _hybrid_factory(target, "eagle", checkpoint)
