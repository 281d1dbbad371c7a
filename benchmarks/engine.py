"""Engine benchmark, full size: plain decoding and the peers against treespec, per dtype.

Rows, all run side by side prompt by prompt (interleaved, so machine noise hits all alike), on
MT-bench first turns through the chat template, at T = 0 (greedy) and T = 1 (sampled, seeded):
- plain decoding: HF ``generate`` on the stock model and on the packed model
  (``treespec.fastpath.packing``: plain decoding gets faster too, bf16 packed and fp32 on the panel
  GEMM), and treespec's own loop with a one-node tree (``treespec plain``: no drafter, the
  target's cache appending in place, ``treespec.fastpath.kvcache``); the fastest of them is the
  honest baseline;
- HF assisted generation with the shipped ``small`` drafter, HF prompt lookup (stock fp32 model,
  as a user runs them; ``--all-peers`` adds them in bf16);
- treespec on the packed target with the shipped eagle3 head: a chain, a best-first tree, and
  ``builder="auto"`` (the cost model with this machine's calibration of the same path);
  ``--hybrid`` adds a best-first tree and ``builder="auto"`` drafted by prompt lookup + eagle3
  (``hybrid``, calibrated as its own drafter);
- treespec lookup adaptive: prompt lookup (suffix n-grams of ``--lookup-min-ngram`` tokens or
  more) drafting an adaptive chain (``ChainBuilder(budget=k + 1, min_confidence=...)``): up to k tokens
  where the text repeats, no draft (a plain step) where it does not;
- ``--llamacpp BIN_DIR`` (built by ``make bench-llamacpp``): llama.cpp on the same GGUF file, the same
  templated prompt (its token count checked) and thread count: its plain decoding (greedy, and
  at T = 1 with its own seeded sampler) and its n-gram speculation (greedy only; ngram-simple:
  prompt lookup; ngram-mod)
  (``treespec.runtime.llamacpp``), timed by
  its own counters; their rows are the ``gguf`` group, and every row gets its ratio to
  ``llama.cpp plain`` paired by prompt.
fp32 is the exact reference target; bf16 rows run only where the CPU has native bf16 units, amx
rows only where it has AMX-BF16 (the fp32 model with its linear layers on the AMX block kernel,
each linear input rounded to bf16: ``load_target(..., pack="amx")``); ``--dtypes x8`` asks for x8 rows
(the fp32 model's exact integer blocks times each linear input rounded to 8-bit integers per block of
32, as llama.cpp multiplies: ``pack="x8"``; ``x8-compiled``: its passes compiled). bf16, amx and x8
targets are different targets:
their rows are compared with plain decoding of the same target, and with the
fastest plain decoding of any of them, so a row cannot win by slowing its own baseline. At T = 1 every output is scored under the fp32 target (mean log-likelihood
per token): bf16 speculative decoding must not cost quality against bf16 plain decoding.

    python benchmarks/engine.py --prompts 20 --max-new-tokens 128 --threads 1

Writes benchmarks/results/engine.{json,md} after every prompt; ``--resume`` continues a cut-short
run from its JSON. Speedups are ratios of median per-prompt tokens/s (prefill included), with
the same comparison paired by prompt and pooled over all prompts beside them (``--render``
rewrites an older result's Markdown with them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

import treespec
from harness import RESULTS, hf_generate, log_likelihood, machine_info, machine_line, write_results
from treespec.cli.main import ensure_calibration, make_builder
from treespec.planning import auto_threshold_text
from treespec.runtime.bench import Run, paired_ratio, pooled_rate, pooled_ratio   # treespec bench's ratios
from treespec.data import chat_prompt, mtbench_questions
from treespec.fastpath.kernels import amx_status, panel_status
from treespec.fastpath.packing import cpu_info
from treespec.builders import BestFirstBuilder
from treespec.runtime.compiled import DEFAULT_BUCKETS, compile_target, parse_buckets
from treespec.runtime.llamacpp import LlamaCppMode, LlamaCppTools, gguf_path, run_llamacpp_mode, same_greedy_text

# plain decoding rows: HF generate (stock, and on the packed path) and treespec's own loop with a
# one-node tree (no drafter; its target cache appends in place, treespec.fastpath.kvcache)
PLAIN = ("HF generate", "HF generate (packed)", "treespec plain", "llama.cpp plain")
LLAMACPP_GROUP = "gguf"     # the llama.cpp rows' "dtype": the GGUF file's own weights and kernels


def is_plain(name: str) -> bool:
    """Whether a result row ("<dtype> <row>", e.g. "fp32 treespec plain") decodes plainly."""
    return name.split(" ", 1)[1] in PLAIN


X8 = ("x8", "x8-compiled")   # the x8 target's groups: eager, and its passes compiled


def auto_path(gen, calibration_path, drafter: str) -> str:
    """What a builder="auto" row runs: its trees at T = 0 and 1, the calibration, the
    speculation threshold and the generator's own work with ``drafter``."""
    return (f"T = 0: {gen.builder.config}, T = 1: {gen.builder_for(1.0).config} (calibration "
            f"{calibration_path}; {auto_threshold_text(gen.calibration)}; {gen.calibration.loop_text(drafter)})")


