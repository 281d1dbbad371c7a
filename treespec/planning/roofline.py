"""Roofline step times of the target (verification) and of drafters.

One forward pass over ``n_tokens`` tokens for each of ``batch`` sequences, each with a cached
prefix of ``context`` tokens:

    bytes  = weight_bytes                          (weights read once for all B · n tokens)
           + B · context · kv_bytes_per_token      (each sequence reads its own KV cache)
           + B · n · kv_bytes_per_token            (the new K, V rows are written)
    FLOPs  = B · n · flops_per_token(context + n)  (weight matmuls + attention; a dense masked
                                                    tree kernel scores all context + n keys)
    t      = max(bytes / attained bandwidth, FLOPs / attained FLOP/s) + overhead   [seconds]

Drafters (``DrafterSpec.kind``), one batched pass per tree level unless noted:
    model       an independent small model (its own ``shape``): every level is a pass of it.
    eagle       ``layers`` decoder layers of the target's width + EAGLE's 2H -> H fusion layer
                + an LM head over ``draft_vocab`` rows (EAGLE-3 uses a 32k draft vocab).
    early_exit  the target's first ``layers`` layers + its LM head (self-speculation).
    medusa      one pass in total (not per level): D heads of H x H + their own LM heads,
                run on the target's last hidden state.
    lookup      n-gram / prompt lookup: no accelerator work, modelled as 0 s.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from treespec.planning.hardware import Hardware
from treespec.planning.shapes import ModelShape

__all__ = [
    "DRAFTER_KINDS",
    "DrafterKind",
    "DrafterSpec",
    "arithmetic_intensity",
    "compute_bound_batch",
    "drafter_pass_shape",
    "pass_bytes",
    "pass_flops",
    "pass_time",
    "t_draft",
    "t_target",
]

DrafterKind = Literal["model", "eagle", "early_exit", "medusa", "lookup"]
DRAFTER_KINDS: tuple[str, ...] = get_args(DrafterKind)


def _is_int(value: object, low: int) -> bool:
    return (type(value) is int or isinstance(value, numbers.Integral)) and not isinstance(value, bool) \
        and value >= low


def _check_sizes(n_tokens: int, batch: int, context: int) -> None:
    if not _is_int(n_tokens, 1):
        raise ValueError(f"n_tokens must be a positive int (tokens per sequence per pass), got {n_tokens!r}")
    if not _is_int(batch, 1):
        raise ValueError(f"batch must be a positive int (sequences per pass), got {batch!r}")
    if not _is_int(context, 0):
        raise ValueError(f"context must be an int >= 0 (cached tokens per sequence), got {context!r}")


def _bytes(shape: ModelShape, n_tokens: int, batch: int, context: int) -> float:
    return shape.weight_bytes + batch * (context + n_tokens) * shape.kv_bytes_per_token


def _flops(shape: ModelShape, n_tokens: int, batch: int, context: int) -> float:
    return batch * n_tokens * shape.flops_per_token(context + n_tokens)


def _time(shape: ModelShape, hardware: Hardware, n_tokens: int, batch: int, context: int) -> float:
    memory_s = _bytes(shape, n_tokens, batch, context) / hardware.effective_bandwidth
    compute_s = _flops(shape, n_tokens, batch, context) / hardware.effective_flops
    return max(memory_s, compute_s) + hardware.overhead_s


def pass_bytes(shape: ModelShape, n_tokens: int, batch: int = 1, context: int = 0) -> float:
    """Bytes one forward pass moves: weights once, KV read per sequence, new KV written."""
    _check_sizes(n_tokens, batch, context)
    return _bytes(shape, n_tokens, batch, context)


def pass_flops(shape: ModelShape, n_tokens: int, batch: int = 1, context: int = 0) -> float:
    """FLOPs of one forward pass: B · n tokens, each attending to context + n keys."""
    _check_sizes(n_tokens, batch, context)
    return _flops(shape, n_tokens, batch, context)


def pass_time(shape: ModelShape, hardware: Hardware, n_tokens: int, batch: int = 1, context: int = 0) -> float:
    """Seconds of one forward pass: max(memory time, compute time) + overhead."""
    _check_sizes(n_tokens, batch, context)
    return _time(shape, hardware, n_tokens, batch, context)


def t_target(shape: ModelShape, hardware: Hardware, n_tokens: int, batch: int = 1, context: int = 0) -> float:
    """Seconds of one target verification pass over ``n_tokens`` tree tokens per sequence
    (root included: a tree with budget b has n = b + 1)."""
    return pass_time(shape, hardware, n_tokens, batch, context)


def arithmetic_intensity(shape: ModelShape, n_tokens: int, batch: int = 1, context: int = 0) -> float:
    """FLOP per byte of one pass: ``pass_flops / pass_bytes``.

    With W = weight bytes, b bytes per weight and KV = B · context · kv_bytes_per_token,
    the weight-matmul part is AI ≈ k · B · n / (1 + KV / W), k = 2 / b FLOP per weight byte
    per token: the seed's ``AI ≈ k·N / (N + KV bytes)`` with bytes counted in units of W.
    It grows linearly with the tokens per pass until the per-sequence KV reads dominate;
    the pass is compute-bound once AI exceeds ``Hardware.ridge_point``.
    """
    return pass_flops(shape, n_tokens, batch, context) / pass_bytes(shape, n_tokens, batch, context)


def compute_bound_batch(
    shape: ModelShape, hardware: Hardware, n_tokens: int = 1, context: int = 0, max_batch: int = 1 << 20
) -> int | None:
    """Smallest batch at which a pass of ``n_tokens`` per sequence is compute-bound.

    None when it never is (up to ``max_batch``): per-sequence KV reads grow with the batch as
    fast as the FLOPs, so at long context the intensity saturates below the ridge point.
    """
    _check_sizes(n_tokens, 1, context)

    def compute_bound(batch: int) -> bool:
        memory_s = pass_bytes(shape, n_tokens, batch, context) / hardware.effective_bandwidth
        return pass_flops(shape, n_tokens, batch, context) / hardware.effective_flops >= memory_s

    if not compute_bound(max_batch):
        return None
    lo, hi = 0, max_batch  # compute_bound(hi) holds; intensity is increasing in the batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi


# ---------------------------------------------------------------------------------------------
# Drafters


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter costs, by kind (see the module docstring).

    Attributes:
        kind:        one of ``DRAFTER_KINDS``.
        shape:       the draft model's shape; required for (and only for) ``kind="model"``.
        layers:      "eagle": decoder layers (1 in EAGLE-1/2); "early_exit": the first k target
                     layers; ignored otherwise.
        draft_vocab: rows of the drafter's LM head; None = the target's (or draft model's) vocab.
    """

    kind: DrafterKind
    shape: ModelShape | None = None
    layers: int = 1
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"unknown drafter kind {self.kind!r}; known kinds: {list(DRAFTER_KINDS)}")
        if (self.kind == "model") != (self.shape is not None):
            raise ValueError("a 'model' drafter needs its shape (DrafterSpec('model', shape=...)); "
                             f"other kinds take none (kind={self.kind!r})")
        if not isinstance(self.layers, int) or self.layers < 1:
            raise ValueError(f"drafter layers must be a positive int, got {self.layers!r}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be a positive int or None, got {self.draft_vocab!r}")


