"""Ranked or drawn drafts when the target samples: τ by drafting mode at T > 0.

At T > 0 a ranked draft (the drafter's top token) is accepted with the target's probability of
that token; a draft drawn from the drafter's distribution q is accepted with probability
Σ min(p, q) (the recursive rejection sampling of ``docs/exactness.md``; children of one node are
drawn without replacement). This script measures which is worth more for a real drafter: the
same builders in each mode, the same prompts and seeds, τ (tokens per target pass) and the
depth-1 acceptance, and plain decoding (a budget-1 tree) for the wall-clock ratio. Both modes
are exact, so only τ differs; τ does not depend on the machine's load, the tokens/s columns do
(read them only from a run on a quiet machine).

    python benchmarks/draw_modes.py --prompts 20 --max-new-tokens 64
    python benchmarks/draw_modes.py --prompts 20 --max-new-tokens 128 --builders "chain 1;chain 2"   # quiet: speed

Writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, md_table, write_results
from treespec.builders import ChainBuilder, DynamicTreeBuilder
from treespec.data import mtbench_questions

MODES = ("deterministic", "without_replacement")
BUILDERS = {
    "chain 1": lambda mode: ChainBuilder(budget=2, mode=mode),
    "chain 2": lambda mode: ChainBuilder(budget=3, mode=mode),
    "chain 4": lambda mode: ChainBuilder(budget=5, mode=mode),
    "dynamic 4 (depth 2, top 3)": lambda mode: DynamicTreeBuilder(budget=4, depth=2, top_k=3, mode=mode),
    "dynamic 8 (depth 3, top 4)": lambda mode: DynamicTreeBuilder(budget=8, depth=3, top_k=4, mode=mode),
}


def ci95(xs: list[float]) -> float:
    return 1.96 * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--builders", default=";".join(BUILDERS), help=f"semicolon-separated, from {list(BUILDERS)}")
    ap.add_argument("--note", default="", help="how the machine was used during the run")
    ap.add_argument("--out", default=str(RESULTS / "draw_modes"))
    args = ap.parse_args()
    if not args.temperature > 0:
        raise SystemExit(f"--temperature must be > 0 (at T = 0 every mode drafts the top tokens), got {args.temperature}")
    torch.set_num_threads(args.threads)
    target = treespec.load_target("smollm2-135m")
    drafter = treespec.load_drafter(args.drafter, target)
    prompts = [q.turns[0] for q in mtbench_questions()[: args.prompts]]
    names = [b.strip() for b in args.builders.split(";") if b.strip()]
    if not names or set(names) - set(BUILDERS):
        raise SystemExit(f"--builders must name some of {list(BUILDERS)}, got {args.builders!r}")

    def run(builder) -> dict:
        gen = treespec.SpeculativeGenerator(target, drafter, builder)
        taus, rates, depth1 = [], [], [0, 0]
        for i, prompt in enumerate(prompts):
            stats = gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 seed=i).stats
            taus.append(stats.tau)
            rates.append(stats.tokens_per_s)
            depth1[0] += stats.depth_accepts[0] if stats.depth_accepts else 0
            depth1[1] += stats.depth_attempts[0] if stats.depth_attempts else 0
        return {"tau": statistics.mean(taus), "tau_ci95": ci95(taus), "taus": taus,
                "tokens_per_s": statistics.median(rates), "rates": rates,
                "depth1_acceptance": depth1[0] / depth1[1] if depth1[1] else 0.0}

    start = time.perf_counter()
    plain = run(DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    print(f"plain decoding: {plain['tokens_per_s']:.1f} tokens/s", flush=True)
    rows = {}
    for name in names:
        rows[name] = {}
        for mode in MODES:
            rows[name][mode] = run(BUILDERS[name](mode))
            print(f"{name:28s} {mode:20s} tau {rows[name][mode]['tau']:.3f} "
                  f"depth-1 {rows[name][mode]['depth1_acceptance']:.3f} "
                  f"{rows[name][mode]['tokens_per_s']:.1f} tokens/s", flush=True)
    data = {"machine": machine_info(), "drafter": args.drafter, "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "threads": args.threads,
            "note": args.note, "minutes": (time.perf_counter() - start) / 60, "plain": plain, "rows": rows}
    print(write_results(args.out, data, markdown(data)))


def markdown(data: dict) -> str:
    lines = [f"# Ranked or drawn drafts at T = {data['temperature']:g}: τ by drafting mode", "",
             f"{machine_line(data['machine'])} Target smollm2-135m (fp32), drafter {data['drafter']}, "
             f"MT-bench prompts 1-{data['prompts']} x {data['max_new_tokens']} new tokens, the same seed per "
             f"prompt in every row; {data['minutes']:.0f} min. {data['note']}".rstrip(), "",
             "*ranked*: the drafter's top tokens (`mode=\"deterministic\"`); *drawn*: children drawn from the "
             "drafter's distribution without replacement. τ = tokens per target pass (mean over prompts, "
             "± 95 % CI); the paired difference is drawn − ranked per prompt. Both modes are exact. "
             "tokens/s: median over prompts of decoding tokens/s (prefill excluded), and its ratio to plain "
             f"decoding in the same run ({data['plain']['tokens_per_s']:.1f} tokens/s).", ""]
    table = []
    plain = data["plain"]["tokens_per_s"]
    for name, by_mode in data["rows"].items():
        ranked, drawn = by_mode["deterministic"], by_mode["without_replacement"]
        diff = [b - a for a, b in zip(ranked["taus"], drawn["taus"])]
        table.append([name, f"{ranked['tau']:.3f} ± {ranked['tau_ci95']:.3f}", f"{drawn['tau']:.3f} ± {drawn['tau_ci95']:.3f}",
                      f"{statistics.mean(diff):+.3f} ± {ci95(diff):.3f}",
                      f"{ranked['depth1_acceptance']:.3f}", f"{drawn['depth1_acceptance']:.3f}",
                      f"{ranked['tokens_per_s']:.1f} ({ranked['tokens_per_s'] / plain:.2f}x)",
                      f"{drawn['tokens_per_s']:.1f} ({drawn['tokens_per_s'] / plain:.2f}x)"])
    lines += md_table(["builder", "τ ranked", "τ drawn", "drawn − ranked", "depth-1 ranked", "depth-1 drawn",
                       "tokens/s ranked", "tokens/s drawn"], table, "lrrrrrrr")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
