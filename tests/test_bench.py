"""treespec bench: argument checks, prompt sets, the paired / pooled ratios, the llama.cpp row,
Sequoia's vector source, and a smoke run on SmolLM2 (2 prompts x 8 tokens, two drafters,
two trees) that must be greedy-equal to plain decoding and resume exactly."""

from __future__ import annotations

import json
import os
import stat
import sys
import types

import pytest

from treespec.cli.bench import (
    BenchReport, TreeSpec, find_llamacpp, parse_drafters, parse_llamacpp_timings, parse_temperatures, parse_trees,
    run_llamacpp, select_prompts,
)
from treespec.data import CODE_EDIT_PROMPTS, chat_prompt, interleave_categories, prompt_set, spec_bench_questions
from treespec.runtime.bench import Run, paired_ratio, pooled_ratio, sequoia_acceptance, summarize


# ------------------------------------------------------------------ arguments
def test_trees_parse_names_and_sizes_and_refuse_bad_specs():
    assert parse_trees("chain:4, dynamic:16,best-first:16,sequoia:16") == [
        TreeSpec("chain", 4), TreeSpec("dynamic", 16), TreeSpec("best-first", 16), TreeSpec("sequoia", 16)]
    for bad, words in (("chain", "NAME:NODES"), ("tree:4", "NAME one of"), ("chain:four", "must be an integer"),
                       ("chain:1", "at least 2 nodes"), ("chain:4,chain:4", "twice"), ("chain:4,", "NAME:NODES")):
        with pytest.raises(ValueError, match=words) as err:
            parse_trees(bad)
        assert "--trees" in str(err.value)


def test_temperatures_and_drafters_are_checked_before_any_model_loads():
    assert parse_temperatures("0, 1") == [0.0, 1.0]
    for bad in ("", "0,x", "-1", "0,0"):
        with pytest.raises(ValueError, match="--temperatures"):
            parse_temperatures(bad)
    assert parse_drafters("eagle3, lookup") == ["eagle3", "lookup"]
    assert parse_drafters("treespec.drafters.lookup:LookupDrafter") == ["treespec.drafters.lookup:LookupDrafter"]
    with pytest.raises(ValueError, match="--drafters: drafter 'nosuchpkg.mod:make': cannot import module"):
        parse_drafters("nosuchpkg.mod:make")
    with pytest.raises(ValueError, match="--drafters: unknown drafter 'nope'; registered: .*eagle3"):
        parse_drafters("eagle3,nope")
    with pytest.raises(ValueError, match="--drafters takes distinct"):
        parse_drafters("lookup,lookup")


def test_the_command_names_the_bad_argument_without_loading_a_model(capsys, monkeypatch, tmp_path):
    from treespec.cli import main as cli

    def no_load(*a, **k):
        raise AssertionError("the target must not load for a bad argument")

    monkeypatch.setattr("treespec.targets.load_target", no_load)
    bad_jsonl = tmp_path / "q.jsonl"
    bad_jsonl.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n{"question_id": 2}\n')
    for argv, words in ((["--trees", "chain:x"], "--trees"), (["--drafters", "nope"], "--drafters: unknown drafter"),
                        (["--prompt-set", "no-such-set"], "--prompt-set: 'no-such-set' is neither"),
                        (["--prompt-set", str(bad_jsonl)], "line 2: missing category, turns"),
                        (["--prompts", "some"], "--prompts takes"), (["--temperatures", "hot"], "--temperatures"),
                        (["--llamacpp", str(tmp_path / "none")], "--llamacpp")):
        assert cli.main(["bench", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err, (argv, err)


# ------------------------------------------------------------------ prompt sets
def test_mt_bench_round_robin_keeps_every_category_in_a_short_run():
    qs = prompt_set("mt-bench")
    assert len(qs) == 80
    order = interleave_categories(qs)
    assert sorted(q.question_id for q in order) == sorted(q.question_id for q in qs)
    assert len({q.category for q in order[:8]}) == 8
    picked = select_prompts(["mt-bench", "code-edit"], 3)
    assert [s for s, _ in picked] == ["mt-bench", "code-edit"] * 3
    assert [q.turns[0] for s, q in picked if s == "code-edit"] == list(CODE_EDIT_PROMPTS[:3])
    with pytest.raises(ValueError, match="--prompts must be an integer >= 1"):
        select_prompts(["mt-bench"], 0)


def test_spec_bench_jsonl_reads_and_names_each_bad_line(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"question_id": "a1", "category": "summary", "turns": ["Sum up: x"]}\n\n'
                    '{"question_id": 7, "category": "qa", "turns": ["Why?", "And then?"]}\n')
    qs = spec_bench_questions(path)
    assert [(q.question_id, q.category, q.turns) for q in qs] == [
        ("a1", "summary", ("Sum up: x",)), (7, "qa", ("Why?", "And then?"))]
    cases = {'{"question_id": 1, "category": "c", "turns": ["x"]': "line 1: not JSON",
             '[1, 2]': "line 1: expected a JSON object",
             '{"question_id": 1, "turns": ["x"]}': "line 1: missing category",
             '{"question_id": 1, "category": "c", "turns": []}': "line 1: turns must be a non-empty list",
             '{"question_id": 1, "category": "", "turns": ["x"]}': "line 1: category must be",
             '{"question_id": true, "category": "c", "turns": ["x"]}': "line 1: question_id must be",
             '': "holds no questions"}
    for text, words in cases.items():
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=words) as err:
            spec_bench_questions(path)
        assert "--prompt-set" in str(err.value) and str(path) in str(err.value)


