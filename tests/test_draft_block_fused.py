"""A feature head's decoder block in two compiled calls (``DraftBlock``'s drafting fast path).

Where every linear layer of the block is stored as integer blocks on the vector block kernel and
the row attention kernel runs (AVX-512 F), a drafting call (no autograd, one sequence, a cache
layer, a bool mask) goes through ``draft_block_pre`` / ``draft_block_post`` instead of some forty
PyTorch operations. They compute the block's formulas in float32 in another order (their own
cos / sin, norm and SiLU loops), so the check is against the module path in float64: both within
a few float32 roundings of it, and the cache rows the same as the module's.
"""

from __future__ import annotations

import pytest
import torch

from treespec.drafters.feature import DraftBlock, HeadConfig
from treespec.fastpath.kernels import kernel_isa, panel_status
from treespec.fastpath.packing import pack_linears
from treespec.fastpath.quant import round_linears_to_blocks8
from treespec.fastpath.kvcache import GrowingLayer

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

needs_kernels = pytest.mark.skipif(not panel_status(build=False)[0] or kernel_isa() != "avx512",
                                   reason="the fused block needs the compiled kernels with AVX-512 F")

CFG = HeadConfig(kind="eagle3", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                 rope_theta=10000.0, rms_norm_eps=1e-5, target_layers=(1, 2, 3), draft_vocab=32)


def _block(seed: int = 0) -> DraftBlock:
    """A random block on 8-bit blocks (a head's ``weights="int8"``), its norm weight not all ones."""
    torch.manual_seed(seed)
    block = DraftBlock(CFG, 2 * CFG.hidden_size)
    with torch.no_grad():
        block.mlp_norm.weight.uniform_(0.5, 1.5)
    round_linears_to_blocks8(block)
    report = pack_linears(block, kernel="blocks")
    assert "7 as 8-bit blocks" in report.path, report.path
    return block.eval()


def _inputs(rows: int, cached: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    attn_in = torch.randn(1, rows, 2 * CFG.hidden_size, generator=g)
    residual = torch.randn(1, rows, CFG.hidden_size, generator=g)
    pos = torch.arange(cached, cached + rows)[None] + 7
    keys = torch.randn(1, CFG.num_kv_heads, cached, CFG.head_dim, generator=g)
    values = torch.randn(1, CFG.num_kv_heads, cached, CFG.head_dim, generator=g)
    mask = torch.rand(1, 1, rows, cached + rows, generator=g) < 0.8        # a tree's holes
    mask[..., cached:] = torch.eye(rows, dtype=torch.bool)                 # each row sees itself
    return attn_in, residual, pos, (keys, values), mask


def _float64(block: DraftBlock) -> DraftBlock:
    """The same block on the module path in float64 (stock layers, the rounded weights)."""
    from treespec.fastpath.packing import unpack_linears

    import copy

    exact = copy.deepcopy(block)
    unpack_linears(exact)
    return exact.double()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_fused_block_computes_the_block(rows) -> None:
    block = _block()
    attn_in, residual, pos, past, mask = _inputs(rows, cached=40)
    cache = GrowingLayer()
    cache.update(*past)
    with torch.inference_mode():
        assert block._fused_layers(attn_in, cache, mask) is not None      # the fast path is taken
        fused, (k, v) = block(attn_in, residual, pos, cache, mask)
        module, (k_ref, v_ref) = block(attn_in, residual, pos, past, mask)   # a tuple: the module path
        exact, (k64, v64) = _float64(block)(attn_in.double(), residual.double(), pos,
                                            tuple(t.double() for t in past), mask)
    assert fused.shape == module.shape == (1, rows, CFG.hidden_size)
    scale = exact.abs().max()
    for got in (fused, module):
        assert (got.double() - exact).abs().max() <= 2e-6 * scale        # a few float32 roundings
    assert (k.double() - k64).abs().max() <= 2e-6 * k64.abs().max()
    assert torch.equal(v, v_ref)                                          # no rotation: the same layer output
    assert cache.keys.shape[2] == 40 + rows                               # appended to the cache
    assert torch.equal(cache.keys[:, :, 40:], k) and torch.equal(cache.values[:, :, 40:], v)


@needs_kernels
def test_module_path_serves_training_and_other_callers() -> None:
    block = _block()
    attn_in, residual, pos, past, mask = _inputs(2, cached=8)
    cache = GrowingLayer()
    cache.update(*past)
    with torch.inference_mode():
        assert block._fused_layers(attn_in, past, mask) is None            # (k, v) tuple
        assert block._fused_layers(attn_in, None, mask) is None
        assert block._fused_layers(attn_in, cache, mask.float()) is None   # not a bool mask
        assert block._fused_layers(attn_in.expand(2, -1, -1), cache, mask) is None   # two sequences
    assert block._fused_layers(attn_in, cache, mask) is None               # autograd on: training
    unpacked = DraftBlock(CFG, 2 * CFG.hidden_size).eval()
    with torch.inference_mode():
        assert unpacked._fused_layers(attn_in, cache, mask) is None        # stock layers
