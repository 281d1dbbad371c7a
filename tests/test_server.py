"""SpeculativeServer: continuous batching. Requests join and leave between steps (EOS, limit,
cancel); per-request sampling, limits and budgets share one batch; after every step each row's
valid KV cache (target and drafter) equals sequential decoding of that request; each request's
output equals its run alone (greedy; seeded T > 0 bit for bit in float64)."""

from __future__ import annotations

import random

import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator, SpeculativeServer
from treespec.planning import Calibration, Curve, model_shape
from treespec.drafters import LookupDrafter, ModelDrafter
from treespec.drafters.eagle import random_feature_drafter
from treespec.targets.loader import tiny_target
from treespec.core.sampling import SamplingConfig

from _engine_helpers import assert_cache_equal, fresh_cache, one_thread, peaky_llama  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")
V = 32


def target_of(dtype=torch.float32):
    t = tiny_target(vocab_size=V, seed=0, dtype=dtype)
    t.model.generation_config.eos_token_id = None
    return t


def drafter_of(kind: str, target):
    if kind == "small":
        return ModelDrafter(peaky_llama(V, seed=7, hidden_size=16, num_layers=2, std=0.3, dtype=target.dtype), V)
    return random_feature_drafter(target, kind, seed=1, draft_vocab=V // 2)


def alone(target, kind, builder, prompt, limit, config, seed) -> list[int]:
    gen = SpeculativeGenerator(target, drafter_of(kind, target), builder)
    return gen.generate(prompt, limit, temperature=config.temperature, top_p=config.top_p,
                        seed=seed).token_ids.tolist()


def row_cache(cache, b: int, length: int):
    """Row b's first ``length`` KV columns of a batched DynamicCache, as a batch-1 cache."""
    from transformers import DynamicCache

    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[b:b + 1, :, :length], layer.values[b:b + 1, :, :length], i)
    return out


@pytest.mark.parametrize("kind", ("small", "eagle3"))
def test_requests_join_and_leave_mid_run(kind: str) -> None:
    """Float64 target and drafter. Requests join at steps 0, 2 and 3, with greedy and sampled
    configs, different limits and budgets; one is cancelled mid-run. Every request equals its
    run alone (the cancelled one: a prefix of it); after every step every live row's target
    cache (and, for the model drafter, its draft cache) equals a plain forward over that
    request's committed tokens."""
    target = target_of(torch.float64)
    server = SpeculativeServer(target, drafter_of(kind, target), DynamicTreeBuilder(budget=8, depth=3, top_k=3))
    rng = random.Random(5)
    specs = {}          # rid -> (prompt, limit, config, seed, builder)
    joins = {0: [(4, 10, SamplingConfig(0.0), 1, None), (9, 7, SamplingConfig(1.0), 2, None)],
             2: [(1, 12, SamplingConfig(0.7, top_p=0.9), 3, ChainBuilder(budget=4, mode="with_replacement")),
                 (6, 9, SamplingConfig(0.0), 4, DynamicTreeBuilder(budget=4, depth=2, top_k=2))],
             3: [(3, 15, SamplingConfig(1.0), 5, None)]}
    streamed: dict[int, list[int]] = {}
    cancelled = None
    for step in range(60):
        for n, limit, cfg, seed, builder in joins.get(step, []):
            prompt = torch.tensor([rng.randrange(V) for _ in range(n)])
            rid = server.add_request(prompt, cfg, limit, seed, builder)
            specs[rid] = (prompt, limit, cfg, seed, builder or server.builder)
        if step == 4:
            cancelled = server.live[1]
            server.cancel(cancelled)
            assert cancelled not in server.live and server.finished[cancelled].reason == "cancelled"
        if not server.live and not server.queued:
            break
        for rid, chunk in server.step().items():
            streamed.setdefault(rid, []).extend(chunk)
        _check_caches(server, specs, streamed, kind)
    assert not server.live and set(server.finished) == set(specs)
    for rid, (prompt, limit, cfg, seed, builder) in specs.items():
        want = alone(target, kind, builder, prompt, limit, cfg, seed)
        got = list(server.finished[rid].tokens)
        assert got == streamed.get(rid, []), rid
        if rid == cancelled:
            assert got == want[:len(got)] and len(got) < limit
        else:
            assert got == want and server.finished[rid].reason == "length", rid


