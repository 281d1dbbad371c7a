"""Closed-form acceptance analytics (the mechanics that size chains and trees).

β (beta)  per-token acceptance rate of one draft token drawn from q against target p:
          β = Σ_x min(p(x), q(x)) = 1 − TVD(p, q).
τ (tau)   expected tokens emitted per target forward (accepted + the one new token).
"""

from __future__ import annotations

import torch

from treespec.tree import DraftTree


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """β = Σ_x min(p(x), q(x)) = 1 − TVD(p, q) over the last dim; [..., V] -> [...].

    This is the probability that standard speculative sampling accepts one token drawn from q
    (accept w.p. min(1, p/q): Σ_x q(x)·min(1, p(x)/q(x)) = Σ_x min(p(x), q(x))).
    """
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(-1)


def expected_chain_tokens(beta: float, k: int) -> float:
    """τ of a chain of k draft tokens with i.i.d. per-token acceptance β.

    Token i (1-based) is emitted iff the first i are all accepted (prob β^i), plus the one new
    token always: τ = Σ_{i=0..k} β^i = (1 − β^(k+1)) / (1 − β), and k + 1 at β = 1.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if k < 0:
        raise ValueError(f"k (chain length) must be >= 0, got {k}")
    if beta == 1.0:
        return float(k + 1)
    return (1.0 - beta ** (k + 1)) / (1.0 - beta)


def expected_tree_tokens(tree: DraftTree, node_accept_probs: torch.Tensor) -> float:
    """τ of a tree from per-node acceptance probabilities.

    ``node_accept_probs[i]`` (FloatTensor[N]) is P(node i is accepted | its parent was reached),
    e.g. p(x_i | path) for deterministic children under the target; entry 0 (the root) is
    ignored. Node i is on the accepted path with probability R_i = Π_{j on path(i), j≠root}
    a_j, and τ = 1 + Σ_{i≥1} R_i (each accepted node is one token, plus the new token).
    The a_i of siblings must sum to at most 1 (they are disjoint events).
    """
    if node_accept_probs.shape != (tree.num_nodes,):
        raise ValueError(f"node_accept_probs must have shape [N={tree.num_nodes}], got "
                         f"{tuple(node_accept_probs.shape)}")
    a = node_accept_probs.to(torch.float64)
    if bool((a < 0).any()) or bool((a > 1).any()):
        raise ValueError("node_accept_probs must lie in [0, 1]")
    reach = torch.ones(tree.num_nodes, dtype=torch.float64)
    par = tree.parents.tolist()
    for i in range(1, tree.num_nodes):
        reach[i] = reach[par[i]] * a[i]
    return float(1.0 + reach[1:].sum())
