"""Cost model: measurement, calibration files, the calibrated cost, auto budget and the CLI."""

from __future__ import annotations

import json

import pytest

from treespec.planning import CalibratedCost, Calibration, Curve, auto_budget, auto_min_gain, best_tree, default_calibration_path, model_shape
from treespec.calibrate.passes import measure, measure_interleaved
from treespec.cli.plan import main


def _flat_then_linear(n: int) -> float:
    """A synthetic CPU-like verify curve: 1 s up to 8 tokens, then n / 8 s."""
    return max(1.0, n / 8)


def _calibration(drafter_s: float = 0.01) -> Calibration:
    ns = (1, 2, 4, 8, 16, 32, 64)
    return Calibration(
        model="toy",
        shape=model_shape("smollm2-135m", bytes_per_weight=4),
        context=64,
        target=Curve.fit(ns, [_flat_then_linear(n) for n in ns]),
        drafters={"early_exit": Curve.fit(ns, [drafter_s * n for n in ns])},
        drafter_layers={"early_exit": 2},
        device="test",
    )


def test_measure_calls_warmup_plus_reps_and_takes_the_median():
    calls = []
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # durations 1, 3, 2 -> median 2
    assert measure(lambda: calls.append(1), n_warmup=2, n_rep=3, clock=lambda: next(ticks)) == 2.0
    assert len(calls) == 5
    assert measure(lambda: None, n_warmup=0, n_rep=1) >= 0.0  # the wall clock by default
    with pytest.raises(ValueError, match="n_rep must be an int >= 1"):
        measure(lambda: None, n_rep=0)
    with pytest.raises(ValueError, match="n_warmup must be an int >= 0"):
        measure(lambda: None, n_warmup=-1)


def test_measure_interleaved_times_round_robin():
    order = []
    ticks = iter(range(100))
    fns = [lambda: order.append("a"), lambda: order.append("b")]
    assert measure_interleaved(fns, n_warmup=1, n_rep=2, clock=lambda: next(ticks)) == [1, 1]
    assert order == ["a", "b", "a", "b", "a", "b"]


def test_time_interleaved_keeps_every_timing_in_rep_order():
    from treespec.calibrate.passes import time_interleaved

    ticks = iter([0, 1, 1, 3, 3, 4, 4, 7])   # a: 1 then 1, b: 2 then 3
    fns = [lambda: None, lambda: None]
    assert time_interleaved(fns, n_warmup=0, n_rep=2, clock=lambda: next(ticks)) == [[1, 1], [2, 3]]


