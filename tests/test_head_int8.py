"""8-bit feature heads (``weights="int8"``, and ``"auto"`` on a target stored as integer blocks).

The rounding must land exactly on weights that 8-bit blocks hold (so the block kernel stores
them, a quarter of the bytes), stay within half a scale step of the trained weights, touch the
head only (never the target it shares modules with), and the drafter must compute exactly what
the same head with those rounded weights in fp32 panels computes. The output stays the target's:
greedy speculative decoding equals plain decoding token for token.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import treespec.drafters.feature as feature
from treespec import SpeculativeGenerator, Target
from treespec.builders import DynamicTreeBuilder
from treespec.drafters import load_drafter
from treespec.drafters.checkpoint import read_header, save_checkpoint
from treespec.fastpath.kernels import BLOCK, pack_blocks, panel_status, round_to_blocks8
from treespec.fastpath.packing import PackedLinear, pack_linears, stores_blocks
from treespec.fastpath.quant import round_linears_to_blocks8

from _engine_helpers import hf_greedy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from test_blocks import quantized_llama
from test_fastpath import small_llama

needs_panel = pytest.mark.skipif(not panel_status(build=False)[0], reason=panel_status(build=False)[1])


def test_round_to_blocks8_lands_on_8_bit_blocks_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 96)      # blocks of very different ranges
    w[3, :32] = 0.0                                          # an all-zero block stays zero
    r = round_to_blocks8(w)
    assert r.shape == w.shape and r.dtype == torch.float32 and r is not w
    assert pack_blocks(r).bits == 8                          # exactly what 8-bit blocks hold
    assert torch.equal(round_to_blocks8(r), r)               # a fixed point: nothing left to round
    assert torch.equal(r[3, :32], torch.zeros(32))
    step = (w.reshape(40, 3, BLOCK).abs().amax(-1, keepdim=True) / 127).half().float()
    err = (w - r).reshape(40, 3, BLOCK).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all())
    assert not torch.equal(r, w)                             # it does round


def test_round_to_blocks8_refuses_what_blocks_cannot_hold() -> None:
    with pytest.raises(ValueError, match="2-D float32"):
        round_to_blocks8(torch.randn(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D float32"):
        round_to_blocks8(torch.randn(64))
    with pytest.raises(ValueError, match="multiple of 32"):
        round_to_blocks8(torch.randn(4, 40))
    bad = torch.randn(4, 64)
    bad[1, 5] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        round_to_blocks8(bad)
    with pytest.raises(ValueError, match="overflows fp16"):
        round_to_blocks8(torch.full((2, 32), 1e8))


def test_round_linears_to_blocks8_rounds_in_place_and_names_what_it_left() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 40))   # in_features 48: no blocks
    before = [m.weight.detach().clone() for m in model]
    count, skipped = round_linears_to_blocks8(model)
    assert count == 1 and skipped == ("1 (in_features 48 not a multiple of 32)",)
    assert torch.equal(model[0].weight, round_to_blocks8(before[0]))
    assert torch.equal(model[1].weight, before[1])
    with pytest.raises(ValueError, match="fp32 CPU block kernel"):
        round_linears_to_blocks8(nn.Linear(64, 8).to(torch.bfloat16))
    mixed = nn.Sequential(nn.Linear(64, 8), nn.Linear(64, 8).to(torch.bfloat16))
    first = mixed[0].weight.detach().clone()
    with pytest.raises(ValueError, match="1 is torch.bfloat16"):
        round_linears_to_blocks8(mixed)
    assert torch.equal(mixed[0].weight, first)          # nothing was changed before the refusal
    with pytest.raises(TypeError, match="nn.Module"):
        round_linears_to_blocks8("not a module")


def _blocks_target() -> Target:
    """A tiny fp32 target stored as integer blocks (Q4_1 layers, a Q8_0 LM head), as SmolLM2's GGUF is."""
    model = quantized_llama(seed=3)
    pack_linears(model, kernel="blocks")
    return Target.from_hf(model, None, name="tiny-blocks", pack=False)


@pytest.fixture
def shipped_head(tmp_path, monkeypatch):
    """Ship a random eagle3 head for any target (what ``load_drafter("eagle3", target)`` loads);
    returns ``ship(target) -> checksum``."""
    monkeypatch.setattr(feature, "shipped_checkpoint", lambda target, name: tmp_path / f"{name}.safetensors")

    def ship(target) -> str:
        head = feature.random_feature_drafter(target, "eagle3", seed=1, draft_vocab=64).head
        path = tmp_path / "eagle3.safetensors"
        save_checkpoint(path, dict(head.state_dict()), "eagle3", head.cfg.to_json(), target)
        return read_header(path)["checksum"]

    return ship


