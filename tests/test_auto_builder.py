"""builder="auto": the engine sizes its tree from the cost model and a calibration."""

import pytest

from treespec.planning import Calibration, Curve, model_shape
from treespec.drafters import LookupDrafter
from treespec.runtime.generator import CalibrationMismatchWarning, SpeculativeGenerator, auto_builder
from treespec.targets.loader import tiny_target
from treespec.builders import ChainBuilder, DynamicTreeBuilder


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
    from treespec.planning import default_calibration_path
    cal.save(default_calibration_path(target.name))
    with pytest.warns(CalibrationMismatchWarning, match="measured on 'test'.*treespec calibrate"):
        gen = SpeculativeGenerator(target, LookupDrafter(16), "auto")  # device="test": not here
    assert gen.generate([1, 2, 3], max_new_tokens=5).token_ids.numel() <= 5
    with pytest.raises(ValueError, match="'auto'"):
        SpeculativeGenerator(target, LookupDrafter(16), "big")


def test_a_calibration_of_other_weights_is_refused(tmp_path, monkeypatch):
    """The verify curve depends on the dtype: a bf16 target needs a bf16 calibration."""
    import torch

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = tiny_target(vocab_size=16)
    target.model.to(torch.bfloat16)
    cal = _calibration(lambda n: 1.0, drafter_s=0.01)          # measured with 4-byte weights
    with pytest.raises(ValueError, match="4-byte weights but the target runs bfloat16.*--dtype bfloat16"):
        auto_builder(target, LookupDrafter(16), cal)
    with pytest.raises(ValueError, match=r"calibration-tiny-llama-v16-s0-bfloat16\.json"):
        SpeculativeGenerator(target, LookupDrafter(16), "auto")


def _measured(calibration: Calibration, name: str, acceptance: tuple[float, ...]) -> Calibration:
    """``calibration`` with drafter ``name`` measured: nearly free passes and ``acceptance``."""
    ns = (1, 2, 4, 8, 16, 32, 64)
    return Calibration(**{**vars(calibration), "drafters": {**calibration.drafters, name: Curve.fit(ns, [1e-6] * 7)},
                          "acceptance": {name: acceptance}})


def test_a_calibrated_drafter_brings_its_own_pass_times_and_acceptance():
    """Keyed by the registered name: the measured vector replaces the kind's default β, and the
    measured pass times replace the generic early-exit pass."""
    from treespec.drafters import load_drafter

    target = tiny_target(vocab_size=16)
    drafter = load_drafter("early-exit", target)
    assert drafter.registry_name == "early-exit"
    flat = _calibration(lambda n: 1.0, drafter_s=5.0)       # generic early-exit pass: costly
    sure = _measured(flat, "early-exit", (0.9, 0.05))
    unsure = _measured(flat, "early-exit", (0.05,))
    assert auto_builder(target, drafter, flat).budget == 1          # generic pass: no speculation
    big, small = auto_builder(target, drafter, sure), auto_builder(target, drafter, unsure)
    assert big.budget > 16 and big.budget > small.budget
    assert auto_builder(target, drafter, sure, acceptance=(0.05,)).budget == small.budget


def test_a_calibration_of_the_plain_drafter_does_not_plan_one_loaded_with_options():
    """early-exit over 1 layer is not early-exit over the default layers: it is keyed by its
    option, planned from the generic pass until a calibration measures it under that key."""
    from treespec.drafters import load_drafter

    target = tiny_target(vocab_size=16)
    plain, shallow = load_drafter("early-exit", target), load_drafter("early-exit", target, num_layers=1)
    assert shallow.registry_name == "early-exit[num_layers=1]"
    flat = _calibration(lambda n: 1.0, drafter_s=5.0)       # generic early-exit pass: costly
    sure = _measured(flat, "early-exit", (0.9, 0.05))
    assert auto_builder(target, plain, sure).budget > 16
    assert auto_builder(target, shallow, sure).budget == 1         # not its measurement
    its_own = _measured(flat, shallow.registry_name, (0.9, 0.05))
    assert auto_builder(target, shallow, its_own).budget > 16
    assert auto_builder(target, plain, its_own).budget == 1


