"""Verification benchmark: token-level vs block (chains) vs traversal (trees), same prompts.

Real target (SmolLM2-135M), a shipped drafter (the best trained one that loads, as in
benchmarks/builders.py, or ``--drafter``), MT-bench first turns (chat template), T = 1 and
T = 0.7 with top-p 0.9. For each temperature:
    chains of 4 and 8 draft tokens (i.i.d. draws from q, ``--chain-mode``): token vs block;
    dynamic (EAGLE-2) and best-first (SpecExec) trees at budgets 8..64 (children drawn without
    replacement, ``--tree-mode``): token vs traversal.
Both rules of a pair run on the same prompt with the same seed, interleaved prompt by prompt
(every configuration on prompt i before any on prompt i + 1). Per configuration: τ (emitted
tokens per target forward) and tokens/s (decode only), their standard errors over prompts, and
the paired per-prompt gain of the new rule with its standard error, next to the papers' ranges
(block: +5-8 % wall clock, Sun et al. 2025; traversal: +2.2-5.7 % acceptance length, Weng et
al. 2025).

    python benchmarks/verification.py                                  # 20 prompts x 128 tokens
    python benchmarks/verification.py --prompts 2 --max-new-tokens 32 --out /tmp/verif   # smoke
    python benchmarks/verification.py --resume benchmarks/results/verification.json

On two cores, one process per sampling, then merge:

    python benchmarks/verification.py --drafter eagle --samplings T1 --out benchmarks/results/verification_t1 &
    python benchmarks/verification.py --drafter eagle --samplings T0.7_top_p0.9 --out benchmarks/results/verification_t07 &
    wait; python benchmarks/verification.py --merge benchmarks/results/verification_t1.json \
        benchmarks/results/verification_t07.json --out benchmarks/results/verification

Results are saved after every prompt (JSON with every per-prompt record, and a Markdown table);
``--resume`` continues a cut-short run with its recorded settings. The JSON records the CPU
model, the command-line flags and the torch thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import RESULTS, machine_info, pick_drafter, write_results
from treespec import BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator, load_target
from treespec.data import chat_prompt, mtbench_questions
SAMPLINGS = {"T1": dict(temperature=1.0, top_p=1.0), "T0.7_top_p0.9": dict(temperature=0.7, top_p=0.9)}
PAPERS = {"block": "Sun et al. 2025: +5-8 % wall clock", "traversal": "Weng et al. 2025: +2.2-5.7 % acceptance length"}


def configs(chains: list[int], budgets: list[int], chain_mode: str, tree_mode: str) -> list[dict]:
    """Every (sampling, shape, rule) configuration; ``key`` names it in the records."""
    out = []
    for s in SAMPLINGS:
        for k in chains:
            for rule in ("token", "block"):
                out.append(dict(sampling=s, shape="chain", budget=k + 1, rule=rule, pair="block",
                                make=lambda k=k: ChainBuilder(budget=k + 1, mode=chain_mode)))
        for shape in ("dynamic", "best-first"):
            for b in budgets:
                depth, wide = min(6, b - 1), 4 if b <= 16 else 8
                make = ((lambda b=b, d=depth, w=wide: DynamicTreeBuilder(b, depth=d, top_k=w, mode=tree_mode))
                        if shape == "dynamic" else
                        (lambda b=b, d=depth, w=wide: BestFirstBuilder(b, max_width=w, max_rounds=d + 1, mode=tree_mode)))
                for rule in ("token", "traversal"):
                    out.append(dict(sampling=s, shape=shape, budget=b, rule=rule, pair="traversal", make=make))
    for c in out:
        c["key"] = f"{c['sampling']}/{c['shape']}/B{c['budget']}/{c['rule']}"
    return out


def mean_se(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def summary(records: list[dict], cfgs: list[dict]) -> list[dict]:
    """One row per (sampling, shape, budget): both rules' τ and tokens/s, paired gains."""
    by = {}
    for r in records:
        by.setdefault(r["key"], {})[r["prompt"]] = r
    rows = []
    for c in cfgs:
        if c["rule"] != "token":
            continue
        new_key = c["key"].rsplit("/", 1)[0] + "/" + c["pair"]
        base, new = by.get(c["key"], {}), by.get(new_key, {})
        prompts = sorted(set(base) & set(new))
        if not prompts:
            continue
        row = dict(sampling=c["sampling"], shape=c["shape"], budget=c["budget"], rule=c["pair"], prompts=len(prompts))
        for name, recs in (("token", base), (c["pair"], new)):
            row[f"{name}_tau"], row[f"{name}_tau_se"] = mean_se([recs[p]["emitted"] / recs[p]["steps"] for p in prompts])
            row[f"{name}_tps"], row[f"{name}_tps_se"] = mean_se([recs[p]["new_tokens"] / recs[p]["decode_s"] for p in prompts])
        dtau = [new[p]["emitted"] / new[p]["steps"] / (base[p]["emitted"] / base[p]["steps"]) - 1 for p in prompts]
        dtps = [(new[p]["new_tokens"] / new[p]["decode_s"]) / (base[p]["new_tokens"] / base[p]["decode_s"]) - 1
                for p in prompts]
        row["tau_gain"], row["tau_gain_se"] = mean_se(dtau)
        row["tps_gain"], row["tps_gain_se"] = mean_se(dtps)
        rows.append(row)
    return rows


