"""The batched drafter protocol: one object holds the drafting state of many requests.

Glossary (see ``treespec.drafters.base`` for committed / features / frontier):
    key        a request's id (any hashable; the server uses ints). Each key is one request with
               its own state, exactly the state a single-request ``Drafter`` would hold.
    row        model drafters keep every request's draft KV cache in ONE right-padded tensor
               [B, H_kv, S, d]: row b is the request at ``keys[b]``; its first ``used`` columns
               are its cache, compact (committed slots, then this tree's slots in expansion
               order); columns past ``used`` are stale and never attended.
    call       ``(key, tree, nodes)``: what one request's builder asks for (``ExpandCall``).

Lifecycle (the single-request one, per key, with the requests of a step batched together):
    begin(key, prompt_ids, features)            a request joins (a model drafter prefills it)
    expand_batch([(key, tree, nodes), ...])     ONE drafter forward for every call
        -> [(logits [F_i, Vd], ids [Vd] | None), ...]   as ``expand_compact`` would give alone
    commit(key, path, tokens, features)         after verification, as ``Drafter.commit``
    drop(key)                                   the request left; its row is freed
    checkpoint() -> state; restore(state)       undo every expand_batch since the checkpoint
                                                (a step that failed before its commits)

A request's part of a batched forward sees only its own cache columns (4-D mask), at its own
positions, so it computes what the request's single drafter computes. What is guaranteed:
each request's output LAW is exact whatever its batch-mates (q is whatever the drafter
returned, and the acceptance rules are exact for any q); tokens are identical to the request
run alone for greedy decoding; at T > 0 they are identical whenever the batched forward rounds
like the single one (tested in float64; in float32 a batched matmul may round a logit
differently, which can move a draw that falls within that rounding of a boundary).

``LoopBatchDrafter`` gives any single-request drafter this protocol (one call per request:
for drafters without a forward to share, e.g. prompt lookup). ``as_batch_drafter`` picks the
batched form a drafter offers (``drafter.batched()``) or that loop.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence, runtime_checkable

import torch

from treespec.drafters.base import Drafter, PartialTree, TargetFeatures, capabilities

Key = Hashable
DraftCall = tuple[Key, PartialTree, list[int]]
DraftAnswer = tuple[torch.Tensor, "torch.Tensor | None"]


@runtime_checkable
class BatchDrafter(Protocol):
    """Drafting state of many requests under one object (see the module docstring).

    Capability flags as ``Drafter``'s (``target_layers``: the union every request needs).
    Optional: ``calls``, the drafter forwards run so far (the server's stats count them).
    """

    needs_target_hidden: bool
    target_layers: tuple[int, ...]
    vocab_size: int
    path_independent: bool

    def begin(self, key: Key, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        """Start request ``key``; prompt_ids: LongTensor[P]; features cover prompt_ids[:-1]."""

    def expand_batch(self, calls: Sequence[DraftCall]) -> list[DraftAnswer]:
        """Per call: (logits [F, Vd] float32, ids LongTensor[Vd] or None = all V)."""

    def commit(self, key: Key, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        """``Drafter.commit`` for request ``key``."""

    def drop(self, key: Key) -> None:
        """Forget request ``key`` (finished or cancelled); its memory is freed."""

    def checkpoint(self) -> object:
        """Every request's drafting state as of now, for ``restore``."""

    def restore(self, state: object) -> None:
        """Back to ``state`` (from ``checkpoint``): undoes the ``expand_batch`` calls made since.
        Valid only if no ``begin``, ``commit`` or ``drop`` came in between."""


class RowCheckpoints:
    """``checkpoint`` / ``restore`` for batched drafters whose per-request state is ``self.rows``
    (key -> a row record with ``copy()``) over ragged KV rows: an ``expand_batch`` writes only
    past each row's ``used`` columns, so the records alone say which columns count and the KV
    tensors need no copy."""

    rows: dict

    def checkpoint(self) -> dict:
        return {key: row.copy() for key, row in self.rows.items()}

    def restore(self, state: dict) -> None:
        check_restorable(state, self.rows)
        self.rows = {key: row.copy() for key, row in state.items()}


def check_restorable(state: dict, live: dict) -> None:
    """``restore`` needs the requests of its checkpoint, no more and no fewer."""
    if state.keys() != live.keys():
        raise ValueError("restore: requests began or left since the checkpoint")


class RequestDrafter:
    """One request of a BatchDrafter seen as a single-request drafter (``expand`` /
    ``expand_compact``): what a builder reads (vocabulary, flags) and what a builder without
    ``grow`` calls, one request at a time."""

    def __init__(self, batch: BatchDrafter, key: Key):
        self.batch, self.key = batch, key
        self.vocab_size = batch.vocab_size
        self.needs_target_hidden = batch.needs_target_hidden
        self.target_layers = batch.target_layers
        self.path_independent = batch.path_independent

    def __repr__(self) -> str:
        return f"RequestDrafter({type(self.batch).__name__}, key={self.key!r})"

    def expand_compact(self, tree: PartialTree, nodes: list[int]) -> DraftAnswer:
        (answer,) = self.batch.expand_batch([(self.key, tree, nodes)])
        return answer

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        return full_logits(*self.expand_compact(tree, nodes), self.vocab_size)


def full_logits(logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[F, Vd] logits over ``ids`` -> [F, V] float32, -inf outside them (ids None: as is)."""
    logits = logits.float()
    if ids is None:
        return logits
    out = torch.full((logits.shape[0], vocab), -math.inf, device=logits.device)
    return out.index_copy_(1, ids.to(logits.device), logits)


def check_calls(calls: Sequence[DraftCall], known: Callable[[Key], bool]) -> None:
    """Clear errors for a malformed ``expand_batch`` argument."""
    if not isinstance(calls, (list, tuple)) or not calls:
        raise ValueError("expand_batch needs a non-empty list of (key, tree, nodes) calls")
    seen = set()
    for c in calls:
        if not isinstance(c, tuple) or len(c) != 3 or not isinstance(c[1], PartialTree):
            raise TypeError(f"each call must be a (key, PartialTree, nodes) tuple, got {c!r}")
        if not known(c[0]):
            raise KeyError(f"request {c[0]!r} was never begun (or was dropped)")
        if c[0] in seen:
            raise ValueError(f"request {c[0]!r} appears twice in one expand_batch call")
        seen.add(c[0])
        if not c[2]:
            raise ValueError(f"request {c[0]!r}: empty node list")


class LoopBatchDrafter:
    """The batched protocol over single-request drafters: one drafter per key (``factory(key)``),
    one ``expand`` call per request. For drafters with no forward to share (prompt lookup), or
    any drafter without a batched form."""

    path_independent = False

    def __init__(self, factory: Callable[[Key], Drafter], vocab_size: int,
                 needs_target_hidden: bool = False, target_layers: tuple[int, ...] = ()):
        self.factory = factory
        self.vocab_size = int(vocab_size)
        self.needs_target_hidden = needs_target_hidden
        self.target_layers = tuple(target_layers)
        self.drafters: dict[Key, Drafter] = {}
        self.calls = 0                       # drafter calls: one per request per round

    @classmethod
    def of(cls, template: Drafter) -> "LoopBatchDrafter":
        """Each request gets its own copy of ``template`` (``fresh_copy``), begun on its prompt."""
        out = cls(lambda key: fresh_copy(template), template.vocab_size, template.needs_target_hidden,
                  tuple(template.target_layers))
        out.path_independent = bool(template.path_independent)
        for attr in ("cost_kind", "registry_name"):
            if hasattr(template, attr):
                setattr(out, attr, getattr(template, attr))
        return out

    def begin(self, key: Key, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        if key in self.drafters:
            raise ValueError(f"request {key!r} was already begun")
        d = self.factory(key)
        if not isinstance(d, Drafter) or d.vocab_size != self.vocab_size:
            raise TypeError(f"the factory must give Drafters of vocab size {self.vocab_size}, got {d!r}")
        d.begin(prompt_ids, _own_layers(d, features))
        self.drafters[key] = d

    def expand_batch(self, calls: Sequence[DraftCall]) -> list[DraftAnswer]:
        check_calls(calls, self.drafters.__contains__)
        self.calls += len(calls)
        out = []
        for key, tree, nodes in calls:
            d = self.drafters[key]
            compact = capabilities(d).expand_compact
            out.append(compact(tree, nodes) if compact is not None else (d.expand(tree, nodes), None))
        return out

    def commit(self, key: Key, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        d = self._get(key)
        d.commit(path, tokens, _own_layers(d, features))

    def drop(self, key: Key) -> None:
        self._get(key)
        del self.drafters[key]

    def checkpoint(self) -> dict[Key, Drafter]:
        """Copies of every request's drafter (``fresh_copy``: weights shared, state copied)."""
        return {key: fresh_copy(d) for key, d in self.drafters.items()}

    def restore(self, state: dict[Key, Drafter]) -> None:
        check_restorable(state, self.drafters)
        self.drafters = {key: fresh_copy(d) for key, d in state.items()}

    def _get(self, key: Key) -> Drafter:
        try:
            return self.drafters[key]
        except KeyError:
            raise KeyError(f"request {key!r} was never begun (or was dropped)") from None


def fresh_copy(drafter: Drafter) -> Drafter:
    """A copy of ``drafter`` for another request: its modules and tensor attributes (weights,
    tables) are shared, everything else (per-request state) is deep-copied; ``begin`` then
    resets the state as for any new request."""
    shared = {id(v): v for v in vars(drafter).values() if isinstance(v, (torch.nn.Module, torch.Tensor))}
    return copy.deepcopy(drafter, shared)


def _own_layers(drafter: Drafter, features: TargetFeatures) -> TargetFeatures:
    """The feature layers ``drafter`` asked for (a batch may carry the union of several)."""
    if not drafter.needs_target_hidden:
        return TargetFeatures.empty()
    return TargetFeatures({i: features.hidden[i] for i in drafter.target_layers})


def as_batch_drafter(drafter: "BatchDrafter | Drafter") -> BatchDrafter:
    """The batched form of ``drafter``: itself if already batched, ``drafter.batched()`` when
    it has one (model drafters: one forward for all requests, weights shared), else a
    ``LoopBatchDrafter`` of copies of it."""
    if isinstance(drafter, BatchDrafter) and not isinstance(drafter, Drafter):
        return drafter
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a Drafter or a BatchDrafter, got {type(drafter).__name__}")
    caps = capabilities(drafter)
    out = caps.batched() if caps.batched is not None else LoopBatchDrafter.of(drafter)
    name = caps.registry_name
    if name is not None:
        out.registry_name = name
    return out


# ---------------------------------------------------------------- ragged KV rows
@dataclass
class RowInputs:
    """One request's new positions in a batched drafter forward.

    Attributes:
        tokens:    token per new position.
        positions: rotary position per new position.
        prefix:    the row's first ``prefix`` cache columns are visible to every new position.
        sees:      per new position, further visible cache columns (e.g. tree ancestors).
        causal:    new position r also sees the new positions before it (a run of committed
                   tokens) instead of only itself.
    """

    tokens: list[int]
    positions: list[int]
    prefix: int
    sees: list[list[int]]
    causal: bool = False


def ancestor_columns(tree: PartialTree, nodes: Sequence[int], slot: dict[int, int]) -> list[list[int]]:
    """Per node, the cache columns of its ancestors that are in ``slot`` (node -> column),
    nearest first: the tree positions a node's query may see besides the committed ones."""
    sees = []
    for n in nodes:
        cols, a = [], tree.parents[n]
        while a in slot:
            cols.append(slot[a])
            a = tree.parents[a]
        sees.append(cols)
    return sees


def batch_inputs(rows: Sequence[RowInputs | None], s: int, device: torch.device):
    """Right-padded (ids [B, M], positions [B, M], mask BoolTensor[B, M, S + M]) of a batched
    forward over ``rows`` (None: a row with nothing new) appended after ``s`` cache columns.
    Padding positions see only themselves (every mask row allows one key: no NaN)."""
    b = len(rows)
    m = max(len(r.tokens) for r in rows if r is not None)
    ids = torch.zeros(b, m, dtype=torch.long)
    pos = torch.zeros(b, m, dtype=torch.long)
    prefix = torch.zeros(b, dtype=torch.long)
    pairs: list[int] = []      # (row, query, key column) triples, one indexed store
    for i, r in enumerate(rows):
        if r is None:
            continue
        f = len(r.tokens)
        ids[i, :f] = torch.tensor(r.tokens)
        pos[i, :f] = torch.tensor(r.positions)
        prefix[i] = r.prefix
        for q, cols in enumerate(r.sees):
            for c in cols:
                pairs += (i, q, c)
            if r.causal:
                for j in range(q):
                    pairs += (i, q, s + j)
    cols = torch.arange(s + m)
    # [B, M, S + M]: the row's prefix, then each position itself
    allowed = (cols[None, None, :] < prefix[:, None, None]).expand(b, m, s + m).clone()
    allowed[:, torch.arange(m), s + torch.arange(m)] = True
    if pairs:
        idx = torch.tensor(pairs, dtype=torch.long).view(-1, 3)
        allowed[idx[:, 0], idx[:, 1], idx[:, 2]] = True
    return ids.to(device), pos.to(device), allowed.to(device)


def move_columns(x: torch.Tensor, moves: Sequence[tuple[int, int, int]]) -> None:
    """In place on x [B, H, S, d]: for each (row, src, dst), column dst of the row gets what
    column src held before any move (sources are read first, so overlaps are safe)."""
    moves = [m for m in moves if m[1] != m[2]]
    if not moves:
        return
    idx = torch.tensor(moves, dtype=torch.long, device=x.device)
    vals = x[idx[:, 0], :, idx[:, 1]]         # [K, H, d]
    x[idx[:, 0], :, idx[:, 2]] = vals


def settle_moves(used: Sequence[int], counts: Sequence[int], s: int) -> list[tuple[int, int, int]]:
    """Moves that put row b's ``counts[b]`` new columns (appended at s, s + 1, ...) right after
    its ``used[b]`` columns, keeping every row compact."""
    return [(b, s + r, u + r) for b, (u, c) in enumerate(zip(used, counts)) for r in range(c)]