def _check_caches(server, specs, streamed, kind) -> None:
    ver = server.verifier
    assert ver.batch_size == len(server.live)
    if not server.live:
        return
    assert ver.cache_len == max(ver.prefix_lens)             # memory: the longest live row
    for b, rid in enumerate(server.live):
        committed = specs[rid][0].tolist() + streamed.get(rid, [])
        assert ver.prefix_lens[b] == len(committed) - 1
        ref = fresh_cache(server.target.model, committed[:-1])
        assert_cache_equal(row_cache(ver.cache, b, ver.prefix_lens[b]), ref, len(committed) - 1, atol=1e-10)
        if kind == "small":
            d = server.drafter
            row = d.rows[rid]
            ref = fresh_cache(d.model, committed[:row.prefix])
            assert_cache_equal(row_cache(d.cache, d.keys.index(rid), row.prefix), ref, row.prefix, atol=1e-10)
            assert d.cache.get_seq_length() == max(r.used for r in d.rows.values())   # bounded by live rows
    assert sorted(getattr(server.drafter, "keys", server.live)) == sorted(server.live)


def test_greedy_server_equals_plain_decoding_with_eos() -> None:
    """Float32, requests stopping at EOS and at their limits at different steps."""
    from test_verifier import greedy_continuation

    target = target_of()
    rng = random.Random(1)
    prompts = [[rng.randrange(V) for _ in range(n)] for n in (2, 7, 12)]
    refs = [greedy_continuation(target.model, p, 12) for p in prompts]
    eos = refs[0][4]
    target.model.generation_config.eos_token_id = eos
    server = SpeculativeServer(target, drafter_of("eagle", target), DynamicTreeBuilder(budget=8, depth=3, top_k=3))
    rids = [server.add_request(p, max_new_tokens=m) for p, m in zip(prompts, (12, 5, 12))]
    server.run()
    for rid, ref, m in zip(rids, refs, (12, 5, 12)):
        want = ref[:m]
        if eos in want:
            want = want[:want.index(eos) + 1]
        res = server.finished[rid]
        assert list(res.tokens) == want
        assert res.reason == ("eos" if want[-1] == eos else "length")
    assert {server.finished[r].reason for r in rids} == {"eos", "length"}
    assert server.verifier.batch_size == 0 and server.drafter.keys == []


