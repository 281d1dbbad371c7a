"""treespec.cli.main helpers that need no model: builders from arguments, Sequoia's vector."""

from __future__ import annotations

import argparse
import types

import pytest

from treespec import builders
from treespec.cli.main import BUILDERS, _sequoia_acceptance, drafter_options, make_builder
from treespec.planning import Calibration, Curve, default_calibration_path, model_shape


def test_make_builder_gives_every_builder_its_arguments():
    built = {name: make_builder(name, 8, 3, 2) for name in BUILDERS}
    assert isinstance(built["chain"], builders.ChainBuilder) and built["chain"].config.budget == 8
    # one meaning of budget: nodes incl. the root, for every builder
    assert all(b.budget <= 8 for b in built.values()) and built["chain"].budget == built["dynamic"].budget == 8
    assert isinstance(built["dynamic"], builders.DynamicTreeBuilder) and built["dynamic"].config.top_k == 2
    assert isinstance(built["best-first"], builders.BestFirstBuilder) and built["best-first"].max_depth <= 3
    assert isinstance(built["static"], builders.StaticTreeBuilder)
    seq = make_builder("sequoia", 8, 3, 2, acceptance=(0.6, 0.2))
    assert isinstance(seq, builders.SequoiaBuilder) and seq.acceptance == (0.6, 0.2)
    with pytest.raises(ValueError, match="unknown tree builder 'bush'"):
        make_builder("bush", 8, 3, 2)


def test_make_builder_passes_min_confidence_to_the_adaptive_builders():
    for name in ("chain", "dynamic", "best-first"):
        assert make_builder(name, 8, 3, 2, min_confidence=0.5).config.min_confidence == 0.5
    with pytest.raises(ValueError, match="min_confidence is an option of the chain, dynamic, best-first"):
        make_builder("static", 8, 3, 2, min_confidence=0.5)


def test_drafter_options_parse_numbers_and_refuse_malformed_pairs():
    assert drafter_options(["min_ngram=3", "floor=0.01", "name=x"]) == {"min_ngram": 3, "floor": 0.01, "name": "x"}
    assert drafter_options([]) == {}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        drafter_options(["min_ngram"])


def test_load_drafter_refuses_an_option_its_factory_does_not_take():
    from types import SimpleNamespace

    import torch

    from treespec import load_drafter

    target = SimpleNamespace(vocab_size=50, model=torch.nn.Linear(2, 2))   # all lookup reads
    assert load_drafter("lookup", target, min_ngram=3).config.min_ngram == 3
    with pytest.raises(ValueError, match="drafter 'lookup' takes no option 'ngram'; its options are"):
        load_drafter("lookup", target, ngram=3)


def test_a_drafter_loaded_with_options_is_keyed_by_them():
    """Options change a drafter's costs and acceptance (4-bit weights, a lookup's n-grams), so
    calibrations key it by name and options, and the key loads the same drafter again."""
    from types import SimpleNamespace

    import torch

    from treespec import load_drafter
    from treespec.drafters import drafter_key, split_drafter_key
    from treespec.drafters.base import drafter_names

    target = SimpleNamespace(vocab_size=50, model=torch.nn.Linear(2, 2))
    assert load_drafter("lookup", target).registry_name == "lookup"
    keyed = load_drafter("lookup", target, min_ngram=3, max_matches=4)
    assert keyed.registry_name == "lookup[max_matches=4,min_ngram=3]"
    again = load_drafter(keyed.registry_name, target)
    assert again.config == keyed.config and again.registry_name == keyed.registry_name
    assert load_drafter("lookup[min_ngram=3]", target, max_matches=4).registry_name == keyed.registry_name
    with pytest.raises(ValueError, match="'min_ngram' given both in the name and as an argument"):
        load_drafter("lookup[min_ngram=3]", target, min_ngram=2)
    with pytest.raises(ValueError, match="takes no option 'ngram'"):
        load_drafter("lookup[ngram=3]", target)

    assert drafter_key("eagle3", {"checkpoint": "runs/x.safetensors"}) == "eagle3"   # the checksum tells
    assert drafter_key("x", {"flag": True, "s": "int4", "f": 0.5}) == "x[f=0.5,flag=true,s=int4]"
    assert split_drafter_key("x[f=0.5,flag=true,s=int4]") == ("x", {"f": 0.5, "flag": True, "s": "int4"})
    for unkeyable in (object(), "3", "a,b", "", torch.ones(2)):
        assert drafter_key("x", {"v": unkeyable}) is None, unkeyable
    for bad in ("x[a=1", "x[a]", "x[a=1,a=2]", "[a=1]", "x[a=[1]]"):
        with pytest.raises(ValueError, match="drafter"):
            split_drafter_key(bad)
    assert drafter_names("eagle3,q[weights=int4,x=1],lookup") == ["eagle3", "q[weights=int4,x=1]", "lookup"]
    with pytest.raises(ValueError, match="single commas"):
        drafter_names("eagle3,,lookup")


