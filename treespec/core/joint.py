"""Sequence-level acceptance: block verification (chains) and traversal verification (trees).

Token-level rules (rejection.py) decide child by child from the root down. These two rules
decide on whole paths and stay exact. On a chain block verification accepts the most any
valid rule can (never less than token level); traversal verification equals it on chains and
often accepts more than token level on trees, but not always (measure it: accept_rules.py).
Block verification: Sun, Mendlovic, Leviathan et al., ICLR 2025 (arXiv 2403.10444); traversal
verification: Weng, Hu et al., NeurIPS 2025 (arXiv 2505.12398). The rules, and the induction
that proves them exact for any draft law per child (every sampling mode), are in
docs/exactness.md; tests/test_exact_law_joint.py computes the output law by enumeration.

Glossary (adds to rejection.py's):
    p̂_u, q̂_u  the target / draft distribution at node u, normalised in float64. q̂_u is the law
              the *next* child of u was drawn from: q_u (with_replacement), q_u without the
              siblings already tried, renormalised (without_replacement), or the point mass
              on the child's own token (deterministic).
    α_u       sequence-level acceptance weight of the path root -> u (Sun et al.'s p_i, Weng
              et al.'s p_α): α_root = 1, α_c = min(α_u p̂_u(x_c) / q̂_u(x_c), 1).
    residual  after the subtree of u's child c is rejected: m = max(α_u p̂_u - q̂_u, 0) with mass
              r, then α_u <- r / (1 - α_u + r) and p̂_u <- m / r.
    test      a node whose children are all rejected is accepted w.p. α_u (the root always);
              the new token is then drawn from p̂_u (bonus at an untouched leaf, else residual).

Traversal verification walks the tree in post-order (children in index order, each child's
subtree before the child itself, the root last); on a chain it *is* block verification. Block
refuses trees that branch. On deterministic trees both rules have exactly the token rule's law
and acceptance, so ``accept`` runs the token walk there; the functions here still handle them.

Rows are distributions: p̂_u and q̂_u start as the input rows themselves, taken to sum to 1 (as
``treespec.core.sampling.process`` returns them); neither rule renormalises a row, since reading every
row's mass up front would cost a pass over the whole [N, V] block. A target row the rule does
read (a residual step or the final draw) is checked: one off 1 by more than DraftTree's
tolerance for q rows (1e-3) is a ValueError.

Cost: a residual step is one float64 pass over a row; it is skipped when the test it feeds
cannot pass (h_i <= p_i, and a node's α only decreases: a uniform >= α rejects). Deterministic
steps are scalar. So like the token rule, both rules read only the rows where they reject.

Round-off: a residual mass r below ``_NULL_MASS`` is 0. If then 1 - α_u is also null, the
rejection itself had probability ~0 and the state is kept; otherwise α_u <- 0.
"""

from __future__ import annotations

import itertools

import torch

from treespec.core.tree import _ROW_SUM_ATOL, DraftTree, row_sums
from treespec.core.acceptance import _NULL_MASS, Acceptance, _draw, _long_tensor


def _check_mass(row: torch.Tensor) -> None:
    """A target row the rule reads must sum to 1 (to the tolerance DraftTree allows q rows)."""
    mass = float(row_sums(row))
    if not abs(mass - 1.0) <= _ROW_SUM_ATOL:
        raise ValueError(f"a target_probs row sums to {mass:.6f}, not 1; the block and traversal "
                         "rules take rows as distributions (renormalise them, e.g. with "
                         "treespec.core.sampling.process)")


def _alpha(a: float, x: int, p: float, q: float) -> float:
    """α of a child with token x: min(a p / q, 1), p and q its normalised target / draft chances."""
    if not q > 0.0:
        raise ValueError(f"child token {x} has draft probability {q} under its parent's "
                         "draft_probs, so it cannot have been drawn from it; fix the builder "
                         "or the sampling mode")
    return min(a * p / q, 1.0)


