"""generate_batch: B requests to completion with ONE target forward per step for all of them.

A minimal batched loop on the batched pieces (``TreeBatch``, ``BatchVerifier``,
``accept_batch``); drafting is still one single-request drafter per request (a batched drafter
protocol is a later step). One step, for the live requests:

    built_b = builder.build(drafter_b, root_b, config_b, gen_b)     per request
    batch   = TreeBatch.from_trees([built_b.tree], configs)
    out     = verifier.score(batch)                                  ONE target forward
    acc     = accept_batch(batch, out.probs, gens)                   per request, own generator
    verifier.compact(acc.keep_src); drafter_b.commit(...)            per row
    finished requests (EOS / their max_new_tokens) leave: verifier.retain(live rows)

Each request draws only from its own generator, in the same order as ``SpeculativeGenerator``
(build, then accept), so its output is its output alone whatever its batch-mates.
"""

from __future__ import annotations

from typing import Sequence

import torch

from treespec.batch import TreeBatch, accept_batch
from treespec.drafters.base import Drafter, TargetFeatures
from treespec.engine import check_builder, check_seed
from treespec.models import Target
from treespec.sampling import SamplingConfig
from treespec.trees.base import TreeBuilder
from treespec.verifiers.acceptance import VERIFY_RULES, VerifyRule
from treespec.verifiers.batch_attention import BatchVerifier


def _layers(feats: TargetFeatures, layers: tuple[int, ...]) -> TargetFeatures:
    return TargetFeatures({i: feats.hidden[i] for i in layers}) if layers else TargetFeatures.empty()


def _check_requests(target: Target, drafters, prompts, max_new_tokens, configs, seeds) -> None:
    for name, value in (("drafters", drafters), ("prompts", prompts), ("max_new_tokens", max_new_tokens),
                        ("configs", configs), ("seeds", seeds)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list with one entry per request, got {type(value).__name__}")
        if len(value) != len(prompts):
            raise ValueError(f"{name} has {len(value)} entries but there are {len(prompts)} prompts")
    if not prompts:
        raise ValueError("prompts must hold at least one request")
    if len({id(d) for d in drafters}) != len(drafters):
        raise ValueError("each request needs its own drafter object (a drafter holds one request's state)")
    for b, (d, p, m, c) in enumerate(zip(drafters, prompts, max_new_tokens, configs)):
        if not isinstance(d, Drafter):
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
    drafters: Sequence[Drafter],
    builder: TreeBuilder,
    # B prompts, LongTensor[P_b + 1] each
    prompts: Sequence[torch.Tensor],
    max_new_tokens: Sequence[int],
    configs: Sequence[SamplingConfig] | None = None,
    seeds: Sequence[int | None] | None = None,
    verify: VerifyRule = "token",
) -> list[list[int]]:
    """New token ids per request (EOS included when hit; never more than its limit).

    ``drafters[b]`` is request b's own drafter; ``configs`` default to greedy; ``seeds[b]``
    seeds request b's generator (None: a fresh random seed). The builder must be stateless
    between calls (every treespec builder is).
    """
    b_ = len(prompts) if isinstance(prompts, (list, tuple)) else 0
    configs = [SamplingConfig(0.0)] * b_ if configs is None else configs
    seeds = [0] * b_ if seeds is None else seeds
    if not isinstance(target, Target):
        raise TypeError(f"target must be a treespec.Target, got {type(target).__name__}")
    check_builder(builder)
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
    _check_requests(target, drafters, prompts, max_new_tokens, configs, seeds)
    budget = getattr(builder, "budget", 1)
    for b, (p, m) in enumerate(zip(prompts, max_new_tokens)):
        if p.numel() + m + budget > target.max_context:
            raise ValueError(f"request {b} does not fit the context window ({target.max_context}: prompt "
                             f"{p.numel()}, max_new_tokens {m}, tree budget {budget}); shorten it")
    gens = []
    for s in seeds:
        g = torch.Generator(device=target.device)
        s = check_seed(s)
        g.manual_seed(s) if s is not None else g.seed()
        gens.append(g)
    eos = set(target.eos_token_ids)
    layers = tuple(sorted({i for d in drafters if d.needs_target_hidden for i in d.target_layers}))
    own = [tuple(d.target_layers) if d.needs_target_hidden else () for d in drafters]
    verifier = BatchVerifier(target.model, layers)
    feats = verifier.prefill([p.cpu() for p in prompts])
    for b, d in enumerate(drafters):
        d.begin(prompts[b], _layers(feats[b], own[b]))
    roots = [int(p[-1]) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(b_))                       # request of each cache row
    while live:
        built = [builder.build(drafters[r], roots[r], configs[r], gens[r]) for r in live]
        batch = TreeBatch.from_trees([x.tree for x in built], [configs[r] for r in live])
        scored = verifier.score(batch)
        results = accept_batch(batch, scored.probs, [gens[r] for r in live], verify)
        verifier.compact([x.keep_src for x in results])
        still = []
        for row, (r, x, acc) in enumerate(zip(live, built, results)):
            keep_feats = scored.features[row].select(acc.keep_src) if layers else TargetFeatures.empty()
            drafters[r].commit(x.source[acc.path], acc.tokens, _layers(keep_feats, own[r]))
            new = acc.tokens.tolist()
            for t in new:
                outs[r].append(t)
                if t in eos or len(outs[r]) >= max_new_tokens[r]:
                    break
            roots[r] = new[-1]
            done = outs[r][-1] in eos or len(outs[r]) >= max_new_tokens[r]
            if not done:
                still.append(row)
        if len(still) < len(live) and still:
            verifier.retain(still)
        live = [live[row] for row in still]
    return outs