def build(args):
    """{dtype: {row name: callable(ids, T, seed) -> record}} and the fp32 scorer."""
    dtypes = ["fp32"] + (["bf16"] if cpu_info().native_bf16 else []) + (["amx"] if amx_status()[0] else [])
    x8 = ["x8", "x8-compiled"] if panel_status()[0] else []   # asked for by name: x8 is its own target
    if args.dtypes:
        asked = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        valid = dtypes + ["compiled"] + x8     # compiled: the fp32 target's passes compiled (Target.compiled)
        if not asked or set(asked) - set(valid):
            raise SystemExit(f"--dtypes takes a comma-separated subset of {valid} on this CPU, got {args.dtypes!r}")
        dtypes = [d for d in valid if d in asked]
    runners, paths, stocks = {}, {}, {}
    scorer = None
    for d in dtypes:
        dtype = torch.bfloat16 if d == "bf16" else torch.float32
        if dtype not in stocks:
            stocks[dtype] = treespec.load_target("smollm2-135m", dtype=dtype, pack=False)
        stock = stocks[dtype]
        if d in X8 or d == "amx":
            pack = "x8" if d in X8 else "amx"
        elif d in ("fp32", "compiled") and args.fp32_kernel != "auto":
            pack = args.fp32_kernel
        else:
            pack = True
        packed = treespec.load_target("smollm2-135m", dtype=dtype, pack=pack)
        if d in ("compiled", "x8-compiled"):
            packed = compile_target(packed, buckets=args.buckets)
        paths[d] = {"packed": packed.speed_path} if d in ("amx", "compiled") + X8 else {"stock": stock.speed_path,
                                                                      "packed": packed.speed_path}
        if d == "fp32":
            scorer = stock.model
        eos = list(stock.eos_token_ids)
        eagle3 = treespec.load_drafter("eagle3", packed)
        skipped = {s.strip() for s in args.skip.split(",")}
        # the calibration (of this thread count) only where an auto row runs: measuring it for
        # another thread count replaces the cached one
        cal = ensure_calibration(packed, "eagle3") if "treespec auto" not in skipped else None
        gens = {
            "treespec chain": treespec.SpeculativeGenerator(
                packed, eagle3, make_builder("chain", args.chain_k + 1, 5, 4)),
            f"treespec best-first {args.budget}": treespec.SpeculativeGenerator(
                packed, eagle3, BestFirstBuilder(args.budget, max_width=4)),
        }
        if cal is not None:
            gens["treespec auto"] = treespec.SpeculativeGenerator(packed, eagle3, "auto")
        if args.hybrid:
            hybrid = treespec.load_drafter("hybrid", packed)
            hybrid_cal = ensure_calibration(packed, "hybrid")   # the same file, the hybrid's entries added
            gens[f"treespec hybrid best-first {args.budget}"] = treespec.SpeculativeGenerator(
                packed, hybrid, BestFirstBuilder(args.budget, max_width=4))
            gens["treespec hybrid auto"] = treespec.SpeculativeGenerator(packed, hybrid, "auto")
        lookup = treespec.load_drafter("lookup", packed, max_ngram=max(3, args.lookup_min_ngram),
                                       min_ngram=args.lookup_min_ngram)
        gens["treespec lookup adaptive"] = treespec.SpeculativeGenerator(
            packed, lookup, make_builder("chain", args.chain_k + 1, 5, 4, min_confidence=args.min_confidence))
        if cal is not None:
            paths[d]["auto"] = auto_path(gens["treespec auto"], cal, "eagle3")
        if args.hybrid:
            paths[d]["hybrid auto"] = auto_path(gens["treespec hybrid auto"], hybrid_cal, "hybrid")
        paths[d]["lookup adaptive"] = f"{lookup.config}, {gens['treespec lookup adaptive'].builder}"
        rows = {}
        peers = d not in ("compiled", "x8-compiled")   # their stock model is fp32's: its HF rows would be fp32's again
        if d not in ("amx",) + X8 and peers:   # their stock model is fp32's: its row would be fp32's HF generate again
            rows["HF generate"] = lambda ids, t, s, m=stock.model, e=eos: hf_generate(m, ids, args.max_new_tokens, e, t, s)
        if (d == "fp32" or args.all_peers and peers) and "HF assisted (small)" not in skipped:   # as a user runs them
            small = treespec.load_drafter("small", stock).model
            rows["HF assisted (small)"] = lambda ids, t, s, m=stock.model, e=eos, a=small: hf_generate(
                m, ids, args.max_new_tokens, e, t, s, assistant=a)
        if d == "fp32" or args.all_peers and peers:
            rows["HF prompt lookup"] = lambda ids, t, s, m=stock.model, e=eos: hf_generate(
                m, ids, args.max_new_tokens, e, t, s, lookup=args.chain_k)
        # plain decoding on the fast path: the honest baseline wherever it is faster (bf16 packed,
        # fp32 on the panel GEMM)
        plain = treespec.SpeculativeGenerator(
            packed, eagle3, treespec.DynamicTreeBuilder(budget=1, depth=1, top_k=1))   # budget 1: no drafting
        hf_packed = lambda ids, t, s, m=packed.model, e=eos: hf_generate(m, ids, args.max_new_tokens, e, t, s)
        # a dtype's first row is its greedy reference: for amx, treespec's plain loop, whose prompt
        # pass the trees share (HF generate scores the prompt's last token inside that pass)
        if d in ("compiled", "x8-compiled"):
            rows["treespec plain"] = plain
        elif d in ("amx", "x8"):
            rows.update({"treespec plain": plain, "HF generate (packed)": hf_packed})
        else:
            rows.update({"HF generate (packed)": hf_packed, "treespec plain": plain})
        for name, g in gens.items():
            rows[name] = g
        runners[d] = rows
    if args.llamacpp:
        runners[LLAMACPP_GROUP], paths[LLAMACPP_GROUP] = llamacpp_rows(args)
    if scorer is None:   # the fp32 rows left out: the log-likelihoods still score under the fp32 target
        scorer = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=False).model
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    names = {n for rows in runners.values() for n in rows} | {"HF assisted (small)", "treespec auto"}   # not built
    if skip - names:
        raise SystemExit(f"--skip names no row: {sorted(skip - names)}; rows are {sorted(names)}")
    return {d: {n: r for n, r in rows.items() if n not in skip} for d, rows in runners.items()}, paths, scorer