class _Residual:
    """α_u and the residual p̂_u (and q̂_u) of one node.

    p̂ is kept unnormalised with mass pm: the input row (mass 1) until its first stochastic
    residual step, then float64 (residuals are built in a spare buffer, swapped in when kept);
    a deterministic update only records the removed token (row work is left to the draw). q̂ is
    the input row without the tokens in ``q_out`` (without_replacement), mass qm.
    """

    def __init__(self, alpha: float, u: int, probs: torch.Tensor, drafts: torch.Tensor | None):
        # probs: [N, V] target rows; drafts: [N, V] q rows, None for deterministic children. Node
        # u's rows are indexed only when read (a view costs microseconds; most nodes need none).
        self.alpha, self.u, self.probs, self.drafts = alpha, u, probs, drafts
        self.p: torch.Tensor | None = None  # [V] float64, from the first stochastic update on
        self.spare: torch.Tensor | None = None  # [V] float64, where the next residual is built
        self.p_out: list[int] = []          # tokens removed from p̂ (deterministic updates)
        self.q_out: list[int] = []          # tokens removed from q̂ (without_replacement)
        self.pm = self.qm = 1.0

    def child_alpha(self, x: int, px: float, qx: float) -> float:
        """α_c = min(α p̂(x) / q̂(x), 1); px, qx: the input rows' values at x (q̂ = δ_x if no q)."""
        p = 0.0 if x in self.p_out else (px if self.p is None else float(self.p[x]))
        q = 1.0 if self.drafts is None else (0.0 if x in self.q_out else qx)
        return _alpha(self.alpha, x, p / self.pm, q / self.qm)

    def reject(self, x: int, px: float, qx: float, without_replacement: bool) -> None:
        """The subtree of the child with token x was rejected: the residual step."""
        a = self.alpha
        if a <= 0.0:  # m = max(0 - q̂, 0) = 0: α stays 0, and nothing below u can be accepted
            return
        if self.drafts is None:  # q̂ = δ_x: m = α p̂ with x removed
            rest_m = self.pm - px
        else:  # m = (α / pm) · max(p - (pm / (α qm)) q, 0), computed in float64
            if self.p is None:  # the first read of this node's rows: are they distributions?
                p_row = self.probs[self.u]
                _check_mass(p_row)  # (DraftTree checked the q rows)
                self.p = p_row.to("cpu", torch.float64, copy=True)  # the same values as the row
                self.spare = torch.empty_like(self.p)
            p = self.p  # into the spare buffer: a null residual below keeps p̂ as it was
            rest = torch.sub(p, self.drafts[self.u].cpu(), alpha=self.pm / (a * self.qm), out=self.spare)
            rest.clamp_(min=0.0)
            if self.q_out:  # q̂ is 0 there: m = p̂
                rest[self.q_out] = p[self.q_out]
            rest_m = float(rest.sum())
        r = a * rest_m / self.pm
        if rest_m > _NULL_MASS * self.pm:
            if self.drafts is None:
                self.p_out.append(x)
            else:
                self.p, self.spare = rest, self.p
            self.pm, self.alpha = rest_m, r / (1.0 - a + r)
        elif 1.0 - a > _NULL_MASS:
            self.alpha = 0.0  # nothing left to emit here: this node can no longer be accepted
        # else: 1 - α + r ~ 0, the rejection had probability ~0 (round-off): keep the state
        if without_replacement:
            self.q_out.append(x)
            self.qm -= qx

    def row(self) -> torch.Tensor:
        """[V] the (unnormalised) distribution the new token is drawn from."""
        if self.p is not None:
            return self.p
        p_row = self.probs[self.u]
        _check_mass(p_row)
        if self.p_out:
            row = p_row.to("cpu", torch.float64, copy=True)
            row[self.p_out] = 0.0
            return row
        return p_row


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


def _child_values(tree: DraftTree, target_probs: torch.Tensor) -> tuple[list[float], list[float]]:
    """p(x_c | parent) and q(x_c | parent) of every node c (0.0 for the root): two gathers."""
    par, tok = tree._child_index
    dev = target_probs.device
    p_kid = [0.0] + target_probs[par.to(dev), tok.to(dev)].tolist()
    q_kid = tree._child_draft_probs if tree.sampling != "deterministic" else [1.0] * tree.num_nodes
    return p_kid, q_kid