def test_calibrate_drafter_measures_a_drafter_with_options_under_its_key():
    from treespec.calibrate.passes import calibrate
    from treespec.calibrate.drafters import calibrate_drafter

    target = tiny_target(vocab_size=16, seed=1)
    cal = calibrate(target.model, "tiny", ns=(1, 4), context=4, early_exit_layers=1, n_warmup=0, n_rep=1)
    out = calibrate_drafter(cal, "early-exit[num_layers=1]", target, [[1, 2, 3, 4, 5]], widths=(2,),
                            acceptance_width=2, max_new_tokens=4, temperatures=(0.0,))
    assert "early-exit[num_layers=1]" in out.drafters and "early-exit" not in out.drafters
    assert len(out.acceptance["early-exit[num_layers=1]"]) == 2


def test_calibrate_drafter_measures_pass_times_and_acceptance(tmp_path):
    from treespec.calibrate.passes import calibrate
    from treespec.calibrate.drafters import calibrate_drafter

    target = tiny_target(vocab_size=16, seed=1)
    cal = calibrate(target.model, "tiny", ns=(1, 4), context=4, early_exit_layers=1, n_warmup=0, n_rep=1)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    out = calibrate_drafter(cal, "target", target, prompts, widths=(2, 4), acceptance_width=3,
                            max_new_tokens=6)
    assert out.drafters["target"].ns == (1, 2, 4)         # the root call, then each width
    assert all(t > 0 for t in out.drafters["target"].seconds)
    assert out.acceptance["target"] == (1.0, 0.0, 0.0)     # the target drafts its own greedy token
    ranked = out.acceptance["target@T1"]                    # T = 1: its top tokens, accepted w.p. p(x)
    assert len(ranked) == 3 and 0.0 < ranked[0] < 1.0 and sum(ranked) <= 1.0 + 1e-12
    # drawn from q = p, the first draw is always accepted (min(p, q) sums to 1)
    assert out.acceptance["target@T1/without_replacement"] == (1.0, 0.0, 0.0)
    assert "target" not in cal.drafters                    # a new Calibration; the input is kept
    assert Calibration.load(out.save(tmp_path / "c.json")) == out
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate_drafter(cal, "target", target, [])
    with pytest.raises(ValueError, match="widths must be positive ints"):
        calibrate_drafter(cal, "target", target, prompts, widths=(0,))


def test_a_calibration_of_this_machine_is_used_without_a_warning(tmp_path, monkeypatch):
    import dataclasses
    import warnings

    import torch

    from treespec.planning import default_calibration_path, machine_mismatch
    from treespec.planning.calibration import _device_description

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = tiny_target(vocab_size=16)
    here = dataclasses.replace(_calibration(lambda n: max(1.0, n / 8), drafter_s=0.01),
                               device=_device_description(), threads=torch.get_num_threads())
    assert machine_mismatch(here) is None
    here.save(default_calibration_path(target.name))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationMismatchWarning)
        SpeculativeGenerator(target, LookupDrafter(16), "auto")


def test_machine_mismatch_names_what_differs():
    """A cached calibration follows a home directory to other machines: AVX-512 curves on an
    AVX2 part (the same "AMD EPYC" name covers both), another torch, another thread count."""
    import dataclasses

    import torch

    from treespec.planning import machine_mismatch
    from treespec.planning.calibration import _device_description

    now = _device_description()
    hardware, rest = now.split("; ", 1)
    cal = dataclasses.replace(_calibration(lambda n: 1.0, 0.01), device=now, threads=torch.get_num_threads())
    assert machine_mismatch(cal) is None
    other_flags = hardware.split(" [")[0] + " [avx2 fma avx512f amx_bf16]"
    assert other_flags != hardware
    why = machine_mismatch(dataclasses.replace(cal, device=f"{other_flags}; {rest}"))
    assert why is not None and "amx_bf16" in why and hardware in why
    why = machine_mismatch(dataclasses.replace(cal, device=f"{hardware}; torch 0.1; 1 threads"))
    assert why is not None and "torch 0.1" in why
    why = machine_mismatch(dataclasses.replace(cal, threads=torch.get_num_threads() + 1))
    assert why is not None and "thread" in why
    # files written before the flags were recorded: the CPU model name decides
    old = dataclasses.replace(cal, device=f"{hardware.split(' [')[0]}; {rest}")
    assert machine_mismatch(old) is None
    assert machine_mismatch(dataclasses.replace(old, device=f"Some Other CPU; {rest}")) is not None