class LlamaCppRow:
    """A llama.cpp mode as a row on SmolLM2's GGUF, the prompt as templated text: greedy, and
    for plain decoding also sampled at T > 0 (its own sampler, seeded; top-k, top-p, min-p off)."""

    def __init__(self, tools: LlamaCppTools, mode: LlamaCppMode, tokenizer, max_new: int, threads: int):
        self.tools, self.mode, self.tokenizer, self.max_new, self.threads = tools, mode, tokenizer, max_new, threads
        self.gguf = gguf_path("smollm2-135m")

    def __call__(self, ids: torch.Tensor, temperature: float, seed: int) -> tuple[str, float, dict]:
        """(generated text, seconds with the prefill, counters) for prompt ids ``ids`` [P]."""
        if temperature != 0 and self.mode.name != "plain":
            raise ValueError(f"llama.cpp's {self.mode.name} row runs greedy only (T = 0)")
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        res = run_llamacpp_mode(self.tools.binary(self.mode), self.mode, self.gguf, text, ids.numel(), self.max_new,
                                self.threads, temperature=temperature, seed=seed)
        return res.text, res.seconds, {"n_tokens": res.tokens, "prefill": res.prefill_s, "passes": res.passes,
                                       "drafted": res.drafted, "accepted": res.accepted, "mode": self.mode.name,
                                       "prompt_tokens": res.prompt_tokens, "text": res.text}


