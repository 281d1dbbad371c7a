"""Sequence-level acceptance: block verification (chains) and traversal verification (trees).

Token-level rules (rejection.py) decide child by child from the root down. These two rules
decide on whole paths, accept at least as much from the same draft, and stay exact.

Glossary (adds to rejection.py's):
    p̂_u, q̂_u  the target / draft distribution at node u, normalised in float64. q̂_u is the law
              the *next* child of u was drawn from: q_u (with_replacement), q_u without the
              siblings already tried, renormalised (without_replacement), or the point mass
              on the child's own token (deterministic: a token fixed by the drafter is a draw
              from the point mass on it).
    α_u       sequence-level acceptance weight of the path root -> u (Sun et al.'s p_i, Weng
              et al.'s p_α): α_root = 1, α_c = min(α_u p̂_u(x_c) / q̂_u(x_c), 1).
    residual  after the subtree of u's child c is rejected: m = max(α_u p̂_u - q̂_u, 0) with mass
              r, then α_u <- r / (1 - α_u + r) and p̂_u <- m / r.
    test      a node whose children are all rejected is accepted w.p. α_u (the root always);
              the new token is then drawn from p̂_u (bonus at an untouched leaf, else residual).

Block verification (Sun, Mendlovic, Leviathan et al., ICLR 2025, arXiv 2403.10444), on a chain
x_1..x_γ: p_i = α of node i; h_γ = p_γ and h_i = r_i / (r_i + 1 - p_i) (the residual step);
τ = the largest i with η_i < h_i, found backward from γ; the new token comes from p̂_γ if
τ = γ, else from norm(max(p_τ p̂_τ - q̂_τ, 0)).

Traversal verification (Weng, Hu et al., NeurIPS 2025, arXiv 2505.12398): the same residual
step on a tree, walked in post-order (children in index order, each child's subtree before
the child itself, the root last). On a chain it *is* block verification, uniform for uniform.

Why it is exact (induction over subtrees, any draft law per child): a subtree entered with
weight α_c is accepted with probability α_c and then emits the target's law from c. At u, a
child drawn from q̂ contributes min(α p̂, q̂) and is rejected with probability 1 - α + r; the
residual step makes the rest contribute max(α p̂ - q̂, 0); together α p̂.
tests/test_exact_law_joint.py computes the output law by enumeration for every mode.

Round-off: a residual mass r below ``_NULL_MASS`` is 0. If then 1 - α_u is also null, the
rejection itself had probability ~0 and the state is kept; otherwise α_u <- 0.
"""

from __future__ import annotations

import torch

from treespec.tree import DraftTree
from treespec.verifiers.rejection import _NULL_MASS, Acceptance, _draw, _long_tensor


class _Residual:
    """α_u and the residual p̂_u (and q̂_u) of one node, float64 copies made at the first update."""

    def __init__(self, alpha: float, p_row: torch.Tensor, q_row: torch.Tensor | None,
                 pm: float, qm: float):
        # p_row, q_row: [V] input rows of node u (q_row None: deterministic children);
        # pm, qm: their float64 sums (the masses of the unnormalised p̂, q̂)
        self.alpha, self.p_row, self.q_row, self.pm, self.qm = alpha, p_row, q_row, pm, qm
        self.p = self.q = None  # [V] float64 unnormalised copies, once updated

    def child_alpha(self, x: int, px: float, qx: float) -> float:
        """α_c = min(α p̂(x) / q̂(x), 1); px, qx: the input rows' values at x (q̂ = δ_x if no q)."""
        p = px if self.p is None else float(self.p[x])
        q = 1.0 if self.q_row is None else (qx if self.q is None else float(self.q[x]))
        if not q > 0.0:
            raise ValueError(f"child token {x} has draft probability {q} under its parent's "
                             "draft_probs, so it cannot have been drawn from it; fix the builder "
                             "or the sampling mode")
        return min(self.alpha * (p / self.pm) / (q / self.qm), 1.0)

    def reject(self, x: int, without_replacement: bool) -> None:
        """The subtree of the child with token x was rejected: the residual step."""
        if self.p is None:
            self.p = self.p_row.to("cpu", torch.float64, copy=True)
        a = self.alpha
        if a <= 0.0:
            rest, rest_m = self.p, self.pm  # m = max(0 - q̂, 0) = 0: α stays 0
        elif self.q_row is None:  # q̂ = δ_x: m = α p̂ with x removed
            rest, rest_m = self.p, self.pm - float(self.p[x])
        else:  # m = (α / pm) · max(p - (pm / (α qm)) q, 0)
            if self.q is None:
                self.q = self.q_row.to("cpu", torch.float64, copy=True)
            rest = torch.sub(self.p, self.q, alpha=self.pm / (a * self.qm)).clamp_(min=0.0)
            rest_m = float(rest.sum())
        r = a * rest_m / self.pm
        if rest_m > _NULL_MASS * self.pm:
            if self.q_row is None:
                rest[x] = 0.0
            self.p, self.pm, self.alpha = rest, rest_m, r / (1.0 - a + r)
        elif 1.0 - a > _NULL_MASS:
            self.alpha = 0.0  # nothing left to emit here: this node can no longer be accepted
        # else: 1 - α + r ~ 0, the rejection had probability ~0 (round-off): keep the state
        if without_replacement:
            if self.q is None:
                self.q = self.q_row.to("cpu", torch.float64, copy=True)
            qx = float(self.q[x])
            self.q[x] = 0.0
            self.qm -= qx

    def row(self) -> torch.Tensor:
        """[V] the (unnormalised) distribution the new token is drawn from."""
        return self.p_row if self.p is None else self.p


