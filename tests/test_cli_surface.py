"""What a command-line user sees, with no hidden side effect and errors that point the right way:
--help shows every default, every printed rate says whether it includes the prefill, the kernel
message appears only when a build is needed, and bad dtypes and tree flags are refused before
any model loads, in the words of the flag (or argument) at fault."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess

import pytest
import torch

from treespec.cli.main import build_parser, main


def _no_model_load(monkeypatch) -> None:
    """Any model load fails the test: the checks below must come first."""
    import treespec.targets
    import treespec.targets.loader

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the flags were checked")

    monkeypatch.setattr(treespec.targets.loader, "load_target", refuse)
    monkeypatch.setattr(treespec.targets, "load_target", refuse)
    monkeypatch.setattr("treespec.load_target", refuse)


# --help ------------------------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_subcommand_lists_its_subcommands() -> None:
    assert {"generate", "demo", "plan", "calibrate", "train", "export", "serve", "bench"} <= set(_subcommands())


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_help_shows_every_default(name: str) -> None:
    """Each option with a default other than none / empty / an on-off flag shows it in --help,
    options without help text (serve --port, train --lr) too."""
    parser = _subcommands()[name]
    text = parser.format_help()
    shown = 0
    for action in parser._actions:
        empty = action.default is None or (isinstance(action.default, (str, list, tuple)) and not action.default)
        if not action.option_strings or action.nargs == 0 or empty or action.default is argparse.SUPPRESS:
            continue
        block = re.search(r"^  " + re.escape(action.option_strings[0]) + r"\b.*?(?=^  -|^\S|\Z)", text,
                          flags=re.S | re.M)
        assert block is not None, f"{name} --help lacks {action.option_strings[0]}"
        words = " ".join(block.group(0).split())
        assert "default" in words, f"{name} {action.option_strings[0]}: no default in {words!r}"
        shown += 1
    assert shown >= 1


def test_help_shows_the_default_of_an_option_without_help_text() -> None:
    words = " ".join(_subcommands()["serve"].format_help().split())
    assert "--port PORT (default: 8000)" in words
    words = " ".join(_subcommands()["train"].format_help().split())
    assert "--lr LR (default: 0.001)" in words
    words = " ".join(_subcommands()["bench"].format_help().split())     # raw description kept, defaults added
    assert "--device DEVICE where the target (and drafter) run: cpu, cuda, cuda:N (default: cpu)" in words


# rates --------------------------------------------------------------------------------------


def test_the_stats_table_gives_the_rate_with_and_without_the_prefill() -> None:
    from treespec.runtime.generator import GenerationStats

    stats = GenerationStats(new_tokens=12, steps=4, draft_time=1.0, verify_time=1.5, accept_time=0.25,
                            other_time=0.25, prefill_time=1.0)
    rows = dict(line.rsplit("  ", 1) for line in stats.table().splitlines())
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["tokens/s, prefill excluded"] == "4.0"          # 12 tokens / 3 s of decoding
    assert rows["tokens/s, prefill included"] == "3.0"          # 12 tokens / (3 + 1) s
    assert not any(k == "tokens/s" for k in rows)


def test_plan_says_its_rate_leaves_out_the_prefill(capsys) -> None:
    assert main(["plan", "--model", "smollm2-135m", "--hardware", "h100", "--batch", "1", "--max-budget", "8"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s: predicted decoding rate of the whole batch, prefill excluded" in out


# the kernel message ------------------------------------------------------------------------


needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="ninja is not installed")


@needs_ninja
def test_build_needed_follows_the_extension_folder(tmp_path, monkeypatch) -> None:
    """build_needed reads what torch.utils.cpp_extension reads: the built module, the build file's
    source and flags, and ninja's own dry run (a source newer than the build)."""
    from treespec.fastpath import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    source = tmp_path / "k.cpp"
    source.write_text("int k;\n")
    assert kernels.build_needed("k_mod", source)                    # nothing built yet
    folder = tmp_path / "ext" / "k_mod"
    folder.mkdir(parents=True, exist_ok=True)

    def write_rules(flags):
        (folder / "build.ninja").write_text(f"cflags = {' '.join(flags)}\nrule copy\n  command = cp $in $out\n"
                                            f"build k_mod.so: copy {source.resolve()}\ndefault k_mod.so\n")
        subprocess.run(["ninja", "-C", str(folder)], check=True, capture_output=True)

    write_rules(kernels._FLAGS)
    assert not kernels.build_needed("k_mod", source)                # built, up to date: no message
    earlier = os.stat(source).st_mtime - 10
    os.utime(folder / "k_mod.so", (earlier, earlier))
    assert kernels.build_needed("k_mod", source)                    # the source is newer than the build
    write_rules(kernels._FLAGS)
    assert not kernels.build_needed("k_mod", source)
    write_rules([f for f in kernels._FLAGS if f != "-O3"])
    assert kernels.build_needed("k_mod", source)                    # other flags: torch rewrites and rebuilds
    write_rules(kernels._FLAGS)
    (folder / "k_mod.so").unlink()
    assert kernels.build_needed("k_mod", source)                    # the module is gone