def test_flags_that_cannot_apply_fail_before_the_model_loads(capsys, monkeypatch):
    from treespec.cli import main as cli

    def no_load(args):
        raise AssertionError("the target must not load for a bad flag")

    monkeypatch.setattr(cli, "_load_target", no_load)
    assert cli.main(["generate", "--prompt", "Hi", "--budget", "auto", "--min-confidence", "0.5"]) == 2
    assert "--min-confidence sets a fixed builder's stop" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "Hi", "--drafter-option", "min_ngram"]) == 2
    assert "--drafter-option takes KEY=VALUE" in capsys.readouterr().err


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"acceptance": None, "model": "toy", "drafter": "eagle3", **kw})


def test_sequoia_vector_from_the_flag_then_the_calibration(tmp_path, monkeypatch):
    from treespec.targets.loader import tiny_llama

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    # fp32, stock linear layers and attention, eager passes: the plain file name
    model = types.SimpleNamespace(name="toy", model=tiny_llama())
    assert _sequoia_acceptance(_args(), model) is None                       # nothing measured: default
    assert _sequoia_acceptance(_args(acceptance="0.5,0.25"), model) == (0.5, 0.25)
    with pytest.raises(SystemExit, match="comma-separated probabilities"):
        _sequoia_acceptance(_args(acceptance="0.5;x"), model)
    ns = (1, 2)
    Calibration(model="toy", shape=model_shape("smollm2-135m"), context=8, target=Curve.fit(ns, [1.0, 1.0]),
                acceptance={"eagle3": (0.4, 0.1)}).save(default_calibration_path("toy"))
    assert _sequoia_acceptance(_args(), model) == (0.4, 0.1)
    assert _sequoia_acceptance(_args(drafter="medusa"), model) is None
    with pytest.raises(ValueError, match="sums to"):
        make_builder("sequoia", 8, 3, 2, acceptance=(0.9, 0.5))


