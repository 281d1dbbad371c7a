"""TreeBatch (CSR layout of B trees) and the step functions prepare_verify / accept_batch.

- round trips: from_trees -> tree(i) gives back each tree exactly (tokens, parents, q rows,
  mode), a batch of one is the tree itself, and a flat batch built by hand validates like trees;
- prepare_verify: the packed mask unpacks to each request's prefix ‖ ancestor mask, positions
  are P_i + depth, indptrs are FlashInfer's;
- accept_batch equals ``accept`` per request bit for bit, for every rule and sampling mode, at
  T = 0 and T > 0, and a request's result does not depend on its batch-mates;
- bad input gets a clear error naming the argument.
"""

from __future__ import annotations

import random

import pytest
import torch

from treespec.core.tree_batch import RequestAcceptance, TreeBatch, accept_batch, prepare_verify
from treespec.core.masks import tree_bool_mask, unpack_masks
from treespec.core.sampling import SamplingConfig, process
from treespec.core.tree import DraftTree
from treespec.core import accept

from _tiny import one_thread, random_tree  # noqa: F401

V = 12
GREEDY, WARM = SamplingConfig(0.0), SamplingConfig(1.0, top_p=0.9)


def chain_tree(rng: random.Random, n: int, sampling: str) -> DraftTree:
    """A chain of n nodes (root included) with random q rows."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    probs = torch.rand(n, V, generator=g, dtype=torch.float64) + 0.05
    probs /= probs.sum(-1, keepdim=True)
    tokens = torch.tensor([rng.randrange(V) for _ in range(n)])
    return DraftTree(tokens, torch.arange(-1, n - 1), probs, sampling, V)


def mixed_trees(rng: random.Random, sizes=(4, 1, 9, 6)) -> list[DraftTree]:
    modes = ["deterministic", "with_replacement", "without_replacement"]
    return [random_tree(rng, n, V, modes[i % 3]) for i, n in enumerate(sizes)]


def assert_tree_equal(a: DraftTree, b: DraftTree) -> None:
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.sampling == b.sampling and a.vocab_size == b.vocab_size
    assert (a.draft_probs is None) == (b.draft_probs is None)
    if a.draft_probs is not None:
        assert torch.equal(a.draft_probs, b.draft_probs)


# ---------------------------------------------------------------- layout
def test_round_trip_and_batch_of_one() -> None:
    rng = random.Random(0)
    trees = mixed_trees(rng)
    configs = [GREEDY, WARM, WARM, GREEDY]
    batch = TreeBatch.from_trees(trees, configs)
    assert batch.batch_size == 4 and batch.sizes == [4, 1, 9, 6] and batch.num_nodes == 20
    assert batch.req_indptr.tolist() == [0, 4, 5, 14, 20]
    assert batch.configs == tuple(configs)
    assert batch.has_draft_probs == (False, True, True, False)
    # local parents: -1 exactly at each root
    assert (batch.parents == -1).nonzero().flatten().tolist() == [0, 4, 5, 14]
    for i, t in enumerate(trees):
        assert_tree_equal(batch.tree(i), t)
    # the flat fields, handed to the constructor, validate and give the same trees
    again = TreeBatch(batch.req_indptr, batch.tokens, batch.parents, batch.sampling, batch.configs,
                      batch.draft_probs, batch.has_draft_probs)
    for i, t in enumerate(trees):
        assert_tree_equal(again.tree(i), t)
    one = TreeBatch.from_trees([trees[2]], [WARM])
    assert_tree_equal(one.tree(0), trees[2])
    assert torch.equal(one.tokens, trees[2].tokens) and torch.equal(one.draft_probs, trees[2].draft_probs)


def test_layout_errors() -> None:
    rng = random.Random(1)
    trees = mixed_trees(rng, (3, 2))
    b = TreeBatch.from_trees(trees, [GREEDY, GREEDY])
    fields = dict(req_indptr=b.req_indptr, tokens=b.tokens, parents=b.parents, sampling=b.sampling,
                  configs=b.configs, draft_probs=b.draft_probs, has_draft_probs=b.has_draft_probs)

    def make(**kw):
        return TreeBatch(**{**fields, **kw})

    with pytest.raises(ValueError, match="req_indptr must start at 0 and end at T=5"):
        make(req_indptr=torch.tensor([0, 3, 4]))
    with pytest.raises(ValueError, match="strictly increasing"):
        make(req_indptr=torch.tensor([0, 0, 5]))
    with pytest.raises(ValueError, match="tokens must have dtype torch.long"):
        make(tokens=b.tokens.int())
    with pytest.raises(TypeError, match="parents must be a torch.LongTensor"):
        make(parents=b.parents.tolist())
    with pytest.raises(ValueError, match="parents has 4 entries but tokens has 5"):
        make(parents=b.parents[:4])
    with pytest.raises(ValueError, match=r"request 1: parents\[0\] must be -1"):
        make(parents=torch.tensor([-1, 0, 0, 0, 0]))   # request 1's root points into request 0
    with pytest.raises(ValueError, match="request 0: parents must be topological"):
        make(parents=torch.tensor([-1, 2, 0, -1, 0]))
    with pytest.raises(ValueError, match="configs has 1 entries but the batch has 2"):
        make(configs=(GREEDY,))
    with pytest.raises(TypeError, match=r"configs\[1\] must be a SamplingConfig"):
        make(configs=(GREEDY, 0.0))
    with pytest.raises(ValueError, match="sampling must be a tuple of 2 modes"):
        make(sampling=("deterministic",))
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        make(draft_probs=b.draft_probs[:4])
    with pytest.raises(ValueError, match="has_draft_probs must be a tuple of 2 bools"):
        make(has_draft_probs=(True,))
    with pytest.raises(TypeError, match=r"trees\[1\] must be a DraftTree"):
        TreeBatch.from_trees([trees[0], "tree"], [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="non-empty list"):
        TreeBatch.from_trees([], [])
    with pytest.raises(TypeError, match="configs must be a list of 2 SamplingConfig"):
        TreeBatch.from_trees(trees, GREEDY)
    other = random_tree(rng, 3, V + 1, "with_replacement")
    with pytest.raises(ValueError, match="mixed vocabularies"):
        TreeBatch.from_trees([trees[1], other], [WARM, WARM])
    f32 = DraftTree(other.tokens % V, other.parents, other.draft_probs[:, :V].float().softmax(-1),
                    "with_replacement")
    with pytest.raises(TypeError, match="mixed dtypes"):
        TreeBatch.from_trees([trees[1], f32], [WARM, WARM])
    assert make(sampling=list(b.sampling)).sampling == b.sampling     # lists are taken as tuples
    with pytest.raises(IndexError, match="out of range"):
        b.tree(2)


# ---------------------------------------------------------------- prepare_verify
def test_prepare_verify_masks_positions_indptr() -> None:
    rng = random.Random(2)
    trees = mixed_trees(rng, (5, 1, 11, 3))
    prefix = [0, 7, 3, 13]
    batch = TreeBatch.from_trees(trees, [WARM] * 4)
    ids, pos, qo, packed, mptr = prepare_verify(batch, prefix)
    assert torch.equal(ids, batch.tokens)
    assert qo.dtype == torch.int32 and qo.tolist() == [0, 5, 6, 17, 20]
    assert mptr.dtype == torch.int32 and packed.dtype == torch.uint8
    sizes = batch.sizes
    # each request is byte-padded on its own: ceil(N (P + N) / 8) bytes
    assert (mptr[1:] - mptr[:-1]).tolist() == [(n * (p + n) + 7) // 8 for n, p in zip(sizes, prefix)]
    masks = unpack_masks(packed, mptr, sizes, [p + n for p, n in zip(prefix, sizes)])
    for i, (t, p) in enumerate(zip(trees, prefix)):
        want = torch.zeros(t.num_nodes, p + t.num_nodes, dtype=torch.bool)
        want[:, :p] = True
        for a in range(t.num_nodes):            # ancestors by walking parents, not the cached mask
            for j in t.path_to(a):
                want[a, p + j] = True
        assert torch.equal(masks[i], want), f"request {i}"
        assert torch.equal(masks[i], tree_bool_mask(t, p))
        s, e = qo[i], qo[i + 1]
        depth = torch.tensor([len(t.path_to(a)) - 1 for a in range(t.num_nodes)])
        assert torch.equal(pos[s:e], p + depth), f"request {i}"
    # the bits are little-endian within a byte: request 0's first row starts with its root's bit
    first = int(packed[0])
    assert first & 1 == 1                              # mask[0, 0] (root sees itself; P = 0)
    assert (first >> 1) & 1 == 0                       # mask[0, 1]: the root does not see node 1


def test_prepare_verify_errors() -> None:
    batch = TreeBatch.from_trees(mixed_trees(random.Random(3), (2, 3)), [WARM, WARM])
    with pytest.raises(ValueError, match="prefix_lens has 1 entries but the batch has 2"):
        prepare_verify(batch, [4])
    with pytest.raises(ValueError, match="prefix_lens must be >= 0"):
        prepare_verify(batch, [4, -1])
    with pytest.raises(TypeError, match="prefix_lens must be a 1-D integer tensor"):
        prepare_verify(batch, torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="prefix_lens must hold ints"):
        prepare_verify(batch, [1, 2.5])
    with pytest.raises(TypeError, match="batch must be a TreeBatch"):
        prepare_verify([batch.tree(0)], [0])


# ---------------------------------------------------------------- accept_batch
def target_rows(rng: random.Random, n: int, config: SamplingConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    return process(torch.randn(n, V, generator=g, dtype=torch.float64) * 2, config)


@pytest.mark.parametrize("rule", ["token", "block", "traversal"])
def test_accept_batch_equals_accept_per_request(rule: str) -> None:
    rng = random.Random(f"accept-{rule}")
    modes = ["deterministic", "with_replacement", "without_replacement"]
    for trial in range(15):
        b = rng.randint(1, 5)
        sizes = [rng.randint(1, 8) for _ in range(b)]
        trees = [chain_tree(rng, n, modes[(trial + i) % 3]) if rule == "block"
                 else random_tree(rng, n, V, modes[(trial + i) % 3]) for i, n in enumerate(sizes)]
        configs = [rng.choice([GREEDY, WARM, SamplingConfig(0.7)]) for _ in range(b)]
        probs = [target_rows(rng, n, c) for n, c in zip(sizes, configs)]
        seeds = [rng.randrange(2**31) for _ in range(b)]
        batch = TreeBatch.from_trees(trees, configs)
        got = accept_batch(batch, torch.cat(probs), [torch.Generator().manual_seed(s) for s in seeds], rule)
        assert len(got) == b and all(isinstance(r, RequestAcceptance) for r in got)
        for i in range(b):
            want = accept(trees[i], probs[i], torch.Generator().manual_seed(seeds[i]), rule)
            r = got[i]
            assert torch.equal(r.path, want.path) and torch.equal(r.tokens, want.tokens), f"trial {trial} req {i}"
            assert r.acceptance.depth_attempts == want.depth_attempts
            assert r.acceptance.children_tried == want.children_tried
            assert r.keep_src.tolist() == [0] + want.path.tolist()
            assert r.keep_dst.tolist() == list(range(want.path.numel() + 1))


def test_accept_batch_is_batch_invariant() -> None:
    """A request's result is its result alone, whatever its batch-mates (their trees, probs,
    seeds) and wherever it sits in the batch."""
    rng = random.Random(5)
    tree = random_tree(rng, 9, V, "with_replacement")
    probs = target_rows(rng, 9, SamplingConfig(1.0))
    alone = set()
    for trial in range(12):
        want = accept(tree, probs, torch.Generator().manual_seed(trial))
        alone.add(tuple(want.tokens.tolist()))
        mates = [random_tree(rng, rng.randint(1, 7), V, "without_replacement") for _ in range(trial % 4)]
        at = rng.randint(0, len(mates))
        trees = mates[:at] + [tree] + mates[at:]
        rows = [target_rows(rng, t.num_nodes, WARM) for t in trees]
        rows[at] = probs
        gens = [torch.Generator().manual_seed(1000 + rng.randrange(99)) for _ in trees]
        gens[at] = torch.Generator().manual_seed(trial)
        r = accept_batch(TreeBatch.from_trees(trees, [WARM] * len(trees)), torch.cat(rows), gens)[at]
        assert torch.equal(r.path, want.path) and torch.equal(r.tokens, want.tokens), f"trial {trial}"
    assert len(alone) > 1          # the seed matters: a shared or swapped generator would show


def test_accept_batch_errors() -> None:
    rng = random.Random(6)
    trees = mixed_trees(rng, (3, 4))
    batch = TreeBatch.from_trees(trees, [WARM, WARM])
    probs = torch.cat([target_rows(rng, 3, WARM), target_rows(rng, 4, WARM)])
    gens = [torch.Generator(), torch.Generator()]
    with pytest.raises(ValueError, match="generators has 1 entries but the batch has 2"):
        accept_batch(batch, probs, gens[:1])
    with pytest.raises(TypeError, match="generators must be a list"):
        accept_batch(batch, probs, gens[0])
    with pytest.raises(TypeError, match=r"generators\[1\] must be a torch.Generator"):
        accept_batch(batch, probs, [gens[0], 3])
    with pytest.raises(ValueError, match=r"target_probs must have shape \[T=7, V\]"):
        accept_batch(batch, probs[:6], gens)
    with pytest.raises(TypeError, match="target_probs must be a floating-point tensor"):
        accept_batch(batch, probs.long(), gens)
    with pytest.raises(ValueError, match="has V=13 but the tree's vocab is 12"):
        accept_batch(batch, torch.cat([probs, probs[:, :1]], 1), gens)
    with pytest.raises(ValueError, match="unknown acceptance rule"):
        accept_batch(batch, probs, gens, "typical")


def test_readme_step_function_example_runs(capsys) -> None:
    """The step-functions block of docs/serving.md runs as written."""
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
    blocks = [b for b in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S) if "prepare_verify" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], str(doc), "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2                            # one line per request: tokens, src, dst
