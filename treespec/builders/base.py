"""Shared pieces of tree builders: the Builder protocol, draft distributions, child choice.

Glossary:
    partial tree  the ``PartialTree`` grown by expanding nodes through the drafter; node ids are
                  what the drafter knows (its cache slots are keyed by them).
    built tree    ``BuiltTree``: the validated ``DraftTree`` handed to the verifier, plus
                  ``source[i]``: the partial-tree id of tree node i (a builder may keep only
                  a subset of what it drafted, e.g. EAGLE-2's final rerank).
    score         cumulative draft log-probability of a node's path, Σ log q(token | path).
    confidence    exp(score): the drafter's probability of the whole path.
    slot          "the j-th child of node u", before it exists. Its planning value is
                  score(u) + log q_u^(j), with q_u^(j) the j-th largest entry of q_u: known as
                  soon as u is expanded, before any child is drawn.

Exactness constraint for stochastic modes: the *number* of children drawn at a node may depend
on anything except those children's own draws; a builder must never drop a drawn child because
of its value (that biases the i.i.d. / without-replacement law the acceptance rule relies on).
Deciding to add the j-th child may depend on everything drawn before it (earlier siblings,
other nodes, their subtrees), so a stopping rule over the draw sequence is exact (the proof:
docs/exactness.md, "Stopping rules in builders"). ``expand_nodes`` pre-draws a
node's children in draw order; a builder takes a *prefix* of them whose length it decides from
slot values, never from the drawn tokens themselves.
Deterministic trees have no such constraint: any candidate set is exact under the
deterministic rule, so deterministic builders may prune freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from treespec.drafters.base import Drafter, PartialTree, capabilities
from treespec.core.sampling import SamplingConfig, process
from treespec.core.tree import DraftTree

DraftMode = Literal["deterministic", "with_replacement", "without_replacement"]
DRAFT_MODES = ("deterministic", "with_replacement", "without_replacement")


@dataclass(frozen=True)
class BuiltTree:
    """A builder's output.

    Attributes:
        tree:          the DraftTree to verify.
        source:        LongTensor[N]; partial-tree id of each tree node (``source[0] == 0``).
        drafter_calls: number of ``drafter.expand`` calls made.
        drafted:       number of nodes drafted (partial-tree size), >= N.
    """

    tree: DraftTree
    source: torch.Tensor
    drafter_calls: int
    drafted: int


class TreeBuilder(Protocol):
    """Grows a draft tree for one step. ``budget``: the most tree nodes it returns, root included
    (the engine reserves that much context).

    Optional, for batches: ``grow(drafter, root_token, sampling, generator)``, the same search
    as a generator that yields an ``ExpandCall`` instead of calling the drafter and is sent
    back its (logits, ids). ``build`` is then ``run_alone(grow(...), drafter)``, and a batch
    driver (``treespec.builders.batch.build_batch``) answers the calls of every request with
    ONE batched drafter forward. Every treespec builder has it; a builder without it still
    works in a batch, one drafter call per request.
    """

    @property
    def budget(self) -> int: ...

    def build(
        self,
        drafter: Drafter,
        root_token: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> BuiltTree: ...


# ---------------------------------------------------------------- validation
def check_int(name: str, value: object, minimum: int = 1) -> None:
    """Clear error for a config integer below ``minimum`` (bools are not ints here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_mode(mode: str) -> None:
    if mode not in DRAFT_MODES:
        raise ValueError(f"sampling mode must be one of {DRAFT_MODES}, got {mode!r}")


def check_confidence(min_confidence: float) -> None:
    if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) \
            or not 0.0 <= min_confidence < 1.0:
        raise ValueError(f"min_confidence must be a probability in [0, 1) (0 disables adaptive "
                         f"termination), got {min_confidence!r}")


def check_width(name: str, width: int, drafter: Drafter) -> None:
    """A per-node child count above the drafter's vocabulary cannot be honoured."""
    if width > drafter.vocab_size:
        raise ValueError(f"{name}={width} exceeds the drafter's vocabulary V={drafter.vocab_size}; "
                         f"use {name} <= V")


def check_finite_draft(q: torch.Tensor, drafter: Drafter) -> None:
    """Refuse NaN / +inf draft logits (and rows without one finite logit): q would be NaN, which
    torch.multinomial rejects in stochastic modes and top-k silently ranks first otherwise.
    -inf is allowed (tokens outside a drafter's support).

    Read from q alone: every q here ends in a softmax over the row (``draft_distribution``), and
    a softmax row holds a NaN exactly when its logits held a NaN or a +inf, or were all -inf (no
    processing step masks a NaN or a +inf away first). One reduction of q to its row sums finds
    that; the three passes over [F, V] it replaces cost ~5 ms a step at Qwen's V = 151,936."""
    if bool(q.sum(-1).isnan().any()):
        raise ValueError(f"{type(drafter).__name__} returned non-finite draft logits (NaN or +inf, or a "
                         f"row with every logit -inf); check the drafter's weights (a checkpoint with "
                         f"non-finite values?) and its inputs")


