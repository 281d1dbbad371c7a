"""Does budget="auto" pick a tree as fast as the best fixed budget of a sweep?

    python benchmarks/auto_budget.py --drafter eagle3 --prompts 10 --max-new-tokens 64

Steps (one run, side by side, same threads):
  1. calibrate this machine for the target (unless --calibration points at one);
  2. calibrate the drafter itself on the 8 last MT-bench prompts (``calibrate_drafter``: its
     expand time by width and its positional acceptance vector);
  3. build the auto tree (``auto_builder``: cost model + both calibrations) and a sweep of
     fixed EAGLE-2 budgets;
  4. run every configuration on the same MT-bench prompts, interleaved, greedy;
  5. report tokens/s per configuration and auto / best-fixed.
Writes benchmarks/results/auto_budget.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, write_results
from treespec.planning import Calibration
from treespec.calibrate.passes import calibrate
from treespec.calibrate.drafters import calibrate_drafter, calibration_prompts
from treespec.planning.calibration import CalibratedCost
from treespec.calibrate.passes import DEFAULT_NS
from treespec.planning.planner import plan_curve
from treespec.data import mtbench_questions
from treespec.runtime.generator import auto_builder
from treespec.builders import DynamicTreeBuilder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="1,2,4,8,16,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="target weights")
    ap.add_argument("--calibration", default=None, help="existing calibration JSON (else measure now)")
    ap.add_argument("--note", default="", help="a line about the machine's state, written into the table")
    ap.add_argument("--out", default=str(RESULTS / "auto_budget"))
    ap.add_argument("--render", metavar="JSON", help="rewrite the table of an earlier run from its JSON")
    args = ap.parse_args()
    if args.render:
        path = Path(args.render)
        result = json.loads(path.read_text())
        result["args"]["note"] = args.note or result["args"].get("note", "")
        md = render(result, Calibration.load(result["calibration"]))
        write_results(path, result, md)
        print(md)
        return
    torch.set_num_threads(args.threads)

    target = treespec.load_target("smollm2-135m", dtype=getattr(torch, args.dtype))
    drafter = treespec.load_drafter(args.drafter, target)
    if args.calibration:
        cal = Calibration.load(Path(args.calibration))
    else:
        t0 = time.perf_counter()
        cal = calibrate(target.model, target.name, context=128, threads=args.threads, n_rep=5,
                        ns=tuple(n for n in DEFAULT_NS if n <= 64))
        print(f"calibrated the target in {time.perf_counter() - t0:.0f} s", flush=True)
    questions = mtbench_questions()
    evaluation = questions[: args.prompts]
    if args.drafter not in cal.drafters:
        cal = calibrate_drafter(cal, args.drafter, target, calibration_prompts(),
                                progress=lambda m: print(m, flush=True))
    vector = cal.acceptance.get(args.drafter)

    configs = {"auto": auto_builder(target, drafter, cal)}
    for b in (int(x) for x in args.budgets.split(",")):
        configs[f"dynamic {b}"] = DynamicTreeBuilder(budget=b, depth=max(1, min(6, b - 1)), top_k=4)
    gens = {k: treespec.SpeculativeGenerator(target, drafter, b) for k, b in configs.items()}
    for g in gens.values():
        g.generate("Hello!", max_new_tokens=4)

    speeds: dict[str, list[float]] = {k: [] for k in gens}
    taus: dict[str, list[float]] = {k: [] for k in gens}
    for i, q in enumerate(evaluation):
        ids = gens["auto"].encode(q.turns[0])
        for k, g in gens.items():
            t0 = time.perf_counter()
            r = g.generate(ids, max_new_tokens=args.max_new_tokens)
            speeds[k].append(r.stats.new_tokens / (time.perf_counter() - t0))
            taus[k].append(r.stats.tau)
        print(f"prompt {i + 1}/{len(evaluation)}", flush=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cal.save(out.with_suffix(".calibration.json"))
    result = {"machine": machine_info(), "args": vars(args), "acceptance": vector, "calibration": str(out.with_suffix(".calibration.json")),
              "auto": str(configs["auto"].config), "tokens_per_s": speeds, "tau": taus}
    md = render(result, cal)
    print(md)
    write_results(out, result, md)


def render(result: dict, cal: Calibration) -> str:
    """The Markdown table; fills result's ratio_auto_to_best and best_fixed. Next to each
    measurement: the cost model's prediction for the best tree of that many nodes (its
    tokens/s relative to no speculation, from the same calibration)."""
    args = argparse.Namespace(**result["args"])
    speeds, taus = result["tokens_per_s"], result["tau"]
    med = {k: statistics.median(v) for k, v in speeds.items()}
    best_fixed = max((k for k in med if k != "auto"), key=med.get)
    result.update(ratio_auto_to_best=med["auto"] / med[best_fixed], best_fixed=best_fixed)
    curve = plan_curve(CalibratedCost(cal, args.drafter), result["acceptance"], 1, cal.context, 64, 16)
    predicted = {c.budget: c.speedup for c in curve}  # keyed by nodes incl. the root
    base = med.get("dynamic 1")
    lines = [
        f"# budget='auto' vs a fixed-budget sweep ({args.drafter} drafter, {args.prompts} MT-bench prompts x "
        f"{args.max_new_tokens} tokens, T=0, {args.threads} thread(s), {getattr(args, 'dtype', 'float32')} weights)",
        "",
        *([args.note, ""] if args.note else []),
        *([machine_line(result["machine"]), ""] if "machine" in result else []),
        f"Measured acceptance vector of {args.drafter}: {[round(a, 3) for a in result['acceptance'] or ()]}; "
        f"auto chose `{result['auto']}`.",
        "",
        "| configuration | median tokens/s | median tau | measured / no speculation | predicted (best tree of that size) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in speeds:
        nodes = int(k.split()[1]) if k.startswith("dynamic") else None
        pred = f"{predicted[nodes]:.2f}" if nodes in predicted else ""
        rel = f"{med[k] / base:.2f}" if base else ""
        lines.append(f"| {k} | {med[k]:.2f} | {statistics.median(taus[k]):.2f} | {rel} | {pred} |")
    lines += ["", f"auto / best fixed ({best_fixed}) = **{result['ratio_auto_to_best']:.3f}** (goal >= 0.90)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
