"""llama.cpp as a peer (treespec.runtime.llamacpp), without a llama.cpp build: its timing lines
parsed from captured output, the command lines, the error where it is not built, the prompt's
token count checked, and benchmarks/engine.py's comparison with llama.cpp's plain row."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from _benchmarks import benchmark_module
from treespec.runtime.llamacpp import (
    LlamaCppMode, LlamaCppTools, llamacpp_command, parse_completion_log, parse_speculative_log, run_llamacpp_mode,
)

# llama-completion's stderr after the generation (captured: SmolLM2-135M Q4_1, 1 thread, MT-bench 1)
COMPLETION_LOG = """\
0.03.243.464 I common_perf_print:    sampling time =      15.03 ms
0.03.243.516 I common_perf_print:    samplers time =       7.70 ms /   181 tokens
0.03.243.562 I common_perf_print:        load time =     172.75 ms
0.03.243.604 I common_perf_print: prompt eval time =     410.66 ms /    53 tokens (    7.75 ms per token,   129.06 tokens per second)
0.03.243.649 I common_perf_print:        eval time =    2371.95 ms /   127 runs   (   18.68 ms per token,    53.54 tokens per second)
0.03.243.695 I common_perf_print:       total time =    2875.21 ms /   180 tokens
0.03.243.741 I common_perf_print: unaccounted time =      77.56 ms /   2.7 %      (total - sampling - prompt eval - eval) / (total)
0.03.243.785 I common_perf_print:    graphs reused =        126
"""

# llama-speculative-simple's summary (captured: --spec-type ngram-simple 3/3, MT-bench 6)
SPECULATIVE_LOG = """\
0.03.425.069 I encoded   60 tokens in    0.543 seconds, speed:  110.468 t/s
0.03.425.108 I decoded  131 tokens in    2.438 seconds, speed:   53.728 t/s
0.03.425.176 I n_draft   = 3
0.03.425.209 I n_predict = 131
0.03.425.241 I n_drafted = 32
0.03.425.275 I n_accept  = 19
0.03.425.309 I accept    = 59.375%
0.03.425.549 I common_perf_print:    sampling time =      16.76 ms
0.03.425.582 I common_perf_print:    samplers time =       3.04 ms /   131 tokens
0.03.425.620 I common_perf_print:        load time =     218.21 ms
0.03.425.653 I common_perf_print: prompt eval time =    1193.10 ms /   105 tokens (   11.36 ms per token,    88.01 tokens per second)
0.03.425.687 I common_perf_print:        eval time =    1697.37 ms /   100 runs   (   16.97 ms per token,    58.91 tokens per second)
0.03.425.721 I common_perf_print:       total time =    3000.33 ms /   205 tokens
"""


def test_completion_timings_prefill_decode_and_tokens():
    res = parse_completion_log(COMPLETION_LOG, text="Hello")
    assert res.prompt_tokens == 53 and res.passes == 127 and res.text == "Hello"
    assert res.prefill_s == pytest.approx(0.41066)
    assert res.decode_s == pytest.approx((2875.21 - 410.66) / 1e3)       # the wall time past the prefill
    no_total = parse_completion_log(COMPLETION_LOG.replace("total time", "all time"))
    assert no_total.decode_s == pytest.approx((2371.95 + 15.03) / 1e3)   # eval + sampling
    assert res.tokens == 128                   # the prompt pass samples the first token: 127 runs + 1
    run = res.to_run()
    assert run.seconds == pytest.approx(res.prefill_s + res.decode_s) and run.steps == 0   # plain: no τ
    with pytest.raises(RuntimeError, match="no timing lines.*prompt eval time"):
        parse_completion_log("llama_model_load: error loading model")


def test_speculative_summary_gives_tau_and_acceptance():
    res = parse_speculative_log(SPECULATIVE_LOG)
    # each target pass emits its accepted drafts + 1 token: 131 tokens, 19 accepted -> 112 passes
    assert (res.prompt_tokens, res.tokens, res.passes, res.drafted, res.accepted) == (60, 131, 112, 32, 19)
    assert (res.prefill_s, res.decode_s) == (pytest.approx(0.543), pytest.approx(2.438))
    assert res.tau == pytest.approx(131 / 112) and res.acceptance == pytest.approx(19 / 32)
    run = res.to_run()
    assert run.steps == 112 and run.emitted == 131 and run.prefill_s == pytest.approx(0.543)
    with pytest.raises(RuntimeError, match="n_drafted"):
        parse_speculative_log(SPECULATIVE_LOG.replace("n_drafted", "drafted"))


def test_command_lines_greedy_same_threads_and_each_mode(tmp_path):
    gguf, prompt = tmp_path / "m.gguf", tmp_path / "p.txt"
    plain = llamacpp_command(Path("/b/llama-completion"), LlamaCppMode("plain"), gguf, prompt, 128, 2, 512)
    assert plain[:5] == ["/b/llama-completion", "-m", str(gguf), "-f", str(prompt)]
    flags = dict(zip(plain[5::2], plain[6::2]))
    assert flags["-n"] == "128" and flags["-t"] == flags["-tb"] == "2" and flags["-c"] == "512"
    assert flags["--temp"] == "0" and flags["--top-k"] == "1"            # greedy
    assert "-no-cnv" in plain and "--no-escape" in plain and "--spec-type" not in plain
    ngram = llamacpp_command(Path("/b/x"), LlamaCppMode("ngram", ngram_n=4, ngram_m=6), gguf, prompt, 64, 1, 256)
    assert ngram[ngram.index("--spec-type") + 1] == "ngram-simple"
    assert ngram[ngram.index("--spec-ngram-simple-size-n") + 1] == "4"
    assert ngram[ngram.index("--spec-ngram-simple-size-m") + 1] == "6"
    draft = llamacpp_command(Path("/b/x"), LlamaCppMode("draft", draft_max=5, draft_gguf=Path("/d.gguf")), gguf,
                             prompt, 64, 1, 256)
    assert draft[draft.index("-md") + 1] == "/d.gguf" and draft[draft.index("--spec-type") + 1] == "draft-simple"
    assert draft[draft.index("-td") + 1] == "1" and draft[draft.index("--spec-draft-n-max") + 1] == "5"
    sampled = llamacpp_command(Path("/b/x"), LlamaCppMode("plain"), gguf, prompt, 64, 1, 256, temperature=1.0)
    assert sampled[sampled.index("--temp") + 1] == "1" and sampled[sampled.index("--top-k") + 1] == "0"
    assert LlamaCppMode("ngram").label == "llama.cpp ngram3/3" and LlamaCppMode("plain").tool == "llama-completion"
    mod = llamacpp_command(Path("/b/x"), LlamaCppMode("ngram-mod"), gguf, prompt, 64, 1, 256)
    assert mod[mod.index("--spec-type") + 1] == "ngram-mod" and LlamaCppMode("ngram-mod").tool == "llama-speculative-simple"
    with pytest.raises(ValueError, match="draft_gguf"):
        LlamaCppMode("draft")
    with pytest.raises(ValueError, match="one of"):
        LlamaCppMode("lookahead")


def test_missing_build_names_the_make_target(tmp_path, monkeypatch):
    monkeypatch.delenv("TREESPEC_LLAMACPP", raising=False)
    with pytest.raises(FileNotFoundError, match="make bench-llamacpp") as err:
        LlamaCppTools.locate(tmp_path)
    assert "llama-completion" in str(err.value) and "llama-speculative-simple" in str(err.value)


def fake_tool(folder: Path, name: str, log: str, prompt_tokens: int) -> Path:
    """A stand-in llama.cpp tool: checks the prompt file and greedy flags, prints ``log`` with the
    prompt's token count set to ``prompt_tokens``."""
    tool = folder / name
    log = log.replace("/    53 tokens", f"/    {prompt_tokens} tokens").replace("encoded   60", f"encoded   {prompt_tokens}")
    tool.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv\n"
                    "text = open(args[args.index('-f') + 1]).read()\n"
                    "assert text == '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n\\n', repr(text)\n"
                    "assert args[args.index('--temp') + 1] == '0'\n"
                    f"sys.stdout.write('Hello!')\nsys.stderr.write({log!r})\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return tool