def log_confidence(min_confidence: float) -> float:
    return math.log(min_confidence) if min_confidence > 0 else -math.inf


def effective_mode(mode: DraftMode, sampling: SamplingConfig) -> DraftMode:
    """Greedy targets are verified with deterministic candidates (stochastic drafts add nothing)."""
    return "deterministic" if sampling.greedy else mode


def draft_distribution(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """q [F, V] from draft logits [F, V]: the target's processing, or T = 1 softmax when greedy.

    Under a greedy target q only ranks candidates, so the drafter's own confidence is used.
    The same holds over a drafter's reduced support (columns = its ids): the processing
    (temperature, top-k/top-p/min-p) never gives mass to a -inf logit, so processing the
    support's columns equals processing the full row and reading those columns.
    """
    if sampling.greedy:
        return logits.float().softmax(-1)
    return process(logits, sampling)


@dataclass(frozen=True)
class DraftQ:
    """Draft distribution(s) q stored over the drafter's support.

    Attributes:
        values: [F, S] (or [S] for one node): q of target ids ``ids``.
        ids:    LongTensor[S] of target ids, or None when S = V and column j is token j.
        vocab:  the target vocabulary size V.
    """

    values: torch.Tensor
    ids: torch.Tensor | None
    vocab: int

    def __len__(self) -> int:
        return self.values.shape[0]

    def __getitem__(self, i: int) -> "DraftQ":
        return DraftQ(self.values[i], self.ids, self.vocab)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _split_q(q: "torch.Tensor | DraftQ") -> tuple[torch.Tensor, torch.Tensor | None]:
    return (q.values, q.ids) if isinstance(q, DraftQ) else (q, None)


def _to_ids(cols: list[list[int]], ids: torch.Tensor | None) -> list[list[int]]:
    """Column indices -> target token ids (identity without a reduced support)."""
    if ids is None:
        return cols
    flat = [c for row in cols for c in row]
    if not flat:
        return [[] for _ in cols]
    return _regroup(ids[torch.tensor(flat, device=ids.device)].tolist(), cols)


def _regroup(flat: list, like: list[list]) -> list[list]:
    """Split ``flat`` into consecutive rows as long as the rows of ``like``."""
    out, i = [], 0
    for row in like:
        out.append(flat[i: i + len(row)])
        i += len(row)
    return out


# ---------------------------------------------------------------- child choice
@dataclass(frozen=True)
class Expansion:
    """What one expanded node offers its children, in trial (= draw) order.

    Attributes:
        tokens:    tokens[j] is the node's j-th child if it gets more than j children: the j-th
                   ranked token (deterministic) or the j-th draw from q (stochastic). Stochastic
                   expansions may hold fewer draws than slots; ``extended`` draws more.
        logq:      log q(tokens[j]).
        slot_logq: planning value of slot j, log of the j-th largest q (see module docstring);
                   independent of the draws. Equal to ``logq`` in deterministic mode.
        cols:      the columns of q holding ``tokens`` when q is stored over a reduced support
                   (``DraftQ.ids``); None when columns are token ids.
    """

    tokens: list[int]
    logq: list[float]
    slot_logq: list[float]
    cols: list[int] | None = None

    def extended(
        self,
        # [V] or DraftQ over the node's support
        q: "torch.Tensor | DraftQ",
        n: int,
        mode: DraftMode,
        generator: torch.Generator | None,
    ) -> "Expansion":
        """The same expansion with up to n more draws, continuing the draw sequence (the next
        i.i.d. draws, or the next draws without replacement given those so far)."""
        if mode == "deterministic" or n <= 0:
            return self
        q, ids = _split_q(q)
        have = self.cols if self.cols is not None else self.tokens
        if mode == "with_replacement":
            more = torch.multinomial(q.float(), n, replacement=True, generator=generator).tolist()
        else:
            rest = q.clone()
            rest[have] = 0.0
            want = min(n, int((rest > 0).sum()))
            more = _distinct_draws(rest[None], [want], generator)[0] if want else []
        logq = q[more].double().log().tolist() if more else []
        cols = None if ids is None else have + more
        return Expansion(self.tokens + _to_ids([more], ids)[0], self.logq + logq, self.slot_logq, cols)


def draw_children(
    # [F, V]
    q: torch.Tensor,
    k: int,
    mode: DraftMode,
    generator: torch.Generator | None,
    draws: int | None = None,
    ids: torch.Tensor | None = None,
) -> list[Expansion]:
    """Up to k children per row of q, in trial order (see ``Expansion``).

    ``ids``: the target id of each column of q when q is stored over a reduced support
    (``DraftQ``); tokens are mapped through it and the columns kept in ``Expansion.cols``.

    deterministic:        the k most likely tokens with q > 0, most likely first.
    with_replacement:     i.i.d. draws from q (repeats possible).
    without_replacement:  sequential draws without replacement (``_distinct_draws``), capped
                          by the support of q.
    Stochastic modes plan k slots but draw only ``draws`` (default k) children up front; a
    builder that needs more calls ``Expansion.extended``.
    """
    if q.dim() != 2:
        raise ValueError(f"q must be [F, V], got shape {tuple(q.shape)}")
    rows, vocab = q.shape
    if k <= 0 or rows == 0:
        return [Expansion([], [], []) for _ in range(rows)]
    top = min(k, vocab)
    now = k if draws is None else min(draws, k)
    # [F, top]
    ranked_q, ranked = torch.topk(q, top, dim=-1)
    # min(support of q, top) from the ranked values: no extra pass over V
    support = (ranked_q > 0).sum(-1).tolist()
    slot = ranked_q.double().clamp_min(0).log().tolist()
    if mode == "deterministic":
        tokens, logq = ranked.tolist(), slot
    elif mode == "with_replacement":
        # [F, now]
        drawn = torch.multinomial(q.float(), now, replacement=True, generator=generator)
        tokens = drawn.tolist()
        logq = q.gather(1, drawn).double().log().tolist()
    elif mode == "without_replacement":
        tokens = _distinct_draws(q, [min(now, s) for s in support], generator)
        # one gather for every row's draws
        r_idx = [r for r, row in enumerate(tokens) for _ in row]
        flat = q[r_idx, [t for row in tokens for t in row]].double().log().tolist()
        logq = _regroup(flat, tokens)
    else:
        check_mode(mode)
        raise AssertionError  # pragma: no cover
    if mode != "with_replacement":
        tokens = [row[:s] for row, s in zip(tokens, support)]
    mapped = _to_ids(tokens, ids)
    out = []
    for r in range(rows):
        s = support[r]
        cols = None if ids is None else tokens[r]
        if mode == "with_replacement":
            # every draw has q > 0; slot j is planned with the j-th largest q (the last one with
            # q > 0 once j exceeds the support)
            plan = [slot[r][min(j, s - 1)] for j in range(k)]
            out.append(Expansion(mapped[r], logq[r], plan, cols))
        else:
            out.append(Expansion(mapped[r], logq[r][:s], slot[r][:s], cols))
    return out


def _distinct_draws(
    # [F, V]
    q: torch.Tensor,
    want: list[int],
    generator: torch.Generator | None,
) -> list[list[int]]:
    """Row r: ``want[r]`` sequential draws without replacement from q[r], in draw order.

    The first m distinct values of an i.i.d. stream from q ARE m sequential draws without
    replacement (the first value outside the set drawn so far follows q restricted to its
    complement). Streams are drawn in batched chunks; a row still short after a chunk continues
    from q with its drawn tokens masked out, which is the same law. O(V) per chunk, no per-token
    random numbers (the exponential race / Gumbel-top-k needs V of them per row).
    """
    out: list[list[int]] = [[] for _ in want]
    pending = [r for r, w in enumerate(want) if w > 0]
    source = q
    chunk = 2 * max(want, default=0)
    while pending:
        draws = torch.multinomial(source[pending].float(), chunk, replacement=True, generator=generator)
        for r, row in zip(pending, draws.tolist()):
            got = out[r]
            for t in row:
                if t not in got:
                    got.append(t)
                    if len(got) == want[r]:
                        break
        pending = [r for r in pending if len(out[r]) < want[r]]
        if pending:
            source = source.clone() if source is q else source
            for r in pending:
                source[r, out[r]] = 0.0
    return out


@dataclass(frozen=True)
class ExpandCall:
    """What a growing builder asks its drafter for: draft logits of ``nodes`` of ``tree``, in
    ONE call. The driver answers with ``drafter_logits``'s pair (logits [F, Vd], ids | None)."""

    tree: PartialTree
    nodes: list[int]


def drafter_logits(drafter: Drafter, tree: PartialTree,
                   nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits [F, Vd], target ids [Vd] or None = all V): the drafter's ``expand_compact`` when
    it has one, else its ``expand``."""
    compact = capabilities(drafter).expand_compact
    if compact is not None:
        return compact(tree, nodes)
    return drafter.expand(tree, nodes), None


def expand_step(
    drafter: Drafter,
    tree: PartialTree,
    nodes: list[int],
    sampling: SamplingConfig,
    mode: DraftMode,
    k: int,
    generator: torch.Generator | None,
    draws: int | None = None,
):
    """``expand_nodes`` as a step of a growing builder: yields one ``ExpandCall`` and draws the
    children from the logits it is sent back (``q, exps = yield from expand_step(...)``).
    ``drafter`` is only read for its vocabulary size and name (errors)."""
    logits, ids = yield ExpandCall(tree, nodes)
    return draft_children(drafter, logits, ids, nodes, sampling, mode, k, generator, draws)


def expand_nodes(
    drafter: Drafter,
    tree: PartialTree,
    nodes: list[int],
    sampling: SamplingConfig,
    mode: DraftMode,
    k: int,
    generator: torch.Generator | None,
    draws: int | None = None,
) -> tuple[DraftQ, list[Expansion]]:
    """ONE batched drafter call for ``nodes``; returns q (``DraftQ``, rows [F, ...]) and each
    node's Expansion (k planned slots; ``draws`` of them drawn up front in stochastic modes,
    default all). Uses the drafter's ``expand_compact`` when it has one."""
    logits, ids = drafter_logits(drafter, tree, nodes)
    return draft_children(drafter, logits, ids, nodes, sampling, mode, k, generator, draws)


