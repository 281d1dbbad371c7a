"""Benchmark: the calibrated cost model against fresh measurements on this CPU, and the planner.

Goal: after calibration, the predicted target verify time is within ±20 % of a fresh
measurement for every n = 1 … 64 tree tokens.

Steps
    1. Calibration run: ``treespec.calibrate.calibrate`` on SmolLM2-135M (fp32, the real weights from
       ``treespec.targets.loader.load_target``) at n = 1 … 128 (``DEFAULT_NS``) with a cached prefix of
       ``--context`` tokens; the fitted JSON is kept as ``results/cost_model_calibration.json``.
    2. Fresh run: the same verify pass measured again at every n = 1 … 64 (timed round-robin in
       shuffled order, new random tokens), compared with the fitted curve; and the early-exit
       drafter at a few n.
    3. Planner: best trees for SmolLM2-135M on the presets and on this machine ('local'), and for
       Llama-3-8B on the presets at batch 1, 8, 64; plots of predicted tokens/s vs budget.
Outputs ``results/cost_model.{json,md}``, ``results/cost_model.png`` (SmolLM2, batch 1, one line
per hardware incl. local), ``results/cost_model_llama-3-8b.png`` (batch 1, 8, 64 panels).

The CPU is shared: the 1-minute load average is recorded before each phase; with
``--quiet-load X`` the script waits (up to ``--quiet-wait`` s) for the load to drop below X.

On a shared machine time one thread's CPU time (``--threads 1 --clock thread``): wall time there
measures the neighbours' load as much as the model (``results/cost_model_wall.*`` shows it).

Usage:  python benchmarks/cost_model.py --threads 1 --clock thread      # -> results/cost_model.*
        python benchmarks/cost_model.py --threads 1 --clock wall --name cost_model_wall
Runtime: ~7 min each on the shared 2-core box (calibration about half of it).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import RESULTS, machine_info, machine_line, write_results
from treespec.planning import DEFAULT_BETA, CalibratedCost, DrafterSpec, RooflineCost, auto_budget, best_choice, get_hardware, model_shape, plan_curve
from treespec.calibrate.passes import calibrate
from treespec.calibrate.passes import DEFAULT_NS, _truncated_model, measure_interleaved, verify_passes
from treespec.planning.plot import plot_curves
from treespec.targets.loader import load_target

TOLERANCE = 0.20
PRESETS = ("h100", "mi300x", "h200", "a100")


def wait_for_quiet(threshold: float | None, max_wait_s: float) -> float:
    """Wait until the 1-minute load average is below ``threshold`` (or time runs out)."""
    start = time.monotonic()
    while threshold is not None and os.getloadavg()[0] > threshold and time.monotonic() - start < max_wait_s:
        time.sleep(10)
    return os.getloadavg()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--reps", type=int, default=11, help="timed calls per calibration point")
    parser.add_argument("--fresh-reps", type=int, default=7, help="timed calls per fresh point")
    parser.add_argument("--max-n", type=int, default=64, help="fresh comparison covers n = 1 … max-n")
    parser.add_argument("--early-exit-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both runs (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="wall: perf_counter; thread: this thread's CPU time (needs --threads 1)")
    parser.add_argument("--quiet-load", type=float, default=None)
    parser.add_argument("--quiet-wait", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="cost_model", help="output file stem (default cost_model)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread counts one thread's CPU time: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time

    model = load_target("smollm2-135m").model
    loads = {"start": wait_for_quiet(args.quiet_load, args.quiet_wait)}

    # 1. calibration run
    t0 = time.time()
    cal = calibrate(model, "smollm2-135m", ns=DEFAULT_NS, context=args.context,
                    early_exit_layers=args.early_exit_layers, n_warmup=2, n_rep=args.reps, clock=clock,
                    progress=lambda m: print(m, flush=True))
    cal_path = cal.save(args.out / f"{args.name}_calibration.json")
    calibration_s = time.time() - t0
    print(f"calibration: {calibration_s:.0f} s -> {cal_path}")

    # 2. fresh measurements
    loads["fresh"] = wait_for_quiet(args.quiet_load, args.quiet_wait)
    t0 = time.time()
    order = list(range(1, args.max_n + 1))
    random.Random(0).shuffle(order)
    seconds = measure_interleaved(verify_passes(model, order, args.context, seed=1), 1, args.fresh_reps, clock)
    measured = dict(zip(order, seconds))
    rows = []
    for n in range(1, args.max_n + 1):
        predicted = cal.target(n)
        rows.append({"n": n, "predicted_ms": predicted * 1e3, "measured_ms": measured[n] * 1e3,
                     "error": predicted / measured[n] - 1})
    draft = _truncated_model(model, args.early_exit_layers)
    draft_ns = (1, 2, 4, 8, 16, 32)
    draft_seconds = measure_interleaved(verify_passes(draft, draft_ns, args.context, seed=1), 1, args.fresh_reps, clock)
    draft_rows = []
    for n, m in zip(draft_ns, draft_seconds):
        p = cal.drafters["early_exit"](n)
        draft_rows.append({"n": n, "predicted_ms": p * 1e3, "measured_ms": m * 1e3, "error": p / m - 1})
    fresh_s = time.time() - t0
    loads["end"] = os.getloadavg()[0]
    errors = [abs(r["error"]) for r in rows]
    within = sum(e <= TOLERANCE for e in errors)

    # 3. planner
    smol = model_shape("smollm2-135m")
    eagle = DrafterSpec("eagle")
    beta = DEFAULT_BETA["eagle"]
    smol_curves = {hw: plan_curve(RooflineCost(smol, eagle, get_hardware(hw)), beta, 1, args.context, 64)
                   for hw in PRESETS}
    smol_curves["local"] = plan_curve(CalibratedCost(cal, "eagle"), beta, 1, args.context, 64)
    auto = {kind: auto_budget(cal, DEFAULT_BETA[kind], kind) for kind in ("eagle", "early_exit")}
    llama = model_shape("llama-3-8b")
    llama_curves = {b: {hw: plan_curve(RooflineCost(llama, eagle, get_hardware(hw)), beta, b, 2048)
                        for hw in PRESETS} for b in (1, 8, 64)}
    plot_curves({1: smol_curves}, args.out / f"{args.name}.png",
                f"smollm2-135m, eagle drafter (β={beta}), context {args.context}")
    plot_curves(llama_curves, args.out / f"{args.name}_llama-3-8b.png",
                f"llama-3-8b, eagle drafter (β={beta}), context 2048")

    def choice_row(c):
        return {"budget": c.budget, "depth": c.depth, "tau": round(c.tau, 3), "tokens_per_s": round(c.tokens_per_s, 2),
                "speedup": round(c.speedup, 3), "verify_ms": round(c.verify_s * 1e3, 3),
                "draft_ms": round(c.draft_s * 1e3, 3)}

    plans = {
        "smollm2-135m": {hw: choice_row(best_choice(c)) for hw, c in smol_curves.items()},
        "llama-3-8b": {f"{hw}/b{b}": choice_row(best_choice(c)) for b, cs in llama_curves.items()
                       for hw, c in cs.items()},
        "auto_budget_local": {kind: choice_row(c) for kind, c in auto.items()},
    }
    result = {
        "machine": machine_info(),
        "device": cal.device,
        "context": args.context,
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "tolerance": TOLERANCE,
        "within_tolerance": within,
        "points": len(rows),
        "max_abs_error": max(errors),
        "median_abs_error": statistics.median(errors),
        "load_average_1min": loads,
        "calibration_s": calibration_s,
        "fresh_s": fresh_s,
        "calibration_file": cal_path.name,
        "name": args.name,
        "target": rows,
        "early_exit_drafter": draft_rows,
        "plans": plans,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    write_results(args.out / args.name, result, markdown(result, cal))
    print(markdown(result, cal))
    return 0 if within == len(rows) else 1


def markdown(r: dict, cal) -> str:
    lines = [
        "# Cost model: calibrated prediction vs fresh measurement (SmolLM2-135M, fp32, this CPU)",
        "",
        f"Device: {r['device']}. Cached prefix: {r['context']} tokens. Batch 1. Threads: {r['threads']}. "
        f"Clock: {r['clock']}. Both runs in one process, calibration first.",
        f"1-minute load average (shared 2-core machine): {r['load_average_1min']}.",
        f"Calibration run {r['calibration_s']:.0f} s; fresh run {r['fresh_s']:.0f} s.",
        f"Command: `{r['command']}`",
        *([machine_line(r["machine"])] if "machine" in r else []),
        "",
        f"**{r['within_tolerance']} / {r['points']} points within ±{r['tolerance']:.0%}**; "
        f"max |error| {r['max_abs_error']:.1%}, median |error| {r['median_abs_error']:.1%}.",
        f"CPU verify cost: t(1) = {cal.target(1) * 1e3:.1f} ms, t(8) = {cal.target(8) * 1e3:.1f} ms, "
        f"t(64) = {cal.target(64) * 1e3:.1f} ms, t(128) = {cal.target(128) * 1e3:.1f} ms (fitted).",
        "",
        "## Target verify pass (forward over n tree tokens + softmax)",
        "",
        "| n | predicted ms | measured ms | error |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {x['n']} | {x['predicted_ms']:.2f} | {x['measured_ms']:.2f} | {x['error']:+.1%} |" for x in r["target"]]
    lines += ["", f"## Early-exit drafter (first {cal.drafter_layers['early_exit']} layers + LM head)", "",
              "| n | predicted ms | measured ms | error |", "|---:|---:|---:|---:|"]
    lines += [f"| {x['n']} | {x['predicted_ms']:.2f} | {x['measured_ms']:.2f} | {x['error']:+.1%} |"
              for x in r["early_exit_drafter"]]
    lines += ["", "## Planner (predicted; eagle drafter, β = 0.75 unless noted)", "",
              "| model | hardware | budget | depth | τ | tokens/s | speedup | verify ms | draft ms |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for model, table in r["plans"].items():
        for hw, c in table.items():
            lines.append(f"| {model} | {hw} | {c['budget']} | {c['depth']} | {c['tau']:.2f} | {c['tokens_per_s']:.1f} | "
                         f"{c['speedup']:.2f} | {c['verify_ms']:.3f} | {c['draft_ms']:.3f} |")
    lines += ["", "`auto_budget_local` rows: `auto_budget(calibration, DEFAULT_BETA[kind], kind)` "
              "(eagle β 0.75, early_exit β 0.5), batch 1, max budget 64.",
              "", f"Plots: `{r['name']}.png` (SmolLM2, batch 1, incl. local), "
              f"`{r['name']}_llama-3-8b.png` (Llama-3-8B, batch 1/8/64, context 2048)."]
    return "\n".join(lines)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