def test_auto_plans_with_the_acceptance_of_the_requested_temperature(tmp_path, monkeypatch):
    """Greedy acceptance high, T = 1 acceptance low: the generator's "auto" tree follows the
    temperature of each generate call."""
    import dataclasses

    from treespec.planning import default_calibration_path
    from treespec.drafters import load_drafter

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = tiny_target(vocab_size=16)
    drafter = load_drafter("early-exit", target)
    ns = (1, 2, 4, 8, 16, 32, 64)
    cal = _calibration(lambda n: 1.0, drafter_s=5.0)
    cal = dataclasses.replace(cal, drafters={**cal.drafters, "early-exit": Curve.fit(ns, [1e-3] * len(ns))},
                              acceptance={"early-exit": (0.9, 0.05), "early-exit@T1": (0.0005,)})
    assert auto_builder(target, drafter, cal).budget > 16
    assert auto_builder(target, drafter, cal, temperature=1.0).budget == 1
    assert auto_builder(target, drafter, cal, temperature=0.2).budget > 16   # nearer to greedy
    cal.save(default_calibration_path(target.name))
    with pytest.warns(CalibrationMismatchWarning):
        gen = SpeculativeGenerator(target, drafter, "auto")
    assert gen.builder.budget > 16 and gen.builder_for(1.0).budget == 1
    out = gen.generate([1, 2, 3], max_new_tokens=6, temperature=1.0, seed=0)
    assert out.stats.steps == out.token_ids.numel()           # no speculation: one token per step


def test_a_noisy_machine_keeps_auto_on_plain_decoding_for_a_small_predicted_gain(tmp_path, monkeypatch):
    """The same small predicted gain is taken on a quiet machine and left alone on a noisy one,
    and the CLI says which threshold decided it."""
    import dataclasses
    import warnings

    from treespec.cli.main import auto_threshold_line
    from treespec.planning import default_calibration_path

    target = tiny_target(vocab_size=16)
    flat = _calibration(lambda n: max(1.0, n / 8), drafter_s=1e-6)

    def spread(noise: float) -> Calibration:
        return dataclasses.replace(flat, target=Curve.fit(flat.target.ns, flat.target.seconds,
                                                          [noise] * len(flat.target.ns)))

    quiet = auto_builder(target, LookupDrafter(16), spread(0.01), acceptance=(0.15,))
    noisy = auto_builder(target, LookupDrafter(16), spread(0.12), acceptance=(0.15,))
    assert quiet.budget > 1 and noisy.budget == 1
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    dataclasses.replace(spread(0.12), acceptance={"lookup": (0.15,)}).save(default_calibration_path(target.name))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationMismatchWarning)   # device "test"
        gen = SpeculativeGenerator(target, "lookup", "auto")     # registered: reads its acceptance
    assert gen.calibration.timing_noise == pytest.approx(0.12)
    assert gen.builder.budget == 1
    assert auto_threshold_line(gen.calibration, gen.builder.budget) == (
        "speculates where the cost model predicts at least 1.25x (timing spread 12.0% per pass on this "
        "machine); no tree does: plain decoding")
    assert auto_threshold_line(flat, 3) == "speculates where the cost model predicts at least 1.05x"
    assert SpeculativeGenerator(target, LookupDrafter(16), ChainBuilder(budget=3)).calibration is None