# ------------------------------------------------------------------ statistics
def test_paired_and_pooled_ratios_part_where_the_host_drifts():
    # Prompt 2 ran on a host twice as slow for both rows: the paired ratio (median of per-prompt
    # ratios) cancels it, the pooled one weighs the slow prompt's seconds more.
    base = [Run(tokens=100, seconds=10.0, prefill_s=1.0), Run(tokens=100, seconds=20.0, prefill_s=2.0),
            Run(tokens=100, seconds=10.0, prefill_s=1.0)]
    rows = [Run(tokens=100, seconds=5.0, prefill_s=1.0), Run(tokens=100, seconds=10.0, prefill_s=2.0),
            Run(tokens=100, seconds=8.0, prefill_s=1.0)]
    assert paired_ratio(rows, base) == pytest.approx(2.0)                 # ratios 2, 2, 1.25
    assert pooled_ratio(rows, base) == pytest.approx(40.0 / 23.0)
    assert pooled_ratio(rows, base, decode_only=True) == pytest.approx(36.0 / 19.0)
    hf = [Run(tokens=100, seconds=9.0)] * 3                               # no prefill split
    assert paired_ratio(hf, base, decode_only=True) is None and pooled_ratio(hf, base, decode_only=True) is None
    with pytest.raises(ValueError, match="one base run per run"):
        paired_ratio(rows[:2], base)


def test_summary_pools_tau_depths_time_split_and_greedy_equality():
    a = Run(tokens=10, seconds=1.0, prefill_s=0.1, steps=4, emitted=10, nodes=16, draft_s=0.2, verify_s=0.4,
            other_s=0.04, depth_attempts=[4, 3], depth_accepts=[3, 2], same_as_plain=True)
    b = Run(tokens=6, seconds=1.0, prefill_s=0.1, steps=4, emitted=6, nodes=16, draft_s=0.2, verify_s=0.4,
            other_s=0.04, depth_attempts=[4, 1, 1], depth_accepts=[1, 0, 0], same_as_plain=False)
    base = [Run(tokens=10, seconds=2.0, prefill_s=0.1)] * 2
    s = summarize([a, b], base)
    assert s.tau == pytest.approx(16 / 8) and s.mean_nodes == pytest.approx(4.0)
    assert s.acceptance_by_depth == pytest.approx([4 / 8, 2 / 4, 0.0])
    assert (s.draft_ms, s.verify_ms, s.other_ms) == pytest.approx((50.0, 100.0, 10.0))
    assert (s.same_as_plain, s.compared) == (1, 2)
    assert s.tokens_per_s == pytest.approx(8.0) and s.speedup_pooled == pytest.approx(8.0 / 5.0)


