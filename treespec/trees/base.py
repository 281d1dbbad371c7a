"""Shared pieces of tree builders: the Builder protocol, draft distributions, child choice.

Glossary:
    partial tree  the ``PartialTree`` grown by expanding nodes through the drafter; node ids are
                  what the drafter knows (its cache slots are keyed by them).
    built tree    ``BuiltTree``: the validated ``DraftTree`` handed to the verifier, plus
                  ``source[i]``: the partial-tree id of tree node i (a builder may keep only
                  a subset of what it drafted, e.g. EAGLE-2's final rerank).

Exactness constraint for stochastic modes: the *number* of children drawn at a node may depend
on anything except those children's own draws; a builder must never drop a drawn child because
of its value (that biases the i.i.d. / without-replacement law the acceptance rule relies on).
Deterministic trees have no such constraint: any candidate set is exact under the
deterministic rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from treespec.drafters.base import Drafter, PartialTree
from treespec.sampling import SamplingConfig, process
from treespec.tree import DraftTree

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
    """Grows a draft tree for one step."""

    def build(
        self,
        drafter: Drafter,
        root_token: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> BuiltTree: ...


def check_mode(mode: str) -> None:
    if mode not in DRAFT_MODES:
        raise ValueError(f"sampling mode must be one of {DRAFT_MODES}, got {mode!r}")


def effective_mode(mode: DraftMode, sampling: SamplingConfig) -> DraftMode:
    """Greedy targets are verified with deterministic candidates (stochastic drafts add nothing)."""
    return "deterministic" if sampling.greedy else mode


def draft_distribution(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """q [F, V] from draft logits [F, V]: the target's processing, or T = 1 softmax when greedy.

    Under a greedy target q only ranks candidates, so the drafter's own confidence is used.
    """
    if sampling.greedy:
        return logits.float().softmax(-1)
    return process(logits, sampling)


def choose_children(
    # [V]
    q: torch.Tensor,
    k: int,
    mode: DraftMode,
    generator: torch.Generator | None,
) -> list[int]:
    """k child tokens of one node: top-k (distinct), i.i.d. draws, or draws without replacement.

    Deterministic and without-replacement choices are capped by the support of q.
    """
    if k <= 0:
        return []
    if mode == "with_replacement":
        return torch.multinomial(q.float(), k, replacement=True, generator=generator).tolist()
    k = min(k, int((q > 0).sum()))
    if mode == "deterministic":
        return torch.topk(q, k).indices.tolist()
    # Gumbel-top-k == sequential draws without replacement, in draw order.
    u = torch.rand(q.shape, generator=generator, dtype=torch.float64).clamp_(min=1e-300)
    keys = torch.log(q.double()) - torch.log(-torch.log(u))
    return torch.topk(keys, k).indices.tolist()


def log_prob(q_row: torch.Tensor, token: int) -> float:
    x = float(q_row[token])
    return math.log(x) if x > 0 else -math.inf


def finish(
    partial: PartialTree,
    rows: dict[int, torch.Tensor],
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
    parents = [-1] + [new_id[partial.parents[o]] for o in keep[1:]]
    probs = None
    if mode != "deterministic":
        vocab = next(iter(rows.values())).shape[-1]
        probs = torch.zeros(len(keep), vocab, dtype=torch.float32)
        for i, o in enumerate(keep):
            if o in rows:
                probs[i] = rows[o].float().cpu()
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, mode)
    return BuiltTree(tree, torch.tensor(keep), calls, len(partial))
