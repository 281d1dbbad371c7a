"""Bring your own model: Target.from_hf packs where the fast path applies (token-identical at
fp32), and a shipped head's errors on a foreign target say how to train one into a folder of
one's own; a damaged checkpoint outside the repository is not told to `git checkout`."""

from __future__ import annotations

import pytest
import torch

from treespec import DynamicTreeBuilder, SpeculativeGenerator, Target
from treespec.drafters import load_drafter
from treespec.drafters.checkpoint import CheckpointError
from treespec.fastpath.packing import linear_kernel
from treespec.targets.loader import tiny_llama
from treespec.testing import plain_greedy

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)


def test_from_hf_packs_by_default_and_stays_token_identical():
    packed = Target.from_hf(tiny_llama(vocab_size=32, seed=0), None, name="mine")
    stock = Target.from_hf(tiny_llama(vocab_size=32, seed=0), None, name="mine", pack=False)
    assert "linear layers:" in packed.speed_path and stock.speed_path == "stock"
    assert linear_kernel(stock.model) == "stock"
    ids = torch.tensor([3, 9, 4, 1])
    for target in (packed, stock):
        target.model.generation_config.eos_token_id = None
    want = plain_greedy(stock, ids, 12)
    out = SpeculativeGenerator(packed, "early-exit", DynamicTreeBuilder(budget=6, depth=3, top_k=2)).generate(
        ids, max_new_tokens=12)
    assert out.token_ids.tolist() == want
    with pytest.raises(TypeError, match="pack must be True, False"):
        Target.from_hf(tiny_llama(vocab_size=32, seed=0), None, pack=1)


def test_a_shipped_head_on_a_foreign_target_says_how_to_train_one_elsewhere():
    target = Target.from_hf(tiny_llama(vocab_size=32, seed=0), None, name="my-model", pack=False)
    with pytest.raises(FileNotFoundError, match=r"no eagle3 checkpoint at .*; train one into a folder of your choice "
                                                r"with `treespec train eagle3 --out DIR`.*checkpoint='DIR/eagle3.safetensors'"):
        load_drafter("eagle3", target)


def test_a_damaged_checkpoint_outside_the_repository_is_not_told_to_git_checkout(tmp_path):
    target = Target.from_hf(tiny_llama(vocab_size=32, seed=0), None, name="my-model", pack=False)
    bad = tmp_path / "eagle3.safetensors"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=str(bad)) as err:
        load_drafter("eagle3", target, checkpoint=str(bad))
    assert "git checkout" not in str(err.value) and f"treespec train eagle3 --out {tmp_path}" in str(err.value)