@pytest.mark.parametrize("needed", [True, False])
def test_the_kernel_message_appears_only_when_it_compiles(monkeypatch, capsys, needed: bool) -> None:
    from treespec.fastpath import kernels

    module = object()
    monkeypatch.setattr(kernels, "_missing_tools", lambda: None)
    monkeypatch.setattr(kernels, "build_needed", lambda *a: needed)
    monkeypatch.setattr(kernels, "compile_kernel", lambda source, name: module)
    assert kernels._build.__wrapped__() == (module, None)
    err = capsys.readouterr().err
    assert ("compiling the fp32 panel kernel" in err) == needed


# dtype --------------------------------------------------------------------------------------


def test_float64_is_a_reference_precision_that_says_so() -> None:
    from treespec.fastpath.packing import resolve_dtype

    for given in ("float64", torch.float64):
        dtype, why = resolve_dtype(given)
        assert dtype == torch.float64 and "float64 reference" in why and "stock modules" in why
    assert resolve_dtype("float16") == (torch.float16, "requested")


def test_an_unknown_dtype_name_lists_every_accepted_one() -> None:
    from treespec.fastpath.packing import resolve_dtype

    with pytest.raises(ValueError) as e:
        resolve_dtype("fp32")
    for name in ("auto", "float32", "bfloat16", "float16", "float64"):
        assert repr(name) in str(e.value)


@pytest.mark.parametrize("dtype", [torch.int8, "int8", torch.float8_e4m3fn, torch.int64, torch.complex64])
def test_a_dtype_that_cannot_hold_weights_is_refused_before_loading(monkeypatch, dtype) -> None:
    from treespec.targets import loader

    def refuse(**kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "TARGET_LOADERS", {**loader.TARGET_LOADERS, "smollm2-135m": refuse})
    with pytest.raises(ValueError, match=r"dtype=.* cannot hold a target's weights; use one of 'auto', "
                                         r"'float32', 'bfloat16', 'float16', 'float64'") as e:
        loader.load_target("smollm2-135m", dtype=dtype)
    if dtype in (torch.int8, "int8", torch.float8_e4m3fn):
        assert "pack='blocks'" in str(e.value)                      # the way to 8-bit weights


# tree flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, message", [
    (["--budget", "abc"], "error: --budget must be an integer >= 1 (tree nodes incl. the root; 1 = plain "
                          "decoding) or 'auto' (the cost model sizes the tree), got 'abc'"),
    (["--budget", "0"], "error: --budget must be an integer >= 1"),
    (["--top-k-draft", "0"], "error: --top-k-draft must be >= 1 (children per expanded node of the dynamic "
                             "tree), got 0"),
    (["--tree", "best-first", "--depth", "0"], "error: --depth must be >= 1"),
    (["--verify", "block", "--tree", "dynamic"], "error: --verify block verifies a chain (--tree chain with a --budget number), but "
                            "--tree dynamic branches; use --verify traversal for trees, or --verify token"),
    (["--verify", "block", "--tree", "chain", "--budget", "auto"], "but --budget auto may build trees; use "
                                                                   "--verify traversal"),
])
def test_generate_refuses_bad_tree_flags_in_their_own_words(monkeypatch, capsys, flags, message) -> None:
    _no_model_load(monkeypatch)
    assert main(["generate", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert "rule=" not in err and "top_k must" not in err             # the API's words, not the CLI's


def test_a_chain_with_the_block_rule_passes_the_check() -> None:
    from treespec.cli.trees import check_tree_flags, parse_budget

    check_tree_flags("chain", 5, 0, "block", numeric_budget=True)    # top-k is not a chain's flag
    assert parse_budget("auto") == "auto" and parse_budget("7") == 7


def test_bench_refuses_top_k_draft_0_before_loading(monkeypatch, capsys) -> None:
    _no_model_load(monkeypatch)
    assert main(["bench", "--drafters", "lookup", "--trees", "chain:4,dynamic:8", "--top-k-draft", "0",
                 "--no-hf"]) == 2
    err = capsys.readouterr().err
    assert "error: --top-k-draft must be >= 1 (children per expanded node of the dynamic tree), got 0" in err


def test_the_engine_names_its_own_argument_for_the_block_rule() -> None:
    """An API user of SpeculativeGenerator(verify="block") with a branching tree is told its
    argument (verify='traversal'), beside accept's rule= and the CLI's flag."""
    from treespec import DynamicTreeBuilder, SpeculativeGenerator
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    gen = SpeculativeGenerator(target, "target", DynamicTreeBuilder(10, 3, 3), verify="block")
    with pytest.raises(ValueError, match=r"verify='traversal' / verify='token'; the CLI's --verify traversal"):
        gen.generate([4, 2], 8, temperature=1.0, seed=0)