def llamacpp_rows(args) -> tuple[dict, dict]:
    """The llama.cpp rows of ``--llamacpp-modes`` and their paths (build, GGUF, command)."""
    tools = LlamaCppTools.locate(args.llamacpp)
    tokenizer = treespec.load_target("smollm2-135m", pack=False).tokenizer
    n, m = (int(x) for x in args.llamacpp_ngram.split("/"))
    names = [x.strip() for x in args.llamacpp_modes.split(",") if x.strip()]
    if set(names) - {"plain", "ngram", "ngram-mod"}:
        raise SystemExit(f"--llamacpp-modes takes plain, ngram, ngram-mod; got {args.llamacpp_modes!r}")
    modes = [LlamaCppMode("ngram", ngram_n=n, ngram_m=m) if name == "ngram" else LlamaCppMode(name) for name in names]
    rows = {mode.label: LlamaCppRow(tools, mode, tokenizer, args.max_new_tokens, args.threads) for mode in modes}
    info = tools.build_info()
    paths = {"llama.cpp": f"{tools.bin_dir} ({info.get('source', 'build info missing')}, build "
                          f"{info.get('llama_cpp_build_number', '?')}, {' '.join(info.get('cmake_flags', []))}) on "
                          f"{gguf_path('smollm2-135m')}, {args.threads} thread(s), --temp 0 --top-k 1 (T = 0); "
                          f"plain at T > 0: --temp T --top-k 0 --top-p 1 --min-p 0 --seed 1000 + prompt index"}
    return rows, paths


def run_row(runner, ids, temperature, seed, max_new):
    if isinstance(runner, LlamaCppRow):
        return runner(ids, temperature, seed)
    if isinstance(runner, treespec.SpeculativeGenerator):
        t0 = time.perf_counter()
        res = runner.generate(ids, max_new_tokens=max_new, temperature=temperature, seed=seed)
        dt = time.perf_counter() - t0
        s = res.stats
        return res.token_ids, dt, {"tau": s.tau, "steps": s.steps, "nodes": s.tree_nodes, "draft": s.draft_time,
                                   "verify": s.verify_time, "accept": s.accept_time, "other": s.other_time,
                                   "prefill": s.prefill_time}
    out, dt = runner(ids, temperature, seed)
    return out, dt, {}


def _runs(records: list[dict]) -> list[Run]:
    """A row's records as treespec bench's runs (new tokens, wall seconds with the prefill, the
    prefill where the row knows it)."""
    return [Run(tokens=r["tokens"], seconds=r["time"], prefill_s=r.get("prefill")) for r in records]


def summarize(data: dict) -> dict:
    """Per temperature: per row median tokens/s, speedups, τ, time split, quality."""
    summary = {}
    for temp, by_row in data["rows"].items():
        med = {name: statistics.median(r["tokens"] / r["time"] for r in rs) for name, rs in by_row.items() if rs}
        plain = {n: v for n, v in med.items() if is_plain(n)}
        # treespec's own baseline: the fastest plain decoding of treespec's paths (llama.cpp's is a
        # peer, compared in its own column)
        ours = {n: v for n, v in plain.items() if not n.startswith(LLAMACPP_GROUP + " ")} or plain
        fastest_plain = max(ours, key=ours.get)
        llama = by_row.get(f"{LLAMACPP_GROUP} llama.cpp plain")
        hf = med.get("fp32 HF generate")
        table = {}
        for name, rs in by_row.items():
            if not rs:
                continue
            d = name.split(" ", 1)[0]
            same = max(v for n, v in plain.items() if n.startswith(d + " "))
            ref = by_row[fastest_plain]
            e = {"tokens_per_s": med[name], "vs_same_dtype_plain": med[name] / same,
                 "vs_fastest_plain": med[name] / plain[fastest_plain],
                 # the same comparison paired by prompt, and pooled: robust where host drift between
                 # prompts moves the medians of the two rows' rates apart
                 "vs_fastest_plain_paired": paired_ratio(_runs(rs), _runs(ref)),
                 "vs_fastest_plain_pooled": pooled_ratio(_runs(rs), _runs(ref)),
                 "vs_fp32_hf_generate": med[name] / hf if hf else None, "prompts": len(rs),
                 "tokens_per_s_pooled": pooled_rate(_runs(rs)),
                 "decode_tokens_per_s_pooled": pooled_rate(_runs(rs), decode_only=True)}
            if llama and len(llama) == len(rs):     # the same prompts, rows run back to back
                e["vs_llamacpp_plain_paired"] = paired_ratio(_runs(rs), _runs(llama))
                e["vs_llamacpp_plain_pooled"] = pooled_ratio(_runs(rs), _runs(llama))
                e["vs_llamacpp_plain_decode_pooled"] = pooled_ratio(_runs(rs), _runs(llama), decode_only=True)
            if "passes" in rs[0] and rs[0]["mode"] != "plain":   # llama.cpp's speculation: τ, acceptance
                passes, drafted = sum(r["passes"] for r in rs), sum(r["drafted"] for r in rs)
                e["tau"] = sum(r["tokens"] for r in rs) / passes if passes else None
                e["acceptance"] = sum(r["accepted"] for r in rs) / drafted if drafted else None
            if "same_as_plain" in rs[0]:
                e["same_as_plain"] = sum(r["same_as_plain"] for r in rs)
            if "tau" in rs[0]:
                steps = sum(r["steps"] for r in rs)
                e.update({"tau": sum(r["tau"] * r["steps"] for r in rs) / steps,
                          "nodes": sum(r["nodes"] for r in rs) / steps,
                          **{f"{k}_ms": 1e3 * sum(r[k] for r in rs) / steps
                             for k in ("draft", "verify", "accept", "other")},
                          # the prefill (the target's and the drafter's) spread over the tokens
                          "prefill_ms_per_token": 1e3 * sum(r.get("prefill", 0.0) for r in rs)
                          / max(1, sum(r["tokens"] for r in rs))})
            lls = [r["ll"] / r["ll_n"] for r in rs if r.get("ll_n")]
            if len(lls) >= 2:
                e["ll_mean"] = statistics.mean(lls)
                e["ll_ci95"] = 1.96 * statistics.stdev(lls) / math.sqrt(len(lls))
            table[name] = e
        summary[temp] = {"fastest_plain": fastest_plain, "rows": table, "quality": quality(by_row, plain)}
    return summary


