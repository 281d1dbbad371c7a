"""Where packed fp32 starts to pay: one linear layer, stock ``F.linear`` vs the packed path.

``treespec.fastpath.packing`` packs fp32 weights for inputs of at least ``fp32_min_rows(cpu)`` rows. This
measures the crossover on this CPU for SmolLM2-135M's weight shapes (MLP up/down, LM head):
median microseconds of 15 calls per point, 1 thread, the two paths interleaved per shape.

    python benchmarks/linear_rows.py

Writes benchmarks/results/linear_rows.{json,md} (``--out``) with the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from harness import RESULTS, machine_info, machine_line, md_table, median_ms, time_calls, write_results
from treespec.fastpath.packing import cpu_info, fp32_min_rows, pack_weight, packed_linear

SHAPES = ((1536, 576), (576, 1536), (49152, 576))   # [out, in]: MLP up, MLP down, LM head


def median_us(fn, reps: int) -> float:
    return median_ms(time_calls(fn, reps, warmup=3)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS / "linear_rows"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    points = []
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f)
        pw = pack_weight(w)
        for n in rows:
            x = torch.randn(1, n, in_f)
            stock = median_us(lambda: F.linear(x, w), args.reps)
            packed = median_us(lambda: packed_linear(x, w, pw, 1), args.reps)
            points.append({"weight": [out_f, in_f], "rows": n, "stock_us": stock, "packed_us": packed})
            print(f"{out_f}x{in_f} n={n}: stock {stock:.0f} us, packed {packed:.0f} us", flush=True)
    chosen = fp32_min_rows(cpu_info())
    result = {"machine": machine_info(), "args": vars(args), "fp32_min_rows": chosen, "points": points}
    lines = ["# fp32 linear layer: stock F.linear vs packed, by row count", "", machine_line(result["machine"]), "",
             f"Median us of {args.reps} calls. treespec packs fp32 from **{chosen} rows** on this CPU "
             "(`treespec.fastpath.packing.fp32_min_rows`).", ""]
    lines += md_table(["weight [out, in]", "rows", "stock us", "packed us", "packed / stock"],
                      [(f"{p['weight'][0]} x {p['weight'][1]}", p["rows"], f"{p['stock_us']:.0f}",
                        f"{p['packed_us']:.0f}", f"{p['packed_us'] / p['stock_us']:.2f}") for p in points], "lrrrr")
    js, md = write_results(args.out, result, "\n".join(lines))
    print(f"wrote {js} and {md}")


if __name__ == "__main__":
    main()