def _storage(drafter) -> set[str]:
    return {m.storage for m in drafter.head.modules() if isinstance(m, PackedLinear)}


@needs_panel
def test_auto_gives_a_blocks_target_an_8_bit_head_and_leaves_the_target_alone(shipped_head) -> None:
    target = _blocks_target()
    assert stores_blocks(target.model)
    checksum = shipped_head(target)
    state = {k: v.clone() for k, v in target.model.state_dict().items()}
    auto = load_drafter("eagle3", target)
    assert auto.head_weights == "int8" and _storage(auto) == {"8-bit blocks"}
    assert auto.weights_checksum == checksum + "+int8" == feature.shipped_checksum(target, "eagle3")
    trained = load_drafter("eagle3", target, weights="trained")
    assert trained.head_weights == "trained" and _storage(trained) == {"fp32 panels"}
    assert trained.weights_checksum == checksum == feature.shipped_checksum(target, "eagle3", {"weights": "trained"})
    assert load_drafter("eagle3[weights=int8]", target).registry_name == "eagle3[weights=int8]"
    after = target.model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)       # the shared trunk is untouched


@needs_panel
def test_the_8_bit_head_computes_exactly_the_rounded_head(shipped_head) -> None:
    """Draft distributions of the 8-bit drafter equal, bit for bit, those of the trained head whose
    weights were rounded by hand and kept in fp32 panels: the block kernel reads the same numbers."""
    target = _blocks_target()
    shipped_head(target)
    int8 = load_drafter("eagle3", target, weights="int8")
    by_hand = load_drafter("eagle3", target, weights="trained")
    with torch.no_grad():
        for layer in by_hand.head.modules():
            if isinstance(layer, PackedLinear):
                layer.weight.copy_(round_to_blocks8(layer.weight))
                layer.kernel = "panel"                  # the rounded weights, read as fp32 panels
                layer._pack()
    assert _storage(int8) == {"8-bit blocks"} and _storage(by_hand) == {"fp32 panels"}
    gens = [SpeculativeGenerator(target, d, DynamicTreeBuilder(budget=8, depth=3, top_k=3)) for d in (int8, by_hand)]
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(0))
    outs = [g.generate(ids, 24, temperature=1.0, seed=5) for g in gens]
    assert torch.equal(outs[0].token_ids, outs[1].token_ids)
    assert outs[0].stats.tree_nodes == outs[1].stats.tree_nodes


@needs_panel
def test_greedy_output_with_an_8_bit_head_equals_plain_decoding(shipped_head) -> None:
    target = _blocks_target()
    shipped_head(target)
    drafter = load_drafter("eagle3", target)
    assert drafter.head_weights == "int8"
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=8, depth=3, top_k=3))
    for seed in range(3):
        ids = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(seed))
        out = gen.generate(ids, 32, temperature=0.0)
        assert out.token_ids.tolist() == hf_greedy(target.model, ids, target.eos_token_ids, 32)


def test_weights_option_errors_name_the_fix(shipped_head) -> None:
    plain = Target.from_hf(small_llama(seed=2), None, name="tiny-fp32", pack=False)   # stock layers, no blocks
    shipped_head(plain)
    assert not stores_blocks(plain.model)
    assert load_drafter("eagle3", plain).head_weights == "trained"       # auto: nothing to match
    with pytest.raises(ValueError, match="weights='int8'.*runs its linear layers on 'stock'.*weights='trained'"):
        load_drafter("eagle3", plain, weights="int8")
    with pytest.raises(ValueError, match="weights must be one of"):
        load_drafter("eagle3", plain, weights="int4")


@needs_panel
def test_export_refuses_a_rounded_head(shipped_head, tmp_path) -> None:
    """An export carries the trained numbers to another stack; the 8-bit rounding is treespec's
    CPU layout, so a rounded head is refused with the load that exports it."""
    from treespec.export import export_eagle3

    target = _blocks_target()
    shipped_head(target)
    with pytest.raises(ValueError, match="weights='trained'"):
        export_eagle3(target, load_drafter("eagle3", target), tmp_path / "out")