def test_sequoia_vector_comes_from_the_calibration_and_says_so(tmp_path, monkeypatch):
    from treespec.planning.calibration import Calibration, Curve, acceptance_key, model_calibration_path
    from treespec.planning.shapes import model_shape
    from treespec.targets.loader import tiny_llama

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = types.SimpleNamespace(name="toy", model=tiny_llama())
    vector, source = sequoia_acceptance(target, "eagle3", 0.0)
    assert vector is None and source.startswith("Sequoia's default (no calibration at")
    path = model_calibration_path("toy", target.model)
    Calibration(model="toy", shape=model_shape("smollm2-135m"), context=8, target=Curve.fit((1, 2), [1.0, 1.0]),
                acceptance={"eagle3": (0.4, 0.1), acceptance_key("eagle3", 1.0, "without_replacement"): (0.3, 0.2)}
                ).save(path)
    assert sequoia_acceptance(target, "eagle3", 0.0) == ((0.4, 0.1), f"calibrated: {path} [eagle3]")
    vector, source = sequoia_acceptance(target, "eagle3", 1.0, "without_replacement")
    assert vector == (0.3, 0.2) and "eagle3@T1/without_replacement" in source
    vector, source = sequoia_acceptance(target, "eagle3", 1.0, "deterministic")
    assert vector is None and "has no entry 'eagle3@T1'" in source


# ------------------------------------------------------------------ llama.cpp
LLAMA_LOG = ("llama_perf_context_print:        load time =     120.00 ms\n"
             "llama_perf_context_print: prompt eval time =      40.00 ms /    25 tokens (    1.60 ms per token)\n"
             "llama_perf_context_print:        eval time =     300.00 ms /    15 runs   (   20.00 ms per token)\n")


def test_llamacpp_row_reads_its_own_timers_and_is_absent_where_not_built(tmp_path, monkeypatch):
    run = parse_llamacpp_timings(LLAMA_LOG)
    # 15 evaluated runs: the prompt pass gave the first of 16 tokens, the 16th was never evaluated
    assert (run.tokens, run.seconds, run.prefill_s) == (16, pytest.approx(0.34), pytest.approx(0.04))
    with pytest.raises(RuntimeError, match="no timing lines"):
        parse_llamacpp_timings("hello")
    monkeypatch.delenv("TREESPEC_LLAMACPP", raising=False)
    binary, why = find_llamacpp(None)
    assert binary is None and "llama.cpp is not built here" in why
    assert find_llamacpp("off") == (None, "left out (--llamacpp off)")
    fake = tmp_path / "llama-cli"   # a stand-in binary: checks its arguments, prints llama.cpp's timers
    fake.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv\n"
                    "assert args[args.index('-n') + 1] == '16' and args[args.index('--temp') + 1] == '0'\n"
                    f"sys.stderr.write({LLAMA_LOG!r})\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("TREESPEC_LLAMACPP", str(fake))
    assert find_llamacpp(None) == (str(fake), "")
    monkeypatch.delenv("TREESPEC_LLAMACPP")              # `make bench-llamacpp`'s folder is found by itself
    import treespec.runtime.llamacpp as llamacpp

    monkeypatch.setattr(llamacpp, "DEFAULT_BIN", tmp_path)
    assert find_llamacpp(None)[0] is None                              # no llama-completion in it yet
    fake.rename(tmp_path / "llama-completion")
    assert find_llamacpp(None) == (str(tmp_path / "llama-completion"), "")
    fake = tmp_path / "llama-completion"
    run = run_llamacpp(str(fake), tmp_path / "m.gguf", "<|im_start|>user\nHi", 16, 0.0, 1, 1)
    assert run.tokens == 16 and run.seconds == pytest.approx(0.34)


