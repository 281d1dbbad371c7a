"""Batched drafting: ONE drafter forward per round serves every request, and each request's
output equals its output alone.

What is guaranteed (treespec.drafters.batched): the output law of every request is exact
whatever its batch-mates; greedy tokens equal the request alone (and plain greedy decoding);
at T > 0 tokens equal the request alone whenever the batched forwards round like the single
ones, which these tests pin in float64 (target and drafters), bit for bit. The draft rows q
themselves are compared with the single drafter's to 1e-12 in float64.
"""

from __future__ import annotations

import random

import pytest
import torch

from treespec import (
    BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, SpeculativeGenerator, StaticTreeBuilder,
)
from treespec.runtime.server import generate_batch
from treespec.drafters import LookupDrafter, ModelDrafter
from treespec.drafters.base import PartialTree
from treespec.drafters.batched import BatchDrafter, LoopBatchDrafter, as_batch_drafter
from treespec.drafters.batch_feature import BatchFeatureDrafter
from treespec.drafters.batch_model import BatchModelDrafter
from treespec.drafters.eagle import random_feature_drafter
from treespec.drafters.medusa import BatchMedusaDrafter, random_medusa
from treespec.targets.loader import tiny_target
from treespec.core.sampling import SamplingConfig
from treespec.builders.batch import BuildJob, build_batch

from _engine_helpers import one_thread, peaky_llama  # noqa: F401
from test_verifier import greedy_continuation

pytestmark = pytest.mark.usefixtures("one_thread")
V = 32
PROMPT_LENS = (1, 5, 11, 3)
LIMITS = [9, 14, 6, 12]
KINDS = ("model", "eagle", "eagle3", "mtp", "medusa", "lookup")
BATCHED = {"model": BatchModelDrafter, "eagle": BatchFeatureDrafter, "eagle3": BatchFeatureDrafter,
           "mtp": BatchFeatureDrafter, "medusa": BatchMedusaDrafter, "lookup": LoopBatchDrafter}


def make_builder(kind: str, mode: str = "deterministic"):
    return {
        "chain": lambda: ChainBuilder(budget=4, mode="with_replacement" if mode != "deterministic" else mode),
        "static": lambda: StaticTreeBuilder.default(8, mode),
        "dynamic": lambda: DynamicTreeBuilder(budget=9, depth=4, top_k=3, mode=mode),
        "best_first": lambda: BestFirstBuilder(budget=9, max_width=3, max_rounds=4, mode=mode),
        "sequoia": lambda: SequoiaBuilder(budget=8, depth=4, mode=mode),
    }[kind]()


BUILDERS = ("chain", "static", "dynamic", "best_first", "sequoia")


def target_of(dtype=torch.float32):
    t = tiny_target(vocab_size=V, seed=0, dtype=dtype)
    t.model.generation_config.eos_token_id = None
    return t