def test_run_checks_the_prompt_token_count(tmp_path, monkeypatch):
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    fake_tool(tmp_path, "llama-completion", COMPLETION_LOG, 9)
    fake_tool(tmp_path, "llama-speculative-simple", SPECULATIVE_LOG, 9)
    monkeypatch.setenv("TREESPEC_LLAMACPP", str(tmp_path))
    tools = LlamaCppTools.locate()
    plain = run_llamacpp_mode(tools.binary(LlamaCppMode("plain")), LlamaCppMode("plain"), tmp_path / "m.gguf", text,
                              9, 128, 1)
    assert plain.tokens == 128 and plain.text == "Hello!"
    ngram = run_llamacpp_mode(tools.binary(LlamaCppMode("ngram")), LlamaCppMode("ngram"), tmp_path / "m.gguf", text,
                              9, 128, 1)
    assert ngram.drafted == 32
    with pytest.raises(RuntimeError, match="held 9 tokens, treespec's tokenizer gives 10"):
        run_llamacpp_mode(tools.binary(LlamaCppMode("plain")), LlamaCppMode("plain"), tmp_path / "m.gguf", text, 10,
                          128, 1)


def test_engine_compares_every_row_with_llamacpp_plain_by_prompt():
    def rows(rates, prefill=0.5, **extra):
        return [{"tokens": 60, "time": 60 / r, "prefill": prefill, **extra} for r in rates]

    data = {"rows": {"0": {
        "fp32 treespec plain": rows([40.0, 40.0, 20.0]),
        "fp32 treespec chain": rows([60.0, 60.0, 30.0]),
        "gguf llama.cpp plain": rows([50.0, 50.0, 50.0], passes=59, drafted=0, accepted=0, mode="plain"),
        "gguf llama.cpp ngram3/3": rows([55.0, 55.0, 55.0], passes=40, drafted=30, accepted=20, mode="ngram")}}}
    with benchmark_module("engine") as engine:
        s = engine.summarize(data)["0"]
        lines = engine.limit_lines({**data, "summary": {"0": s}, "limits": {
            "copy_bandwidth_bytes_per_s": 10e9,
            "groups": {"gguf": {"bytes_per_pass": 1e8, "what": "GGUF tensors", "passes_per_s_limit": 100.0}}}})
    assert s["fastest_plain"] == "fp32 treespec plain"       # llama.cpp is a peer, not treespec's baseline
    chain = s["rows"]["fp32 treespec chain"]
    assert chain["vs_llamacpp_plain_paired"] == pytest.approx(60 / 50)      # median of 1.2, 1.2, 0.6
    assert chain["decode_tokens_per_s_pooled"] == pytest.approx(180 / (0.5 + 0.5 + 1.5))   # prefills left out
    ngram = s["rows"]["gguf llama.cpp ngram3/3"]
    assert ngram["tau"] == pytest.approx(60 / 40) and ngram["acceptance"] == pytest.approx(20 / 30)
    assert ngram["vs_same_dtype_plain"] == pytest.approx(55 / 50)            # against llama.cpp plain
    assert s["rows"]["gguf llama.cpp plain"].get("tau") is None
    assert any(line.startswith("| gguf llama.cpp ngram3/3 |") and "150" in line for line in lines)


def test_qwen_rows_need_the_build_and_the_qwen_gguf(tmp_path, monkeypatch):
    import argparse

    monkeypatch.delenv("TREESPEC_LLAMACPP", raising=False)
    with benchmark_module("qwen") as qwen:
        assert qwen.llamacpp_modes(argparse.Namespace(llamacpp=None, llamacpp_draft_max=3)) == []
        with pytest.raises(FileNotFoundError, match="make bench-llamacpp"):
            qwen.llamacpp_modes(argparse.Namespace(llamacpp=str(tmp_path), llamacpp_draft_max=3))


def test_generated_text_leaves_out_the_echoed_prompt_and_end_markers():
    from treespec.runtime.llamacpp import generated_text, same_greedy_text

    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert generated_text("\n\n" + prompt + "Hello there.\n\n", prompt) == "Hello there."    # speculative-simple
    assert generated_text("Hello there. [end of text]\n", prompt) == "Hello there."         # completion at EOS
    assert generated_text("Hello there. [end of text]\n\n", prompt) == "Hello there."
    assert same_greedy_text("Hello there", "Hello there, friend") and not same_greedy_text("Hello", "Help")