def test_bad_input_is_refused_and_never_corrupts_the_others() -> None:
    target = target_of()
    server = SpeculativeServer(target, drafter_of("small", target), ChainBuilder(budget=4))
    good = server.add_request([1, 2, 3], max_new_tokens=6)
    with pytest.raises(TypeError, match="seed must be an int"):
        server.add_request([1, 2], seed=1.5)
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        server.add_request([1, 2], sampling=0.7)
    with pytest.raises(ValueError, match="this target has no tokenizer: pass token ids"):
        server.add_request("hello")
    with pytest.raises(TypeError, match="prompt must be text, token ids"):
        server.add_request({"ids": [1]})
    with pytest.raises(ValueError, match="prompt is empty"):
        server.add_request([])
    with pytest.raises(ValueError, match="either as sampling= or as keywords \\(temperature\\), not both"):
        server.add_request([1, 2], SamplingConfig(0.5), temperature=0.5)
    with pytest.raises(ValueError, match=r"lie in \[0, 32\)"):
        server.add_request([1, 40])
    with pytest.raises(ValueError, match="max_new_tokens must be an int > 0"):
        server.add_request([1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="does not fit the context window"):
        server.add_request([1] * 200, max_new_tokens=100)
    with pytest.raises(ValueError, match="unknown request id 99"):
        server.cancel(99)
    server.step()
    other = server.add_request([4, 5], max_new_tokens=4)
    server.cancel(other)
    with pytest.raises(ValueError, match="already finished \\(cancelled\\)"):
        server.cancel(other)
    server.run()
    with pytest.raises(ValueError, match="already finished \\(length\\)"):
        server.cancel(good)
    from test_verifier import greedy_continuation

    assert list(server.finished[good].tokens) == greedy_continuation(target.model, [1, 2, 3], 6)
    with pytest.raises(ValueError, match="drafter vocab size 16 != target vocab size 32"):
        SpeculativeServer(target, LookupDrafter(16))
    with pytest.raises(ValueError, match="builder must be a TreeBuilder or 'auto'"):
        SpeculativeServer(target, LookupDrafter(V), "big")
    assert server.step() == {}


def _calibration() -> Calibration:
    """Verify flat up to 8 tokens then linear: speculation pays at batch 1, not at batch 8."""
    ns = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    return Calibration(
        model="toy", shape=model_shape("smollm2-135m", bytes_per_weight=4), context=64,
        target=Curve.fit(ns, [max(1.0, n / 8) for n in ns]),
        drafters={"early_exit": Curve.fit(ns, [0.01 * n for n in ns])},
        drafter_layers={"early_exit": 2}, device="test",
    )


def test_auto_budget_follows_the_current_batch_size() -> None:
    target = target_of()
    server = SpeculativeServer(target, LookupDrafter(V), "auto", calibration=_calibration())
    rids = [server.add_request([1, 2, 3 + i], max_new_tokens=3 + 3 * i) for i in range(8)]
    server.step()
    assert len(server.live) == 8 and server._auto[(7, 0.0)].budget == 1    # batch 7 or 8: no speculation
    assert not any(r.drafting for r in server._live)                        # so they joined plainly
    server.run()
    assert set(server.finished) == set(rids)
    one = SpeculativeServer(target, LookupDrafter(V), "auto", calibration=_calibration())
    one.add_request([1, 2, 3], max_new_tokens=4)
    one.step()
    assert one._auto[(1, 0.0)].budget > 1                                   # batch 1: a tree


def _detaching_server(target):
    """An eagle3 server on auto whose calibration plans a tree up to batch 7 and none from 8."""
    import dataclasses

    drafter = drafter_of("eagle3", target)
    drafter.registry_name = "eagle3"
    cal = dataclasses.replace(_calibration(), acceptance={"eagle3": (0.95, 0.02)},
                              drafters={"eagle3": _calibration().drafters["early_exit"]},
                              drafter_layers={"eagle3": 2})
    return SpeculativeServer(target, drafter, "auto", calibration=cal)


def _spy_features(monkeypatch) -> list:
    """Records, in order, whether each prefill (("add", f)) and each verify pass (("score", f))
    asked the target for hidden states."""
    from treespec.runtime.batch_verifier import BatchVerifier

    asked = []
    score, add = BatchVerifier.score, BatchVerifier.add

    def spy_score(self, batch, features=True):
        asked.append(("score", features))
        return score(self, batch, features)

    def spy_add(self, prompts, features=True):
        asked.append(("add", features))
        return add(self, prompts, features)

    monkeypatch.setattr(BatchVerifier, "score", spy_score)
    monkeypatch.setattr(BatchVerifier, "add", spy_add)
    return asked


def test_an_auto_request_joining_a_batch_auto_would_not_draft_for_never_drafts(monkeypatch) -> None:
    """Nine requests joining at once (auto plans no tree for 8 or 9): none begins on the
    drafter, the target computes no hidden states, not even over the prompts, and the tokens
    are the plain server's. A burst of two still drafts: auto plans a tree for one request."""
    target = target_of()
    asked = _spy_features(monkeypatch)
    prompts = [[1, 2, 3 + i] for i in range(9)]
    server, plain = _detaching_server(target), SpeculativeServer(target, None)
    for p in prompts:
        server.add_request(p, max_new_tokens=6)
        plain.add_request(p, max_new_tokens=6)
    server.step()
    assert server._auto[(8, 0.0)].budget == 1 and not any(r.drafting for r in server._live)
    assert server.drafter.rows == {} and asked == [("add", False), ("score", False)]
    server.run()
    assert server.stats.drafter_calls == 0 and all(not f for _, f in asked)
    assert {k: v.tokens for k, v in server.finished.items()} == {k: v.tokens for k, v in plain.run().items()}

    burst = _detaching_server(target)
    for p in prompts[:2]:
        burst.add_request(p, max_new_tokens=6)
    burst.step()
    assert burst._auto[(1, 0.0)].budget > 1 and all(r.drafting for r in burst._live)
    assert set(burst.drafter.rows) == set(burst.live) and asked[-2] == ("add", True)


def test_a_request_auto_keeps_decoding_plainly_leaves_the_drafter(monkeypatch) -> None:
    """A request that drafted alone, then shares a batch of 9 (no tree): after
    AUTO_DETACH_STEPS plain steps in a row it leaves the drafter (its rows dropped; the target
    is no longer asked for hidden states) and every request's tokens stay those of the plain
    server. A request left alone after fewer plain steps keeps its drafter and drafts again."""
    from treespec.runtime.server import AUTO_DETACH_STEPS

    target = target_of()
    asked = _spy_features(monkeypatch)
    limit = AUTO_DETACH_STEPS + 5
    prompts = [[1, 2, 3 + i] for i in range(9)]
    server, plain = _detaching_server(target), SpeculativeServer(target, None)
    first = server.add_request(prompts[0], max_new_tokens=limit + 1)
    server.step()
    assert server.stats.drafter_calls > 0 and server._live[0].drafting
    for p in prompts[1:]:
        server.add_request(p, max_new_tokens=limit)
    for p in prompts:
        plain.add_request(p, max_new_tokens=limit + 1)
    for step in range(AUTO_DETACH_STEPS):
        server.step()
        assert server._auto[(9, 0.0)].budget == 1
        assert [r.drafting for r in server._live] == [step < AUTO_DETACH_STEPS - 1] + [False] * 8
    assert server.drafter.rows == {} and asked[-1] == ("score", True)
    calls = server.stats.drafter_calls
    server.run()
    assert asked[-1] == ("score", False) and server.stats.drafter_calls == calls
    expected = {k: v.tokens for k, v in plain.run().items()}
    assert server.finished[first].tokens == expected[0]
    assert all(server.finished[k].tokens == expected[k][:limit] for k in expected if k != first)

    server = _detaching_server(target)
    long = server.add_request(prompts[8], max_new_tokens=limit)
    server.step()
    for p in prompts[:8]:
        server.add_request(p, max_new_tokens=2)
    server.step()
    server.step()
    assert server.live == (long,) and server._live[0].drafting
    calls = server.stats.drafter_calls
    server.step()
    assert server._auto[(1, 0.0)].budget > 1 and server.stats.drafter_calls > calls
    assert asked[-1] == ("score", True)


def test_auto_plans_each_temperature_with_its_own_acceptance() -> None:
    """A drafter that is good greedy and useless at T = 1: the greedy request gets a tree, the
    sampled one plain decoding, in the same batch (it joins plainly: auto plans it no tree
    even alone)."""
    import dataclasses

    target = target_of()
    drafter = drafter_of("small", target)
    drafter.registry_name = "small"
    cal = dataclasses.replace(_calibration(), acceptance={"small": (0.95, 0.02), "small@T1": (0.001,)})
    server = SpeculativeServer(target, drafter, "auto", calibration=cal)
    server.add_request([1, 2, 3], max_new_tokens=4)
    server.add_request([1, 2, 4], SamplingConfig(1.0), max_new_tokens=4, seed=0)
    server.step()
    assert server._auto[(2, 0.0)].budget > 1 and server._auto[(1, 1.0)].budget == 1
    assert [r.drafting for r in server._live] == [True, False]
    server.run()
    assert len(server.finished) == 2


class _Injected(RuntimeError):
    pass


def cache_width(server) -> int:
    layers = server.verifier.cache.layers if server.verifier.cache is not None else []
    return layers[0].keys.shape[-2] if layers and layers[0].is_initialized else 0


@pytest.mark.parametrize("kind", ("small", "eagle3", "lookup"))
@pytest.mark.parametrize("where", ("draft", "accept"))
def test_a_failed_step_leaves_every_request_as_it_was(kind: str, where: str, monkeypatch) -> None:
    """A step that raises midway (inside drafting, after some of its drafter calls; or in
    acceptance, after the target pass) changes nothing: stepping on, every request (greedy and
    seeded sampled) ends exactly as in a run without the failures."""
    import treespec.runtime.server as server_module

    target = target_of(torch.float64)
    real_accept = server_module.accept_batch

    def run(fail_at: set[int]) -> tuple[dict, int]:
        drafter = LookupDrafter(V) if kind == "lookup" else drafter_of(kind, target)
        server = SpeculativeServer(target, drafter, DynamicTreeBuilder(budget=6, depth=3, top_k=2))
        for prompt, cfg, seed in (([1, 2, 3, 1, 2], SamplingConfig(0.0), 1), ([5, 6, 7, 5, 6], SamplingConfig(1.0), 2),
                                  ([9, 8], SamplingConfig(0.7, top_p=0.9), 3)):
            server.add_request(torch.tensor(prompt), cfg, 10, seed)
        armed = {"on": False, "calls": 0}
        real_expand = server.drafter.expand_batch

        def expand_batch(calls):
            armed["calls"] += 1
            if armed["on"] and armed["calls"] == 2:      # the step's second drafter call
                armed["on"] = False
                raise _Injected("drafter failed")
            return real_expand(calls)

        def accept_batch(*a, **kw):
            if armed["on"]:
                armed["on"] = False
                raise _Injected("acceptance failed")
            return real_accept(*a, **kw)

        if where == "draft":
            server.drafter.expand_batch = expand_batch
        else:
            monkeypatch.setattr(server_module, "accept_batch", accept_batch)
        failures = step = 0
        while server.live or server.queued:
            armed.update(on=step in fail_at, calls=0)
            width = cache_width(server)
            try:
                server.step()
            except _Injected:
                failures += 1
                assert cache_width(server) == width     # no tree rows left in the target cache
            step += 1
        return {rid: r.tokens for rid, r in server.finished.items()}, failures

    clean, none = run(set())
    failed, count = run({1, 3})
    assert none == 0 and count == 2
    assert failed == clean


def test_plain_server_decodes_greedy_without_a_drafter_and_counts_positions() -> None:
    """drafter=None: no drafter call, one token per request per step, the greedy continuation;
    a speculative server's per-position counters add up to its acceptances."""
    from test_verifier import greedy_continuation

    target = target_of()
    plain = SpeculativeServer(target, None)
    rids = [plain.add_request([1, 2, 3], max_new_tokens=6), plain.add_request([4, 5], max_new_tokens=4)]
    plain.run()
    assert list(plain.finished[rids[0]].tokens) == greedy_continuation(target.model, [1, 2, 3], 6)
    assert list(plain.finished[rids[1]].tokens) == greedy_continuation(target.model, [4, 5], 4)
    assert plain.stats.drafter_calls == 0 and plain.stats.tau == 1.0 and plain.stats.depth_attempts == []
    with pytest.raises(ValueError, match="drafter=None is plain decoding: it takes no builder"):
        SpeculativeServer(target, None, ChainBuilder(budget=3))
    with pytest.raises(ValueError, match="decodes plainly"):
        plain.add_request([1], builder=DynamicTreeBuilder(budget=4, depth=2, top_k=2))
    spec = SpeculativeServer(target, drafter_of("small", target), DynamicTreeBuilder(budget=6, depth=3, top_k=2))
    spec.add_request([1, 2, 3], max_new_tokens=12)
    spec.run()
    s = spec.stats
    assert len(s.depth_attempts) >= 1 and s.depth_attempts[0] == s.request_steps
    assert s.emitted == s.request_steps + sum(s.depth_accepts)        # accepted + 1 per step
    assert 0 <= min(s.depth_acceptance) and max(s.depth_acceptance) <= 1


def test_a_fixed_tree_drafts_only_while_the_batch_is_at_most_draft_max_batch() -> None:
    """draft_max_batch=1: a lone request drafts its chain; while a second one is live, every
    step is the root alone (one node a request, no drafter call); once alone again it drafts
    again, its lookup state having followed the text. Greedy output equals plain decoding."""
    from test_verifier import greedy_continuation

    target = target_of()
    prompt = [3, 4, 5, 6] * 4            # a recurring suffix: the lookup drafter proposes
    server = SpeculativeServer(target, LookupDrafter(V), ChainBuilder(budget=4), draft_max_batch=1)
    first = server.add_request(prompt, max_new_tokens=24)
    nodes = []

    def step() -> None:
        before, calls = server.stats.tree_nodes, server.stats.drafter_calls
        live = len(server.live) + len(server.queued)
        server.step()
        nodes.append((live, server.stats.tree_nodes - before, server.stats.drafter_calls - calls))

    for _ in range(2):
        step()
    second = server.add_request([7, 1], max_new_tokens=3)
    while second not in server.finished:
        step()
    while server.live:
        step()
    assert list(server.finished[first].tokens) == greedy_continuation(target.model, prompt, 24)
    assert list(server.finished[second].tokens) == greedy_continuation(target.model, [7, 1], 3)
    crowded = [(n, c) for live, n, c in nodes if live == 2]
    assert crowded and all(n == 2 and c == 0 for n, c in crowded)
    alone_before, alone_after = nodes[:2], nodes[2 + len(crowded):]
    assert all(live == 1 for live, _, _ in alone_before + alone_after)
    assert any(n > 1 for _, n, _ in alone_before) and any(n > 1 for _, n, _ in alone_after)
    for bad in (0, -1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="draft_max_batch must be an int >= 1 or None"):
            SpeculativeServer(target, LookupDrafter(V), ChainBuilder(budget=4), draft_max_batch=bad)


def test_text_prompts_keywords_and_scalar_limits_as_the_generator_takes_them() -> None:
    """add_request and generate_batch take text (through the chat template), sampling keywords,
    a drafter name... as SpeculativeGenerator.generate does, with the same tokens."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _serve_helpers import text_drafter, text_target
    from treespec import generate_batch

    target = text_target()
    builder = DynamicTreeBuilder(budget=5, depth=2, top_k=2)
    gen = SpeculativeGenerator(target, text_drafter(target), builder)
    want = [gen.generate("hello", 9).token_ids.tolist(),
            gen.generate("hi there", 9, temperature=0.8, top_p=0.9, seed=5, chat=False).token_ids.tolist()]
    server = SpeculativeServer(target, text_drafter(target), builder)
    a = server.add_request("hello", max_new_tokens=9)
    b = server.add_request("hi there", max_new_tokens=9, temperature=0.8, top_p=0.9, seed=5, chat=False)
    server.run()
    assert [list(server.finished[r].tokens) for r in (a, b)] == want
    assert generate_batch(target, text_drafter(target), builder, ["hello", "hello"], 9) == [want[0]] * 2
    lookup = SpeculativeGenerator(target, "lookup", builder).generate("hello", 9).token_ids.tolist()
    assert lookup == want[0]                                             # greedy: any drafter, same tokens
    assert generate_batch(target, "lookup", builder, ["hello"], 9) == [lookup]   # a registered name
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        generate_batch(target, text_drafter(target), builder, ["hello", "  "], 9)
    with pytest.raises(TypeError, match="chat must be True or False"):
        server.add_request("hello", chat="yes")