def single_drafter(kind: str, target):
    """A fresh single-request drafter of ``kind`` (seeded: every call gives the same weights)."""
    if kind == "model":
        model = peaky_llama(V, seed=7, hidden_size=16, num_layers=2, std=0.3, dtype=target.dtype)
        return ModelDrafter(model, V)
    if kind == "medusa":
        return random_medusa(target, num_heads=3, seed=1, scale=0.3)
    if kind == "lookup":
        return LookupDrafter(V)
    return random_feature_drafter(target, kind, seed=1, draft_vocab=V // 2)


def prompts_of(seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    return [torch.tensor([rng.randrange(V) for _ in range(n)]) for n in PROMPT_LENS]


def alone(target, kind, builder, prompt, limit, config=SamplingConfig(0.0), seed=0) -> list[int]:
    gen = SpeculativeGenerator(target, single_drafter(kind, target), builder)
    return gen.generate(prompt, limit, temperature=config.temperature, top_p=config.top_p,
                        seed=seed).token_ids.tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_every_registered_kind_has_its_batched_form(kind: str) -> None:
    target = target_of()
    batched = as_batch_drafter(single_drafter(kind, target))
    assert type(batched) is BATCHED[kind] and isinstance(batched, BatchDrafter)
    assert batched.vocab_size == V


@pytest.mark.parametrize("builder_kind", BUILDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_batch_equals_each_request_alone(kind: str, builder_kind: str) -> None:
    """One batched drafter, ragged prompts and limits: every request equals its run alone and
    plain greedy decoding."""
    target = target_of()
    builder = make_builder(builder_kind)
    prompts = prompts_of(0)
    outs = generate_batch(target, single_drafter(kind, target), builder, prompts, LIMITS)
    for b, (p, m) in enumerate(zip(prompts, LIMITS)):
        assert outs[b] == greedy_continuation(target.model, p.tolist(), m), f"request {b}"
        assert outs[b] == alone(target, kind, builder, p, m), f"request {b}"


@pytest.mark.parametrize("builder_kind", BUILDERS)
@pytest.mark.parametrize("kind", KINDS)
def test_seeded_sampling_batch_equals_each_request_alone(kind: str, builder_kind: str) -> None:
    """T > 0, stochastic trees, per-request temperatures / top-p and seeds, float64: bit for bit
    the run alone."""
    target = target_of(torch.float64)
    builder = make_builder(builder_kind, "without_replacement")
    prompts = prompts_of(1)
    configs = [SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9), SamplingConfig(1.0), SamplingConfig(0.6)]
    seeds = [11, 12, 13, 14]
    outs = generate_batch(target, single_drafter(kind, target), builder, prompts, LIMITS, configs, seeds)
    for b, (p, m) in enumerate(zip(prompts, LIMITS)):
        assert len(outs[b]) == m
        assert outs[b] == alone(target, kind, builder, p, m, configs[b], seeds[b]), f"request {b}"
    other = generate_batch(target, single_drafter(kind, target), builder, prompts, LIMITS, configs,
                           [99, 12, 13, 14])
    assert other[0] != outs[0] and other[1:] == outs[1:]


@pytest.mark.parametrize("kind", ("model", "eagle3", "medusa"))
def test_one_drafter_forward_per_round_for_all_requests(kind: str) -> None:
    """The batched drafter runs once per drafting round, not once per request."""
    target = target_of()
    single = single_drafter(kind, target)
    batched = as_batch_drafter(single)
    builder = DynamicTreeBuilder(budget=9, depth=4, top_k=3)
    prompts = prompts_of(2)
    from treespec.runtime.server import SpeculativeServer

    server = SpeculativeServer(target, batched, builder)
    for p in prompts:
        server.add_request(p, max_new_tokens=40)
    server.step()
    # every request expands one level per round, depth 4 (the root's included): 4 rounds, not
    # 4 per request (Medusa: one pass of its heads per tree)
    assert batched.calls == (1 if kind == "medusa" else builder.max_depth)
    assert server.stats.drafter_calls == batched.calls


@pytest.mark.parametrize("kind", ("model", "eagle", "medusa"))
def test_draft_rows_match_the_single_drafter(kind: str) -> None:
    """Driven with the same trees and commits, the batched drafter's q rows equal the single
    drafters' (float64, 1e-12), the trees are identical, and after every commit each request's
    row of the batched draft cache holds the single drafter's committed cache, while requests
    leave mid-run."""
    target = target_of(torch.float64)
    rng = random.Random(3)
    prompts = prompts_of(3)
    singles = {b: single_drafter(kind, target) for b in range(4)}
    batched = as_batch_drafter(single_drafter(kind, target))
    feats = {b: _features(target, p, singles[b]) for b, p in enumerate(prompts)}
    for b, p in enumerate(prompts):
        singles[b].begin(p, feats[b])
        batched.begin(b, p, feats[b])
    roots = {b: int(p[-1]) for b, p in enumerate(prompts)}
    ctx = {b: p.tolist() for b, p in enumerate(prompts)}
    builder = DynamicTreeBuilder(budget=9, depth=3, top_k=3, mode="without_replacement")
    cfg = SamplingConfig(1.0)
    for step in range(4):
        keys = sorted(singles)
        g1 = {b: torch.Generator().manual_seed(step * 10 + b) for b in keys}
        g2 = {b: torch.Generator().manual_seed(step * 10 + b) for b in keys}
        a = {b: builder.build(singles[b], roots[b], cfg, g1[b]) for b in keys}
        got = build_batch(batched, [BuildJob(b, builder, roots[b], cfg, g2[b]) for b in keys])
        for b, y in zip(keys, got):
            x = a[b]
            assert torch.equal(x.tree.tokens, y.tree.tokens) and torch.equal(x.tree.parents, y.tree.parents)
            torch.testing.assert_close(x.tree.draft_probs, y.tree.draft_probs, atol=1e-12, rtol=0)
            path = _random_path(rng, x.tree)
            toks = torch.tensor([int(x.tree.tokens[j]) for j in path] + [rng.randrange(V)])
            ctx[b] += toks.tolist()
            f = _features(target, torch.tensor(ctx[b]), singles[b], last=len(toks))
            src = x.source[torch.tensor(path, dtype=torch.long)]
            singles[b].commit(src, toks, f)
            batched.commit(b, src, toks, f)
            roots[b] = int(toks[-1])
            _assert_same_cache(batched, singles[b], b)
        if step == 1:                         # a request leaves mid-run
            batched.drop(1)
            del singles[1]
    with pytest.raises(KeyError, match="never begun"):
        batched.drop(1)


def _random_path(rng: random.Random, tree) -> list[int]:
    node = rng.randrange(tree.num_nodes)
    path = []
    while node > 0:
        path.append(node)
        node = int(tree.parents[node])
    return path[::-1]


def _features(target, ids: torch.Tensor, drafter, last: int | None = None):
    """Target features of ids[:-1] (the last ``last`` rows of them, when given)."""
    from treespec.drafters.base import TargetFeatures

    if not drafter.needs_target_hidden:
        return TargetFeatures.empty()
    with torch.inference_mode():
        hs = target.model(input_ids=ids[None, :-1], output_hidden_states=True).hidden_states \
            if ids.numel() > 1 else None
    h = target.model.config.hidden_size
    out = {}
    for layer in drafter.target_layers:
        rows = hs[layer][0] if hs is not None else torch.zeros(0, h, dtype=target.dtype)
        out[layer] = rows[-last:] if last else rows
    return TargetFeatures(out)


class BuildOnly:
    """A builder with ``build`` only (no ``grow``): a batch drives it one request at a time."""

    def __init__(self, inner):
        self.inner = inner
        self.budget = inner.budget

    def build(self, drafter, root_token, sampling, generator):
        return self.inner.build(drafter, root_token, sampling, generator)


def test_a_builder_without_grow_still_works_in_a_batch() -> None:
    target = target_of(torch.float64)
    builder = BuildOnly(DynamicTreeBuilder(budget=9, depth=3, top_k=3, mode="without_replacement"))
    prompts = prompts_of(4)
    configs = [SamplingConfig(1.0)] * 4
    outs = generate_batch(target, single_drafter("eagle", target), builder, prompts, LIMITS, configs,
                          [1, 2, 3, 4])
    for b, (p, m) in enumerate(zip(prompts, LIMITS)):
        assert outs[b] == alone(target, "eagle", builder, p, m, configs[b], b + 1), f"request {b}"


def test_loop_batch_drafter_errors() -> None:
    target = target_of()
    loop = as_batch_drafter(LookupDrafter(V))
    loop.begin(0, torch.tensor([1, 2]), None)
    with pytest.raises(ValueError, match="already begun"):
        loop.begin(0, torch.tensor([1, 2]), None)
    with pytest.raises(KeyError, match="never begun"):
        loop.expand_batch([(5, PartialTree.rooted(2), [0])])
    with pytest.raises(ValueError, match="appears twice"):
        loop.expand_batch([(0, PartialTree.rooted(2), [0]), (0, PartialTree.rooted(2), [0])])
    with pytest.raises(ValueError, match="non-empty list"):
        loop.expand_batch([])
    loop.drop(0)
    with pytest.raises(KeyError, match="never begun"):
        loop.commit(0, torch.tensor([], dtype=torch.long), torch.tensor([3]), None)
    with pytest.raises(TypeError, match="must be a Drafter or a BatchDrafter"):
        as_batch_drafter(object())
    template = single_drafter("model", target)
    batched = as_batch_drafter(template)
    assert as_batch_drafter(batched) is batched
    # a looped model drafter: per-request state, the model shared (not copied)
    looped = LoopBatchDrafter.of(template)
    for key in (0, 1):
        looped.begin(key, torch.tensor([1, 2, key]), None)
    a, b = looped.drafters[0], looped.drafters[1]
    assert a.model is b.model is template.model and a.cache is not b.cache
    looped.expand_batch([(0, PartialTree.rooted(0), [0]), (1, PartialTree.rooted(1), [0])])
    assert looped.calls == 2 and a.prefix_len == b.prefix_len == 2


def _assert_same_cache(batched, single, key) -> None:
    """The batched drafter's row of request ``key`` holds the single drafter's committed cache."""
    if isinstance(batched, BatchFeatureDrafter):
        row, b = batched.rows[key], batched.keys.index(key)
        k, v = single.committed_cache()
        assert row.committed == k.shape[2]
        torch.testing.assert_close(batched.k[b:b + 1, :, :row.committed], k, atol=1e-12, rtol=0)
        torch.testing.assert_close(batched.v[b:b + 1, :, :row.committed], v, atol=1e-12, rtol=0)
    elif isinstance(batched, BatchModelDrafter):
        row, b = batched.rows[key], batched.keys.index(key)
        assert row.prefix == single.prefix_len and row.pending == single.pending
        for mine, theirs in zip(batched.cache.layers, single.cache.layers):
            if theirs.is_initialized:
                torch.testing.assert_close(mine.keys[b:b + 1, :, :row.prefix], theirs.keys, atol=1e-12, rtol=0)
                torch.testing.assert_close(mine.values[b:b + 1, :, :row.prefix], theirs.values, atol=1e-12, rtol=0)