def _pm(m: float, se: float, pct: bool = False) -> str:
    f = 100.0 if pct else 1.0
    s = "" if math.isnan(se) else f" ± {f * se:.{1 if pct else 2}f}"
    return f"{f * m:+.1f}{s} %" if pct else f"{m:.2f}{s}"


def write_markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# Verification rules: token vs block (chains) vs traversal (trees)", "",
             f"Target {meta['target']}, drafter **{meta['drafter']}**, {meta['prompts_done']} of "
             f"{meta['prompts']} MT-bench prompts x {meta['max_new_tokens']} new tokens; {meta['cpu']}, "
             f"torch {meta['torch']} with {meta['torch_threads']} thread(s); chains drawn "
             f"{meta['chain_mode']}, trees {meta['tree_mode']}. Wall time {meta['wall_s'] / 60:.1f} min. "
             f"Flags: `{' '.join(meta['argv'])}`.", "",
             "Means over prompts ± standard error; gain = paired per-prompt ratio new / token - 1.", ""]
    spans = [m for m in meta.get("machines", []) if m["prompts"][1] > m["prompts"][0]]
    if len(spans) > 1:
        where = "; ".join(f"{m.get('samplings', '')} prompts {a + 1}-{b} on {m['cpu']} "
                          f"({', '.join(m['machine_info']['cpu_flags'])})".lstrip()
                          for m in spans for a, b in [m["prompts"]])
        lines += [f"**Resumed on another machine**: {where}. τ does not depend on the machine; absolute "
                  "tokens/s mix machines, the paired per-prompt gains compare like with like.", ""]
    if not meta.get("complete"):
        lines += [f"**Partial run**: {meta['prompts_done']} of {meta['prompts']} prompts.", ""]
    for s in SAMPLINGS:
        part = [r for r in rows if r["sampling"] == s]
        if not part:
            continue
        lines += [f"## {s}", "", "| shape | budget | rule | τ token | τ new | τ gain | tok/s token | tok/s new "
                  "| tok/s gain | papers |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in part:
            n = r["rule"]
            lines.append(f"| {r['shape']} | {r['budget']} | {n} | {_pm(r['token_tau'], r['token_tau_se'])} | "
                         f"{_pm(r[f'{n}_tau'], r[f'{n}_tau_se'])} | {_pm(r['tau_gain'], r['tau_gain_se'], True)} | "
                         f"{_pm(r['token_tps'], r['token_tps_se'])} | {_pm(r[f'{n}_tps'], r[f'{n}_tps_se'])} | "
                         f"{_pm(r['tps_gain'], r['tps_gain_se'], True)} | {PAPERS[n]} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def save(out: Path, meta: dict, records: list[dict], cfgs: list[dict]) -> None:
    rows = summary(records, cfgs)
    write_results(out, dict(meta=meta, summary=rows, records=records), write_markdown(meta, rows))


def merge(paths: list[str], out: Path) -> None:
    """One report from runs split by sampling (same drafter, prompts and settings otherwise)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    meta = dict(runs[0]["meta"], merged_from=paths)
    samplings = [s for r in runs for s in r["meta"]["settings"]["samplings"].split(",")]
    meta["settings"] = dict(meta["settings"], samplings=",".join(samplings))
    meta["prompts_done"] = min(r["meta"]["prompts_done"] for r in runs)
    meta["complete"] = all(r["meta"]["complete"] for r in runs)
    meta["wall_s"] = max(r["meta"]["wall_s"] for r in runs)
    if any(len(r["meta"].get("machines", [])) > 1 for r in runs):  # one split run resumed elsewhere
        meta["machines"] = [dict(m, samplings=r["meta"]["settings"]["samplings"]) for r in runs
                            for m in r["meta"].get("machines") or
                            [dict(cpu=r["meta"]["cpu"], machine_info=r["meta"]["machine_info"],
                                  prompts=[0, r["meta"]["prompts_done"]])]]
    st = meta["settings"]
    cfgs = configs([int(k) for k in st["chains"].split(",")], [int(b) for b in st["budgets"].split(",")],
                   st["chain_mode"], st["tree_mode"])
    out.parent.mkdir(parents=True, exist_ok=True)
    save(out, meta, [rec for r in runs for rec in r["records"] if rec["prompt"] < meta["prompts_done"]], cfgs)
    print(f"merged {len(paths)} runs into {out}.json and {out}.md")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--chains", default="4,8", help="draft tokens per chain")
    ap.add_argument("--budgets", default="8,16,32,64", help="tree budgets (nodes incl. root)")
    ap.add_argument("--chain-mode", default="with_replacement",
                    choices=("deterministic", "with_replacement", "without_replacement"))
    ap.add_argument("--tree-mode", default="without_replacement",
                    choices=("deterministic", "with_replacement", "without_replacement"))
    ap.add_argument("--samplings", default=",".join(SAMPLINGS), help=f"subset of {list(SAMPLINGS)}")
    ap.add_argument("--drafter", default=None, help="registered drafter (default: best available)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"),
                    help="target weights (float32: the exact reference, same tau on every machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "verification"))
    ap.add_argument("--resume", metavar="JSON", help="continue a cut-short run (its settings win)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge runs split by --samplings into --out")
    args = ap.parse_args(argv)
    if args.merge:
        merge(args.merge, Path(args.out))
        return
    records, done, earlier = [], 0, None
    if args.resume:
        earlier = json.loads(Path(args.resume).read_text())
        m = earlier["meta"]
        for k in ("max_new_tokens", "chains", "budgets", "chain_mode", "tree_mode", "samplings", "drafter",
                  "threads", "seed"):
            setattr(args, k, m["settings"][k])
        args.dtype = m["settings"].get("dtype", "float32")
        args.prompts = max(args.prompts, m["prompts"]) if "--prompts" in argv else m["prompts"]
        args.out = str(Path(args.resume).with_suffix(""))
        records, done = earlier["records"], m["prompts_done"]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    target = load_target("smollm2-135m", dtype=args.dtype)
    questions = mtbench_questions()
    name, drafter = pick_drafter(target, args.drafter, questions[-4].turns[0])
    prompts = [torch.tensor(chat_prompt(target.tokenizer, q.turns[0])) for q in questions[: args.prompts]]
    samplings = args.samplings.split(",") if isinstance(args.samplings, str) else list(args.samplings)
    for s in samplings:
        if s not in SAMPLINGS:
            raise SystemExit(f"--samplings: unknown {s!r}; choose from {list(SAMPLINGS)}")
    chains = [int(k) for k in str(args.chains).split(",")]
    budgets = [int(b) for b in str(args.budgets).split(",")]
    cfgs = [c for c in configs(chains, budgets, args.chain_mode, args.tree_mode) if c["sampling"] in samplings]
    gens = [SpeculativeGenerator(target, drafter, c["make"](), verify=c["rule"]) for c in cfgs]
    gens[0].generate(prompts[0], max_new_tokens=4)  # warm-up
    settings = dict(max_new_tokens=args.max_new_tokens, chains=",".join(map(str, chains)),
                    budgets=",".join(map(str, budgets)), chain_mode=args.chain_mode, tree_mode=args.tree_mode,
                    samplings=",".join(samplings), drafter=name, threads=args.threads, seed=args.seed,
                    dtype=str(target.dtype).removeprefix("torch."), speed_path=target.speed_path)
    meta = dict(target="smollm2-135m", drafter=name, prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                chain_mode=args.chain_mode, tree_mode=args.tree_mode, settings=settings,
                cpu=machine_info()["cpu_model"], machine=platform.machine(), torch=torch.__version__, machine_info=machine_info(),
                torch_threads=torch.get_num_threads(), omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
                argv=["benchmarks/verification.py", *argv], prompts_done=done, complete=False,
                wall_s_before=earlier["meta"]["wall_s"] if earlier else 0.0, wall_s=0.0)
    # A resumed run may continue on another machine: tau is the same everywhere, tokens/s is not
    # (the paired per-prompt gains stay fair). Say which prompts ran where.
    spans = list(earlier["meta"].get("machines", [])) if earlier else []
    if earlier and not spans:
        spans = [dict(cpu=earlier["meta"]["cpu"], machine_info=earlier["meta"]["machine_info"], prompts=[0, done])]
    spans.append(dict(cpu=meta["cpu"], machine_info=meta["machine_info"], prompts=[done, done]))
    meta["machines"] = spans
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"drafter {name}; {len(prompts)} prompts x {args.max_new_tokens} tokens; {len(cfgs)} configurations",
          flush=True)
    for i, ids in enumerate(prompts):
        if i < done:
            continue
        t0 = time.perf_counter()
        for c, gen in zip(cfgs, gens):
            st = gen.generate(ids, max_new_tokens=args.max_new_tokens, seed=args.seed + i, **SAMPLINGS[c["sampling"]]).stats
            records.append(dict(key=c["key"], prompt=i, steps=st.steps, emitted=st._emitted, new_tokens=st.new_tokens,
                                decode_s=st.decode_time, accept_s=st.accept_time, mean_nodes=st.tree_nodes / st.steps))
        meta.update(prompts_done=i + 1, wall_s=meta["wall_s_before"] + time.perf_counter() - start)
        spans[-1]["prompts"][1] = i + 1
        save(out, meta, records, cfgs)  # after every prompt: a cut-short run keeps its prompts
        print(f"prompt {i + 1}/{len(prompts)} in {time.perf_counter() - t0:.0f} s", flush=True)
    meta.update(complete=True, wall_s=meta["wall_s_before"] + time.perf_counter() - start)
    save(out, meta, records, cfgs)
    for r in summary(records, cfgs):
        n = r["rule"]
        print(f"{r['sampling']:14s} {r['shape']:10s} B={r['budget']:>2} tau token {r['token_tau']:.2f} "
              f"{n} {r[f'{n}_tau']:.2f} ({100 * r['tau_gain']:+.1f} %)  tok/s {r['token_tps']:.1f} -> "
              f"{r[f'{n}_tps']:.1f} ({100 * r['tps_gain']:+.1f} %)")
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
