"""Compiled verify passes (treespec.runtime.compiled): the packed kernels as custom operators,
one compiled pass against the eager one, dummy rows that change nothing, compaction in the
static cache, and greedy decoding on the compiled path token for token against plain decoding.

Compiling costs ~10-30 s a graph on 2 cores, so the model tests share one compiled tiny target
(buckets 1 and 4; a 6-node tree runs eagerly on the same cache)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.core.sampling import SamplingConfig
from treespec.core.tree import DraftTree
from treespec.drafters import ModelDrafter
from treespec.planning import Curve
from treespec.fastpath.kernels import block_linear, pack_blocks, pack_panels, panel_linear, panel_status
from treespec.drafters.base import PartialTree
from treespec.drafters.hybrid import HybridDrafter
from treespec.runtime.compiled import (CompiledPasses, compile_drafter, compile_drafter_for, compile_target, drafter_passes,
                                       parse_buckets)
from treespec.runtime.verifier import TreeVerifier

from _engine_helpers import NGramDrafter, one_thread, peaky_target  # noqa: F401
from test_blocks import gguf_q4_1, gguf_q8_0

# one worker runs this module (make test: --dist loadgroup), so its compiled fixture is built once
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("compiled")]
needs_panel = pytest.mark.skipif(not panel_status(build=False)[0], reason=panel_status(build=False)[1])
V = 16


@needs_panel
@pytest.mark.parametrize("fmt", [gguf_q4_1, gguf_q8_0])
def test_custom_ops_give_the_kernels_bits_and_pass_opcheck(fmt):
    from treespec.fastpath import ops    # builds and loads the kernel, which registers treespec::*

    torch.manual_seed(0)
    weight = fmt(torch.randn(40, 96) * 0.05)           # 40 outputs: a zero-padded last panel
    blocks, panels = pack_blocks(weight), pack_panels(weight)
    for shape in ((1, 96), (3, 96), (1, 5, 96)):
        x = torch.randn(*shape)
        got = ops.block_linear(x, blocks.blob, blocks.bits, 0, blocks.half_scales, 40)
        assert got.shape == (*shape[:-1], 40) and torch.equal(got, block_linear(x, blocks, isa="avx2"))
        assert torch.equal(ops.panel_linear(x, panels, 0, 40), panel_linear(x, panels, 40, isa="avx2"))
    x = torch.randn(2, 3, 96)
    torch.library.opcheck(ops.block_linear, (x, blocks.blob, blocks.bits, 0, blocks.half_scales, 40),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(ops.panel_linear, (x, panels, 0, 40), test_utils=("test_schema", "test_faketensor"))


def test_bad_buckets_and_lengths_are_refused():
    model = peaky_target(V).model
    with pytest.raises(ValueError, match="buckets must be node counts >= 1"):
        CompiledPasses(model, buckets=(0, 4))
    with pytest.raises(ValueError, match="max_len must be an int > the largest bucket"):
        CompiledPasses(model, buckets=(1, 64), max_len=64)


def test_bucket_lists_from_a_command_line():
    assert parse_buckets("4,1,2,2") == (1, 2, 4)
    with pytest.raises(ValueError, match="expected comma-separated node counts"):
        parse_buckets("1,x")
    with pytest.raises(ValueError, match="node counts start at 1"):
        parse_buckets("0,2")


@pytest.fixture(scope="module")
def compiled():
    """(eager target, compiled target): one peaky tiny Llama, its passes compiled for 1 and 4
    nodes; the cache starts at 256 positions."""
    torch.set_num_threads(1)
    target = peaky_target(V, seed=3, hidden_size=32, num_layers=2, max_position_embeddings=1024)
    return target, compile_target(target, buckets=(1, 4), max_len=256)


def tree_of(tokens, parents) -> DraftTree:
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def test_a_compiled_pass_agrees_with_the_eager_one_and_dummy_rows_change_nothing(compiled):
    target, fast = compiled
    prompt = torch.tensor([1, 5, 7, 2, 9, 3, 11])
    tree = tree_of([3, 4, 6, 8], [-1, 0, 0, 1])         # 4 nodes: the 4-node graph, no dummy row
    small = tree_of([3, 4, 6], [-1, 0, 0])               # 3 nodes: the 4-node graph with one dummy row
    for t in (tree, small):
        eager = TreeVerifier(target.model, SamplingConfig(0.0))
        eager.prefill(prompt)
        want = eager.score(t).probs
        comp = TreeVerifier(fast.model, SamplingConfig(0.0), passes=fast.passes)
        comp.prefill(prompt)
        got = comp.score(t).probs
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)     # fp32 rounding, nothing more
    # the same graph, the dummy row's token and slot content changed: the real rows' bits stay
    passes = fast.passes
    passes.prefill(prompt[:-1], ())
    ids, pos, cache_pos, mask = passes.inputs(*passes.tree_rows(small, prompt.numel() - 1), prompt.numel() - 1, 4)
    with torch.inference_mode():
        passes._set_length(prompt.numel() - 1)
        first, _ = passes._graph(ids, pos, cache_pos, mask, ())
        ids[0, 3] = 13
        for layer in passes.cache.layers:                 # stale junk where the dummy row writes
            layer.keys[..., prompt.numel() + 2:, :] = 1e3
        passes._set_length(prompt.numel() - 1)
        second, _ = passes._graph(ids, pos, cache_pos, mask, ())
    assert torch.equal(first[0, :3], second[0, :3])


def test_each_compiled_model_runs_its_own_graph(compiled):
    """The guards on the model's modules are skipped (``_skip_model_guards``): a second compiled
    model of the same shapes, whose norms' epsilon (a constant inside the graph) differs, must
    still run its own graph, and the first one its own after it. On a CPU the graphs have
    Inductor's C++ wrapper."""
    target, fast = compiled
    twin = peaky_target(V, seed=3, hidden_size=32, num_layers=2, max_position_embeddings=1024)
    for module in twin.model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 0.5
    other = compile_target(twin, buckets=(1, 4), max_len=256)
    assert fast.passes.cpp_wrapper and other.passes.cpp_wrapper
    prompt, root = torch.tensor([1, 5, 7, 2]), tree_of([3], [-1])
    for eager_model, t in ((twin.model, other), (target.model, fast), (twin.model, other)):
        eager = TreeVerifier(eager_model, SamplingConfig(1.0))      # T = 1: the whole softmax compared
        eager.prefill(prompt)
        comp = TreeVerifier(t.model, SamplingConfig(1.0), passes=t.passes)
        comp.prefill(prompt)
        torch.testing.assert_close(comp.score(root).probs, eager.score(root).probs, rtol=1e-5, atol=1e-6)


