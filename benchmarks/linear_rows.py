"""Where packed fp32 starts to pay: one linear layer, stock ``F.linear`` vs the packed path.

``treespec.fastpath.packing`` packs fp32 weights for inputs of at least ``fp32_min_rows(cpu)`` rows. This
measures the crossover on this CPU for SmolLM2-135M's weight shapes (MLP up/down, LM head):
median microseconds of 15 calls per point, 1 thread, the two paths interleaved per shape.
``--dtype bfloat16`` adds the packed product padded with zero rows to ``BF16_PAD_ROWS`` (what
``pack_linears`` does for large weights where the bf16 units are AVX-512 BF16 without AMX);
``--shapes qwen`` takes Qwen2.5-Coder-1.5B's shapes instead.

    python benchmarks/linear_rows.py
    python benchmarks/linear_rows.py --dtype bfloat16 --shapes qwen --out benchmarks/results/linear_rows_bf16_epyc

Writes benchmarks/results/linear_rows.{json,md} (``--out``) with the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from harness import RESULTS, machine_info, machine_line, md_table, median_ms, time_calls, write_results
from treespec.fastpath.packing import BF16_PAD_ROWS, cpu_info, fp32_min_rows, pack_weight, packed_linear

SHAPES = {  # [out, in]
    "smollm2": ((1536, 576), (576, 1536), (49152, 576)),                         # MLP up, down, LM head
    "qwen": ((1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)),  # q/o, k/v, up, down, head
}


def median_us(fn, reps: int) -> float:
    return median_ms(time_calls(fn, reps, warmup=3)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=str(RESULTS / "linear_rows"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--shapes", default="smollm2", choices=sorted(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    bf16 = dtype == torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    points = []
    for out_f, in_f in SHAPES[args.shapes]:
        w = (torch.randn(out_f, in_f) * 0.02).to(dtype)
        pw = pack_weight(w)
        for n in rows:
            x = torch.randn(1, n, in_f).to(dtype)
            point = {"weight": [out_f, in_f], "rows": n,
                     "stock_us": median_us(lambda: F.linear(x, w), args.reps),
                     "packed_us": median_us(lambda: packed_linear(x, w, pw, 1), args.reps)}
            if bf16:
                point["padded_us"] = median_us(lambda: packed_linear(x, w, pw, 1, pad_rows=BF16_PAD_ROWS),
                                               args.reps)
            points.append(point)
            print(f"{out_f}x{in_f} n={n}: " + ", ".join(f"{k[:-3]} {v:.0f} us" for k, v in point.items()
                                                         if k.endswith("_us")), flush=True)
    chosen = fp32_min_rows(cpu_info())
    result = {"machine": machine_info(), "args": vars(args), "fp32_min_rows": chosen, "points": points}
    if bf16:
        lines = ["# bf16 linear layer: stock F.linear, packed, and packed with 1-3 rows padded to "
                 f"{BF16_PAD_ROWS}", "", machine_line(result["machine"]), "",
                 f"Median us of {args.reps} calls, {args.shapes} shapes.", ""]
        lines += md_table(["weight [out, in]", "rows", "stock us", "packed us", f"padded to {BF16_PAD_ROWS} us",
                           "padded / packed"],
                          [(f"{p['weight'][0]} x {p['weight'][1]}", p["rows"], f"{p['stock_us']:.0f}",
                            f"{p['packed_us']:.0f}", f"{p['padded_us']:.0f}",
                            f"{p['padded_us'] / p['packed_us']:.2f}") for p in points], "lrrrrr")
        js, md = write_results(args.out, result, "\n".join(lines))
        print(f"wrote {js} and {md}")
        return
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
