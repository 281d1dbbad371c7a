"""Recursive multi-branch rejection sampling: lossless acceptance of a DraftTree.

Glossary:
    p_u        the target's processed distribution at node u (row u of ``target_probs``).
    residual   what is left of p_u after the children tried so far were rejected; it starts as
               p_u and, once no child survives, the new token is drawn from it.
    accepted   a child whose token the target keeps; the walk moves to it.
    bonus      the new token drawn from p at a node with no children (a leaf).

Rules at node u with residual r (initially p_u) and children x_1..x_m tried in index order:
    deterministic:        accept x_i w.p. r(x_i) / Σr; else r[x_i] = 0.
    with_replacement:     accept w.p. min(1, r(x)/q(x)); else r = norm(max(r - q, 0)).
    without_replacement:  accept w.p. min(1, r(x)/q(x)); else r = norm(max(r - q, 0)),
                          q[x] = 0, q = norm(q).
If no child is accepted the new token is drawn from r. Each rule reproduces p exactly
(tests/test_exact_law.py computes the output law by enumeration). Greedy decoding is the
deterministic rule with one-hot p.

Round-off: all arithmetic is float64 on the CPU. A rejection whose residual mass is below
``_NULL_MASS`` can only come from round-off (in exact arithmetic the rejection probability
*equals* that mass), so it is treated as the acceptance it would have been.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treespec.tree import DraftTree

# Residual mass under which a rejection is round-off, not probability (see module docstring).
_NULL_MASS = 1e-12


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one tree.

    Attributes:
        path:           LongTensor[A]; accepted node indices, root excluded, root -> leaf order.
        tokens:         LongTensor[A + 1]; the accepted tokens followed by the one new token
                        (residual or bonus).
        depth_attempts: tuple[int, ...] of length D; 1 where the walk stood at depth d with at
                        least one child to try (so depth d + 1 was attempted).
        depth_accepts:  tuple[int, ...] of length D; 1 where a child at depth d + 1 was accepted.
        children_tried: total number of child tokens tested.
    """

    path: torch.Tensor
    tokens: torch.Tensor
    depth_attempts: tuple[int, ...]
    depth_accepts: tuple[int, ...]
    children_tried: int

    @property
    def num_accepted(self) -> int:
        return int(self.path.numel())


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _draw(r: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the unnormalised non-negative float64 vector r (mass > 0)."""
    cdf = r.cumsum(0)
    total = float(cdf[-1])
    if not total > 0.0:
        raise ValueError("cannot draw from a distribution with zero mass; target_probs has a "
                         "row that sums to 0")
    idx = int(torch.searchsorted(cdf, _uniform(generator) * total, right=True))
    if idx >= r.numel():  # u * total rounded up to total: take the last token with mass
        idx = int(r.nonzero()[-1])
    return idx


def _try_deterministic(r: torch.Tensor, xs: list[int], gen: torch.Generator | None):
    """Returns (index of accepted child or None, final residual, tries)."""
    for i, x in enumerate(xs):
        mass = float(r.sum())
        px = float(r[x])
        if px > 0.0 and (mass - px <= _NULL_MASS * mass or _uniform(gen) * mass < px):
            return i, r, i + 1
        r[x] = 0.0
    return None, r, len(xs)


def _try_stochastic(
    r: torch.Tensor, xs: list[int], q: torch.Tensor, gen: torch.Generator | None,
    without_replacement: bool,
):
    """Returns (index of accepted child or None, final residual, tries)."""
    r = r / r.sum()
    q = q / q.sum()
    for i, x in enumerate(xs):
        qx = float(q[x])
        if not qx > 0.0:
            raise ValueError(
                f"child token {x} has draft probability {qx} under its parent's draft_probs "
                f"{'(after removing earlier siblings) ' if without_replacement else ''}"
                "so it cannot have been drawn from it; fix the builder or the sampling mode"
            )
        rest = (r - q).clamp_(min=0.0)
        rest_mass = float(rest.sum())
        if rest_mass <= _NULL_MASS or _uniform(gen) * qx < float(r[x]):
            return i, r, i + 1
        r = rest / rest_mass
        if without_replacement:
            q = q.clone()
            q[x] = 0.0
            q_mass = float(q.sum())
            if i + 1 < len(xs) and not q_mass > 0.0:
                raise ValueError("without_replacement tree has more children than tokens with "
                                 "draft probability > 0")
            q = q / q_mass if q_mass > 0 else q
    return None, r, len(xs)


def accept(
    tree: DraftTree,
    # [N, V]
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Verify ``tree`` against the target's processed probabilities; exact in distribution.

    ``target_probs[i]`` is p(.|path to i) after the same sampling processing as q. Uniforms are
    drawn in float64 from ``generator`` (a CPU torch.Generator), so seeded runs repeat exactly.
    """
    n = tree.num_nodes
    if target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must have shape [N={n}, V], got {tuple(target_probs.shape)}")
    if tree.vocab_size is not None and target_probs.shape[1] != tree.vocab_size:
        raise ValueError(f"target_probs has V={target_probs.shape[1]} but the tree's vocab is "
                         f"{tree.vocab_size}")
    if int(tree.tokens.max()) >= target_probs.shape[1]:
        raise ValueError(f"tree tokens exceed target vocab V={target_probs.shape[1]}")
    tokens = tree.tokens.tolist()
    children = tree.children
    mode = tree.sampling
    max_d = tree.max_depth
    attempts, accepts = [0] * max_d, [0] * max_d
    path: list[int] = []
    tried = 0
    u, d = 0, 0
    while True:
        r = target_probs[u].to("cpu", torch.float64)
        if not float(r.sum()) > 0.0:
            raise ValueError(f"target_probs row {u} sums to 0; rows must be distributions")
        kids = children[u]
        if not kids:
            break
        attempts[d] = 1
        xs = [tokens[c] for c in kids]
        if mode == "deterministic":
            hit, r, k = _try_deterministic(r.clone(), xs, generator)
        else:
            q = tree.draft_probs[u].to("cpu", torch.float64)
            hit, r, k = _try_stochastic(r, xs, q, generator, mode == "without_replacement")
        tried += k
        if hit is None:
            break
        accepts[d] = 1
        u, d = kids[hit], d + 1
        path.append(u)
    new_token = _draw(r, generator)
    return Acceptance(
        path=torch.tensor(path, dtype=torch.long),
        tokens=torch.tensor([tokens[i] for i in path] + [new_token], dtype=torch.long),
        depth_attempts=tuple(attempts),
        depth_accepts=tuple(accepts),
        children_tried=tried,
    )