def test_keep_moves_accepted_rows_like_the_growing_cache(compiled):
    _, fast = compiled
    passes = fast.passes
    passes.prefill(torch.tensor([1, 2, 3]), ())
    layer = passes.cache.layers[0]
    with torch.inference_mode():
        layer.keys[..., 3:8, :] = torch.arange(5.0).view(1, 1, 5, 1)
    passes.keep(3, [3, 5, 7])
    assert layer.keys[0, 0, 3:6, 0].tolist() == [0.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="rows must increase"):
        passes.keep(3, [5, 4])


@pytest.mark.parametrize("builder", [ChainBuilder(budget=4), DynamicTreeBuilder(budget=4, depth=3, top_k=2),
                                     DynamicTreeBuilder(budget=6, depth=3, top_k=2)],
                         ids=["chain4", "dynamic4", "dynamic6-eager"])
def test_greedy_on_the_compiled_path_equals_plain_decoding(compiled, builder):
    """Every drafter and tree on the compiled path emits plain decoding's tokens (compiled and
    eager). The prompt fits the caches' first size: growing them is tested on its own
    (``test_a_pass_past_the_cache_grows_it_and_keeps_the_rows``, the head test), each size a
    graph to compile."""
    target, fast = compiled
    prompt = torch.tensor([(7 * i + 3) % V for i in range(200)])
    plain = SpeculativeGenerator(fast, NGramDrafter(V), DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    want = plain.generate(prompt, 40, temperature=0.0).token_ids.tolist()
    eager = SpeculativeGenerator(target, NGramDrafter(V), DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    assert eager.generate(prompt, 40, temperature=0.0).token_ids.tolist() == want
    # ~nothing / everything accepted; the model drafter's calls eager and compiled; a feature
    # head's calls compiled
    from treespec.drafters.feature import random_feature_drafter
    from treespec.drafters.feature_compiled import CompiledHeadCalls

    head = random_feature_drafter(fast, "eagle3", seed=1)
    head.compiled = CompiledHeadCalls(head.head, buckets=(1, 4), max_len=256, cpp_wrapper=False, announce=False)
    for drafter in (NGramDrafter(V, seed=1), ModelDrafter(fast.model, V),
                    compile_drafter(ModelDrafter(fast.model, V), buckets=(1, 4)), head):
        gen = SpeculativeGenerator(fast, drafter, builder)
        assert gen.generate(prompt, 40, temperature=0.0).token_ids.tolist() == want


@pytest.mark.parametrize("draft_vocab", [None, list(range(0, V, 2))], ids=["full-head", "sliced-head"])
def test_a_compiled_drafter_drafts_the_eager_drafters_q(compiled, draft_vocab):
    """A model drafter's calls compiled (buckets 1 and 4; the prompt and a 5-node frontier run
    eagerly on the same static cache) give the eager drafter's logits to fp32 rounding through
    root calls of 1 and 2 pending tokens, frontiers of 1, 2 and 5 nodes and commits that keep
    fed and unfed nodes; with a draft_vocab the graphs end at the decoder and the sliced head
    runs after them."""
    target, _ = compiled
    eager = ModelDrafter(target.model, V, draft_vocab=draft_vocab)
    fast = compile_drafter(ModelDrafter(target.model, V, draft_vocab=draft_vocab), buckets=(1, 4), max_len=256)
    assert drafter_passes(fast).head is (draft_vocab is None) and drafter_passes(eager) is None
    prompt = torch.tensor([(3 * i + 1) % V for i in range(30)])
    for d in (eager, fast):
        d.begin(prompt, None)

    def both(tree, nodes):
        want, got = eager.expand(tree, nodes), fast.expand(tree, nodes)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    root = int(prompt[-1])
    # step 1: the prompt (past every bucket: eager), a 2-node frontier (the 4-node graph, 2 dummy
    # rows), a 1-node one; node 3 accepted but never fed, so the next root call feeds 2 tokens
    tree = PartialTree.rooted(root)
    both(tree, [0])
    n1, n2 = tree.add(0, 4), tree.add(0, 5)
    both(tree, [n1, n2])
    n3, n4 = tree.add(n1, 7), tree.add(n2, 8)
    both(tree, [n4])
    for d in (eager, fast):
        d.commit(torch.tensor([n1, n3]), torch.tensor([4, 7, 9]), None)
    # step 2: a root call of 2 pending tokens, then a 5-node frontier (past every bucket: eager)
    tree = PartialTree.rooted(9)
    both(tree, [0])
    kids = [tree.add(0, t) for t in (1, 2, 3, 6, 8)]
    both(tree, kids)
    for d in (eager, fast):
        d.commit(torch.tensor([kids[2]]), torch.tensor([3, 11]), None)
    tree = PartialTree.rooted(11)
    both(tree, [0])


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_a_compiled_feature_head_drafts_the_eager_heads_q(compiled, kind):
    """A feature head's calls compiled (rows 1 and 4; the prompt's slots and a 5-node frontier
    run eagerly on the same static cache) give the eager head's logits to fp32 rounding through
    root calls of 1 and 2 pending slots, frontiers of 1, 2 and 5 nodes and commits that drop
    the tree region; the committed cache equals the eager drafter's."""
    from treespec.drafters.base import TargetFeatures
    from treespec.drafters.feature import random_feature_drafter
    from treespec.drafters.feature_compiled import CompiledHeadCalls

    target, _ = compiled
    eager = random_feature_drafter(target, kind, seed=1)
    fast = random_feature_drafter(target, kind, seed=1)
    fast.compiled = CompiledHeadCalls(fast.head, buckets=(1, 4), max_len=256, cpp_wrapper=False, announce=False)
    gen = torch.Generator().manual_seed(0)

    def feats(n):
        return TargetFeatures({i: torch.randn(n, 32, generator=gen) for i in eager.target_layers})

    prompt = torch.tensor([(3 * i + 1) % V for i in range(30)])
    f = feats(29)
    for d in (eager, fast):
        d.begin(prompt, f)

    def both(tree, nodes):
        want, got = eager.expand(tree, nodes), fast.expand(tree, nodes)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    tree = PartialTree.rooted(int(prompt[-1]))
    both(tree, [0])                                        # 29 slots: past every bucket, eagerly
    n1, n2 = tree.add(0, 4), tree.add(0, 5)
    both(tree, [n1, n2])                                   # the 4-row graph, 2 dummy rows
    n3 = tree.add(n1, 7)
    both(tree, [n3])
    f = feats(3)
    for d in (eager, fast):
        d.commit(torch.tensor([0, n1, n3]), torch.tensor([4, 7, 9]), f)
    tree = PartialTree.rooted(9)
    both(tree, [0])                                        # 3 pending slots: the 4-row graph
    kids = [tree.add(0, t) for t in (1, 2, 3, 6, 8)]
    both(tree, kids)                                       # 5 rows: eagerly
    f = feats(2)
    for d in (eager, fast):
        d.commit(torch.tensor([0, kids[2]]), torch.tensor([3, 11]), f)
    tree = PartialTree.rooted(11)
    both(tree, [0])
    for want, got in zip(eager.committed_cache(), fast.committed_cache()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a request whose prompt nearly fills the 256 slots: its first frontier grows the buffers
    # (the slots in use copied) and runs the 4-row graph of the new size
    prompt = torch.tensor([(5 * i + 2) % V for i in range(250)])
    f = feats(249)
    for d in (eager, fast):
        d.begin(prompt, f)
    tree = PartialTree.rooted(int(prompt[-1]))
    both(tree, [0])                                        # 249 slots, eagerly: still 256
    assert fast.compiled.max_len == 256
    assert fast.compiled._graphs.get((4, 256)) is not None    # its calls ran directly (DirectGraphs)
    both(tree, [tree.add(0, 2), tree.add(0, 3)])
    assert fast.compiled.max_len == 512 and fast.compiled._graphs.get((4, 256)) is None   # dropped with the buffers


def test_compile_drafter_finds_the_model_inside_a_hybrid_and_refuses_drafters_without_one(compiled):
    target, fast = compiled
    hybrid = compile_drafter(HybridDrafter(ModelDrafter(target.model, V)), buckets=(1,))
    assert isinstance(drafter_passes(hybrid), CompiledPasses) and drafter_passes(hybrid).role == "drafter"
    with pytest.raises(TypeError, match="has neither"):
        compile_drafter(NGramDrafter(V))
    # what --compile does: a model drafter of a compiled target only, once, its cache sized as the target's
    assert drafter_passes(compile_drafter_for(target, ModelDrafter(target.model, V))) is None
    lookup = NGramDrafter(V)
    assert compile_drafter_for(fast, lookup) is lookup
    drafter = compile_drafter_for(fast, ModelDrafter(target.model, V))
    passes = drafter_passes(drafter)
    assert passes.max_len == fast.passes.max_len and compile_drafter_for(fast, drafter) is drafter
    assert drafter_passes(drafter) is passes
    # a feature head: compiled where its block does not run as fused C++ calls (AVX-512)
    from treespec.drafters.feature import random_feature_drafter
    from treespec.drafters.feature_compiled import head_compiles

    eagle = random_feature_drafter(target, "eagle3", seed=1)
    assert compile_drafter_for(target, eagle).compiled is None          # an eager target: left alone
    hybrid = HybridDrafter(random_feature_drafter(target, "eagle3", seed=1))
    if head_compiles(eagle.head):
        assert compile_drafter_for(fast, eagle).compiled.max_len == fast.passes.max_len
        assert compile_drafter(hybrid).head.compiled is not None
    else:
        assert compile_drafter_for(fast, eagle).compiled is None
        with pytest.raises(ValueError, match="fused C.. calls already"):
            compile_drafter(hybrid)


def test_two_requests_cannot_interleave_on_one_compiled_cache(compiled):
    """The static cache holds one request: a second request's prefill takes it, and the first
    request's next pass is refused by name instead of reading the other's rows."""
    _, fast = compiled
    first = TreeVerifier(fast.model, SamplingConfig(0.0), passes=fast.passes)
    first.prefill(torch.tensor([1, 2, 3]))
    second = TreeVerifier(fast.model, SamplingConfig(0.0), passes=fast.passes)
    second.prefill(torch.tensor([4, 5]))
    with pytest.raises(RuntimeError, match="one request at a time"):
        first.score(tree_of([3], [-1]))
    second.score(tree_of([5], [-1]))


def test_a_pass_past_the_cache_grows_it_and_keeps_the_rows(compiled):
    """A verifier whose prompt nearly fills the cache: the next pass grows it (copying every
    row) and still agrees with the eager pass."""
    target, _ = compiled
    passes = CompiledPasses(target.model, buckets=(4,), max_len=256, announce=False)
    prompt = torch.tensor([(5 * i + 1) % V for i in range(254)])
    tree = tree_of([3, 4, 6, 8], [-1, 0, 0, 1])
    eager = TreeVerifier(target.model, SamplingConfig(0.0))
    eager.prefill(prompt)
    comp = TreeVerifier(target.model, SamplingConfig(0.0), passes=passes)
    comp.prefill(prompt)
    assert passes.max_len == 512                          # sized for the prompt and one 4-node tree
    for _ in range(90):                                   # past 512 - 4: the cache grows to 768
        want, got = eager.score(tree).probs, comp.score(tree).probs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        eager.compact(torch.tensor([0, 2, 3]))
        comp.compact(torch.tensor([0, 2, 3]))
    assert passes.max_len == 768 and comp.cache is passes.cache
    # the graphs called directly hold the cache they were compiled on: the old size's are dropped
    assert {key[3] for key in passes._graphs._direct} == {768}


def test_a_pass_calls_its_graph_directly_with_its_own_arguments(compiled):
    """After its first pass, a key's graph is called without Dynamo (``DirectGraphs``: no guards,
    no gathering of the weights): with another tree, at another position, on another cache
    content, it gives the Dynamo call's bits, and it writes the cache slots the Dynamo call
    writes."""
    _, fast = compiled
    passes = fast.passes
    key = (1, 4, (), passes.max_len)
    passes.prefill(torch.tensor([1, 5, 7, 2, 9]), ())
    passes.score(tree_of([3, 4, 6, 8], [-1, 0, 0, 1]), 5, ())    # the 4-node graph: compiled or not, adopted
    assert passes._graphs.get(key) is not None
    passes.prefill(torch.tensor([4, 4, 8, 1, 6, 2, 2, 9, 10]), ())
    tree = tree_of([3, 12, 6], [-1, 0, 0])                 # the 4-node graph, one dummy row
    padded = passes.inputs(*passes.tree_rows(tree, 9), 9, 4)
    with torch.inference_mode():
        passes._set_length(9)
        direct, _ = passes.call(padded, ())
        written = [layer.keys[..., 9:13, :].clone() for layer in passes.cache.layers]
        for layer in passes.cache.layers:
            layer.keys[..., 9:13, :] = 0.0
        passes._set_length(9)
        dynamo, _ = passes._graph(*padded, ())
        again = [layer.keys[..., 9:13, :] for layer in passes.cache.layers]
    assert torch.equal(direct, dynamo)
    assert all(torch.equal(a, b) for a, b in zip(written, again))


def test_bucket_steps_make_n_cost_what_its_bucket_costs():
    from treespec.calibrate.passes import bucket_steps
    from treespec.planning import Curve

    measured = Curve.fit([1, 2, 4, 8], [1.0, 1.5, 2.0, 4.0], [0.1, 0.2, 0.3, 0.4])
    steps = bucket_steps(measured, [1, 2, 4, 8])
    assert steps.ns == (1, 2, 3, 4, 5, 8)
    assert [steps(n) for n in range(1, 9)] == [1.0, 1.5, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert steps.spread == (0.1, 0.2, 0.3, 0.3, 0.4, 0.4)


def test_a_compiled_target_is_calibrated_on_its_graphs_in_its_own_file(compiled, tmp_path, monkeypatch):
    """``calibrate(passes=...)`` times the compiled graphs, one per bucket, as steps; the file is
    the ``-compiled`` one; the calibration takes the cache, and the next request prefills again
    and decodes as before; ``auto`` never plans a tree past the largest bucket."""
    from treespec.calibrate.passes import calibrate, compiled_verify_passes
    from treespec.planning import target_calibration_path
    from treespec.runtime.generator import auto_builder

    target, fast = compiled
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"compiled passes\) at .*-compiled\.json; run `treespec calibrate .* --no-pack "
                                         r"--compile --threads 1` first"):
        SpeculativeGenerator(fast, NGramDrafter(V), "auto")   # the error names the command that writes that file
    assert target_calibration_path(fast).name == target_calibration_path(target).name.replace(".json", "-compiled.json")
    want = SpeculativeGenerator(target, NGramDrafter(V), ChainBuilder(budget=4)).generate([1, 2, 3], 12,
                                                                                        temperature=0.0)
    for fn in compiled_verify_passes(fast.passes, [1, 3, 4], context=8):
        fn()
    cal = calibrate(target.model, "toy", ns=(1, 2, 3), context=8, early_exit_layers=1, n_warmup=0,
                    n_rep=1, passes=fast.passes)
    assert cal.target.ns == (1, 2, 4)                     # buckets 1 and 4 only: 2 and 3 run in 4's graph
    assert cal.target(2) == cal.target(3) == cal.target(4)
    gen = SpeculativeGenerator(fast, NGramDrafter(V), ChainBuilder(budget=4))
    assert gen.generate([1, 2, 3], 12, temperature=0.0).token_ids.tolist() == want.token_ids.tolist()
    with pytest.raises(ValueError, match="passes must be the compiled passes of model"):
        calibrate(peaky_target(V).model, "toy", ns=(1,), context=8, n_rep=1, early_exit_layers=1,
                  passes=fast.passes)
    free = dataclasses.replace(cal, target=Curve.fit([1, 64], [1.0, 1.0]), acceptance={})
    assert auto_builder(target, NGramDrafter(V), free, acceptance=0.9).budget > 4
    assert auto_builder(fast, NGramDrafter(V), free, acceptance=0.9).budget <= 4


def test_a_drafter_is_calibrated_as_a_compiled_target_runs_it(compiled, monkeypatch):
    """``calibrate_drafter`` on a compiled target times the model drafter's compiled calls (what
    ``--compile`` runs), not its eager ones: every timed call goes through the drafter's passes."""
    from treespec.calibrate.drafters import calibrate_drafter
    from treespec.calibrate.passes import calibrate

    target, fast = compiled
    roles = []
    run = CompiledPasses.run

    def spy(self, *args, **kwargs):
        roles.append(self.role)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(CompiledPasses, "run", spy)
    cal = calibrate(target.model, "tiny", ns=(1, 4), context=4, early_exit_layers=1, n_warmup=0, n_rep=1)
    out = calibrate_drafter(cal, "target", fast, [[1, 2, 3, 4, 5]], widths=(2,), acceptance_width=2,
                            max_new_tokens=4, temperatures=(0.0,))
    assert out.drafters["target"].ns == (1, 2)
    assert "drafter" in roles and "target" in roles


@needs_panel
def test_a_tree_pass_keeps_the_one_token_steps_bits_on_two_threads():
    """With 2 threads, Inductor would split a 1-row pass's RMSNorm sum over 1024 values between
    the threads and give each row of a 4-row pass to one thread whole: two orders of addition, a
    chain's rows off the bits of the one-token steps (greedy speculation then leaves plain
    decoding's tokens). ``serial_kernels`` keeps Inductor's own kernels on one thread there."""
    from _engine_helpers import peaky_llama
    from _rounded_targets import assert_chain_rows_are_one_token_steps, rounded_copy

    model = peaky_llama(256, seed=5, hidden_size=1024, max_position_embeddings=256)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(gguf_q4_1(module.weight))
    packed = rounded_copy(model, "x8")
    torch.set_num_threads(2)                                # the one_thread fixture puts it back
    passes = CompiledPasses(packed, buckets=(1, 4), max_len=64, announce=False, cpp_wrapper=False)
    assert_chain_rows_are_one_token_steps(packed, passes)
