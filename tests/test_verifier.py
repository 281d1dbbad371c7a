"""TreeVerifier: one forward scores a tree exactly, and compaction leaves the KV cache equal to
the cache of plain sequential decoding of the committed tokens.

Driven by hand (prefill -> score -> accept -> compact) on tiny 2-layer Llamas, sdpa and eager,
with random trees that contain the target's greedy continuation as one path among random
branches: paths are accepted deep, with non-contiguous node indices, and branches are rejected.
"""

from __future__ import annotations

import random

import pytest
import torch

from treespec.drafters.base import PartialTree, as_draft_tree
from treespec.core.sampling import SamplingConfig, process
from treespec.core import accept
from treespec.runtime.verifier import TreeVerifier

from _engine_helpers import assert_cache_equal, fresh_cache, one_thread, peaky_llama  # noqa: F401

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")


def greedy_continuation(model, tokens: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([tokens + out])).logits[0, -1].argmax()))
    return out


def tree_with_path(rng: random.Random, root: int, size: int, path: list[int]):
    """A random tree of ~``size`` nodes (distinct sibling tokens) in which ``path`` (tokens below
    the root) is one root-to-node path, its nodes interleaved with random ones."""
    tree = PartialTree.rooted(root)
    kids: dict[int, dict[int, int]] = {0: {}}  # node -> token -> child

    def add(parent: int, token: int) -> int:
        if token in kids[parent]:
            return kids[parent][token]
        child = tree.add(parent, token)
        kids[parent][token] = child
        kids[child] = {}
        return child

    tip, todo = 0, list(path)
    while len(tree) < size or todo:
        if todo and rng.random() < 0.35:
            tip = add(tip, todo.pop(0))
        else:
            parent = rng.randrange(len(tree))
            free = [t for t in range(V) if t not in kids[parent]]
            if free:
                add(parent, rng.choice(free))
    return as_draft_tree(tree, None, "deterministic")