def draft_children(
    drafter: Drafter,
    # [F, Vd]
    logits: torch.Tensor,
    ids: torch.Tensor | None,
    nodes: list[int],
    sampling: SamplingConfig,
    mode: DraftMode,
    k: int,
    generator: torch.Generator | None,
    draws: int | None = None,
) -> tuple[DraftQ, list[Expansion]]:
    """q and each node's Expansion from the draft logits of ``nodes`` (see ``expand_nodes``)."""
    width = drafter.vocab_size if ids is None else ids.numel()
    if logits.dim() != 2 or logits.shape[0] != len(nodes) or logits.shape[1] != width:
        raise ValueError(f"drafter.expand must return logits [F={len(nodes)}, V={width}], got shape "
                         f"{tuple(logits.shape)} from {type(drafter).__name__}")
    q = draft_distribution(logits, sampling)
    check_finite_draft(q, drafter)
    if generator is not None and q.device != generator.device:
        q = q.to(generator.device)  # a drafter on another device: draw (and keep q) where p lives
        ids = None if ids is None else ids.to(generator.device)
    return DraftQ(q, ids, drafter.vocab_size), draw_children(q, k, mode, generator, draws, ids)


def run_alone(steps, drafter: Drafter) -> BuiltTree:
    """Drive a builder's ``grow`` generator with one drafter: each ``ExpandCall`` it yields is
    answered by ``drafter_logits``; returns the BuiltTree the generator returns."""
    try:
        call = next(steps)
        while True:
            call = steps.send(drafter_logits(drafter, call.tree, call.nodes))
    except StopIteration as done:
        return done.value