def test_relative_spread_is_the_interquartile_range_over_the_median():
    from treespec.planning.calibration import relative_spread

    assert relative_spread([3.0, 1.0, 5.0, 2.0, 4.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    assert relative_spread([2.0] * 4) == 0.0
    with pytest.raises(ValueError, match="at least 4 timings"):
        relative_spread([1.0, 2.0, 3.0])


def test_a_curve_keeps_the_spread_of_its_timings(tmp_path):
    import dataclasses

    curve = Curve.from_timings([1, 2], [[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 2.0, 2.0, 2.0]])
    assert curve.seconds == (3.0, 2.0) and curve.spread == pytest.approx((2.0 / 3.0, 0.0))
    assert Curve.from_timings([1, 2], [[1.0, 2.0, 3.0], [2.0] * 5]).spread is None   # too few at n = 1
    assert Curve.from_json(curve.to_json()) == curve
    assert "spread" not in Curve.fit([1], [1.0]).to_json()
    with pytest.raises(ValueError, match="one spread per n"):
        Curve.fit([1, 2], [1.0, 2.0], spread=[0.1])
    with pytest.raises(ValueError, match="finite and >= 0"):
        Curve.fit([1], [1.0], spread=[-0.1])
    # the calibration's noise: the median spread of its target curve; saved and loaded
    cal = _calibration()
    assert cal.timing_noise is None
    spread = (0.02, 0.05, 0.20, 0.03, 0.04, 0.30, 0.01)
    noisy = dataclasses.replace(cal, target=Curve.fit(cal.target.ns, cal.target.seconds, spread))
    assert noisy.timing_noise == pytest.approx(0.04)
    assert Calibration.load(noisy.save(tmp_path / "c.json")) == noisy


def test_auto_needs_a_larger_predicted_gain_on_a_noisy_machine():
    import dataclasses
    import math

    def with_noise(noise: float) -> Calibration:
        cal = _calibration()
        return dataclasses.replace(cal, target=Curve.fit(cal.target.ns, cal.target.seconds,
                                                         [noise] * len(cal.target.ns)))

    assert auto_min_gain(_calibration()) == 1.05          # no spreads recorded: the quiet default
    assert auto_min_gain(with_noise(0.01)) == 1.05        # a quiet machine: the default holds
    # 12 % spread: σ = 0.12 / 1.349 per pass, √2 σ for a ratio of two, two of those
    assert auto_min_gain(with_noise(0.12)) == pytest.approx(1 + 2 * math.sqrt(2) * 0.12 / 1.349)
    # one free draft accepted 15 % of the time on a flat curve: a 15 % predicted gain
    quiet = auto_budget(with_noise(0.01), (0.15,), "lookup")
    assert quiet.drafts > 0 and 1.05 < quiet.speedup < 1.2
    assert auto_budget(with_noise(0.12), (0.15,), "lookup").drafts == 0      # inside the noise
    assert auto_budget(with_noise(0.12), (0.15,), "lookup", min_gain=1.05).drafts > 0   # asked for
    assert auto_budget(with_noise(0.12), (0.5,), "lookup").drafts == 7       # a clear gain holds
    from treespec.planning import auto_threshold_text

    assert auto_threshold_text(with_noise(0.12)) == ("speculates where the cost model predicts at least "
                                                     "1.25x (timing spread 12.0% per pass on this machine)")
    assert auto_threshold_text(_calibration()) == "speculates where the cost model predicts at least 1.05x"


def test_curve_follows_the_measurement():
    curve = Curve.fit([1, 2, 4, 8], [1.0, 3.0, 2.0, 6.0])
    assert curve.seconds == (1.0, 3.0, 2.0, 6.0)  # the 3, 2 dip is kept: CPUs have such dips
    assert curve(1) == 1.0 and curve(0.5) == 1.0  # flat below the first point
    assert curve(1.5) == pytest.approx(2.0)
    assert curve(3) == pytest.approx(2.5)
    assert curve(6) == pytest.approx(4.0)
    assert curve(12) == pytest.approx(6.0 + 4 * 4.0 / 4)  # last segment's slope
    assert Curve.fit([1, 2], [2.0, 1.0])(10) == 1.0  # never decreasing past the last point
    with pytest.raises(ValueError, match="strictly increasing"):
        Curve.fit([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match="measured seconds must be > 0"):
        Curve.fit([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="need one time per n"):
        Curve.fit([1, 2], [1.0])


def test_calibration_round_trip_and_default_path(tmp_path, monkeypatch):
    cal = _calibration()
    path = cal.save(tmp_path / "sub" / "cal.json")
    assert Calibration.load(path) == cal
    assert json.loads(path.read_text())["target"]["ns"] == [1, 2, 4, 8, 16, 32, 64]
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    assert default_calibration_path("smollm2-135m") == tmp_path / "calibration-smollm2-135m.json"
    monkeypatch.delenv("TREESPEC_CACHE")
    assert default_calibration_path("m").name == "calibration-m.json"
    assert default_calibration_path("m").parent.name == "treespec"
    assert default_calibration_path("m", "bfloat16").name == "calibration-m-bfloat16.json"
    import torch

    assert default_calibration_path("m", torch.bfloat16).name == "calibration-m-bfloat16.json"
    assert default_calibration_path("m", torch.float32).name == "calibration-m.json"
    # the panel and block kernels' AVX-512 code has its own curve; AVX2 files keep their names
    assert default_calibration_path("m", "float32", "blocks", isa="avx512").name == "calibration-m-blocks-avx512.json"
    assert default_calibration_path("m", "float32", "panel", isa="avx512").name == "calibration-m-panel-avx512.json"
    # compiled passes: their own curve, named last
    assert (default_calibration_path("m", "float32", "x8", "treespec_row_attention", compiled=True).name
            == "calibration-m-x8-rows-compiled.json")
    # each thread count its own file; one thread keeps the plain name
    assert default_calibration_path("m", threads=2).name == "calibration-m-2threads.json"
    assert default_calibration_path("m", "float32", "x8", compiled=True, threads=2).name == "calibration-m-x8-compiled-2threads.json"
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        default_calibration_path("m", threads=0)
    from treespec.planning import model_calibration_path
    from treespec.targets.loader import tiny_llama

    model, before = tiny_llama(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert model_calibration_path("m", model).name == "calibration-m-2threads.json"
        assert model_calibration_path("m", model, threads=1).name == "calibration-m.json"
    finally:
        torch.set_num_threads(before)
    assert default_calibration_path("m", "float32", "blocks", isa="avx2").name == "calibration-m-blocks.json"
    assert default_calibration_path("m", "float32", "onednn", isa="avx512").name == "calibration-m-packed.json"
    with pytest.raises(ValueError, match="isa must be"):
        default_calibration_path("m", "float32", "blocks", isa="sse2")
    with pytest.raises(FileNotFoundError, match="run `treespec calibrate"):
        Calibration.load(tmp_path / "missing.json")
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"version": 0}))
    with pytest.raises(ValueError, match="calibration version 0"):
        Calibration.load(bad)


def test_calibrated_cost_follows_the_measurement():
    cal = _calibration()
    cost = CalibratedCost(cal, "early_exit")
    for n in (1, 3, 8, 24, 64):
        assert cost.verify_s(n, 1, cal.context) == pytest.approx(_flat_then_linear(n))
    assert cost.verify_s(4, 4, 0) == pytest.approx(cal.target(16))  # a batch is one pass of B·n tokens
    assert cost.verify_s(1, 1, 10 * cal.context) > cost.verify_s(1, 1, cal.context)  # more KV to read
    assert cost.draft_s([1, 2, 4], 1, cal.context) == pytest.approx(0.01 * 7)
    assert CalibratedCost(cal, "lookup").draft_s([1, 2], 1, 0) == 0.0
    with pytest.raises(KeyError, match=r"no 'eagle' drafter; measured: \['early_exit'\]"):
        CalibratedCost(cal, "eagle")
    scaled = CalibratedCost.for_model(cal, "early_exit", model_shape("llama-3-8b", bytes_per_weight=4))
    assert scaled.scale == pytest.approx(model_shape("llama-3-8b").matmul_params / cal.shape.matmul_params)


def test_auto_budget_by_hand():
    # Free drafting on a verify curve flat up to 8 tokens, then linear; chain-only acceptance
    # 0.5: τ(b) = 2 − 0.5^b rises while t(b + 1) stays 1 s up to b = 7, after which the time
    # grows faster (9/8 at b = 8) than τ (1.996 / 1.992). Best: a chain of 7 drafts (budget 8).
    choice = auto_budget(_calibration(), (0.5,), "lookup")
    assert (choice.drafts, choice.depth) == (7, 7)
    assert choice.tau == pytest.approx(2 - 0.5**7) and choice.tokens_per_s == pytest.approx(choice.tau)
    assert choice.speedup == pytest.approx(choice.tau)
    # A costly drafter shortens it.
    slow = auto_budget(_calibration(drafter_s=0.2), (0.5,), "early_exit")
    assert 0 < slow.drafts < 7
    # best_tree accepts a calibration as the hardware.
    assert best_tree("smollm2-135m", "lookup", _calibration(), context=64, acceptance=(0.5,)).drafts == 7


def test_calibrate_a_tiny_model():
    from treespec.calibrate.passes import calibrate
    from treespec.targets.loader import tiny_llama

    cal = calibrate(tiny_llama(num_layers=2), "tiny", ns=(1, 3), context=5, early_exit_layers=1,
                    n_warmup=0, n_rep=1)
    assert cal.target.ns == (1, 3) and all(t > 0 for t in cal.target.seconds)
    assert set(cal.drafters) == {"early_exit", "eagle"} and cal.drafter_layers["early_exit"] == 1
    assert cal.shape.bytes_per_weight == 4 and cal.shape.layers == 2 and cal.context == 5
    assert cal.clock == "perf_counter" and cal.threads >= 1
    assert cal.target.spread is None and cal.timing_noise is None    # one rep: no spread
    spread = calibrate(tiny_llama(num_layers=2), "tiny", ns=(1, 3), context=5, early_exit_layers=1,
                       n_warmup=0, n_rep=4)
    assert len(spread.target.spread) == 2 and spread.timing_noise >= 0.0
    with pytest.raises(ValueError, match=r"early_exit_layers must be in \[1, 2\]"):
        calibrate(tiny_llama(num_layers=2), "tiny", ns=(1,), early_exit_layers=3)


def test_the_early_exit_copy_runs_on_the_targets_linear_kernel():
    """The generic drafter curves time a copy of the target's first layers: packed as the
    target is (a stock copy of a packed target timed PyTorch's GEMM, whose 4-14-row passes of
    SmolLM2 cost more than its 16-row ones)."""
    from treespec.calibrate.passes import _truncated_model
    from treespec.fastpath.kernels import panel_status
    from treespec.fastpath.packing import linear_kernel, pack_linears
    from treespec.targets.loader import tiny_llama

    model = tiny_llama(num_layers=2)
    assert linear_kernel(_truncated_model(model, 1)) == "stock"
    ok, why = panel_status(build=False)
    if not ok:
        pytest.skip(why)
    pack_linears(model, kernel="panel")
    draft = _truncated_model(model, 1)
    assert linear_kernel(draft) == "panel" and len(draft.model.layers) == 1


def test_cli_plan_prints_a_table_and_writes_a_plot(tmp_path, capsys):
    cal_path = _calibration().save(tmp_path / "cal.json")
    plot = tmp_path / "plan.png"
    assert main(["plan", "--model", "smollm2-135m", "--hardware", "h100,mi300x,local", "--batch", "1,8",
                 "--context", "64", "--calibration", str(cal_path), "--drafter", "early_exit",
                 "--max-budget", "32", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["h100"], ["mi300x"], ["local"])]
    assert [(r[0], r[1]) for r in rows] == [("h100", "1"), ("h100", "8"), ("mi300x", "1"), ("mi300x", "8"),
                                          ("local", "1"), ("local", "8")]
    assert plot.stat().st_size > 1000


def test_cli_errors(capsys):
    assert main(["plan", "--hardware", "h100,tpu", "--plot", "none"]) == 2
    assert "unknown hardware 'tpu'" in capsys.readouterr().err
    assert main(["plan", "--model", "gpt-5", "--plot", "none"]) == 2
    assert "unknown model 'gpt-5'" in capsys.readouterr().err
    assert main(["plan", "--drafter", "model", "--plot", "none"]) == 2
    assert "needs --draft-model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--acceptance", "1.5"])
    assert "must be in [0, 1], got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--batch", "0,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["plan", "--batch", "0", "--plot", "none"]) == 2
    assert "batch must be an int >= 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrate_smollm2(tmp_path):
    """The real target, a few points: the CPU verify curve is increasing and far from flat."""
    from treespec.calibrate.passes import calibrate
    from treespec.targets.loader import load_target

    cal = calibrate(load_target("smollm2-135m").model, "smollm2-135m", ns=(1, 8, 64), context=32,
                    n_warmup=1, n_rep=3)
    assert cal.target(64) > 2 * cal.target(1)
    assert Calibration.load(cal.save(tmp_path / "c.json")) == cal