@functools.lru_cache(maxsize=64)
def drafter_pass_shape(spec: DrafterSpec, target: ModelShape) -> ModelShape | None:
    """The weights one per-level drafter pass reads, as a ModelShape (None: medusa, lookup)."""
    if spec.kind == "model":
        assert spec.shape is not None
        return spec.shape.replace(vocab=spec.draft_vocab or spec.shape.vocab)
    if spec.kind == "eagle":
        if spec.layers > target.layers:
            raise ValueError(f"eagle drafter layers ({spec.layers}) exceed the target's ({target.layers})")
        return target.replace(name=f"eagle-{target.name}", layers=spec.layers,
                              vocab=spec.draft_vocab or target.vocab, tied_embeddings=False,
                              extra_params=2 * target.hidden * target.hidden)
    if spec.kind == "early_exit":
        if spec.layers > target.layers:
            raise ValueError(f"early-exit layers ({spec.layers}) exceed the target's ({target.layers})")
        return target.replace(name=f"{target.name}[:{spec.layers}]", layers=spec.layers,
                              vocab=spec.draft_vocab or target.vocab)
    return None


def t_draft(
    target: ModelShape,
    spec: DrafterSpec,
    hardware: Hardware,
    widths: Sequence[int],
    batch: int = 1,
    context: int = 0,
) -> float:
    """Seconds to draft one tree: one batched pass per level.

    ``widths[l]`` is the number of nodes at depth l that pass l expands (``widths[0] == 1``, the
    root); a chain of k draft tokens has ``widths == [1] * k``. No widths: no drafting, 0 s.
    """
    if not all(_is_int(w, 1) for w in widths):
        raise ValueError(f"widths must be positive ints (nodes expanded per level), got {list(widths)}")
    _check_sizes(1, batch, context)
    if not widths or spec.kind == "lookup":
        return 0.0
    if spec.kind == "medusa":
        # D heads (ResBlock H x H + LM head V x H each) on one hidden state per sequence.
        vocab = spec.draft_vocab or target.vocab
        params = len(widths) * (target.hidden * target.hidden + vocab * target.hidden)
        memory_s = params * target.bytes_per_weight / hardware.effective_bandwidth
        compute_s = 2.0 * params * batch / hardware.effective_flops
        return max(memory_s, compute_s) + hardware.overhead_s
    shape = drafter_pass_shape(spec, target)
    assert shape is not None
    return math.fsum(_time(shape, hardware, w, batch, context) for w in widths)