# ------------------------------------------------------------------ smoke on SmolLM2
def test_smoke_two_drafters_two_trees_greedy_equal_and_resumable(tmp_path, capsys, monkeypatch):   # ~35 s, in make test
    """2 MT-bench prompts x 8 tokens, lookup and eagle3 as chain:4 and dynamic:8, T = 0: every
    configuration emits plain decoding's tokens; the second prompt is measured by --resume."""
    import treespec.targets
    from treespec.cli import main as cli

    load, loaded = treespec.targets.load_target, {}
    monkeypatch.setattr(treespec.targets, "load_target",   # the two commands share one loaded target
                        lambda name, **kw: loaded.get(name) or loaded.setdefault(name, load(name, **kw)))
    monkeypatch.delenv("TREESPEC_LLAMACPP", raising=False)
    argv = ["bench", "--drafters", "lookup,eagle3", "--trees", "chain:4,dynamic:8", "--temperatures", "0",
            "--max-new-tokens", "8", "--no-hf", "--out", str(tmp_path), "--plot"]
    assert cli.main([*argv, "--prompts", "1"]) == 0
    first = json.loads((tmp_path / "bench.json").read_text())
    assert cli.main([*argv, "--prompts", "2", "--resume"]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "bench.json").read_text())
    report = BenchReport.from_json(data)
    assert len(report.prompts) == 2 and report.complete
    assert [p["category"] for p in report.prompts] == ["writing", "roleplay"]   # categories round-robin
    for key, runs in first["runs"].items():          # the resumed run kept the first prompt's runs exactly
        assert data["runs"][key][0] == runs[0]
    configs = [r for r in report.rows if r.drafter is not None]
    assert [r.label for r in configs] == ["lookup chain:4", "lookup dynamic:8", "eagle3 chain:4", "eagle3 dynamic:8"]
    for row in configs:
        s = report.summary(row)
        assert (s.same_as_plain, s.compared) == (2, 2), row
        assert s.tau >= 1.0 and s.speedup_paired > 0 and len(s.acceptance_by_depth) >= 1
    assert report.summary([r for r in configs if r.label == "eagle3 chain:4"][0]).tau > 1.0
    md = (tmp_path / "bench.md").read_text()
    assert "llama.cpp is not built here" in md and "| eagle3 dynamic:8 |" in md and "prefill" in md
    assert (f"Reproduce: `treespec bench --model smollm2-135m --drafters lookup,eagle3 --trees chain:4,dynamic:8 "
            f"--temperatures 0 --prompt-set mt-bench --prompts 2 --max-new-tokens 8") in md
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "eagle3 dynamic:8" in out and "llama.cpp is not built here" in out

    # llama.cpp built after the run: --resume measures its row for the prompts already saved
    import treespec.cli.bench as bench_module
    from treespec.cli.bench import LLAMACPP, Row

    fake = tmp_path / "llama-completion"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    asked = []

    def fake_run(binary, gguf, text, max_new_tokens, temperature, seed, threads, prompt_tokens=None):
        asked.append((binary, seed, max_new_tokens, temperature, prompt_tokens,
                      text.endswith("<|im_start|>assistant\n")))
        return Run(tokens=max_new_tokens, seconds=0.5, prefill_s=0.1, steps=max_new_tokens - 1,
                   emitted=max_new_tokens, nodes=max_new_tokens - 1)

    monkeypatch.setattr(bench_module, "run_llamacpp", fake_run)
    assert cli.main([*argv, "--prompts", "2", "--resume", "--llamacpp", str(fake)]) == 0
    added = BenchReport.from_json(json.loads((tmp_path / "bench.json").read_text()))
    llama = Row(LLAMACPP, 0.0)
    assert [r.key for r in added.rows] == [report.rows[0].key, llama.key] + [r.key for r in report.rows[1:]]
    lengths = [len(chat_prompt(loaded["smollm2-135m"].tokenizer, q.turns[0]))
               for _, q in bench_module.select_prompts(["mt-bench"], 2)]
    assert asked == [(str(fake), i, 8, 0.0, lengths[i], True) for i in range(2)]   # the chat-templated text
    assert len(added.runs[llama.key]) == 2 and added.summary(llama).tokens_per_s == pytest.approx(16 / 1.0)
    assert all([r.to_json() for r in added.runs[k]] == [r.to_json() for r in report.runs[k]] for k in report.runs)
    assert added.command == report.command and "added to the saved run afterwards" in added.llamacpp
    assert f"| {LLAMACPP} |" in (tmp_path / "bench.md").read_text()
    assert cli.main([*argv, "--prompts", "2", "--resume", "--llamacpp", "off"]) == 2     # rows differ now
    assert "--llamacpp off" in capsys.readouterr().err
    assert cli.main([*argv[:-4], "--max-new-tokens", "4", "--out", str(tmp_path), "--resume"]) == 2
    assert "--resume" in capsys.readouterr().err and os.path.exists(tmp_path / "bench.json")