def reference(model, tokens: list[int], sampling: SamplingConfig, layer: int):
    """(processed p(. | tokens) [V], hidden state of layer ``layer`` at the last token [H])
    from a plain forward."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return process(out.logits[0, -1].float(), sampling), out.hidden_states[layer][0, -1]


# (dtype, weight std, atol): float32 with O(1) activations meets 1e-5; float64 with large
# activations shows the equality is exact up to round-off. float64 runs on sdpa only: HF's eager
# attention computes its softmax in float32 whatever the model dtype (errors ~1e-6 there).
PRECISIONS = {"fp32": (torch.float32, 0.2, 1e-5), "fp64": (torch.float64, 0.5, 1e-10)}
BACKENDS = [("sdpa", "fp32"), ("eager", "fp32"), ("sdpa", "fp64")]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_len", [1, 6])
@pytest.mark.parametrize("attn,precision", BACKENDS, ids=[f"{a}-{p}" for a, p in BACKENDS])
def test_cache_equals_sequential_decoding(attn: str, precision: str, prompt_len: int,
                                          temperature: float) -> None:
    dtype, std, atol = PRECISIONS[precision]
    model = peaky_llama(V, seed=3, hidden_size=32, num_layers=2, attn_implementation=attn,
                        std=std, dtype=dtype)
    sampling = SamplingConfig(temperature=temperature)
    rng = random.Random(f"{attn}-{prompt_len}-{temperature}-{precision}")
    gen = torch.Generator().manual_seed(0)
    verifier = TreeVerifier(model, sampling, target_layers=(1,))
    prompt = [rng.randrange(V) for _ in range(prompt_len)]
    feats = verifier.prefill(torch.tensor(prompt))
    committed = list(prompt)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[1][0]
    assert feats.length == prompt_len - 1
    if prompt_len > 1:
        torch.testing.assert_close(feats.hidden[1], ref[:-1], atol=atol, rtol=0)
    assert_cache_equal(verifier.cache, fresh_cache(model, committed[:-1]), prompt_len - 1, atol)

    rejected = deep = non_contiguous = 0
    for step in range(8):
        path = greedy_continuation(model, committed, rng.randint(1, 4))
        tree = tree_with_path(rng, committed[-1], rng.randint(1, 12), path)
        out = verifier.score(tree)
        # Every row is p(. | committed prefix, path to the node), as a plain forward gives it,
        # and so are the node's target features.
        assert out.features.length == tree.num_nodes
        for i in range(tree.num_nodes):
            toks = committed[:-1] + [int(tree.tokens[j]) for j in tree.path_to(i)]
            want, hidden = reference(model, toks, sampling, layer=1)
            torch.testing.assert_close(out.probs[i], want, atol=1e-5, rtol=0,
                                       msg=lambda m: f"step {step} node {i}: {m}")
            torch.testing.assert_close(out.features.hidden[1][i], hidden, atol=atol, rtol=0)
        acc = accept(tree, out.probs, gen)
        keep = torch.cat([torch.zeros(1, dtype=torch.long), acc.path])
        verifier.compact(keep)
        committed += acc.tokens.tolist()
        # The cache holds the committed tokens except the new root, nothing else.
        assert verifier.prefix_len == len(committed) - 1
        assert_cache_equal(verifier.cache, fresh_cache(model, committed[:-1]), len(committed) - 1,
                           atol)
        rejected += tree.num_nodes > keep.numel()
        deep += acc.num_accepted >= 2
        non_contiguous += not torch.equal(keep, torch.arange(keep.numel()))
    # Branches were rejected, paths were kept from scattered rows, and (surely at T = 0, where
    # the greedy path is always accepted) some accepted paths were deep.
    assert rejected >= 4, rejected
    if temperature == 0:
        assert deep >= 4 and non_contiguous >= 1, (deep, non_contiguous)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_acceptance_of_the_greedy_path(attn: str) -> None:
    """At T = 0 a tree holding the greedy continuation as a path is accepted along it entirely,
    and the new token is the next greedy token."""
    model = peaky_llama(V, seed=4, hidden_size=32, num_layers=2, attn_implementation=attn)
    rng = random.Random(attn)
    verifier = TreeVerifier(model, SamplingConfig(temperature=0.0))
    committed = [3, 1, 4]
    verifier.prefill(torch.tensor(committed))
    for _ in range(4):
        path = greedy_continuation(model, committed, 5)
        tree = tree_with_path(rng, committed[-1], 14, path[:4])
        acc = accept(tree, verifier.score(tree).probs)
        assert acc.tokens.tolist() == path
        verifier.compact(torch.cat([torch.zeros(1, dtype=torch.long), acc.path]))
        committed += path
        assert_cache_equal(verifier.cache, fresh_cache(model, committed[:-1]), len(committed) - 1)


def test_memory_does_not_grow_with_rejected_branches() -> None:
    """Wide trees whose branches are all rejected: the cache length tracks the committed tokens."""
    model = peaky_llama(V, seed=5, hidden_size=32, num_layers=2)
    verifier = TreeVerifier(model, SamplingConfig(temperature=0.0))
    committed = [1, 2]
    verifier.prefill(torch.tensor(committed))
    for _ in range(6):
        nxt = greedy_continuation(model, committed, 1)[0]
        wrong = [t for t in range(V) if t != nxt]
        tree = as_draft_tree(_star(committed[-1], wrong), None, "deterministic")
        acc = accept(tree, verifier.score(tree).probs)
        assert acc.num_accepted == 0 and acc.tokens.tolist() == [nxt]
        verifier.compact(torch.zeros(1, dtype=torch.long))
        committed.append(nxt)
        for layer in verifier.cache.layers:
            assert layer.keys.shape[-2] == layer.values.shape[-2] == len(committed) - 1
    assert_cache_equal(verifier.cache, fresh_cache(model, committed[:-1]), len(committed) - 1)


def _star(root: int, tokens: list[int]) -> PartialTree:
    tree = PartialTree.rooted(root)
    for t in tokens:
        tree.add(0, t)
    return tree


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("prompt_len", [1, 6])
def test_a_root_alone_is_scored_as_the_models_own_one_token_step(attn: str, prompt_len: int) -> None:
    """A root-only tree (a plain step) skips the tree mask: its logits are bit for bit what the
    model computes for the next token after its cached prompt, as HF's own decode step does, and
    its cache row is that step's."""
    model = peaky_llama(vocab_size=V, hidden_size=32, num_layers=2, attn_implementation=attn)
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(V) for _ in range(prompt_len + 1)]
    v = TreeVerifier(model, SamplingConfig(temperature=1.0))
    v.prefill(torch.tensor(prompt))
    got = v.score(as_draft_tree(PartialTree.rooted(prompt[-1]), None, "deterministic")).probs
    ref_cache = fresh_cache(model, prompt[:-1])
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([prompt[-1:]]), cache=ref_cache, use_cache=True).logits[0, -1]
    assert torch.equal(got[0], process(ref.float(), SamplingConfig(temperature=1.0)))
    v.compact(torch.tensor([0]))
    assert_cache_equal(v.cache, ref_cache, len(prompt), atol=0.0)


def test_score_before_prefill_is_an_error() -> None:
    verifier = TreeVerifier(peaky_llama(V), SamplingConfig())
    tree = as_draft_tree(_star(1, [2, 3]), None, "deterministic")
    with pytest.raises(RuntimeError, match="prefill"):
        verifier.score(tree)


def test_compact_takes_a_path_from_the_root_only() -> None:
    """Kept rows move down in place (each after the ones before it), so ``keep`` must be a path:
    increasing from node 0. Anything else is refused before the cache is touched."""
    verifier = TreeVerifier(peaky_llama(V), SamplingConfig())
    verifier.prefill(torch.tensor([5, 6, 7]))
    tree = as_draft_tree(_star(1, [2, 3]), None, "deterministic")
    verifier.score(tree)
    before = [layer.keys.clone() for layer in verifier.cache.layers]
    for bad in ([1, 2], [0, 2, 1], [0, 0], []):
        with pytest.raises(ValueError, match="path from the root"):
            verifier.compact(torch.tensor(bad, dtype=torch.long))
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, verifier.cache.layers))
    verifier.compact(torch.tensor([0, 2]))
    assert verifier.prefix_len == 4
    for old, layer in zip(before, verifier.cache.layers):     # node 2's row moved into node 1's place
        assert layer.keys.shape[-2] == 4
        assert torch.equal(layer.keys[..., :3, :], old[..., :3, :]) and torch.equal(layer.keys[..., 3, :], old[..., 4, :])
