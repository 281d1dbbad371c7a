"""Online training throughput: training tokens per second (target pass + head step) for 1 and N
processes on this machine.

    OMP_NUM_THREADS=1 python benchmarks/train_throughput.py --procs 1,2 --steps 8

Each process count runs ``treespec train KIND --online --steps S --procs P`` in a fresh directory
(the real SmolLM2 target and ShareGPT stream) and reads the per-step log of its state: global
tokens and wall seconds per step. Throughput is over the steps after the first (which also warms
up the allocator and kernels); the head unrolls its full depth from the first step
(``--unroll-ramp 0``), the cost of most of a long run. Writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import RESULTS, machine_info, machine_line, write_results
from treespec.train.loop import load_train_state


def run(kind: str, procs: int, steps: int, batch_size: int, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "treespec.train", kind, "--online", "--steps", str(steps), "--procs", str(procs),
               "--batch-size", str(batch_size), "--threads", str(threads), "--unroll-ramp", "0", "--out", out]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        log = load_train_state(Path(out) / f"{kind}.train.safetensors")["log"]
    steady = log[1:]
    tokens, seconds = sum(r["tokens"] for r in steady), sum(r["seconds"] for r in steady)
    return {"procs": procs, "threads_per_process": threads, "batch_size_per_process": batch_size,
            "steps_timed": len(steady), "tokens_per_step": round(tokens / len(steady), 1),
            "median_step_s": round(statistics.median(r["seconds"] for r in steady), 3),
            "tokens_per_s": round(tokens / seconds, 1), "command_wall_s": round(wall, 1)}


def markdown(rows: list[dict], info: dict, kind: str) -> str:
    one = next((r for r in rows if r["procs"] == 1), None)
    lines = [f"# Online training throughput ({kind}, SmolLM2-135M target)", "",
             machine_line(info) + f" Load average at the start: {info['load_avg_1m']}.", "",
             "Training tokens per second: the target's pass over each step's sequences plus the head's "
             "training step (full unroll), over the steps after the first.", "",
             "| processes | threads each | sequences per step | tokens per step | median step (s) | tokens/s | vs 1 process |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if one else "-"
        lines.append(f"| {r['procs']} | {r['threads_per_process']} | {r['procs'] * r['batch_size_per_process']} | "
                     f"{r['tokens_per_step']:.0f} | {r['median_step_s']:.2f} | {r['tokens_per_s']:.0f} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="eagle3")
    ap.add_argument("--procs", default="1,2", help="process counts to measure")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per process per step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--out", default=None, help="result path without suffix (default results/train_throughput_<isa>)")
    args = ap.parse_args()
    info = machine_info()
    isa = "amx" if "amx_bf16" in info["cpu_flags"] else "avx2"
    out = Path(args.out) if args.out else RESULTS / f"train_throughput_{isa}"
    rows = []
    for procs in (int(p) for p in args.procs.split(",")):
        rows.append(run(args.kind, procs, args.steps, args.batch_size, args.threads))
        print(json.dumps(rows[-1]), flush=True)
    write_results(out, {"machine": info, "kind": args.kind, "rows": rows}, markdown(rows, info, args.kind))
    print(markdown(rows, info, args.kind))


if __name__ == "__main__":
    main()