def test_loop_costs_enter_the_plan_only_in_pairs_and_at_batch_one(tmp_path):
    """The generator's own work per step: plain decoding's raises the baseline, the drafter's
    (per step + per drafter call) raises every tree's step; one without the other is ignored."""
    from treespec.planning import PLAIN_LOOP, CalibratedCost, LoopCost
    from treespec.planning.planner import best_choice, plan_curve

    ns = (1, 2, 4, 8, 16, 32, 64)
    base = Calibration(**{**vars(_calibration(lambda n: 1.0, drafter_s=0.01)),
                          "drafters": {"eagle3": Curve.fit(ns, [0.05] * len(ns))}})
    loops = {PLAIN_LOOP: LoopCost(0.2), "eagle3": LoopCost(0.5, 0.1)}
    cal = Calibration(**{**vars(base), "loop": loops})
    assert Calibration.load(cal.save(tmp_path / "c.json")) == cal
    cost = CalibratedCost(cal, "eagle3")
    assert cost.loop_s((), 1) == pytest.approx(0.2)
    assert cost.loop_s((1, 1, 1), 1) == pytest.approx(0.5 + 3 * 0.1)
    assert cost.loop_s((1, 1, 1), 2) == 0.0                                  # the server's loop: not measured
    for half in ({PLAIN_LOOP: LoopCost(0.2)}, {"eagle3": LoopCost(0.5, 0.1)}):
        assert CalibratedCost(Calibration(**{**vars(base), "loop": half}), "eagle3").loop_s((1,), 1) == 0.0

    # by hand, a one-wide acceptance vector: only chains, a chain of k has tau 2 - 0.5^k and a step of
    # 1 (flat verify) + 0.05 k (drafts) + 0.5 + 0.1 k (loop), against 1.2 a token for plain decoding
    curve = plan_curve(cost, (0.5,), max_drafts=4, max_depth=4)
    assert curve[0].step_s == pytest.approx(1.2) and curve[0].loop_s == pytest.approx(0.2)
    chain = curve[2]
    assert chain.is_chain and chain.drafts == 2 and chain.tau == pytest.approx(1.75)
    assert chain.step_s == pytest.approx(1.0 + 0.1 + 0.5 + 0.2)
    assert chain.speedup == pytest.approx(1.75 / 1.8 * 1.2)
    without = best_choice(plan_curve(CalibratedCost(base, "eagle3"), (0.5,), max_drafts=4, max_depth=4))
    with_loop = best_choice(curve)
    assert with_loop.speedup < without.speedup and with_loop.tokens_per_s < without.tokens_per_s
    with pytest.raises(ValueError, match="LoopCost.call must be finite seconds >= 0"):
        LoopCost(0.1, -0.01)
    with pytest.raises(ValueError, match="LoopCost.step must be finite seconds >= 0"):
        LoopCost(float("nan"))


def test_an_expensive_loop_turns_auto_to_plain_decoding():
    """A tree the passes alone make worth it gives way to plain decoding once the drafter's loop
    work per step is counted."""
    from treespec.drafters import load_drafter
    from treespec.planning import PLAIN_LOOP, LoopCost

    target = tiny_target(vocab_size=16)
    drafter = load_drafter("early-exit", target)
    ns = (1, 2, 4, 8, 16, 32, 64)
    passes = Calibration(**{**vars(_calibration(lambda n: 1.0 + 0.02 * n, drafter_s=0.01)),
                            "drafters": {"early-exit": Curve.fit(ns, [0.02] * len(ns))},
                            "acceptance": {"early-exit": (0.3,)}})
    assert auto_builder(target, drafter, passes).budget > 1
    heavy = Calibration(**{**vars(passes), "loop": {PLAIN_LOOP: LoopCost(0.0), "early-exit": LoopCost(0.3, 0.05)}})
    assert auto_builder(target, drafter, heavy).budget == 1


def test_calibrate_loop_books_builder_and_commit_time_where_they_belong():
    """A builder that sleeps around its drafter call shows up as per-call loop time; a drafter whose
    commit sleeps shows up as per-step time; plain decoding pays neither."""
    import time

    from treespec.calibrate.passes import calibrate
    from treespec.calibrate.drafters import calibrate_loop
    from treespec.drafters import load_drafter
    from treespec.planning import PLAIN_LOOP

    target = tiny_target(vocab_size=16, seed=1)
    cal = calibrate(target.model, "tiny", ns=(1, 2, 3, 4, 8), context=4, early_exit_layers=1, n_warmup=1, n_rep=3)

    class SlowCommit:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def commit(self, *args):
            time.sleep(0.04)
            return self.inner.commit(*args)

    class SlowChain(ChainBuilder):
        def build(self, *args, **kwargs):
            time.sleep(0.03)
            return super().build(*args, **kwargs)

    drafter = SlowCommit(load_drafter("target", target))
    out = calibrate_loop(cal, drafter, "slow", target, [[1, 2, 3, 4, 5]], max_new_tokens=6,
                         builders=(lambda: SlowChain(budget=2),))   # the root and one draft
    plain, slow = out.loop[PLAIN_LOOP], out.loop["slow"]
    assert slow.call >= 0.03 * 0.9           # one drafter call per build: the sleep is the builder's
    assert slow.step >= 0.04 * 0.9           # the commit: after acceptance, in the step
    # plain decoding pays neither (a load on the machine inflates both steps alike)
    assert plain.step < slow.step - 0.02 and plain.call == 0.0
    assert "slow" not in cal.loop            # a new Calibration
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate_loop(cal, drafter, "slow", target, [])