@pytest.mark.slow
def test_the_python_example_of_docs_bench_runs(capsys):
    from test_readme import doc_block

    code, path = doc_block("from treespec.cli.bench import bench")
    exec(compile(code, path, "exec"), {})
    out = capsys.readouterr().out
    assert "lookup chain:3" in out and "plain (treespec loop)" in out


def test_render_rewrites_markdown_and_plot_from_the_json_alone(tmp_path, capsys):
    from treespec.cli import main as cli
    from treespec.cli.bench import PLAIN, Row, save

    rows = [Row(PLAIN, 0.0), Row("toy chain:4", 0.0, drafter="toy", tree="chain:4")]
    plain = Run(tokens=10, seconds=1.0, prefill_s=0.1, steps=10, emitted=10, nodes=10)
    fast = Run(tokens=10, seconds=0.5, prefill_s=0.1, steps=5, emitted=10, nodes=20, draft_s=0.1, verify_s=0.3,
               depth_attempts=[5, 5, 5], depth_accepts=[4, 1, 0], same_as_plain=True)
    report = BenchReport(settings=dict(target="toy", drafters=["toy"], trees=["chain:4"], temperatures=[0.0],
                                       prompt_sets=["mt-bench"], prompts_per_set=2, max_new_tokens=10, depth=5,
                                       top_k=4, sampled_mode="without_replacement", seed=0, hf_plain=False, threads=1),
                         machine={"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"], "torch": "2", "torch_cpu_capability":
                                  "AVX2", "torch_threads": 1, "load_avg_1m": 0.5},
                         speed_path="fp32", prompts=[{"set": "mt-bench", "question_id": 81, "category": "writing"},
                                                     {"set": "mt-bench", "question_id": 91, "category": "roleplay"}],
                         rows=rows, runs={rows[0].key: [plain, plain], rows[1].key: [fast, fast]},
                         llamacpp="llama.cpp is not built here", complete=True)
    save(report, tmp_path / "bench", plot=False)
    (tmp_path / "bench.md").write_text("stale")
    assert cli.main(["bench", "--render", "--out", str(tmp_path), "--plot"]) == 0
    md = (tmp_path / "bench.md").read_text()
    header, rule, *_ = [line for line in md.splitlines() if line.startswith("| row | tok/s")] + \
        [line for line in md.splitlines() if line.startswith("| --- | ---: |")]
    assert header.count("|") == rule.count("|")            # one alignment cell per column
    assert "| toy chain:4 | 20.0 | 25.0 | 2.00x | 2.00x | 2.25x | 2.00 | 4.0 | 0.80 0.20 0.00 | 20.0 / 60.0 / 0.0 | 2/2 |" in md
    assert "| toy chain:4 | 2.00x / 2.00 | 2.00x / 2.00 |" in md             # per category
    assert (tmp_path / "bench.png").stat().st_size > 0 and "toy chain:4" in capsys.readouterr().out
    assert cli.main(["bench", "--render", "--out", str(tmp_path / "none")]) == 2
    assert "--render: no saved run" in capsys.readouterr().err


def test_the_api_sequoia_builder_takes_the_calibrated_vector_and_says_so(tmp_path, monkeypatch):
    from treespec.builders.sequoia import DEFAULT_ACCEPTANCE
    from treespec.planning.calibration import Calibration, Curve, model_calibration_path
    from treespec.planning.shapes import model_shape
    from treespec.runtime.bench import sequoia_builder
    from treespec.targets.loader import tiny_llama

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = types.SimpleNamespace(name="toy", model=tiny_llama())
    default = sequoia_builder(target, "eagle3", budget=8, depth=3)
    assert default.acceptance == tuple(DEFAULT_ACCEPTANCE) and default.acceptance_source.startswith("Sequoia's default")
    Calibration(model="toy", shape=model_shape("smollm2-135m"), context=8, target=Curve.fit((1, 2), [1.0, 1.0]),
                acceptance={"eagle3": (0.6, 0.1)}).save(model_calibration_path("toy", target.model))
    drafter = types.SimpleNamespace(registry_name="eagle3")
    calibrated = sequoia_builder(target, drafter, budget=8, depth=3)
    assert calibrated.acceptance == (0.6, 0.1) and calibrated.acceptance_source.startswith("calibrated: ")
    assert calibrated.budget == 8
    with pytest.raises(TypeError, match="registry_name"):
        sequoia_builder(target, object())