def _result(tree: DraftTree, path: list[int], node: _Residual, tests: int, us) -> Acceptance:
    """Acceptance of ``path`` (root excluded) with the new token drawn from ``node``'s row."""
    tokens = tree._tokens_list
    attempts, accepts = [0] * tree.max_depth, [0] * tree.max_depth
    for d in range(len(path)):
        attempts[d] = accepts[d] = 1
    last = path[-1] if path else 0
    if tree.children[last]:
        attempts[len(path)] = 1
    new_token = _draw(node.row(), next(us))
    return Acceptance(_long_tensor(path), _long_tensor([tokens[i] for i in path] + [new_token]),
                      tuple(attempts), tuple(accepts), tests)


def _node_values(tree: DraftTree, target_probs: torch.Tensor):
    """Per node c: p(x_c | parent), q(x_c | parent) (two gathers) and, for nodes with children,
    the float64 masses of their p and q rows (one batched sum each)."""
    n = tree.num_nodes
    par, tok = tree._child_index
    dev = target_probs.device
    p_kid = [0.0] + target_probs[par.to(dev), tok.to(dev)].tolist()
    inner = sorted(set(tree._parents_list[1:]))
    pm, qm = [0.0] * n, [1.0] * n
    for u, m in zip(inner, target_probs[inner].sum(-1, dtype=torch.float64).tolist()):
        if not m > 0.0:
            raise ValueError(f"target_probs row {u} sums to 0; rows must be distributions")
        pm[u] = m
    if tree.sampling == "deterministic":
        return p_kid, [1.0] * n, pm, qm, None
    q = tree.draft_probs
    for u, m in zip(inner, q[inner].sum(-1, dtype=torch.float64).tolist()):
        qm[u] = m
    return p_kid, tree._child_draft_probs, pm, qm, q


def accept_block(tree: DraftTree, target_probs: torch.Tensor, us) -> Acceptance:
    """Block verification of a chain (every node has at most one child); ``us``: uniforms."""
    # target_probs: [N, V]; node i of a chain is x_i, its row is p(.|x_1..x_i)
    if any(len(k) > 1 for k in tree.children):
        raise ValueError("rule='block' verifies a chain (at most one child per node), but this tree "
                         "branches; use rule='traversal' (trees) or rule='token'")
    gamma, tokens = tree.num_nodes - 1, tree._tokens_list
    p_kid, q_kid, pm, qm, q = _node_values(tree, target_probs)
    p, nodes = [1.0], []  # p_i = min(p_{i-1} p̂_{i-1}(x_i) / q̂_{i-1}(x_i), 1)
    for i in range(gamma):
        nodes.append(_Residual(p[i], target_probs[i], None if q is None else q[i], pm[i], qm[i]))
        p.append(nodes[i].child_alpha(tokens[i + 1], p_kid[i + 1], q_kid[i + 1]))
    if gamma and next(us) < p[gamma]:  # h_γ = p_γ: the whole block is accepted
        leaf = _Residual(1.0, target_probs[gamma], None, 0.0, 1.0)
        return _result(tree, list(range(1, gamma + 1)), leaf, 1, us)
    for i in range(gamma - 1, -1, -1):  # backward: h_i = r_i / (r_i + 1 - p_i)
        nodes[i].reject(tokens[i + 1], False)
        if i == 0 or next(us) < nodes[i].alpha:
            return _result(tree, list(range(1, i + 1)), nodes[i], gamma - i + (i > 0), us)
    return _result(tree, [], _Residual(1.0, target_probs[0], None, 0.0, 1.0), 0, us)  # root only


def accept_traversal(tree: DraftTree, target_probs: torch.Tensor, us) -> Acceptance:
    """Traversal verification of any tree, leaves first (post-order); ``us``: uniforms."""
    # target_probs: [N, V]; row u = p(.|path to u)
    wor = tree.sampling == "without_replacement"
    tokens, children = tree._tokens_list, tree.children
    p_kid, q_kid, pm, qm, q = _node_values(tree, target_probs)
    tests = 0

    def visit(u: int, alpha: float) -> tuple[list[int], _Residual] | None:
        nonlocal tests
        node = _Residual(alpha, target_probs[u], None if q is None else q[u], pm[u], qm[u])
        for c in children[u]:
            found = visit(c, node.child_alpha(tokens[c], p_kid[c], q_kid[c]))
            if found is not None:
                found[0].insert(0, c)
                return found
            node.reject(tokens[c], wor)  # the residual step at u
        tests += u > 0
        if u == 0 or next(us) < node.alpha:  # u is a leaf now: accept the path to u w.p. α_u
            return [], node
        return None

    path, node = visit(0, 1.0)
    return _result(tree, path, node, tests, us)