def quality(by_row: dict, plain: dict) -> dict:
    """Paired per-prompt difference of the mean fp32 log-likelihood per token, each treespec row
    minus the fastest plain decoding of its dtype (same prompts): mean, 95 % CI, paired t-test p."""
    from scipy import stats

    out = {}
    for name, rs in by_row.items():
        d = name.split(" ", 1)[0]
        if " treespec " not in name or is_plain(name) or not rs or "ll_n" not in rs[0]:
            continue
        base = max((n for n in plain if n.startswith(d + " ")), key=plain.get)
        pairs = [(r["ll"] / r["ll_n"], b["ll"] / b["ll_n"]) for r, b in zip(rs, by_row[base])
                 if r.get("ll_n") and b.get("ll_n")]
        if len(pairs) < 3:
            continue
        diff = [a - b for a, b in pairs]
        sd = statistics.stdev(diff)
        out[name] = {"against": base, "prompts": len(diff), "mean_diff": statistics.mean(diff),
                     "ci95": stats.t.ppf(0.975, len(diff) - 1) * sd / math.sqrt(len(diff)),
                     "p_value": float(stats.ttest_rel([a for a, _ in pairs], [b for _, b in pairs]).pvalue)}
    return out


def limiter(summary_t: dict, goal: float) -> list[str]:
    """Why the best treespec row of each dtype is where it is: τ, verify cost, draft cost."""
    lines = []
    rows = summary_t["rows"]
    for d in ("fp32", "bf16", "amx", "compiled") + X8:
        spec = {n: e for n, e in rows.items() if n.startswith(d + " treespec") and not is_plain(n)}
        if not spec:
            continue
        best = max(spec, key=lambda n: spec[n]["tokens_per_s"])
        e = spec[best]
        plain_name = max((n for n in rows if n.startswith(d + " ") and is_plain(n)),
                         key=lambda n: rows[n]["tokens_per_s"])
        plain_ms = 1e3 / rows[plain_name]["tokens_per_s"]   # its prefill included
        step = e["draft_ms"] + e["verify_ms"] + e["accept_ms"] + e["other_ms"]
        prefill = e.get("prefill_ms_per_token", 0.0)       # absent from results written before it was kept
        budget = plain_ms / goal - prefill                  # what a token may cost in steps at the goal
        need_tau = f"τ {step / budget:.2f}" if budget > 0 else "more than any τ (the prefill alone is too slow)"
        lines.append(
            f"- {best}: τ {e['tau']:.2f}, {e['nodes']:.1f} nodes per step; per step draft {e['draft_ms']:.1f} ms + "
            f"verify {e['verify_ms']:.1f} ms + accept/other {e['accept_ms'] + e['other_ms']:.1f} ms = {step:.1f} ms, "
            f"and its prefill (target and drafter) adds {prefill:.1f} ms a token; against {plain_ms:.1f} ms per "
            f"token of {plain_name}, its prefill included (verify ratio {e['verify_ms'] / plain_ms:.2f}, draft "
            f"{e['draft_ms'] / plain_ms:.2f} of a plain token). At this step cost {goal:g}x needs {need_tau}; at "
            f"this τ it needs a step of {e['tau'] * budget:.1f} ms.")
    return lines


