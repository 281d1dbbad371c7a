"""Masks and positions: hand examples, formats per attention implementation, bit packing, and
the decisive check: a real (tiny, random) HF Llama fed a tree after a cached prefix gives every
node the logits of sequential decoding of its path."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from treespec.core.masks import (
    _pack_bits,
    _pack_bits_torch,
    attn_implementation_of,
    hf_tree_mask,
    pack_masks,
    pack_tree_masks,
    position_ids,
    tree_bool_mask,
    unpack_masks,
)
from treespec.core.tree import DraftTree

from _tiny import TINY_VOCAB, cache_kwargs, one_thread, random_tree, tiny_llama  # noqa: F401

# root 9 -> (4 -> (6 -> 8, 7), 5 -> 6): the example of test_tree.py
TREE = DraftTree(torch.tensor([9, 4, 5, 6, 7, 6, 8]), torch.tensor([-1, 0, 0, 1, 1, 2, 3]))
ANC = [
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 0, 0, 1],
]


def test_bool_mask_is_prefix_then_ancestors():
    m = tree_bool_mask(TREE, 3)
    assert m.dtype == torch.bool and m.shape == (7, 10)
    assert m.tolist() == [[True] * 3 + [bool(b) for b in row] for row in ANC]
    assert tree_bool_mask(TREE, 0).tolist() == [[bool(b) for b in row] for row in ANC]


def test_position_ids_are_prefix_plus_depth():
    pos = position_ids(TREE, 5)
    assert pos.dtype == torch.long and pos.tolist() == [[5, 6, 6, 7, 7, 7, 8]]


@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2", "flex_attention"])
def test_bool_formats(impl):
    m = hf_tree_mask(TREE, 3, impl)
    assert m.dtype == torch.bool and m.shape == (1, 1, 7, 10)
    assert torch.equal(m[0, 0], tree_bool_mask(TREE, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_eager_format_is_additive(dtype):
    m = hf_tree_mask(TREE, 3, "eager", dtype)
    assert m.dtype == dtype and m.shape == (1, 1, 7, 10)
    allowed = tree_bool_mask(TREE, 3)
    assert (m[0, 0][allowed] == 0).all()
    assert (m[0, 0][~allowed] == torch.finfo(dtype).min).all()


def test_builder_picks_the_format_of_the_model():
    assert attn_implementation_of(tiny_llama("eager")) == "eager"
    assert attn_implementation_of(tiny_llama("sdpa")) == "sdpa"
    assert attn_implementation_of(torch.nn.Linear(2, 2)) == "eager"  # no config: HF's default
    assert hf_tree_mask(TREE, 2, "eager").dtype == torch.float32
    assert hf_tree_mask(TREE, 2, "sdpa").dtype == torch.bool


def test_mask_errors():
    with pytest.raises(ValueError, match="prefix_len must be >= 0, got -1"):
        tree_bool_mask(TREE, -1)
    with pytest.raises(ValueError, match="prefix_len must be >= 0, got -1"):
        hf_tree_mask(TREE, -1, "eager")
    with pytest.raises(ValueError, match="prefix_len must be >= 0, got -2"):
        position_ids(TREE, -2)
    with pytest.raises(ValueError, match=r"an eager \(additive\) mask needs a floating dtype"):
        hf_tree_mask(TREE, 2, "eager", torch.int32)


# ---------------------------------------------------------------------------- packing
def test_packed_by_hand():
    """Two requests, FlashInfer layout: row-major bits, little bit order, byte-aligned each."""
    a = DraftTree(torch.tensor([5, 6]), torch.tensor([-1, 0]))  # N=2, P=1 -> [2, 3] mask
    b = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]))  # N=3, P=0 -> [3, 3]
    packed, indptr = pack_tree_masks([a, b], [1, 0])
    # a: rows [1 1 0] [1 1 1]       -> bits 1,1,0,1,1,1         -> 0b00111011 = 0x3B
    # b: rows [1 0 0] [1 1 0] [1 0 1] -> bits 1,0,0,1,1,0,1,0 | 1 -> 0b01011001 = 0x59, 0x01
    assert packed.dtype == torch.uint8 and packed.tolist() == [0x3B, 0x59, 0x01]
    assert indptr.dtype == torch.int32 and indptr.tolist() == [0, 1, 3]
    back = unpack_masks(packed, indptr, [2, 3], [3, 3])
    assert back[0].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert back[1].tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]


def test_pack_unpack_round_trip():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    masks = [torch.rand(rng.randint(1, 9), rng.randint(1, 13), generator=g) < 0.5 for _ in range(12)]
    packed, indptr = pack_masks(masks)
    assert indptr.tolist() == list(np.cumsum([0] + [(m.numel() + 7) // 8 for m in masks]))
    back = unpack_masks(packed, indptr, [m.shape[0] for m in masks], [m.shape[1] for m in masks])
    assert all(torch.equal(x, y) for x, y in zip(masks, back))
    trees = [random_tree(rng, rng.randint(1, 20), 50) for _ in range(6)]
    prefixes = [rng.randint(0, 17) for _ in trees]
    packed, indptr = pack_tree_masks(trees, prefixes)
    back = unpack_masks(packed, indptr, [t.num_nodes for t in trees],
                        [t.num_nodes + p for t, p in zip(trees, prefixes)])
    assert all(torch.equal(tree_bool_mask(t, p), m) for t, p, m in zip(trees, prefixes, back))


def test_torch_and_numpy_bit_packing_agree():
    g = torch.Generator().manual_seed(1)
    for m in (1, 7, 8, 9, 64, 1001):
        bits = torch.rand(m, generator=g) < 0.5
        assert torch.equal(_pack_bits(bits), _pack_bits_torch(bits))


def test_pack_errors():
    assert [t.tolist() for t in pack_masks([])] == [[], [0]]
    with pytest.raises(ValueError, match=r"masks\[1\] must be a 2-D bool tensor"):
        pack_masks([torch.ones(2, 2, dtype=torch.bool), torch.ones(2, 2)])
    with pytest.raises(ValueError, match=r"masks\[0\] must be a 2-D bool tensor"):
        pack_masks([torch.ones(4, dtype=torch.bool)])
    with pytest.raises(ValueError, match="got 1 trees but 2 prefix lengths"):
        pack_tree_masks([TREE], [1, 2])
    packed, indptr = pack_tree_masks([TREE], [3])
    with pytest.raises(ValueError, match="describes 1 requests; got 2 qo_lens"):
        unpack_masks(packed, indptr, [7, 1], [10, 1])
    with pytest.raises(ValueError, match=r"request 0: 9 bytes cannot hold a \[7, 11\] mask"):
        unpack_masks(packed, indptr, [7], [11])


# ---------------------------------------------------------------------------- real model
P_LEN = 6
ATOL = 1e-5


def _tree_logits(model, prefix: torch.Tensor, tree: DraftTree, mask: torch.Tensor):
    """[N, V] logits of one forward over the tree after the prefix's cache."""
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prefix[None], use_cache=True, **cache_kwargs(model, cache))
        assert cache.get_seq_length() == prefix.numel()
        out = model(tree.tokens[None], attention_mask=mask,
                    position_ids=position_ids(tree, prefix.numel()), use_cache=True,
                    **cache_kwargs(model, cache))
    return out.logits[0]