@pytest.mark.slow
def test_cli_calibrate_with_a_real_drafter(tmp_path, capsys):
    """`treespec calibrate --drafter`: the drafter's own curve and acceptance land in the file."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--drafter", "lookup", "--max-n", "4", "--reps", "1", "--warmup", "0",
                 "--threads", "1", "--out", str(out)]) == 0
    cal = Calibration.load(out)
    assert "lookup" in cal.drafters and len(cal.acceptance["lookup"]) == 8
    assert 0.0 <= sum(cal.acceptance["lookup"]) <= 1.0
    assert "lookup acceptance:" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_calibrate_compile_times_the_buckets_into_the_compiled_file(tmp_path, monkeypatch, capsys):
    """`treespec calibrate --compile`: the target curve of the compiled graphs (buckets 1, 2 and
    4 for --max-n 3: n = 3 runs in the 4-node graph), written as steps to ``...-compiled.json``."""
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    assert main(["calibrate", "--compile", "--max-n", "3", "--reps", "2", "--warmup", "0", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    saved = [line.split()[-1] for line in out.splitlines() if line.startswith("saved ")]
    assert saved and saved[0].endswith("-compiled.json"), out
    cal = Calibration.load(saved[0])
    assert cal.target.ns == (1, 2, 3, 4) and cal.target(3) == cal.target(4) and "target (compiled)" in out


def test_batched_curves_are_read_where_measured_and_interpolated_between():
    import dataclasses

    cal = _calibration()
    ns = (1, 2, 4, 8)
    batched = dataclasses.replace(cal, batch_target={4: Curve.fit(ns, [2.0, 2.5, 3.0, 4.0]),
                                                     8: Curve.fit(ns, [3.0, 4.0, 5.0, 8.0])})
    cost = CalibratedCost(batched, "early_exit")
    assert cost.verify_s(2, 4, cal.context) == pytest.approx(2.5)              # measured B
    assert cost.verify_s(2, 1, cal.context) == pytest.approx(cal.target(2))    # B = 1: the target curve
    assert cost.verify_s(2, 6, cal.context) == pytest.approx(3.25)             # halfway between 4 and 8
    assert cost.verify_s(1, 2, cal.context) == pytest.approx(1.0 + (2.0 - 1.0) / 3)   # between 1 and 4
    assert cost.verify_s(4, 12, cal.context) == pytest.approx(5.0 + 2.0)       # past 8: the 4 -> 8 slope
    # longer contexts add the extra KV of every request
    assert cost.verify_s(2, 4, cal.context + 100) > cost.verify_s(2, 4, cal.context)
    # without batched curves a batch is one pass of B·n tokens (the old approximation)
    assert CalibratedCost(cal, "early_exit").verify_s(2, 4, 0) == pytest.approx(cal.target(8))
    assert batched.target_batch_s(2, 4) == pytest.approx(2.5) and cal.target_batch_s(2, 4) is None


def test_acceptance_is_read_at_the_nearest_measured_temperature(tmp_path):
    import dataclasses

    from treespec.planning import acceptance_key

    assert acceptance_key("eagle3", 0.0) == "eagle3" and acceptance_key("eagle3", 1.0) == "eagle3@T1"
    assert acceptance_key("eagle3", 0.7) == "eagle3@T0.7"
    assert acceptance_key("eagle3", 1.0, "without_replacement") == "eagle3@T1/without_replacement"
    assert acceptance_key("eagle3", 0.0, "without_replacement") == "eagle3"    # greedy: one mode
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        acceptance_key("eagle3", -1.0)
    with pytest.raises(ValueError, match="mode must be 'deterministic'"):
        acceptance_key("eagle3", 1.0, "sampled")
    cal = dataclasses.replace(_calibration(), acceptance={"eagle3": (0.6, 0.1), "eagle3@T1": (0.4, 0.1),
                                                          "eagle3x@T1": (0.9,), "eagle": (0.5,)},
                              batch_target={2: Curve.fit((1, 2), [1.5, 1.7])})
    assert cal.acceptance_for("eagle3", 0.0) == (0.6, 0.1)
    assert cal.acceptance_for("eagle3", 0.3) == (0.6, 0.1)     # nearer to 0 than to 1
    assert cal.acceptance_for("eagle3", 0.8) == (0.4, 0.1)
    assert cal.acceptance_for("eagle3", 2.0) == (0.4, 0.1)
    assert cal.acceptance_for("eagle", 1.0) == (0.5,)          # only greedy measured: that one
    assert cal.acceptance_for("medusa", 0.0) is None and cal.acceptance_for(None) is None
    assert cal.acceptance_for("eagle3", 1.0, "without_replacement") is None   # drawn drafts: not measured
    assert cal.acceptance_for("eagle3", 0.0, "without_replacement") == (0.6, 0.1)   # greedy: any mode
    drawn = dataclasses.replace(cal, acceptance={**cal.acceptance, "eagle3@T1/without_replacement": (0.5, 0.2)})
    assert drawn.acceptance_for("eagle3", 1.0, "without_replacement") == (0.5, 0.2)
    assert drawn.acceptance_for("eagle3", 1.0) == (0.4, 0.1)                  # ranked drafts: their own
    assert drawn.acceptance_for("eagle3", 0.2, "without_replacement") == (0.6, 0.1)   # nearest: greedy
    assert Calibration.load(cal.save(tmp_path / "c.json")) == cal   # temperatures and batch curves saved


def test_calibrate_batches_on_a_tiny_model():
    from treespec.calibrate.passes import calibrate, calibrate_batches
    from treespec.targets.loader import tiny_llama

    model = tiny_llama(num_layers=2)
    cal = calibrate(model, "tiny", ns=(1, 3), context=5, early_exit_layers=1, n_warmup=0, n_rep=1)
    out = calibrate_batches(cal, model, batches=(2, 3), ns=(1, 2), n_warmup=0, n_rep=1)
    assert set(out.batch_target) == {2, 3} and out.batch_target[3].ns == (1, 2)
    assert all(t > 0 for c in out.batch_target.values() for t in c.seconds)
    assert out.target == cal.target and cal.batch_target == {}
    with pytest.raises(ValueError, match="batches must be ints >= 2"):
        calibrate_batches(cal, model, batches=(1,))
    with pytest.raises(ValueError, match="ns must be increasing ints >= 1"):
        calibrate_batches(cal, model, batches=(2,), ns=(2, 1))


def test_auto_budget_speculates_only_above_its_minimum_gain():
    # τ(1) = 1.04 for one free draft on a flat curve: a 4 % predicted gain is not worth a tree
    weak = auto_budget(_calibration(), (0.04,), "lookup")
    assert weak.drafts == 0 and weak.speedup == 1.0
    assert auto_budget(_calibration(), (0.04,), "lookup", min_gain=1.0).drafts > 0
    assert auto_budget(_calibration(), (0.5,), "lookup").drafts == 7      # a clear gain: unchanged
    with pytest.raises(ValueError, match="min_gain must be >= 1"):
        auto_budget(_calibration(), (0.5,), "lookup", min_gain=0.9)


def test_batched_drafter_curves_are_read_where_measured(tmp_path):
    import dataclasses

    cal = dataclasses.replace(_calibration(drafter_s=0.01),
                              batch_drafters={"early_exit": {4: Curve.fit((1, 2, 4), [0.02, 0.03, 0.05])}})
    cost = CalibratedCost(cal, "early_exit")
    assert cost.draft_s([2], 4, cal.context) == pytest.approx(0.03)                 # the measured call
    assert cost.draft_s([1, 2], 4, cal.context) == pytest.approx(0.05)              # one call per level
    assert cost.draft_s([2], 1, cal.context) == pytest.approx(cal.drafters["early_exit"](2))
    halfway = cal.drafters["early_exit"](2) + (0.03 - cal.drafters["early_exit"](2)) / 3
    assert cost.draft_s([2], 2, cal.context) == pytest.approx(halfway)              # between B = 1 and 4
    # a drafter measured at batch 1 only: B requests are one call over w·B nodes, as before
    plain = _calibration(drafter_s=0.01)
    assert CalibratedCost(plain, "early_exit").draft_s([2], 4, 0) == pytest.approx(plain.drafters["early_exit"](8))
    assert plain.drafter_batch_s("early_exit", 2, 4) is None
    assert Calibration.load(cal.save(tmp_path / "c.json")) == cal


@pytest.mark.parametrize("kind", ["model", "feature", "lookup"])
def test_calibrate_drafter_batches_on_a_tiny_target(kind):
    import dataclasses

    from treespec.calibrate.passes import calibrate
    from treespec.drafters import LookupDrafter, ModelDrafter
    from treespec.drafters.eagle import random_feature_drafter
    from treespec.calibrate.drafters import calibrate_drafter_batches
    from treespec.targets.loader import tiny_llama, tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    drafter = {"model": lambda: ModelDrafter(tiny_llama(vocab_size=32, num_layers=1, seed=3), 32),
               "feature": lambda: random_feature_drafter(target, "eagle3", seed=1, draft_vocab=16),
               "lookup": lambda: LookupDrafter(32)}[kind]()
    cal = calibrate(target.model, "tiny", ns=(1, 3), context=6, early_exit_layers=1, n_warmup=0, n_rep=1)
    with pytest.raises(ValueError, match="calibrate_drafter\\('mine'\\) first"):
        calibrate_drafter_batches(cal, "mine", target, drafter=drafter)
    cal = dataclasses.replace(cal, drafters={**cal.drafters, "mine": Curve.fit((1, 2), [1e-3, 2e-3])})
    out = calibrate_drafter_batches(cal, "mine", target, batches=(2, 3), widths=(1, 2), n_warmup=0, n_rep=1,
                                    drafter=drafter)
    assert set(out.batch_drafters["mine"]) == {2, 3} and out.batch_drafters["mine"][2].ns == (1, 2)
    assert all(s > 0 for c in out.batch_drafters["mine"].values() for s in c.seconds)
    with pytest.raises(ValueError, match="batches must be ints >= 2"):
        calibrate_drafter_batches(cal, "mine", target, batches=(1,), drafter=drafter)


def test_a_one_node_pass_is_timed_as_the_verifier_runs_it() -> None:
    """n = 1 is the model's own one-token step (no mask, no positions), as ``TreeVerifier.score``
    runs a root alone; larger n carry the tree mask and positions."""
    from treespec.calibrate.passes import verify_passes
    from treespec.targets.loader import tiny_llama

    model = tiny_llama(vocab_size=16)
    seen = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append((kwargs["input_ids"].shape[1], kwargs.get("attention_mask") is None,
                                             kwargs.get("position_ids") is None)), with_kwargs=True)
    for fn in verify_passes(model, (1, 3), context=5):
        fn()
    assert seen[-2:] == [(1, True, True), (3, False, False)]