def test_loop_text_says_what_was_measured():
    from treespec.planning import PLAIN_LOOP, LoopCost

    cal = _calibration(lambda n: 1.0, drafter_s=0.01)
    assert "not measured" in cal.loop_text("eagle3")
    cal = Calibration(**{**vars(cal), "loop": {PLAIN_LOOP: LoopCost(0.001), "eagle3": LoopCost(0.002, 0.0005)}})
    assert cal.loop_text("eagle3") == ("the generator's own work: 1.00 ms a step decoding plainly, "
                                       "2.00 ms a step + 0.50 ms a drafter call with eagle3")


def test_auto_draws_its_drafts_above_t0_where_drawn_drafts_are_accepted_more():
    """Above T = 0 auto plans ranked and drawn drafts from their own measured acceptance and
    builds the faster; at T = 0 drafts are ranked whatever was measured."""
    from treespec.drafters import load_drafter

    target = tiny_target(vocab_size=16)
    drafter = load_drafter("early-exit", target)
    ns = (1, 2, 4, 8, 16, 32, 64)
    base = Calibration(**{**vars(_calibration(lambda n: 1.0 + 0.01 * n, drafter_s=0.01)),
                          "drafters": {"early-exit": Curve.fit(ns, [0.01] * len(ns))}})

    def with_vectors(**vectors):
        return Calibration(**{**vars(base), "acceptance": {"early-exit": (0.7, 0.1), **vectors}})

    drawn_better = with_vectors(**{"early-exit@T1": (0.1,), "early-exit@T1/without_replacement": (0.5, 0.1)})
    builder = auto_builder(target, drafter, drawn_better, temperature=1.0)
    assert builder.budget > 1 and builder.config.mode == "without_replacement"
    assert auto_builder(target, drafter, drawn_better, temperature=0.0).config.mode == "deterministic"
    ranked_better = with_vectors(**{"early-exit@T1": (0.5, 0.1), "early-exit@T1/without_replacement": (0.1,)})
    assert auto_builder(target, drafter, ranked_better, temperature=1.0).config.mode == "deterministic"
    only_ranked = with_vectors(**{"early-exit@T1": (0.5, 0.1)})
    assert auto_builder(target, drafter, only_ranked, temperature=1.0).config.mode == "deterministic"


def test_the_generator_says_which_tree_each_temperature_runs(tmp_path, monkeypatch):
    """builder_for(T): the auto tree a request at T runs (planned once per T); a fixed builder
    serves every T."""
    import dataclasses

    import torch

    from treespec.drafters import load_drafter
    from treespec.planning import default_calibration_path
    from treespec.planning.calibration import _device_description

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = tiny_target(vocab_size=16)
    ns = (1, 2, 4, 8, 16, 32, 64)
    cal = dataclasses.replace(_calibration(lambda n: 1e-3 * (1.0 + 0.01 * n), drafter_s=1e-5),
                              drafters={"early-exit": Curve.fit(ns, [1e-5] * len(ns))},
                              acceptance={"early-exit": (0.7, 0.1), "early-exit@T1": (0.05,),
                                          "early-exit@T1/without_replacement": (0.6, 0.1)},
                              device=_device_description(), threads=torch.get_num_threads())
    cal.save(default_calibration_path(target.name))
    gen = SpeculativeGenerator(target, load_drafter("early-exit", target), "auto")
    hot = gen.builder_for(1.0)
    assert gen.builder_for(0.0) is gen.builder and gen.builder.config.mode == "deterministic"
    assert hot.config.mode == "without_replacement" and gen.builder_for(1.0) is hot
    fixed = SpeculativeGenerator(target, LookupDrafter(16), ChainBuilder(budget=3))
    assert fixed.builder_for(0.0) is fixed.builder_for(1.0) is fixed.builder
    res = gen.generate([1, 2, 3], max_new_tokens=6, temperature=1.0, seed=0)
    assert 0 < res.token_ids.numel() <= 6
