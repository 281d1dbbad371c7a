"""Logits -> probabilities, applied identically to the target (p) and the drafter (q).

Order (the same as HF's default warpers): temperature, then top-k, then top-p, then min-p.
Temperature 0 means greedy: a one-hot on the argmax, ties broken toward the lowest token id
(``torch.max`` over a dim returns the first maximal index, as ``torch.argmax`` does). Greedy
decoding then needs no special case in the acceptance rules: a one-hot p accepts exactly the
argmax token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become probabilities, for the target and the drafter alike. Validated on
    construction. These are the only sampling defaults in treespec: every front door
    (``generate``, ``stream``, ``add_request``, ``generate_batch``, the CLI) takes the same
    settings in this order and defaults to this dataclass's values, i.e. greedy decoding.
    """

    # 0 = greedy (one-hot argmax, exact token-for-token equality with plain decoding);
    # > 0 divides the logits before the softmax.
    temperature: float = 0.0
    # keep the k most likely tokens; 0 disables.
    top_k: int = 0
    # keep the smallest most-likely set whose mass reaches top_p; 1.0 disables.
    top_p: float = 1.0
    # drop tokens whose probability is below min_p times the largest; 0.0 disables.
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0.0 <= m < 1.0):
            raise ValueError(f"min_p must be in [0, 1) (0 disables it), got {m!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(
    # [..., V]
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> torch.Tensor:
    """Processed probabilities [..., V] in float32 (float64 stays float64). The settings and
    their defaults are ``SamplingConfig``'s (greedy by default).

    Raises ValueError on invalid sampling values (see SamplingConfig).
    """
    cfg = SamplingConfig(temperature, top_k, top_p, min_p)
    return process(logits, cfg)


def process(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """``logits_to_probs`` with a validated config; [..., V] -> [..., V]."""
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(dtype)
    vocab = x.shape[-1]
    if cfg.greedy:
        return torch.zeros_like(x).scatter_(-1, first_argmax(x), 1.0)
    if cfg.temperature != 1.0:   # x / 1 is x, bit for bit: skip a pass over [..., V]
        x = x / cfg.temperature
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        sorted_p = sorted_x.softmax(-1)
        # Mass strictly before each token; keep a token while that mass is still < top_p.
        before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = before >= cfg.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    probs = x.softmax(-1)
    if cfg.min_p > 0.0:
        floor = cfg.min_p * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


ARGMAX_CHUNK = 512   # columns per chunk in ``first_argmax``


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """LongTensor[..., 1]: the first index of each row's maximum over the last dim, as
    ``x.max(-1, keepdim=True).indices`` (NaN counts as the maximum, as there).

    PyTorch's CPU max over a dim with its index is a scalar loop, its max without the index a
    vector one, about ten times faster on a row of 49,152 here. So: each row's chunks of
    ``ARGMAX_CHUNK`` columns reduced by the vector max (the last chunk padded with -inf), the
    first chunk holding the row's maximum found among those few values, and the index found
    inside that chunk alone. The first maximal chunk holds the first maximal column, so ties
    break toward the lowest index, as before."""
    vocab = x.shape[-1]
    if vocab < 8 * ARGMAX_CHUNK:
        return x.max(-1, keepdim=True).indices
    rows = x.reshape(-1, vocab)
    chunks = -(-vocab // ARGMAX_CHUNK)
    if chunks * ARGMAX_CHUNK != vocab:
        rows = torch.nn.functional.pad(rows, (0, chunks * ARGMAX_CHUNK - vocab), value=-math.inf)
    # [R, C, ARGMAX_CHUNK]
    blocks = rows.view(rows.shape[0], chunks, ARGMAX_CHUNK)
    # [R, 1]: the first chunk holding each row's maximum
    chunk = blocks.amax(-1).max(-1, keepdim=True).indices
    inside = blocks[torch.arange(rows.shape[0], device=x.device), chunk[:, 0]].max(-1, keepdim=True).indices
    return (chunk * ARGMAX_CHUNK + inside).reshape(*x.shape[:-1], 1)