def test_bad_input_is_one_error_line_not_a_traceback(capsys, monkeypatch):
    from treespec.cli import main as cli

    def boom(args):
        raise ValueError("builder='auto' needs a calibration; run `treespec calibrate` first")

    monkeypatch.setattr(cli, "cmd_generate", boom)
    assert cli.main(["generate", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: builder='auto' needs a calibration; run `treespec calibrate` first"


def test_demo_and_generate_default_to_the_fastest_measured_configuration():
    """With no --drafter / --tree / --budget, ``generate`` runs the target's preset for this CPU
    kind (SmolLM2: the hybrid with builder="auto" where a native-bf16 CPU measured it fastest;
    on AVX2 only, the x8 target with compiled passes: plain decoding for SmolLM2, a lookup chain
    of 3 cut at confidence 0.5 for Qwen; Qwen elsewhere: the 0.5B chain of 4); a flag given always
    wins (the preset's --min-confidence goes with its tree only), and a tree without a budget
    keeps budget 16."""
    from treespec.cli.main import build_parser
    from treespec.cli.presets import PRESETS, apply_preset
    from treespec.fastpath.cpu import CpuInfo

    parser = build_parser()
    assert parser.parse_args(["demo"]).drafter == "hybrid"
    assert parser.parse_args(["demo", "--drafter", "eagle3"]).drafter == "eagle3"
    for flags in (("avx2", "avx512f", "avx512_bf16"), ("avx2", "avx512_bf16", "amx_bf16")):
        cpu = CpuInfo("test", flags, "AVX2")
        args = parser.parse_args(["generate", "--prompt", "Hi"])
        assert apply_preset(args, cpu) is PRESETS["smollm2-135m"][cpu.kind]
        assert (args.drafter, args.tree, args.budget, args.kernel, args.compile) == (
            "hybrid", "dynamic", "auto", "auto", False)
    cpu = CpuInfo("test", ("avx2", "fma", "f16c"), "AVX2")
    for model, budget, stop in (("smollm2-135m", "1", 0.0), ("qwen2.5-coder-1.5b", "4", 0.5)):
        args = parser.parse_args(["generate", "--prompt", "Hi", "--model", model])
        assert apply_preset(args, cpu).plain == (budget == "1")
        assert (args.drafter, args.tree, args.budget, args.kernel, args.compile) == ("lookup", "chain", budget, "x8", True)
        assert args.min_confidence == stop
    args = parser.parse_args(["generate", "--prompt", "Hi", "--model", "qwen2.5-coder-1.5b", "--min-confidence", "0.2"])
    apply_preset(args, cpu)
    assert (args.budget, args.min_confidence) == ("4", 0.2)             # the user's stop on the preset's tree
    args = parser.parse_args(["generate", "--prompt", "Hi", "--model", "qwen2.5-coder-1.5b", "--budget", "8"])
    apply_preset(args, cpu)
    assert (args.tree, args.budget, args.min_confidence) == ("dynamic", "8", 0.0)   # not the preset's tree: no stop
    args = parser.parse_args(["generate", "--prompt", "Hi", "--model", "qwen2.5-coder-1.5b"])
    apply_preset(args, CpuInfo("test", ("avx2", "avx512f", "avx512_bf16"), "AVX2"))
    assert (args.drafter, args.tree, args.budget, args.min_confidence) == ("qwen2.5-coder-0.5b", "chain", "5", 0.0)
    args = parser.parse_args(["generate", "--prompt", "Hi", "--drafter", "eagle3", "--tree", "chain"])
    apply_preset(args, cpu)
    assert (args.drafter, args.tree, args.budget) == ("eagle3", "chain", "16")
    assert (args.kernel, args.compile) == ("x8", True)        # the path is the preset's still
    args = parser.parse_args(["generate", "--prompt", "Hi", "--budget", "8"])
    assert apply_preset(args, cpu) is not None and (args.drafter, args.tree, args.budget) == ("lookup", "dynamic", "8")
    # a tree flag given: the user's tree shape, not the preset's plain decoding
    args = parser.parse_args(["generate", "--prompt", "Hi", "--top-k-draft", "3"])
    apply_preset(args, cpu)
    assert (args.tree, args.budget, args.depth, args.top_k_draft) == ("dynamic", "16", 5, 3)


@pytest.mark.parametrize("flags, path", [
    (["--kernel", "blocks"], ("blocks", False)),             # one of the two given: the other's default
    (["--no-compile"], ("auto", False)),
    (["--compile"], ("auto", True)),
    (["--no-pack"], ("auto", False)),                         # paths the x8 kernel cannot take
    (["--dtype", "bfloat16"], ("auto", False)),
    (["--device", "cuda"], ("auto", False)),
])
def test_a_path_flag_given_keeps_the_preset_path_away(flags, path):
    """The preset's --kernel / --compile fill only what the user left out, and only where the
    user's flags leave the packed CPU path free; the demo keeps the CPU's default path."""
    from treespec.cli.main import build_parser
    from treespec.cli.plan import target_pack
    from treespec.cli.presets import apply_preset
    from treespec.fastpath.cpu import CpuInfo

    parser = build_parser()
    cpu = CpuInfo("test", ("avx2", "fma", "f16c"), "AVX2")
    args = parser.parse_args(["generate", "--prompt", "Hi", *flags])
    apply_preset(args, cpu)
    assert (args.kernel, args.compile) == path
    demo = parser.parse_args(["demo"])
    apply_preset(demo, cpu)
    assert (demo.kernel, demo.compile) == ("auto", False)
    with pytest.raises(ValueError, match="apply_preset"):
        target_pack(parser.parse_args(["generate", "--prompt", "Hi"]))   # the preset not applied yet


@pytest.mark.parametrize("command", [["generate", "--prompt", "Hi", "--budget", "auto"], ["demo"]])
def test_auto_measures_the_drafter_under_its_key_before_planning(command, monkeypatch):
    """``generate --budget auto`` and the demo hand the drafter, keyed with its options, to
    ``ensure_calibration`` (which measures it where the cached file lacks it) before planning."""
    from treespec.cli import main as cli
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    monkeypatch.setattr(cli, "_load_target", lambda args: target)
    seen = []

    def ensure(t, key):
        seen.append((t, key))
        raise ValueError("stopped after the calibration")

    monkeypatch.setattr(cli, "ensure_calibration", ensure)
    argv = command + ["--drafter", "lookup", "--drafter-option", "min_ngram=3"]
    assert cli.main(argv) == 2
    assert seen == [(target, "lookup[min_ngram=3]")]


def test_serve_defaults_to_the_targets_serving_drafter_and_tree():
    """With no --drafter, ``serve`` takes the drafter of the target's serving preset (SmolLM2:
    eagle3 with --budget auto, the load-tested row; Qwen: its 0.5B with auto, and on AVX2 the
    lookup chain cut at 0.5 drafted while a request is alone); on an AVX2-only CPU the preset's
    x8 kernel and compiled passes too, unless --kernel / --compile / --dtype say otherwise. A
    tree flag or another drafter keeps the preset's tree away (auto, or the flags' tree). A
    target without a preset gets eagle3, and a --drafter given always wins (none included)."""
    from treespec.cli.main import build_parser
    from treespec.cli.presets import SERVE_PRESETS, apply_serve_preset
    from treespec.fastpath.cpu import CpuInfo

    parser = build_parser()
    for flags in (("avx2", "fma", "f16c"), ("avx2", "avx512f", "avx512_bf16"), ("avx2", "avx512_bf16", "amx_bf16")):
        cpu = CpuInfo("test", flags, "AVX2")
        path = ("x8", True) if cpu.kind == "avx2" else ("auto", False)
        args = parser.parse_args(["serve"])
        assert apply_serve_preset(args, cpu) is SERVE_PRESETS["smollm2-135m"][cpu.kind]
        assert (args.drafter, args.budget, args.kernel, args.compile) == ("eagle3", "auto", *path)
        args = parser.parse_args(["serve", "--model", "qwen2.5-coder-1.5b"])
        assert apply_serve_preset(args, cpu) is not None
        if cpu.kind == "avx2":
            assert (args.drafter, args.budget, args.tree, args.min_confidence, args.draft_max_batch,
                    args.kernel, args.compile) == ("lookup", "4", "chain", 0.5, 1, *path)
        else:
            assert (args.drafter, args.budget, args.kernel, args.compile) == ("qwen2.5-coder-0.5b", "auto", *path)
    cpu = CpuInfo("test", ("avx2", "fma", "f16c"), "AVX2")
    qwen = ["serve", "--model", "qwen2.5-coder-1.5b"]
    for flags, tree in ((["--budget", "6"], ("lookup", "6", "dynamic", 0.0, None)),
                        (["--min-confidence", "0.3"], ("lookup", "auto", None, 0.3, None)),
                        (["--drafter", "hybrid"], ("hybrid", "auto", None, None, None))):
        args = parser.parse_args(qwen + flags)
        apply_serve_preset(args, cpu)
        assert (args.drafter, args.budget, args.tree, args.min_confidence, args.draft_max_batch) == tree
    for given in ("none", "hybrid"):
        args = parser.parse_args(["serve", "--drafter", given, "--budget", "8"])
        assert apply_serve_preset(args, cpu) is not None            # the path still comes from the preset
        assert (args.drafter, args.budget, args.kernel, args.compile) == (given, "8", "x8", True)
    for flags, path in ((["--no-compile"], ("auto", False)), (["--kernel", "x8"], ("x8", False)),
                        (["--dtype", "bfloat16"], ("auto", False))):
        args = parser.parse_args(["serve", "--drafter", "none", *flags])
        assert apply_serve_preset(args, cpu) is None and (args.kernel, args.compile) == path
    args = parser.parse_args(["serve"])
    args.model = "no-such-preset"            # a target no measurement covers
    assert apply_serve_preset(args, cpu) is None and args.drafter == "eagle3"
