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
If no child is accepted the new token is drawn from r. Each rule reproduces p exactly (the
proofs: docs/exactness.md; tests/test_exact_law.py computes the output law by enumeration).
Greedy decoding is the deterministic rule with one-hot p.

Round-off: all sums, residuals and comparisons are float64. A rejection whose residual mass is
below ``_NULL_MASS`` (relative) can only come from round-off (in exact arithmetic the
rejection probability *equals* that mass), so it is treated as the acceptance it would have
been, unless the child's target probability is exactly 0: a token the target forbids is never
accepted.
"""

from __future__ import annotations

import torch

from treespec.core.sampling import SamplingConfig, first_argmax, process
from treespec.core.tree import DraftTree
from treespec.core.acceptance import (  # noqa: F401  (re-exported from here, as before the split)
    _NULL_MASS, VERIFY_RULES, Acceptance, VerifyRule, _draw, _long_tensor,
)
from treespec.core.joint import accept_block, accept_traversal, check_chain


def _try_deterministic(row: torch.Tensor, mass: float, xs: list[int], pxs: list[float], us):
    """Children tokens xs (target probs pxs) at a node with target row ``row`` of sum ``mass``.

    Returns (index of the accepted child or None, residual to draw from or None, tries). The
    residual is kept as a scalar mass until every child is rejected.
    """
    for i, (x, px) in enumerate(zip(xs, pxs)):
        # accept w.p. r(x) / Σr; a rejection of (numerically) all the mass is round-off.
        if px > 0.0 and (mass - px <= _NULL_MASS * mass or next(us) * mass < px):
            return i, None, i + 1
        mass -= px  # r[x] = 0
    residual = row.to(torch.float64, copy=True)  # on the row's device: no V-sized host copy
    residual[xs] = 0.0
    return None, residual, len(xs)


def _try_stochastic(
    p_row: torch.Tensor, pm: float, draft_probs: torch.Tensor, u: int,
    xs: list[int], pxs: list[float], qxs: list[float], us, without_replacement: bool,
):
    """Children tokens xs of node u, with p(x) = pxs (row p_row of mass pm) and q(x) = qxs
    (row ``draft_probs[u]``).

    Returns (index of the accepted child or None, residual to draw from or None, tries).

    r, q are kept unnormalised with masses rm, qm (r̂ = r / rm, q̂ = q / qm); float64 copies
    of the rows are made only at the first rejection, and each rejection costs three passes.
    """
    qm = float(draft_probs[u].sum(dtype=torch.float64))
    r = q = spare = None
    rm = pm
    removed: set[int] = set()
    for i, x in enumerate(xs):
        rx = pxs[i] if r is None else float(r[x])
        qx = 0.0 if x in removed else qxs[i]
        if not qx > 0.0:
            raise ValueError(
                f"child token {x} has draft probability {qx} under its parent's draft_probs "
                f"{'(after removing earlier siblings) ' if without_replacement else ''}"
                "so it cannot have been drawn from it; fix the builder or the sampling mode"
            )
        # q̂ <= r̂ at x: always accept; else accept w.p. r̂(x) / q̂(x).
        if rx * qm >= qx * rm or next(us) * qx * rm < rx * qm:
            return i, None, i + 1
        if r is None:
            r = p_row.to(torch.float64, copy=True)  # float64 rows stay on p's device
            q = draft_probs[u].to(p_row.device, torch.float64, copy=True)
            spare = torch.empty_like(r)
        rest = torch.sub(r, q, alpha=rm / qm, out=spare).clamp_(min=0.0)  # rm·max(r̂ - q̂, 0)
        rest_mass = float(rest.sum())
        if rest_mass > _NULL_MASS * rm:
            r, spare, rm = rest, r, rest_mass
        elif rx > 0.0:  # r̂ == q̂ up to round-off: the rejection had probability ~0
            return i, None, i + 1
        # else: x has target probability 0 and r is round-off away from q; keep r (r[x] == 0)
        if without_replacement:
            q[x] = 0.0
            qm -= qx
            removed.add(x)
            if i + 1 < len(xs) and not qm > 0.0:
                raise ValueError("without_replacement tree has more children than tokens with "
                                 "draft probability > 0")
    return None, r, len(xs)


def accept_root(target_probs: torch.Tensor, generator: torch.Generator | None = None) -> Acceptance:
    """:func:`accept` of a tree that is its root alone (a plain decoding step), without the tree:
    ``target_probs`` [1, V] the root's row; one float64 uniform drawn from ``generator``, as
    :func:`accept` draws, and the new token drawn from the row with it."""
    return _root_token(_draw(target_probs[0], _uniform(generator, target_probs.device)))


def accept_root_logits(logits: torch.Tensor, sampling: SamplingConfig,
                       generator: torch.Generator | None = None) -> Acceptance:
    """:func:`accept_root` of ``process(logits, sampling)`` (``logits`` [1, V], the root's):
    greedy, the first maximal logit, which is what the draw from ``process``' one-hot row gives
    for every uniform (the uniform is drawn all the same, so a seeded generator moves as
    there); else the draw from the processed row."""
    if not sampling.greedy:
        return accept_root(process(logits, sampling), generator)
    _uniform(generator, logits.device)
    return _root_token(int(first_argmax(logits[0])))


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One float64 uniform, drawn where :func:`accept` draws its uniforms."""
    return torch.rand(1, dtype=torch.float64, generator=generator,
                      device=device if generator is None else generator.device).item()


def _root_token(token: int) -> Acceptance:
    """A lone root's acceptance: no path, the new token ``token``."""
    return Acceptance(path=_long_tensor([]), tokens=_long_tensor([token]), depth_attempts=(), depth_accepts=(),
                      children_tried=0)


def accept(
    tree: DraftTree,
    # [N, V]
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    rule: VerifyRule = "token",
) -> Acceptance:
    """Verify ``tree`` against the target's processed probabilities; exact in distribution.

    ``target_probs[i]`` is p(.|path to i) after the same sampling processing as q. The call
    draws N float64 uniforms from ``generator`` (on any device) up front and uses each
    at most once, so seeded runs repeat exactly. Rows are read where the walk goes: a float64
    sum of p (and q) per visited node, a cumsum for the new token, and full-row float64 work
    only after rejections.

    ``rule``: "token" (the rules above, every tree and sampling mode), "block" (block
    verification, chains only) or "traversal" (traversal verification, every tree); the last
    two accept whole paths on sequence-level probabilities (treespec.core.joint) and take
    the rows as distributions (summing to 1, as ``process`` returns them) instead of
    renormalising them. On a deterministic tree they have the token rule's law exactly, so the
    token walk runs.
    """
    if not isinstance(rule, str):
        raise TypeError(f"rule must be one of {VERIFY_RULES} (a str), got {type(rule).__name__}")
    if rule not in VERIFY_RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose from {VERIFY_RULES}")
    n = tree.num_nodes
    if target_probs.dim() != 2 or target_probs.shape[0] != n:
        raise ValueError(f"target_probs must have shape [N={n}, V], got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[1]
    if tree.vocab_size is not None and vocab != tree.vocab_size:
        raise ValueError(f"target_probs has V={vocab} but the tree's vocab is {tree.vocab_size}")
    if tree.vocab_size is None and int(tree.tokens.max()) >= vocab:
        raise ValueError(f"tree tokens exceed target vocab V={vocab}")
    if rule != "token":

        if rule == "block":
            check_chain(tree)
        # Deterministic trees: both rules have exactly the token rule's output law (q̂ = δ_x
        # makes α_c = α_u p̂_u(x_c), the token-level chance of reaching c; compared per tree
        # in tests/test_joint_rules.py), and the token walk reads fewer rows: run it.
        if tree.sampling != "deterministic":
            us = iter(torch.rand(n, dtype=torch.float64, generator=generator).tolist())
            return (accept_block if rule == "block" else accept_traversal)(tree, target_probs, us)
    if n == 1:          # a lone root (plain decoding): no child to try, the new token from its row
        return accept_root(target_probs, generator)
    tokens = tree._tokens_list
    children = tree.children
    mode = tree.sampling
    dev = target_probs.device
    # p(x_i | path to parent) of every child i: one gather (q's are cached on the tree).
    kid_par, kid_tok = tree._child_index
    p_kid = [0.0] + target_probs[kid_par.to(dev), kid_tok.to(dev)].tolist()
    # At most one uniform per child tried, plus one for the new token.
    us = iter(torch.rand(n, dtype=torch.float64, generator=generator,
                         device=dev if generator is None else generator.device).tolist())
    max_d = tree.max_depth
    attempts, accepts = [0] * max_d, [0] * max_d
    path: list[int] = []
    tried = 0
    u, d = 0, 0
    residual = None
    while True:
        row = target_probs[u]
        kids = children[u]
        if not kids:
            break
        mass = float(row.sum(dtype=torch.float64))
        if not mass > 0.0:
            raise ValueError(f"target_probs row {u} sums to 0; rows must be distributions")
        attempts[d] = 1
        xs = [tokens[c] for c in kids]
        pxs = [p_kid[c] for c in kids]
        if mode == "deterministic":
            hit, residual, k = _try_deterministic(row, mass, xs, pxs, us)
        else:
            q_kid = tree._child_draft_probs
            hit, residual, k = _try_stochastic(
                row, mass, tree.draft_probs, u, xs, pxs,
                [q_kid[c] for c in kids], us, mode == "without_replacement",
            )
        tried += k
        if hit is None:
            break
        accepts[d] = 1
        u, d = kids[hit], d + 1
        path.append(u)
    new_token = _draw(row if residual is None else residual, next(us))
    return Acceptance(
        path=_long_tensor(path),
        tokens=_long_tensor([tokens[i] for i in path] + [new_token]),
        depth_attempts=tuple(attempts),
        depth_accepts=tuple(accepts),
        children_tried=tried,
    )