def test_shard_spelling_is_checked():
    from treespec.cli.bench import parse_shard

    assert parse_shard(None) is None and parse_shard("1/1") is None and parse_shard("2/3") == (2, 3)
    for bad in ("0/2", "3/2", "1", "a/b", "1/0", "-1/2"):
        with pytest.raises(ValueError, match="--shard takes K/N"):
            parse_shard(bad)


def test_shards_merge_into_the_run_one_process_makes(tmp_path, monkeypatch):   # ~15 s, in make test
    """3 prompts x 8 tokens, T = 0 and 1, as shards 1/2 and 2/2: the shard that completes last
    merges them into bench.json in prompt order, equal to the unsharded run in every count
    (seeds follow the global prompt index), and deletes the shard files."""
    import treespec.targets
    from treespec.cli import main as cli
    from treespec.cli.bench import merge_shards

    load, loaded = treespec.targets.load_target, {}
    monkeypatch.setattr(treespec.targets, "load_target",
                        lambda name, **kw: loaded.get(name) or loaded.setdefault(name, load(name, **kw)))
    monkeypatch.delenv("TREESPEC_LLAMACPP", raising=False)
    argv = ["bench", "--drafters", "lookup", "--trees", "chain:4", "--temperatures", "0,1", "--prompts", "3",
            "--max-new-tokens", "8", "--no-hf"]
    assert cli.main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*argv, "--shard", "2/2", "--out", str(tmp_path / "two")]) == 0
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["bench-shard2of2.json", "bench-shard2of2.md"]
    assert merge_shards(tmp_path / "two", "bench", 2) is None           # shard 1 not measured yet
    assert cli.main([*argv, "--shard", "1/2", "--out", str(tmp_path / "two")]) == 0
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["bench.json", "bench.md"]
    one = BenchReport.from_json(json.loads((tmp_path / "one" / "bench.json").read_text()))
    two = BenchReport.from_json(json.loads((tmp_path / "two" / "bench.json").read_text()))
    assert two.complete and two.prompts == one.prompts and [p["index"] for p in two.prompts] == [0, 1, 2]
    assert two.settings == {**one.settings, "shards": 2}
    counts = ("tokens", "steps", "emitted", "nodes", "depth_attempts", "depth_accepts", "same_as_plain")
    for key, runs in one.runs.items():
        assert [[getattr(r, c) for c in counts] for r in two.runs[key]] == \
               [[getattr(r, c) for c in counts] for r in runs], key
    md = (tmp_path / "two" / "bench.md").read_text()
    assert "the longest of 2 shards measured in parallel" in md and "--shard K/2" in md
    # a shard measured with other settings is refused by name, never merged silently
    other = json.loads((tmp_path / "one" / "bench.json").read_text())
    other["settings"]["max_new_tokens"] = 9
    for k in (1, 2):
        part = dict(other, settings={**other["settings"], "shard": f"{k}/2"})
        (tmp_path / "two" / f"bench-shard{k}of2.json").write_text(json.dumps(part))
    other["settings"]["max_new_tokens"] = 8
    (tmp_path / "two" / "bench-shard1of2.json").write_text(json.dumps(dict(other, settings={**other["settings"],
                                                                                          "shard": "1/2"})))
    with pytest.raises(ValueError, match="bench-shard2of2.json was measured with other settings"):
        merge_shards(tmp_path / "two", "bench", 2)
    assert cli.main([*argv, "--shard", "1/2"]) == 2                      # no --out: nowhere to merge