def finish(
    partial: PartialTree,
    rows: "dict[int, DraftQ | torch.Tensor]",
    mode: DraftMode,
    keep: list[int] | None = None,
    calls: int = 0,
) -> BuiltTree:
    """Freeze the partial tree (or the ancestor-closed subset ``keep``) into a BuiltTree.

    rows: q rows of expanded nodes by partial id (only needed for stochastic modes).
    """
    keep = list(range(len(partial))) if keep is None else sorted(keep)
    if keep[0] != 0:
        raise ValueError("the kept node set must contain the root")
    new_id = {old: i for i, old in enumerate(keep)}
    tokens = [partial.tokens[o] for o in keep]
    try:
        parents = [-1] + [new_id[partial.parents[o]] for o in keep[1:]]
    except KeyError:
        raise ValueError("the kept node set must contain every kept node's parent") from None
    probs = None
    if mode != "deterministic":
        # [N, V] on the drafter's device, where q was computed (no host round trip)
        first = next(iter(rows.values()))
        vocab = first.vocab if isinstance(first, DraftQ) else first.shape[-1]
        device = _split_q(first)[0].device
        probs = torch.zeros(len(keep), vocab, dtype=torch.float32, device=device)
        at = [i for i, o in enumerate(keep) if o in rows]
        if at:
            split = [_split_q(rows[keep[i]]) for i in at]
            ids = split[0][1]
            values = torch.stack([q for q, _ in split]).float()
            if ids is None:
                probs[at] = values
            else:  # one flat scatter of every kept row's support (2-D fancy indexing is slower)
                flat = torch.tensor(at, device=device)[:, None] * vocab + ids.to(device)[None, :]
                probs.view(-1).index_copy_(0, flat.reshape(-1), values.reshape(-1))
    # the tree's structure is host data (builders grow it in Python); the verifier uploads it
    tree = DraftTree.from_builder(torch.tensor(tokens, dtype=torch.long, device="cpu"),
                                  torch.tensor(parents, dtype=torch.long, device="cpu"), probs, mode)
    return BuiltTree(tree, torch.tensor(keep, dtype=torch.long, device="cpu"), calls, len(partial))
