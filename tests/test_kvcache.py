"""The in-place KV cache (``treespec.fastpath.kvcache``): the same numbers as HF's own cache.

A forward over ``growing_cache`` must give bit for bit the logits of the same forward over HF's
``DynamicCache``, through a prefill, decode steps, tree passes with masks, crops and in-place
compaction, across buffer growth; tensors that something else put into a layer are adopted.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from treespec.core.masks import hf_tree_mask, position_ids
from treespec.fastpath.attention import use_grouped_attention
from treespec.fastpath.kvcache import GrowingLayer, growing_cache, keep_rows

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_fastpath import random_tree, small_llama


def _step(model, cache, ids, tree=None):
    """Logits of one forward over ``cache``: plain rows, or ``tree`` after the cached prefix."""
    with torch.inference_mode():
        if tree is None:
            return model(input_ids=ids[None], cache=cache, use_cache=True).logits[0]
        p = cache.get_seq_length()
        return model(input_ids=tree.tokens[None], position_ids=position_ids(tree, p),
                     attention_mask=hf_tree_mask(tree, p, model.config._attn_implementation),
                     cache=cache, use_cache=True).logits[0]


def _compact(cache, prefix: int, keep: list[int]) -> None:
    """Keep tree rows ``keep`` after ``prefix`` cached rows, as TreeVerifier.compact does."""
    idx = torch.tensor(keep) + prefix
    with torch.inference_mode():
        _compact_layers(cache, prefix, keep, idx)


def _compact_layers(cache, prefix: int, keep: list[int], idx: torch.Tensor) -> None:
    for layer in cache.layers:
        total = layer.keys.shape[-2]
        layer.keys[..., prefix:prefix + len(keep), :] = layer.keys.index_select(-2, idx)
        layer.values[..., prefix:prefix + len(keep), :] = layer.values.index_select(-2, idx)
        layer.crop(-(total - prefix - len(keep)))


def test_growing_cache_gives_hf_caches_logits_bit_for_bit() -> None:
    rng = random.Random(0)
    for grouped in (False, True):
        model = small_llama(seed=4)
        if grouped:
            assert use_grouped_attention(model)[0]
        caches = [DynamicCache(config=model.config), growing_cache(model.config)]
        assert all(type(layer) is GrowingLayer for layer in caches[1].layers)
        ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))
        outs = [_step(model, c, ids) for c in caches]
        assert torch.equal(*outs)
        for step in range(30):   # past the first 64 positions: the buffer grows twice
            if step % 3 == 0:
                tree = random_tree(rng, rng.randint(2, 9), 300)
                prefix = caches[0].get_seq_length()
                outs = [_step(model, c, None, tree) for c in caches]
                keep = [0] + [i for i in range(1, tree.num_nodes) if rng.random() < 0.5 and
                              int(tree.parents[i]) == 0][:1]
                for c in caches:
                    _compact(c, prefix, keep)
            else:
                tok = torch.randint(0, 300, (rng.randint(1, 3),), generator=torch.Generator().manual_seed(step))
                outs = [_step(model, c, tok) for c in caches]
            assert torch.equal(*outs), f"step {step} (grouped attention: {grouped})"
            assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                       for a, b in zip(*(c.layers for c in caches)))
        assert caches[1].layers[0]._key_buf.shape[-2] >= 128      # it grew past its first 64


def test_growing_layer_crops_grows_and_adopts_tensors_put_into_it() -> None:
    layer = GrowingLayer()
    k = torch.randn(2, 3, 5, 8)
    v = torch.randn(2, 3, 5, 8)
    keys, values = layer.update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v) and layer.get_seq_length() == 5
    layer.crop(-2)
    assert torch.equal(layer.keys, k[..., :3, :]) and layer.get_seq_length() == 3
    assert layer.keys.data_ptr() == layer._key_buf.data_ptr()   # a view of the buffer, as HF's crop slices
    with pytest.raises(ValueError, match="positive value"):
        layer.crop(2)                                            # HF's refusal stands
    layer.crop(0)
    assert layer.get_seq_length() == 3
    new = torch.randn(2, 100, 3, 8).transpose(1, 2)   # a strided view, as attention gives; past the first capacity
    assert not new.is_contiguous()
    keys, _ = layer.update(new, new)
    assert torch.equal(keys, torch.cat([k[..., :3, :], new], dim=-2)) and layer._key_buf.shape[-2] >= 103
    layer.batch_repeat_interleave(2)                 # the base class replaces the tensors ...
    keys, _ = layer.update(k[..., :1, :].repeat(2, 1, 1, 1), v[..., :1, :].repeat(2, 1, 1, 1))
    assert keys.shape == (4, 3, 104, 8)              # ... and the next update adopts them
    assert torch.equal(keys[:, :, :103], torch.cat([k[..., :3, :], new], dim=-2).repeat_interleave(2, dim=0))
    layer.reset()
    assert layer.get_seq_length() == 0
    keys, _ = layer.update(k, v)
    assert torch.equal(keys, k)


def test_sliding_window_layers_are_left_as_hf_builds_them() -> None:
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    cache = growing_cache(MistralForCausalLM(config).config)
    kinds = {type(layer) for layer in cache.layers}
    assert kinds <= {GrowingLayer, DynamicSlidingWindowLayer} and DynamicLayer not in kinds


@pytest.mark.parametrize("layer_kind", [GrowingLayer, DynamicLayer])
def test_keep_rows_compacts_an_increasing_path_and_refuses_anything_else(layer_kind) -> None:
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 2, 9, 4, generator=gen), torch.randn(1, 2, 9, 4, generator=gen)
    cache = DynamicCache()
    cache.layers = [layer_kind(), layer_kind(), layer_kind()]   # the last one never written: left alone
    for layer in cache.layers[:2]:
        layer.update(keys.clone(), values.clone())
    rows = [3, 4, 6, 8]                                  # 3 and 4 stay, 6 -> 5, 8 -> 6
    keep_rows(cache, 3, rows)
    want = [*range(3), *rows]
    for layer in cache.layers[:2]:
        assert torch.equal(layer.keys, keys[..., want, :]) and torch.equal(layer.values, values[..., want, :])
    before = [layer.keys.clone() for layer in cache.layers[:2]]
    for bad in ([2, 4], [4, 4], [5, 4], [3, 5, 5]):
        with pytest.raises(ValueError, match="must increase"):
            keep_rows(cache, 3, bad)
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, cache.layers))
    keep_rows(cache, 3, [])                               # nothing kept after the prefix
    assert all(layer.keys.shape[-2] == 3 for layer in cache.layers[:2])
