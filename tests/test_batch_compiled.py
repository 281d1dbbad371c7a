"""Batched verification on compiled passes (treespec.runtime.batch_compiled): every pass of a
request sequence with joins, leaves, bucket changes, dummy rows and an eager fallback gives the
eager BatchVerifier's logits and features to fp32 rounding; garbage past a row's prefix is never
read; and a server on a compiled target decodes each request greedily as the generator does on
the same compiled target.

Graphs compile with Inductor's Python wrapper here (seconds each on a tiny model; the C++
wrapper is the same graph with its calls in generated C++)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treespec import ChainBuilder, SpeculativeGenerator, SpeculativeServer
from treespec.core.sampling import SamplingConfig
from treespec.planning import Curve
from treespec.core.tree import DraftTree
from treespec.core.tree_batch import TreeBatch
from treespec.runtime.batch_compiled import BatchPasses, CompiledBatchVerifier, batch_bucket, batch_passes
from treespec.runtime.batch_verifier import BatchVerifier
from treespec.runtime.compiled import CompiledPasses

from treespec.drafters import ModelDrafter

from _engine_helpers import NGramDrafter, one_thread, peaky_llama, peaky_target  # noqa: F401

# one worker runs this module (make test: --dist loadgroup), so its compiled fixture is built once
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("batch_compiled")]
V = 16


@pytest.fixture(scope="module")
def compiled():
    """(eager target, the same model with compiled passes: one request 1 and 2 nodes)."""
    torch.set_num_threads(1)
    target = peaky_target(V, seed=5, hidden_size=32, num_layers=2, max_position_embeddings=1024)
    passes = CompiledPasses(target.model, (1, 2), 256, cpp_wrapper=False, announce=False)
    return target, dataclasses.replace(target, passes=passes)


def chain(tokens) -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.arange(-1, len(tokens) - 1))


def test_batch_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        batch_bucket(0)


def test_compiled_batches_give_the_eager_logits_through_joins_and_leaves(compiled):
    target, fast = compiled
    layers = (1,)
    eager = BatchVerifier(target.model, layers)
    comp = CompiledBatchVerifier(batch_passes(fast), layers)
    prompts = [torch.tensor([1, 5, 7, 2, 9]), torch.tensor([3, 4, 6]), torch.tensor([2, 8, 1, 1, 5, 7, 12])]

    def both(fn):
        return fn(eager), fn(comp)

    def check(trees, keeps):
        batch = TreeBatch.from_trees(trees, [SamplingConfig(1.0)] * len(trees))
        want, got = both(lambda v: v.score(batch))
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)   # fp32 rounding only
        torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-6)
        for w, g in zip(want.features, got.features):
            torch.testing.assert_close(g.hidden[1], w.hidden[1], rtol=1e-5, atol=1e-5)
        both(lambda v: v.compact([torch.tensor(k) for k in keeps]))
        assert comp.prefix_lens == eager.prefix_lens

    f_want, f_got = both(lambda v: v.prefill(prompts[:1]))
    torch.testing.assert_close(f_got[0].hidden[1], f_want[0].hidden[1])
    assert comp.rows is fast.passes                        # one request: the target's own passes
    check([chain([3, 4, 6])], [[0, 1]])                    # 3 nodes: past every bucket, eager
    check([chain([6, 2])], [[0, 1]])                       # the 2-node graph
    both(lambda v: v.add(prompts[1:]))                     # three requests: the cache of four rows
    assert comp.rows.batch == 4 and comp.prefix_lens == [8, 2, 6]
    check([chain([1, 2]), chain([5]), chain([9, 3])], [[0], [0], [0, 1]])
    with torch.inference_mode():                           # junk past each prefix: never read
        for layer in comp.rows.cache.layers:
            for b, p in enumerate(comp.prefix_lens):
                layer.keys[b, :, p:] = 1e3
                layer.values[b, :, p:] = -1e3
    check([chain([4]), chain([7, 7]), chain([2])], [[0], [0, 1], [0]])
    both(lambda v: v.retain([2, 0]))                       # two requests: the cache of two rows
    assert comp.rows.batch == 2 and comp.prefix_lens == [9, 10]
    check([chain([8, 1]), chain([3])], [[0, 1], [0]])
    batch = TreeBatch.from_trees([chain([5]), chain([6])], [SamplingConfig(0.0)] * 2)
    comp.score(batch)
    comp.discard()                                         # undone: the next pass sees nothing of it
    eager.score(batch)
    eager.discard()
    both(lambda v: v.retain([1]))                          # back to one request, the target's passes
    assert comp.rows is fast.passes
    check([chain([2, 9])], [[0, 1]])


def test_one_verifier_at_a_time_owns_the_caches(compiled):
    _, fast = compiled
    first = CompiledBatchVerifier(batch_passes(fast))
    first.prefill([torch.tensor([1, 2, 3])])
    second = CompiledBatchVerifier(batch_passes(fast))
    second.prefill([torch.tensor([4, 5])])
    with pytest.raises(RuntimeError, match="another verifier wrote the compiled batch caches"):
        first.score(TreeBatch.from_trees([chain([1])], [SamplingConfig(0.0)]))
    with pytest.raises(TypeError, match="passes must be a BatchPasses"):
        CompiledBatchVerifier(fast.passes)
    with pytest.raises(ValueError, match="one request's passes"):
        BatchPasses(CompiledPasses(fast.model, (1,), 256, batch=2, announce=False, cpp_wrapper=False))
    with pytest.raises(RuntimeError, match="this cache holds 2 requests"):
        CompiledPasses(fast.model, (1,), 256, batch=2, announce=False, cpp_wrapper=False).prefill(
            torch.tensor([1, 2]), ())


def test_warm_compiles_one_node_graphs_where_no_batch_of_a_bucket_drafts(compiled):
    """``draft_max_batch``: a batch bucket whose batches all exceed it (bucket b holds b/2 + 1
    .. b requests) is warmed for plain steps only; one holding a drafting batch for the trees."""
    _, fast = compiled
    passes = BatchPasses(fast.passes)

    def graphs(b: int) -> list[int]:
        return sorted(m for batch, m, *_ in passes.of(b)._seen if batch == b)

    passes.warm(4, nodes=2, draft_max_batch=1)
    assert graphs(2) == [1] and graphs(4) == [1]
    passes.warm(4, nodes=2, draft_max_batch=2)
    assert graphs(2) == [1, 2] and graphs(4) == [1]
    passes.warm(4, nodes=2, draft_max_batch=3)
    assert graphs(4) == [1, 2]


def test_a_server_on_a_compiled_target_decodes_each_request_as_the_generator_does(compiled):
    """Greedy, requests joining at different steps and leaving at their limits, a chain drafter
    and the plain server: each request's tokens equal SpeculativeGenerator's on the same
    compiled target."""
    _, fast = compiled
    prompts = [[1, 5, 7, 2, 9], [3, 4], [2, 8, 1, 1, 5, 7, 12], [6, 6, 3]]
    limits = [9, 14, 6, 11]
    want = [SpeculativeGenerator(fast, NGramDrafter(V), ChainBuilder(budget=2)).generate(
        torch.tensor(p), n).token_ids.tolist() for p, n in zip(prompts, limits)]
    small = ModelDrafter(peaky_llama(V, seed=7, hidden_size=16, num_layers=2, std=0.3), V)
    for drafter, builder in ((small, ChainBuilder(budget=2)), (None, None)):
        server = SpeculativeServer(fast, drafter, builder)
        assert isinstance(server.verifier, CompiledBatchVerifier)
        rids = [server.add_request(torch.tensor(prompts[0]), max_new_tokens=limits[0])]
        server.step()
        rids += [server.add_request(torch.tensor(p), max_new_tokens=n) for p, n in zip(prompts[1:3], limits[1:3])]
        server.step()
        server.step()
        rids.append(server.add_request(torch.tensor(prompts[3]), max_new_tokens=limits[3]))
        done = server.run()
        assert [list(done[r].tokens) for r in rids] == want


def test_a_compiled_target_is_calibrated_on_its_batch_graphs(compiled, monkeypatch):
    """``calibrate_batches(passes=...)`` times the batch graphs the server runs, at their node
    buckets (n nodes cost their bucket's time), and auto plans no tree past those buckets when
    requests share a step."""
    from treespec.calibrate.passes import calibrate_batches
    from treespec.planning import Calibration, model_shape
    from treespec.runtime.server import AUTO_MAX_BUDGET, auto_max_budget

    target, fast = compiled
    seen = []
    real = CompiledPasses.run_batch

    def spy(self, ids, *a, **k):
        seen.append((self.batch, ids.shape[1]))
        return real(self, ids, *a, **k)

    monkeypatch.setattr(CompiledPasses, "run_batch", spy)
    base = Calibration(model="toy", shape=model_shape("smollm2-135m", bytes_per_weight=4), context=6,
                       target=Curve.fit([1, 2], [1.0, 1.0]))
    cal = calibrate_batches(base, target.model, (3,), ns=(1, 2, 3, 4), n_warmup=0, n_rep=1,
                            passes=batch_passes(fast))
    assert cal.batch_target[3].ns == (1, 2)               # the batch graphs' node buckets
    assert {s for s in seen} == {(4, 1), (4, 2)}          # three requests in the cache of four
    with pytest.raises(ValueError, match="compiled batch passes of model"):
        calibrate_batches(base, peaky_target(V).model, (2,), passes=batch_passes(fast))
    assert auto_max_budget(fast, 1) == AUTO_MAX_BUDGET and auto_max_budget(target, 8) == AUTO_MAX_BUDGET
    assert auto_max_budget(fast, 2) == 2


def test_a_generator_taking_the_targets_passes_from_a_server_is_refused(compiled):
    """One request of a server sits in the target's own passes; a generator's request on the
    same target prefills them: the server's next step is refused by name instead of reading the
    generator's rows (and the generator's passes are left to it)."""
    _, fast = compiled
    server = SpeculativeServer(fast, None)
    server.add_request(torch.tensor([1, 5, 7]), max_new_tokens=8)
    server.step()
    SpeculativeGenerator(fast, NGramDrafter(V), ChainBuilder(budget=2)).generate(torch.tensor([3, 4]), 4)
    with pytest.raises(RuntimeError, match="a generator's request took the target's compiled passes"):
        server.step()