def limit_lines(data: dict) -> list[str]:
    """The physical limit of each row group: bytes a target pass reads / one core's copy
    bandwidth, and for each row its τ times that (the drafter's reads left out)."""
    lim = data["limits"]
    bw = lim["copy_bandwidth_bytes_per_s"]
    lines = [f"Physical limit: one core copies {bw / 1e9:.1f} GB/s (a 1 GiB numpy copy, bytes read + written, "
             "measured at the start on the loaded host); a target pass reads:"]
    for group, g in lim["groups"].items():
        lines.append(f"- {group}: {g['bytes_per_pass'] / 1e6:.1f} MB ({g['what']}): at most "
                     f"{g['passes_per_s_limit']:.0f} passes/s")
    lines += ["", "| row (T = 0) | tokens/s, decode only | limit: τ × passes/s | of the limit |", "| --- | ---: | ---: | ---: |"]
    for name, e in data["summary"].get("0", {}).get("rows", {}).items():
        g = lim["groups"].get(name.split(" ", 1)[0])
        rate = e.get("decode_tokens_per_s_pooled")
        if g is None or not rate:
            continue
        limit = (e.get("tau") or 1.0) * g["passes_per_s_limit"]
        lines.append(f"| {name} | {rate:.1f} | {limit:.0f} | {100 * rate / limit:.0f} % |")
    if data.get("llama_bench"):
        runs = {(r["n_prompt"], r["n_gen"]): r for r in data["llama_bench"]}
        one = runs.get((1, 0))
        lines += ["", f"`llama-bench` on the same GGUF ({data['llama_bench'][0]['n_threads']} thread(s)): "
                  + ", ".join(f"{'tg' + str(g) if g else 'pp' + str(p)} {r['avg_ts']:.1f} ± {r['stddev_ts']:.1f} "
                              "tokens/s" for (p, g), r in runs.items())
                  + ("; a pass over n tokens costs " + ", ".join(
                      f"{one['avg_ts'] / r['avg_ts'] * p:.1f}x (n = {p})" for (p, g), r in runs.items() if p > 1 and not g)
                     + " a 1-token pass: its CPU kernels are compute-bound past one row" if one else "")
                  + (f". {data['llama_bench_note']}" if data.get("llama_bench_note") else "")]
    return lines