def check_chain(tree: DraftTree) -> None:
    """Block verification's precondition: a chain (every node has at most one child)."""
    if not tree.is_chain:
        raise ValueError("rule='block' verifies a chain (at most one child per node), but this tree "
                         "branches; use rule='traversal' (trees) or rule='token' (the generator's and "
                         "server's verify='traversal' / verify='token'; the CLI's --verify traversal)")


def accept_block(tree: DraftTree, target_probs: torch.Tensor, us) -> Acceptance:
    """Block verification of a chain (every node has at most one child); ``us``: uniforms."""
    # target_probs: [N, V]; node i of a chain is x_i, its row is p(.|x_1..x_i)
    check_chain(tree)
    gamma, x = tree.num_nodes - 1, tree._tokens_list
    q = tree.draft_probs if tree.sampling != "deterministic" else None
    p_kid, q_kid = _child_values(tree, target_probs)
    p = [1.0]  # p_i = min(p_{i-1} p̂_{i-1}(x_i) / q̂_{i-1}(x_i), 1): scalars, no row is read
    for i in range(gamma):
        p.append(_alpha(p[i], x[i + 1], p_kid[i + 1], q_kid[i + 1]))
    if gamma and next(us) < p[gamma]:  # h_γ = p_γ: the whole block is accepted
        return _result(tree, list(range(1, gamma + 1)), _Residual(1.0, gamma, target_probs, None), 1, us)
    for i in range(gamma - 1, 0, -1):  # backward: stop at i w.p. h_i = r_i / (r_i + 1 - p_i)
        eta = next(us)
        if eta < p[i]:  # h_i <= p_i: only then is r_i (a pass over the row) needed
            node = _Residual(p[i], i, target_probs, q)
            node.reject(x[i + 1], p_kid[i + 1], q_kid[i + 1], False)
            if eta < node.alpha:
                return _result(tree, list(range(1, i + 1)), node, gamma - i + 1, us)
    root = _Residual(1.0, 0, target_probs, q if gamma else None)
    if gamma:
        root.reject(x[1], p_kid[1], q_kid[1], False)  # τ = 0: residual norm(max(p̂ - q̂, 0))
    return _result(tree, [], root, gamma, us)


def accept_traversal(tree: DraftTree, target_probs: torch.Tensor, us) -> Acceptance:
    """Traversal verification of any tree, leaves first (post-order); ``us``: uniforms."""
    # target_probs: [N, V]; row u = p(.|path to u)
    wor = tree.sampling == "without_replacement"
    x, children = tree._tokens_list, tree.children
    q = tree.draft_probs if tree.sampling != "deterministic" else None
    p_kid, q_kid = _child_values(tree, target_probs)
    sizes = tree.subtree_sizes
    tests = 0

    def visit(u: int, alpha: float) -> tuple[list[int], _Residual] | None:
        nonlocal tests
        if alpha <= 0.0:  # (not the root) every test below fails: one uniform and test per node
            tests += sizes[u]
            next(itertools.islice(us, sizes[u] - 1, None))
            return None
        kids = children[u]
        node = _Residual(alpha, u, target_probs, q)
        for j, c in enumerate(kids):
            found = visit(c, node.child_alpha(x[c], p_kid[c], q_kid[c]))
            if found is not None:
                found[0].insert(0, c)
                return found
            if j + 1 < len(kids) or u == 0:  # the residual step at u (the last one: lazily)
                node.reject(x[c], p_kid[c], q_kid[c], wor)
        if u == 0:
            return [], node  # the root always stops the walk
        tests += 1
        eta = next(us)  # u is a leaf now: accept the path to u w.p. α_u (<= α before the step)
        if kids and eta < node.alpha:
            node.reject(x[kids[-1]], p_kid[kids[-1]], q_kid[kids[-1]], wor)
        return ([], node) if eta < node.alpha else None

    path, node = visit(0, 1.0)
    return _result(tree, path, node, tests, us)
