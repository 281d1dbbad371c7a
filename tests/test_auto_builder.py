"""builder="auto": the engine sizes its tree from the cost model and a calibration."""

import pytest

from treespec.cost import Calibration, Curve, model_shape
from treespec.drafters import LookupDrafter
from treespec.engine import SpeculativeGenerator, auto_builder
from treespec.models import tiny_target
from treespec.trees import ChainBuilder, DynamicTreeBuilder


def _calibration(verify, drafter_s: float) -> Calibration:
    ns = (1, 2, 4, 8, 16, 32, 64)
    return Calibration(
        model="toy", shape=model_shape("smollm2-135m", bytes_per_weight=4), context=64,
        target=Curve.fit(ns, [verify(n) for n in ns]),
        drafters={"early_exit": Curve.fit(ns, [drafter_s * n for n in ns])},
        drafter_layers={"early_exit": 2}, device="test",
    )


def test_flat_verify_and_free_drafts_give_a_tree():
    target = tiny_target(vocab_size=16)
    cal = _calibration(lambda n: 1.0, drafter_s=1e-6)      # verify cost flat: trees are free
    builder = auto_builder(target, LookupDrafter(16), cal, acceptance=0.8)
    assert isinstance(builder, DynamicTreeBuilder) and builder.budget > 8


def test_linear_verify_gives_small_or_no_speculation():
    target = tiny_target(vocab_size=16)
    cal = _calibration(lambda n: float(n), drafter_s=0.5)  # every node costs a full pass
    builder = auto_builder(target, LookupDrafter(16), cal, acceptance=0.1)
    assert builder.budget <= 2
    assert isinstance(builder, (ChainBuilder, DynamicTreeBuilder))


def test_auto_builder_runs_in_the_engine(tmp_path, monkeypatch):
    target = tiny_target(vocab_size=16)
    cal = _calibration(lambda n: max(1.0, n / 8), drafter_s=0.01)
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="treespec calibrate"):
        SpeculativeGenerator(target, LookupDrafter(16), "auto")
    from treespec.cost import default_calibration_path
    cal.save(default_calibration_path(target.name))
    gen = SpeculativeGenerator(target, LookupDrafter(16), "auto")
    assert gen.generate([1, 2, 3], max_new_tokens=5).token_ids.numel() <= 5
    with pytest.raises(ValueError, match="'auto'"):
        SpeculativeGenerator(target, LookupDrafter(16), "big")