def write(data: dict, out: Path) -> str:
    data["summary"] = summarize(data)
    m, a = data["machine"], data["args"]
    n_prompts = min(len(rs) for t in data["rows"].values() for rs in t.values())
    lines = [
        f"# Engine benchmark: {n_prompts} MT-bench prompts x {a['max_new_tokens']} new tokens",
        "",
        f"{machine_line(m)} Wall time {data['wall_s'] / 60:.1f} min; load average during the run "
        f"{min(data['load']):.1f}-{max(data['load']):.1f} (other processes shared the 2 cores when > 1). "
        f"{data.get('note', '')}",
        "",
        "Paths: " + "; ".join(f"{d} {k}: {v}" for d, p in data["paths"].items() for k, v in p.items()),
        "",
        "Speedups are ratios of median per-prompt tokens/s (prefill included). *same dtype* = against the "
        "fastest plain decoding of that dtype; *fastest plain* = against the fastest plain decoding of any "
        "dtype on this machine; *paired* = the median over prompts of the per-prompt ratio against that same "
        "fastest plain decoding (a prompt's rows run back to back, so drift of the host between prompts "
        "cancels); *pooled* = all tokens over all seconds, against the same. On a quiet host the three agree "
        "within a few per cent; where they part, the host moved during the run and paired is the one to "
        "trust. *fp32 HF* = against stock fp32 HF `generate`. ll = mean per-token "
        "log-likelihood of the output under the fp32 target (T = 1; ± 95 % CI over prompts). = plain: prompts "
        "whose greedy output equals the first row of the same dtype token for token (stock HF `generate`; for "
        "amx and x8, treespec's plain loop: HF `generate` scores the prompt's last token inside the prompt's "
        "pass, whose attention rounds differently from a one-token step's, and these kernels' rounding of each "
        "linear input (to bf16, to 8-bit integers) can turn that last-bit difference into another token).",
    ]
    if "limits" in data:
        lines += ["", *limit_lines(data)]
    for temp, s in data["summary"].items():
        lines += ["", f"## T = {temp}", "",
                  f"Fastest plain decoding: {s['fastest_plain']}.", "",
                  "| row | tokens/s | pooled, decode only | same dtype | fastest plain | paired | pooled | fp32 HF | "
                  "llama.cpp plain, paired / decode pooled | τ | nodes | draft / verify / other ms per step | ll | "
                  "= plain |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
        for name, e in s["rows"].items():
            tau = f"{e['tau']:.2f}" if e.get("tau") is not None else "-"
            if e.get("acceptance") is not None:
                tau += f" ({100 * e['acceptance']:.0f} % of drafts)"
            rate = lambda v: f"{v:.1f}" if v else "-"     # noqa: E731
            pooled = f"{rate(e.get('tokens_per_s_pooled'))}, {rate(e.get('decode_tokens_per_s_pooled'))}"
            vs = (f"{e['vs_llamacpp_plain_paired']:.2f}x / {e['vs_llamacpp_plain_decode_pooled'] or 0:.2f}x"
                  if e.get("vs_llamacpp_plain_paired") else "-")
            nodes = f"{e['nodes']:.1f}" if "nodes" in e else "-"
            split = (f"{e['draft_ms']:.1f} / {e['verify_ms']:.1f} / {e['accept_ms'] + e['other_ms']:.1f}"
                     if "draft_ms" in e else "-")
            ll = f"{e['ll_mean']:.3f} ± {e['ll_ci95']:.3f}" if "ll_mean" in e else "-"
            hf = f"{e['vs_fp32_hf_generate']:.2f}x" if e["vs_fp32_hf_generate"] else "-"
            lines.append(f"| {name} | {e['tokens_per_s']:.1f} | {pooled} | {e['vs_same_dtype_plain']:.2f}x | "
                         f"{e['vs_fastest_plain']:.2f}x | {e['vs_fastest_plain_paired']:.2f}x | "
                         f"{e['vs_fastest_plain_pooled']:.2f}x | {hf} | {vs} | {tau} | {nodes} | {split} | {ll} | "
                         f"{str(e['same_as_plain']) + '/' + str(e['prompts']) if 'same_as_plain' in e else '-'} |")
        if s.get("quality"):
            lines += ["", "Quality (paired over prompts): mean log-likelihood per token under the fp32 target, "
                      "speculative minus plain decoding of the same dtype. The fp32 rows are exact by construction (same output "
                      "law as plain decoding), so their differences show how far two runs of one law drift apart "
                      f"on {n_prompts} sampled texts: the noise level against which the bf16 rows are read.", ""]
            for name, q in s["quality"].items():
                lines.append(f"- {name} − {q['against']}: {q['mean_diff']:+.3f} ± {q['ci95']:.3f} (95 % CI, "
                             f"{q['prompts']} prompts; paired t-test p = {q['p_value']:.2f})")
        goal = 1.5 if temp == "0" else 1.2       # issue 28's goals at T = 0 and T = 1
        lines += ["", f"What holds the best rows back (goal {goal}x over the fastest plain decoding of their "
                      f"dtype):", ""]
        lines += limiter(s, goal)
        lines += ["", "The step arithmetic uses means (over steps, and the prefill over tokens) and counts both "
                      "sides' prefill (results written before the prefill was kept count none of it: about 6 % "
                      "optimistic here); the ratios in the table are medians of per-prompt rates, so the two can "
                      "differ by a few per cent."]
    md = "\n".join(lines) + "\n"
    write_results(out, data, md)
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--chain-k", type=int, default=3, help="chain length and prompt-lookup tokens")
    ap.add_argument("--budget", type=int, default=8, help="best-first tree nodes incl. the root")
    ap.add_argument("--lookup-min-ngram", type=int, default=3,
                    help="lookup adaptive: the shortest repeated suffix that may propose a draft")
    ap.add_argument("--min-confidence", type=float, default=0.5,
                    help="lookup adaptive: the chain stops where its draft confidence falls below this")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--buckets", default=DEFAULT_BUCKETS, type=parse_buckets,
                    help="node counts the compiled rows' graphs are compiled for (each takes minutes the first "
                         "time with Inductor's C++ wrapper; auto plans no tree past the largest)")
    ap.add_argument("--fp32-kernel", default="auto", choices=("auto", "blocks", "panel", "onednn"),
                    help="the fp32 packed rows' linear kernel (auto: the CPU decides: the block kernel "
                         "wherever there is AVX2)")
    ap.add_argument("--hybrid", action="store_true",
                    help="add a best-first row and an auto row with the hybrid drafter (prompt lookup + eagle3)")
    ap.add_argument("--all-peers", action="store_true",
                    help="also run HF assisted / prompt lookup in bf16 (default: fp32 only, as users run them)")
    ap.add_argument("--dtypes", default="",
                    help="comma-separated subset of fp32,bf16,amx,compiled,x8 (default: fp32, bf16 where the CPU "
                         "has it natively, amx where it has AMX-BF16; compiled: the fp32 target with its passes "
                         "compiled, treespec's rows only; x8: the blocks times 8-bit inputs, asked for by name; "
                         "x8-compiled: that target with its passes compiled)")
    ap.add_argument("--llamacpp", default=None, metavar="BIN_DIR",
                    help="add llama.cpp's rows (T = 0): the bin folder of `make bench-llamacpp` "
                         "(.cache/llama.cpp/build/bin) or a binary in it")
    ap.add_argument("--llamacpp-modes", default="plain,ngram,ngram-mod",
                    help="llama.cpp rows: plain, ngram (ngram-simple, --llamacpp-ngram), ngram-mod")
    ap.add_argument("--llamacpp-ngram", default="3/3", metavar="N/M",
                    help="llama.cpp's ngram row: look up the last N tokens, draft the M after the match")
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out, e.g. 'HF prompt lookup'")
    ap.add_argument("--note", default="", help="how the machine was used during the run")
    ap.add_argument("--resume", action="store_true", help="continue the run saved at --out")
    ap.add_argument("--out", default=str(RESULTS / "engine"))
    ap.add_argument("--render", action="store_true", help="only rewrite the Markdown from the JSON at --out")
    args = ap.parse_args()
    if args.render:
        print(write(json.loads(Path(args.out).with_suffix(".json").read_text()), Path(args.out)))
        return
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    temps = [t.strip() for t in args.temperatures.split(",")]
    runners, paths, scorer = build(args)
    names = [f"{d} {n}" for d, rows in runners.items() for n in rows]
    # llama.cpp's speculation: T = 0 only (its plain decoding samples at T > 0 too)
    greedy_only = {f"{LLAMACPP_GROUP} {n}" for n, r in runners.get(LLAMACPP_GROUP, {}).items() if r.mode.name != "plain"}
    names_at = {t: [n for n in names if float(t) == 0 or n not in greedy_only] for t in temps}
    if args.resume and out.with_suffix(".json").exists():
        data = json.loads(out.with_suffix(".json").read_text())
        data["note"] = " ".join(x for x in (data.get("note", ""), args.note) if x)
    else:
        data = {"machine": machine_info(), "args": vars(args), "paths": paths, "note": args.note, "wall_s": 0.0,
                "load": [], "rows": {t: {n: [] for n in names_at[t]} for t in temps}}
        if args.llamacpp:
            from llamacpp import llama_bench, physical_limits

            data["limits"] = physical_limits(runners)
            data["llama_bench"] = llama_bench(LlamaCppTools.locate(args.llamacpp), gguf_path("smollm2-135m"),
                                              args.threads)
    tokenizer = treespec.load_target("smollm2-135m", pack=False).tokenizer
    questions = mtbench_questions()[: args.prompts]
    warm = torch.tensor(chat_prompt(tokenizer, "Hello!"))
    for d, rows in runners.items():          # warm-up: kernels, allocator, packed shapes
        for runner in rows.values():
            if not isinstance(runner, LlamaCppRow):
                run_row(runner, warm, 0.0, 0, 8)
    done = min(len(rs) for t in data["rows"].values() for rs in t.values())
    for qi in range(done, len(questions)):
        t_start = time.time()
        ids = torch.tensor(chat_prompt(tokenizer, questions[qi].turns[0]))
        for temp in temps:
            temperature = float(temp)
            seed = 1000 + qi
            plain_out: dict[str, list[int]] = {}
            for d, rows in runners.items():
                for name, runner in rows.items():
                    if f"{d} {name}" not in data["rows"][temp]:
                        continue                 # a llama.cpp row at T > 0
                    new, dt, extra = run_row(runner, ids, temperature, seed, args.max_new_tokens)
                    # llama.cpp's rows give their text and count (their greedy reference: llama.cpp plain)
                    count = extra.pop("n_tokens") if isinstance(new, str) else int(new.numel())
                    record = {"tokens": count, "time": dt, **extra}
                    if temperature > 0 and not isinstance(new, str):   # llama.cpp's text: its own ids, not scored
                        record["ll"], record["ll_n"] = log_likelihood(scorer, ids, new.cpu())
                    if temperature == 0:      # greedy: every row of a dtype must emit plain decoding's tokens
                        output = new if isinstance(new, str) else new.tolist()
                        reference = plain_out.setdefault(d, output)
                        record["same_as_plain"] = (same_greedy_text(output, reference) if isinstance(new, str)
                                                   else output == reference)
                    data["rows"][temp][f"{d} {name}"].append(record)
        data["wall_s"] += time.time() - t_start
        data["load"].append(os.getloadavg()[0])
        write(data, out)
        print(f"prompt {qi + 1}/{len(questions)} done ({time.time() - t_start:.0f} s)", flush=True)
    print(write(data, out))


if __name__ == "__main__":
    main()
