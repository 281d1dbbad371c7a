"""Benchmark: ``accept`` and the verification masks at serving sizes, on this CPU.

Targets: ``accept`` on N = 64 nodes, V = 49,152 has a median <= 1 ms (deterministic)
and <= 3 ms (stochastic modes); all masks for N = 64, P = 2,048 (DraftTree construction, its
ancestor mask, HF 4-D masks for sdpa and eager, position_ids, FlashInfer-packed mask) take
<= 0.5 ms together.

Trees are EAGLE-like (``harness.make_case``): 6 levels (8, 16, 16, 12, 7, 4 nodes), the first
nodes of each level expanded (builders try their best candidates first). Target scenarios:
    accept-few   p = 0.7 q + 0.3 noise: the walk accepts a few levels (realistic).
    reject-all   p has no mass on the root's children: every child of the root is rejected.
    worst-walk   the same tree with the expanded nodes *last* in each level, and p at every
                 node on its last child: every earlier sibling is rejected (a residual update
                 per rejection in the stochastic modes) and the walk reaches depth 6; about
                 the most work one call can do on a 64-node tree (with_replacement siblings are
                 distinct here: i.i.d. draws from a peaked q usually repeat the top token).
Input rows are float32 softmax outputs (what a model gives), on the CPU.

Usage:  python benchmarks/accept.py [--reps 300] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from harness import (
    N_NODES, RESULTS, SCENARIOS, VOCAB, machine_info, machine_line, make_case, summarise, time_calls, write_results,
)
from treespec.core.masks import hf_tree_mask, pack_tree_masks, position_ids
from treespec.core.tree import SAMPLING_MODES, DraftTree
from treespec.core import accept

PREFIX = 2_048
TARGET_MS = {"deterministic": 1.0, "with_replacement": 3.0, "without_replacement": 3.0, "masks": 0.5}


def build_all_masks(tokens: torch.Tensor, parents: torch.Tensor) -> tuple:
    """Everything the verify pass needs, from raw parent pointers (fresh tree: no caches)."""
    tree = DraftTree(tokens, parents)
    anc = tree.ancestor_mask
    sdpa = hf_tree_mask(tree, PREFIX, "sdpa")
    eager = hf_tree_mask(tree, PREFIX, "eager", torch.float32)
    pos = position_ids(tree, PREFIX)
    packed = pack_tree_masks([tree], [PREFIX])
    return anc, sdpa, eager, pos, packed


def run(reps: int) -> list[dict]:
    rows = []
    default_threads = torch.get_num_threads()
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        for mode in SAMPLING_MODES:
            for scenario in SCENARIOS:
                tree, p = make_case(mode, scenario)
                gen = torch.Generator().manual_seed(0)
                accepted = [accept(tree, p, gen).num_accepted for _ in range(200)]
                ms = time_calls(lambda: accept(tree, p, gen), reps, warmup=20)
                rows.append({
                    "case": f"accept/{mode}/{scenario}", "threads": threads,
                    "mean_accepted": statistics.fmean(accepted),
                    "target_ms": TARGET_MS[mode], **summarise(ms),
                })
        tree, _ = make_case("deterministic", "accept-few")
        ms = time_calls(lambda: build_all_masks(tree.tokens, tree.parents), reps, warmup=20)
        rows.append({"case": "masks/N64_P2048", "threads": threads, "mean_accepted": None,
                     "target_ms": TARGET_MS["masks"], **summarise(ms)})
    torch.set_num_threads(default_threads)
    for r in rows:
        r["pass"] = r["median_ms"] <= r["target_ms"]
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"# accept / masks benchmark (N={N_NODES}, V={VOCAB}, P={PREFIX})",
        "",
        f"{meta['cpu']}, {os.cpu_count()} cores; torch {meta['torch']}; {meta['reps']} timed "
        f"calls per case; float32 input rows; 1-min load average {meta['loadavg_before']:.1f} "
        f"before, {meta['loadavg_after']:.1f} after (other jobs share the machine: p90 includes "
        "preemption).",
        "",
        machine_line(meta["machine"]) + " (the threads column says what each case ran with)",
        "",
        "| case | threads | median ms | p10 ms | p90 ms | target ms | ok | mean accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "" if r["mean_accepted"] is None else f"{r['mean_accepted']:.2f}"
        lines.append(
            f"| {r['case']} | {r['threads']} | {r['median_ms']:.3f} | {r['p10_ms']:.3f} | "
            f"{r['p90_ms']:.3f} | {r['target_ms']:.1f} | {'yes' if r['pass'] else 'NO'} | {acc} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of accept.{json,md}")
    args = ap.parse_args(argv)
    meta = {
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "default_threads": torch.get_num_threads(),
        "reps": args.reps,
        "N": N_NODES, "V": VOCAB, "P": PREFIX,
        "loadavg_before": os.getloadavg()[0],
        "machine": machine_info(),
    }
    rows = run(args.reps)
    meta["loadavg_after"] = os.getloadavg()[0]
    md = markdown(rows, meta)
    print(md)
    write_results(args.out / "accept", {"meta": meta, "rows": rows}, md)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
