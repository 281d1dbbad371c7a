"""Unrolls, losses and held-out metrics shared by the drafter recipes.

Glossary (positions index the cached sequence; p_t = the target's law of token t + 1):
    depth j     the j-th draft level below the root (j = 0: the root's children). At slot t a
                depth-j draft proposes token t + j + 2, whose target law is p_{t+j+1}.
    TTT unroll  training-time test (EAGLE-3): depth 0 runs every slot on the target's features
                with a causal mask; depth j >= 1 feeds each slot its own depth j - 1 output as the
                feature and the true token t + j + 1, at position t + j, attending to depth-0 keys
                s <= t and to its own earlier depths at the same t. This is exactly what a tree
                node at depth j sees at inference (committed slots + its ancestors).
    sequential  DeepSeek-V3 MTP training: depth j runs the whole sequence on depth j - 1's
                outputs with a causal mask among depth-j positions only.
    top-k KD    distillation loss: cross-entropy between the target's top-k distribution
                (renormalised over the ids the student can represent) and the student's softmax
                over a vocabulary subset S containing those ids.
    top1        held-out rate at which argmax q == argmax p (greedy acceptance of one draft
                token given a correct prefix). beta_top32: sum over the target's top-32 ids of
                min(p, q), a lower bound of the T = 1 acceptance 1 - TVD(p, q).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treespec.train.data import Batch


@dataclass(frozen=True)
class DepthView:
    """Inputs and labels of depth j for every slot t (B sequences, T slots).

    tokens: LongTensor[B, T] token t + j + 1 (0 past the end); pos: LongTensor[B, T] = t + j;
    mask: BoolTensor[B, T] where the loss / metric counts; top_i, top_p: [B, T, K] p_{t+j+1}.
    """

    tokens: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    top_i: torch.Tensor
    top_p: torch.Tensor


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x[:, t + s] at t (zeros past the end); x: [B, T, ...]."""
    out = torch.zeros_like(x)
    if s < x.shape[1]:
        out[:, : x.shape[1] - s] = x[:, s:]
    return out


def depth_view(batch: Batch, j: int) -> DepthView:
    b, t = batch.tokens.shape
    ar = torch.arange(t, device=batch.tokens.device)
    nxt = ar + j + 1                                     # index of the input token / of p
    length = batch.valid.sum(1, keepdim=True)
    # the drafted token t + j + 2 must be a reply token; p_{t+j+1} must exist
    start = (batch.reply.float().argmax(1, keepdim=True))
    mask = (nxt[None] < length) & (nxt[None] + 1 >= start)
    return DepthView(
        tokens=_shift(batch.tokens, j + 1),
        pos=(ar + j)[None].expand(b, t),
        mask=mask,
        top_i=_shift(batch.top_i, j + 1),
        top_p=_shift(batch.top_p, j + 1),
    )


def causal(t: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def ttt_unroll(head, feat0: torch.Tensor, batch: Batch, depths: int,
               noise: float = 0.0) -> list[torch.Tensor]:
    """Outputs g_j [B, T, H] for j < depths (see the module docstring). feat0: [B, T, H]."""
    b, t, _ = feat0.shape
    outs, past_k, past_v = [], [], []
    feat = feat0 if noise == 0 else feat0 + (torch.rand_like(feat0) - 0.5) * 2 * noise
    eye = torch.eye(t, dtype=torch.bool, device=feat0.device)
    for j in range(depths):
        view = depth_view(batch, j)
        mask = torch.cat([causal(t, feat0.device)] + [eye] * j, dim=1)[None, None]
        past = (torch.cat(past_k, 2), torch.cat(past_v, 2)) if past_k else None
        g, (k, v) = head(view.tokens, feat, view.pos, past, mask)
        outs.append(g)
        past_k.append(k)
        past_v.append(v)
        feat = g
    return outs


def sequential_unroll(head, feat0: torch.Tensor, batch: Batch, depths: int) -> list[torch.Tensor]:
    """DeepSeek-V3 MTP depths: g_j [B, T, H], each depth causal over its own positions."""
    t = feat0.shape[1]
    outs, feat = [], feat0
    for j in range(depths):
        view = depth_view(batch, j)
        g, _ = head(view.tokens, feat, view.pos, None, causal(t, feat0.device)[None, None])
        outs.append(g)
        feat = g
    return outs


# ---------------------------------------------------------------------------------- losses
class VocabSubset:
    """The candidate set S of a step: frequent ids ∪ the batch's target top-k ids ∪ ``negatives``
    ids drawn uniformly from the whole vocabulary (a sampled softmax: without them, ids never in
    S keep whatever logits they drift to, and a model with its own head ends up proposing them).

    ``frequent``: LongTensor[F] of target ids. ``ids(batch)`` -> LongTensor[|S|];
    ``lookup(ids)`` -> LongTensor[V] with the position of each id in S, or -1.
    """

    def __init__(self, frequent: torch.Tensor, vocab_size: int, negatives: int = 0):
        self.frequent = frequent.long()
        self.vocab_size = vocab_size
        self.negatives = negatives

    def ids(self, *tops: torch.Tensor) -> torch.Tensor:
        device = tops[0].device if tops else self.frequent.device
        extra = [torch.randint(0, self.vocab_size, (self.negatives,)).to(device)] if self.negatives else []
        return torch.unique(torch.cat([self.frequent.to(device)] + [t.reshape(-1) for t in tops] + extra))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        table = torch.full((self.vocab_size,), -1, dtype=torch.long, device=ids.device)
        table[ids] = torch.arange(ids.numel(), device=ids.device)
        return table


def topk_kd(logits: torch.Tensor, top_i: torch.Tensor, top_p: torch.Tensor,
            lookup: torch.Tensor) -> torch.Tensor:
    """Per-row top-k KD loss [N].

    logits: [N, S] student logits over the subset; top_i/top_p: [N, K] target ids/probs;
    lookup: LongTensor[V] target id -> subset column (-1 = not representable, dropped).
    """
    col = lookup[top_i]                                   # [N, K]
    ok = col >= 0
    w = top_p * ok
    w = w / w.sum(-1, keepdim=True).clamp_min(1e-6)
    logq = logits.float().log_softmax(-1).gather(-1, col.clamp_min(0))
    return -(w * logq).sum(-1)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


# ---------------------------------------------------------------------------------- metrics
@dataclass
class DepthMetrics:
    """Running sums of top1 and beta_top32 per depth (see the module docstring)."""

    count: list[float]
    top1: list[float]
    beta: list[float]

    @classmethod
    def zeros(cls, depths: int) -> "DepthMetrics":
        return cls([0.0] * depths, [0.0] * depths, [0.0] * depths)

    def add(self, j: int, q: torch.Tensor, view_top_i: torch.Tensor, view_top_p: torch.Tensor,
            mask: torch.Tensor) -> None:
        """q: [N, V] draft probabilities (target ids); rows selected by mask [N]."""
        q, ti, tp = q[mask], view_top_i[mask], view_top_p[mask]
        self.count[j] += float(mask.sum())
        self.top1[j] += float((q.argmax(-1) == ti[:, 0]).sum())
        self.beta[j] += float(torch.minimum(tp, q.gather(-1, ti)).sum())

    def summary(self) -> dict:
        """Rates per measured depth (depths with no positions, e.g. a model drafter's j >= 1, are left out)."""
        d = [j for j, c in enumerate(self.count) if c > 0]
        return {
            "top1_by_depth": [round(self.top1[j] / self.count[j], 4) for j in d],
            "beta_top32_by_depth": [round(self.beta[j] / self.count[j], 4) for j in d],
            "positions": int(self.count[0]),
        }
