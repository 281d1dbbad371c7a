"""Benchmark: latency of the block / traversal acceptance rules against the token rule.

The goal: accept latency of the new rules within 2x of the token rule at N = 64, V = 49,152.
Same inputs for both rules of a pair (float32 softmax rows, CPU):
    traversal vs token  the EAGLE-like 64-node trees of benchmarks/accept.py (``harness.make_case``),
                        scenarios accept-few / reject-all / worst-walk, every draft mode.
    block vs token      a 64-node chain (63 draft tokens; also 8 nodes, the benchmark's
                        longest block) with p = 0.7 q + 0.3 noise at
                        every node ("accept-few") or with no mass on the first draft token
                        ("reject-all": token level stops at once, block walks back through
                        the whole chain), every draft mode.
Reports the median over ``--reps`` calls per case and the ratio new / token.

Usage:  python benchmarks/accept_rules.py [--reps 200] [--threads 1] [--out benchmarks/results]
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
    N_NODES, RESULTS, SCENARIOS, VOCAB, machine_info, machine_line, make_case, median_ms, time_calls, write_results,
)
from treespec.core.tree import SAMPLING_MODES, DraftTree
from treespec.core import accept

CHAIN_SCENARIOS = ("accept-few", "reject-all")


def make_chain(mode: str, scenario: str, n: int = N_NODES, seed: int = 0) -> tuple[DraftTree, torch.Tensor]:
    """(chain of n nodes, target_probs float32 [n, V])."""
    g = torch.Generator().manual_seed(seed)
    logits_q = torch.randn(n, VOCAB, generator=g) * 2.0
    logits_q[:, :16] += 16.0 * torch.rand(n, 16, generator=g)
    q = logits_q.softmax(-1)
    tokens = torch.ones(n, dtype=torch.long)
    for i in range(n - 1):  # one child: argmax (deterministic) or one draw from q
        tokens[i + 1] = q[i].argmax() if mode == "deterministic" else torch.multinomial(q[i], 1, generator=g)
    p = 0.7 * q + 0.3 * (torch.randn(n, VOCAB, generator=g) * 2.0).softmax(-1)
    if scenario == "reject-all":
        p[0, tokens[1]] = 0.0
        p[0] /= p[0].sum()
    tree = DraftTree(tokens, torch.arange(-1, n - 1), None if mode == "deterministic" else q,
                     mode, VOCAB)
    return tree, p.float().contiguous()


def run(reps: int) -> list[dict]:
    rows = []
    cases = [("traversal", m, s, N_NODES) for m in SAMPLING_MODES for s in SCENARIOS]
    cases += [("block", m, s, n) for n in (N_NODES, 8) for m in SAMPLING_MODES for s in CHAIN_SCENARIOS]
    for rule, mode, scenario, n in cases:
        tree, p = make_case(mode, scenario) if rule == "traversal" else make_chain(mode, scenario, n)
        row = {"rule": rule, "mode": mode, "scenario": scenario,
               "shape": f"eagle-tree N={n}" if rule == "traversal" else f"chain N={n}"}
        for r in ("token", rule):
            gen = torch.Generator().manual_seed(0)
            row[f"{r}_mean_accepted"] = statistics.fmean(accept(tree, p, gen, r).num_accepted for _ in range(100))
            row[f"{r}_ms"] = median_ms(time_calls(lambda: accept(tree, p, gen, r), reps, warmup=20))
        row["ratio"] = row[f"{rule}_ms"] / row["token_ms"]
        rows.append(row)
        print(f"{rule:9s} {row['shape']:16s} {mode:19s} {scenario:10s} token {row['token_ms']:6.3f} ms  {rule} "
              f"{row[f'{rule}_ms']:6.3f} ms  ratio {row['ratio']:.2f}  accepted "
              f"{row['token_mean_accepted']:.2f} -> {row[f'{rule}_mean_accepted']:.2f}", flush=True)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# accept latency: block / traversal vs token (N={N_NODES}, V={VOCAB})", "",
             f"{meta['cpu']}; torch {meta['torch']}, {meta['threads']} thread(s); median of "
             f"{meta['reps']} calls; float32 rows; load average {meta['loadavg_before']:.1f} before, "
             f"{meta['loadavg_after']:.1f} after (shared machine).", "",
             *([machine_line({**meta["machine"], "torch_threads": meta["threads"]}), ""] if "machine" in meta else []),
             "Deterministic trees run the token walk under every rule (same output law, see "
             "treespec/core/rejection.py). Every rule reads a row only where it rejects or draws: the "
             "joint rules take rows as distributions and read no row for its mass, walk a zero-weight "
             "subtree without visiting it, and build residuals in a reused buffer (treespec/core/"
             "joint.py). A ratio above 1 is the walk's extra residual steps. 'accepted' is the mean over 100 calls on one "
             "fixed draft; block verification is optimal in expectation over drafts, not per draft.", "",
             "| rule | shape | mode | scenario | token ms | new ms | ratio | accepted token -> new |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        new = r["rule"]
        lines.append(f"| {new} | {r['shape']} | {r['mode']} | {r['scenario']} | {r['token_ms']:.3f} | "
                     f"{r[f'{new}_ms']:.3f} | {r['ratio']:.2f} | {r['token_mean_accepted']:.2f} -> "
                     f"{r[f'{new}_mean_accepted']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of accept_rules.{json,md}")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    meta = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "reps": args.reps, "N": N_NODES, "V": VOCAB,
            "loadavg_before": os.getloadavg()[0], "machine": machine_info()}
    rows = run(args.reps)
    meta["loadavg_after"] = os.getloadavg()[0]
    md = markdown(rows, meta)
    print(md)
    write_results(args.out / "accept_rules", {"meta": meta, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
