"""generate_batch: B requests to completion, every step ONE target forward for all of them.

A thin front door on ``treespec.server.SpeculativeServer`` (all requests join at the first
step, each leaves at its EOS or limit). With one drafter for all requests, drafting is batched
too (``treespec.drafters.batched``); with a list of per-request drafters, each request is
drafted by its own (``LoopBatchDrafter``). Each request draws only from its own generator, in
the same order as ``SpeculativeGenerator`` (build, then accept), so its output is its output
alone whatever its batch-mates.
"""

from __future__ import annotations

from typing import Sequence

import torch

from treespec.drafters.base import Drafter
from treespec.drafters.batched import BatchDrafter, LoopBatchDrafter, as_batch_drafter
from treespec.engine import check_builder
from treespec.models import Target
from treespec.sampling import SamplingConfig
from treespec.trees.base import TreeBuilder
from treespec.verifiers.acceptance import VERIFY_RULES, VerifyRule


def _check_requests(target: Target, drafters, prompts, max_new_tokens, configs, seeds,
                    per_request: bool = True) -> None:
    for name, value in (("drafters", drafters), ("prompts", prompts), ("max_new_tokens", max_new_tokens),
                        ("configs", configs), ("seeds", seeds)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list with one entry per request, got {type(value).__name__}")
        if len(value) != len(prompts):
            raise ValueError(f"{name} has {len(value)} entries but there are {len(prompts)} prompts")
    if not prompts:
        raise ValueError("prompts must hold at least one request")
    if per_request and len({id(d) for d in drafters}) != len(drafters):
        raise ValueError("each request needs its own drafter object (a drafter holds one request's state)")
    for b, (d, p, m, c) in enumerate(zip(drafters, prompts, max_new_tokens, configs)):
        if not isinstance(d, (Drafter, BatchDrafter)) or (per_request and not isinstance(d, Drafter)):
            raise TypeError(f"drafters[{b}] must be a Drafter, got {type(d).__name__}")
        if d.vocab_size != target.vocab_size:
            raise ValueError(f"drafters[{b}] has vocab size {d.vocab_size} but the target has "
                             f"{target.vocab_size}; they must share one vocabulary")
        if not isinstance(p, torch.Tensor) or p.dtype != torch.long or p.dim() != 1 or p.numel() < 1:
            raise TypeError(f"prompts[{b}] must be a 1-D LongTensor with at least one token id")
        if bool((p < 0).any()) or bool((p >= target.vocab_size).any()):
            raise ValueError(f"prompts[{b}] has token ids outside [0, {target.vocab_size})")
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise ValueError(f"max_new_tokens[{b}] must be an int > 0, got {m!r}")
        if not isinstance(c, SamplingConfig):
            raise TypeError(f"configs[{b}] must be a SamplingConfig, got {type(c).__name__}")


def generate_batch(
    target: Target,
    drafters: "Sequence[Drafter] | Drafter | BatchDrafter",
    builder: TreeBuilder,
    # B prompts, LongTensor[P_b + 1] each
    prompts: Sequence[torch.Tensor],
    max_new_tokens: Sequence[int],
    configs: Sequence[SamplingConfig] | None = None,
    seeds: Sequence[int | None] | None = None,
    verify: VerifyRule = "token",
) -> list[list[int]]:
    """New token ids per request (EOS included when hit; never more than its limit).

    ``drafters``: one Drafter or BatchDrafter for every request (its batched form: one
    drafter forward per round for all of them), or a list with request b's own single-request
    drafter at b (each driven alone, ``LoopBatchDrafter``). ``configs`` default to greedy;
    ``seeds[b]`` seeds request b's generator (None: a fresh random seed). Runs a
    ``SpeculativeServer`` with every request joining at the first step.
    """
    from treespec.server import SpeculativeServer

    b_ = len(prompts) if isinstance(prompts, (list, tuple)) else 0
    configs = [SamplingConfig(0.0)] * b_ if configs is None else configs
    seeds = [0] * b_ if seeds is None else seeds
    if not isinstance(target, Target):
        raise TypeError(f"target must be a treespec.Target, got {type(target).__name__}")
    check_builder(builder)
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
    per_request = isinstance(drafters, (list, tuple))
    _check_requests(target, drafters if per_request else [drafters] * b_, prompts, max_new_tokens,
                    configs, seeds, per_request)
    budget = getattr(builder, "budget", 1)
    for b, (p, m) in enumerate(zip(prompts, max_new_tokens)):
        if p.numel() + m + budget > target.max_context:
            raise ValueError(f"request {b} does not fit the context window ({target.max_context}: "
                             f"{target.max_context_reason}; prompt "
                             f"{p.numel()}, max_new_tokens {m}, tree budget {budget}); shorten it")
    if per_request:
        layers = tuple(sorted({i for d in drafters if d.needs_target_hidden for i in d.target_layers}))
        drafter = LoopBatchDrafter(lambda key: drafters[key], target.vocab_size, bool(layers), layers)
    else:
        drafter = as_batch_drafter(drafters)
    server = SpeculativeServer(target, drafter, builder, verify)
    rids = [server.add_request(p, c, m, s) for p, c, m, s in zip(prompts, configs, max_new_tokens, seeds)]
    assert rids == list(range(b_))          # LoopBatchDrafter keys are request indices
    server.run()
    return [list(server.finished[r].tokens) for r in rids]