def _sequential_logits(model, prefix: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[N, V]: node i's logits from decoding its path token by token after the cached prefix."""
    from transformers import DynamicCache

    out = torch.empty(tree.num_nodes, model.config.vocab_size)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(prefix[None], use_cache=True, **cache_kwargs(model, cache))
        for path in tree.paths:
            c = copy.deepcopy(cache)
            for node in path:
                step = model(tree.tokens[node].view(1, 1), use_cache=True, **cache_kwargs(model, c))
                out[node] = step.logits[0, -1]
    return out


@pytest.fixture(scope="module")
def world():
    rng = random.Random(3)
    trees = [random_tree(rng, n, TINY_VOCAB) for n in (1, 2, 9, 16)]
    trees.append(TREE)
    assert max(t.max_depth for t in trees) >= 3
    prefix = torch.randint(0, TINY_VOCAB, (P_LEN,), generator=torch.Generator().manual_seed(0))
    return trees, prefix


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_tree_pass_equals_sequential_decoding(impl, world):
    trees, prefix = world
    model = tiny_llama(impl)
    for tree in trees:
        mask = hf_tree_mask(tree, P_LEN, attn_implementation_of(model))
        got = _tree_logits(model, prefix, tree, mask)
        want = _sequential_logits(model, prefix, tree)
        err = (got - want).abs().max().item()
        assert err <= ATOL, f"{impl}: node logits differ from sequential decoding by {err:.2e}"


def test_a_bool_mask_is_silently_wrong_under_eager(world):
    """HF's eager attention *adds* the 4-D mask to the scores: a bool mask becomes +1/+0 and
    masks nothing. This is why ``hf_tree_mask`` returns an additive float mask for eager."""
    trees, prefix = world
    model = tiny_llama("eager")
    tree = trees[3]
    want = _sequential_logits(model, prefix, tree)
    wrong = _tree_logits(model, prefix, tree, hf_tree_mask(tree, P_LEN, "sdpa"))
    assert (wrong - want).abs().max().item() > 1e-3
    right = _tree_logits(model, prefix, tree, hf_tree_mask(tree, P_LEN, "eager"))
    assert (right - want).abs().max().item() <= ATOL


def test_tree_forward_args_leave_a_root_alone_to_the_model() -> None:
    """A root alone gets neither positions nor a mask (the model's own decode step); a larger
    tree gets P + depth and the prefix ‖ ancestor mask, in the implementation's mask format."""
    from treespec.core.masks import hf_tree_mask, position_ids, tree_forward_args

    root = DraftTree(torch.tensor([5]), torch.tensor([-1]))
    assert tree_forward_args(root, 4) == (None, None)
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]))
    for impl in ("sdpa", "eager"):
        pos, mask = tree_forward_args(tree, 4, impl)
        assert torch.equal(pos, position_ids(tree, 4)) and torch.equal(mask, hf_tree_mask(tree, 4, impl))
