"""What ``treespec bench`` measures, and how its rows are compared.

A **row** is one way of decoding: plain decoding (treespec's loop with a one-node tree, or HF
``generate`` on the same model object, or llama.cpp) or one **configuration** (a drafter, a tree
builder with its size in nodes incl. the root, a temperature). A **run** is one row on one
prompt. The rows of one prompt run back to back (interleaved), so drift of the host between
prompts hits every row alike, and two statistics compare a row with plain decoding:

- **paired**: the median over prompts of (row's tokens/s) / (plain's tokens/s) on the same prompt;
  drift between prompts cancels;
- **pooled**: (all the row's tokens / all its seconds) / (the same for plain decoding).

Rates are given with the prefill (wall time of the whole generation: what a user waits) and
decode-only (the prefill left out: steady-state speed). ``benchmarks/engine.py`` uses the same
two ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from treespec.runtime.generator import SpeculativeGenerator

__all__ = ["Run", "RowSummary", "paired_ratio", "pooled_ratio", "run_generator", "run_hf_generate",
           "sequoia_acceptance", "sequoia_builder", "summarize"]


@dataclass
class Run:
    """One row on one prompt (seconds; counts summed over the generation)."""

    tokens: int                       # new tokens
    seconds: float                    # wall time, prefill included
    prefill_s: float | None = None    # None where the row cannot split it (HF generate)
    steps: int = 0                    # target forwards after the prefill
    emitted: int = 0                  # tokens the steps emitted before truncation (τ = emitted / steps)
    nodes: int = 0                    # tree nodes verified, roots included
    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0              # acceptance, compaction, commit, bookkeeping
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    same_as_plain: bool | None = None  # T = 0: token for token equal to the plain row's output

    @property
    def decode_s(self) -> float | None:
        return None if self.prefill_s is None else max(self.seconds - self.prefill_s, 1e-9)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> Run:
        return cls(**record)


def paired_ratio(runs: Sequence[Run], base: Sequence[Run], decode_only: bool = False) -> float | None:
    """Median over prompts of the per-prompt ratio of tokens/s, ``runs[i]`` against ``base[i]``
    (the same prompt). None where a rate is missing (no decode-only split, or no tokens)."""
    if len(runs) != len(base):
        raise ValueError(f"paired_ratio needs one base run per run, got {len(runs)} runs and {len(base)} base runs")
    ratios = []
    for r, b in zip(runs, base):
        rt, bt = (r.decode_s, b.decode_s) if decode_only else (r.seconds, b.seconds)
        if rt is None or bt is None or r.tokens == 0 or b.tokens == 0:
            return None
        ratios.append((r.tokens / rt) / (b.tokens / bt))
    return statistics.median(ratios) if ratios else None


def pooled_ratio(runs: Sequence[Run], base: Sequence[Run], decode_only: bool = False) -> float | None:
    """(all tokens / all seconds of ``runs``) / (the same of ``base``)."""
    a, b = pooled_rate(runs, decode_only), pooled_rate(base, decode_only)
    return a / b if a and b else None


def pooled_rate(runs: Sequence[Run], decode_only: bool = False) -> float | None:
    """All tokens over all seconds (decode-only: the prefill left out); None if unknown."""
    seconds = [r.decode_s if decode_only else r.seconds for r in runs]
    if not runs or any(s is None for s in seconds) or sum(seconds) <= 0:
        return None
    return sum(r.tokens for r in runs) / sum(seconds)


@dataclass(frozen=True)
class RowSummary:
    """A row over a set of prompts, against plain decoding on the same prompts."""

    prompts: int
    tokens: int
    tokens_per_s: float | None          # pooled, prefill included
    decode_tokens_per_s: float | None   # pooled, prefill left out
    speedup_paired: float | None        # prefill included, against the plain row
    speedup_pooled: float | None
    decode_speedup_pooled: float | None
    tau: float | None                   # None for rows without steps (HF generate, llama.cpp)
    mean_nodes: float | None
    acceptance_by_depth: list[float]    # accepted / attempted at draft depth 1, 2, ...
    draft_ms: float | None              # per step
    verify_ms: float | None
    other_ms: float | None
    same_as_plain: int | None           # T = 0: prompts whose output equals the plain row's
    compared: int | None                # prompts with a greedy comparison


def summarize(runs: Sequence[Run], base: Sequence[Run]) -> RowSummary:
    """``runs`` (one row) against ``base`` (the plain row) over the same prompts, in order."""
    steps = sum(r.steps for r in runs)
    depth = max((len(r.depth_attempts) for r in runs), default=0)
    attempts = [sum(r.depth_attempts[d] for r in runs if d < len(r.depth_attempts)) for d in range(depth)]
    accepts = [sum(r.depth_accepts[d] for r in runs if d < len(r.depth_accepts)) for d in range(depth)]
    compared = [r.same_as_plain for r in runs if r.same_as_plain is not None]
    per_step = (lambda total: 1e3 * total / steps) if steps else (lambda total: None)
    return RowSummary(
        prompts=len(runs), tokens=sum(r.tokens for r in runs),
        tokens_per_s=pooled_rate(runs), decode_tokens_per_s=pooled_rate(runs, decode_only=True),
        speedup_paired=paired_ratio(runs, base), speedup_pooled=pooled_ratio(runs, base),
        decode_speedup_pooled=pooled_ratio(runs, base, decode_only=True),
        tau=sum(r.emitted for r in runs) / steps if steps else None,
        mean_nodes=sum(r.nodes for r in runs) / steps if steps else None,
        acceptance_by_depth=[a / t if t else 0.0 for a, t in zip(accepts, attempts)],
        draft_ms=per_step(sum(r.draft_s for r in runs)), verify_ms=per_step(sum(r.verify_s for r in runs)),
        other_ms=per_step(sum(r.other_s for r in runs)),
        same_as_plain=sum(compared) if compared else None, compared=len(compared) if compared else None)


def run_generator(gen: SpeculativeGenerator, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                  seed: int) -> tuple[Run, list[int]]:
    """One generation of prompt ids ``ids`` [P]: its Run and its new tokens."""
    t0 = time.perf_counter()
    res = gen.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    seconds = time.perf_counter() - t0
    s = res.stats
    run = Run(tokens=s.new_tokens, seconds=seconds, prefill_s=min(s.prefill_time, seconds), steps=s.steps,
              emitted=round(s.tau * s.steps), nodes=s.tree_nodes, draft_s=s.draft_time, verify_s=s.verify_time,
              other_s=s.accept_time + s.other_time, depth_attempts=list(s.depth_attempts),
              depth_accepts=list(s.depth_accepts))
    return run, res.token_ids.tolist()


def run_hf_generate(target, ids: torch.Tensor, max_new_tokens: int, temperature: float,
                    seed: int) -> tuple[Run, list[int]]:
    """HF ``generate`` of ``ids`` [P] on the target's own model object (its weights, dtype and
    linear path): greedy at T = 0, else sampled at ``temperature`` (no top-k / top-p)."""
    from treespec.fastpath.device import synchronize

    eos = list(target.eos_token_ids) or None
    sample = temperature > 0
    torch.manual_seed(seed)
    device_ids = ids[None].to(target.device)
    with torch.inference_mode():
        synchronize(target.device)
        t0 = time.perf_counter()
        out = target.model.generate(device_ids, do_sample=sample, max_new_tokens=max_new_tokens, eos_token_id=eos,
                                    pad_token_id=eos[0] if eos else 0, attention_mask=torch.ones_like(device_ids),
                                    repetition_penalty=None, temperature=temperature if sample else None,
                                    top_p=None, top_k=0 if sample else None)
        synchronize(target.device)
        seconds = time.perf_counter() - t0
    new = out[0, ids.numel():].tolist()
    return Run(tokens=len(new), seconds=seconds), new


def sequoia_acceptance(target, drafter_name: str, temperature: float,
                       mode: str = "deterministic") -> tuple[tuple[float, ...] | None, str]:
    """Sequoia's positional acceptance vector for ``drafter_name`` on ``target`` at
    ``temperature`` drafting in ``mode``: the one ``treespec calibrate`` measured on this
    machine for this target (dtype and linear path), else None (Sequoia's default vector).
    Returns (vector, where it came from, in words)."""
    from treespec.planning.calibration import Calibration, acceptance_key, target_calibration_path

    path = target_calibration_path(target)
    key = acceptance_key(drafter_name, temperature, mode)
    if not path.exists():
        return None, f"Sequoia's default (no calibration at {path}; `treespec calibrate --drafter {drafter_name}`)"
    vector = Calibration.load(path).acceptance.get(key)
    if vector is None:
        return None, f"Sequoia's default ({path} has no entry {key!r}; `treespec calibrate --drafter {drafter_name}`)"
    return tuple(float(x) for x in vector), f"calibrated: {path} [{key}]"


def sequoia_builder(target, drafter: str | object, budget: int = 16, depth: int = 5, temperature: float = 0.0,
                    mode: str = "deterministic"):
    """A ``SequoiaBuilder`` of ``budget`` nodes (incl. the root) shaped for ``drafter``'s
    acceptance on ``target``: the vector ``treespec calibrate`` measured on this machine at
    ``temperature`` in ``mode``, else Sequoia's default. ``drafter``: a name or a loaded drafter
    (its ``registry_name``). The builder's ``acceptance_source`` says which vector it took."""
    from treespec.builders.sequoia import SequoiaBuilder
    from treespec.drafters.base import capabilities

    name = drafter if isinstance(drafter, str) else capabilities(drafter).registry_name
    if not isinstance(name, str):
        raise TypeError(f"drafter must be a registered name or a drafter loaded by treespec.load_drafter (it "
                        f"carries registry_name), got {type(drafter).__name__}")
    vector, source = sequoia_acceptance(target, name, temperature, mode)
    builder = SequoiaBuilder(budget=budget, depth=depth, acceptance=vector, mode=mode)
    builder.acceptance_source = source
    return builder
