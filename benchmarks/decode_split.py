"""Where one decode pass of the target spends its time: the linear layers against the rest.

A decode step is one target pass over one new token with a cached context. Its linear layers
read every weight once, so their time is bounded by memory; the rest (norms, rotary embedding,
the cache append, attention for one query, the module calls of the stock HF model) is per-
operation overhead. This script times, interleaved and on the same cached context:
- ``forward``: the whole pass (the cache cropped back after each call);
- ``linears``: every linear layer of the model called alone on one row, back to back;
and reports the rest as their difference, for the stock model and for the packed one
(``treespec.load_target(pack=...)``). ``--profile`` adds PyTorch's operator table of the packed
pass (the profiler slows small operators, so read it for counts, not for time).

    python benchmarks/decode_split.py --threads 1
    python benchmarks/decode_split.py --dtype float32 --kernel blocks   # AVX-512 CPUs: ask for it

Writes ``--out``.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import DynamicCache

import treespec
from harness import RESULTS, interleaved, machine_info, machine_line, md_table, summarise, write_results
from treespec.fastpath.packing import PackedLinear, resolve_dtype


def cases_for(target, context: int, seed: int) -> tuple[dict[str, object], int]:
    """Timed callables for one loaded target (its decode pass, its linear layers alone) and the
    number of linear layers."""
    model = target.model
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, context), generator=gen)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        nxt = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    xs = [torch.randn(1, 1, m.in_features, generator=gen).to(model.dtype) for m in linears]

    def forward():
        with torch.inference_mode():
            model(input_ids=nxt, cache=cache, use_cache=True)
        cache.crop(-1)

    def layers():
        with torch.inference_mode():
            for m, x in zip(linears, xs):
                m(x)

    return {"forward": forward, "linears": layers}, len(linears)


def profile_table(target, context: int, rows: int = 15) -> list[dict]:
    model = target.model
    ids = torch.randint(100, model.config.vocab_size - 100, (1, context), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        nxt = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                model(input_ids=nxt, cache=cache, use_cache=True)
                cache.crop(-1)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    return [{"op": e.key, "calls_per_pass": e.count / 10, "self_ms_per_pass": e.self_cpu_time_total / 1e3 / 10}
            for e in events]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto", help="auto (bf16 where native, else fp32), float32, bfloat16")
    ap.add_argument("--kernel", default="auto", choices=("auto", "blocks", "panel", "onednn"),
                    help="the packed model's linear kernel (auto: the CPU decides)")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the decode pass")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="add the profiler's operator table")
    ap.add_argument("--note", default="")
    ap.add_argument("--out", default=str(RESULTS / "decode_split"))
    args = ap.parse_args()
    if args.context < 1 or args.reps < 3:
        raise SystemExit("--context must be >= 1 and --reps >= 3")
    torch.set_num_threads(args.threads)
    dtype, why = resolve_dtype(args.dtype)
    targets = {"stock": treespec.load_target("smollm2-135m", dtype=dtype, pack=False),
               "packed": treespec.load_target("smollm2-135m", dtype=dtype,
                                              pack=True if args.kernel == "auto" else args.kernel)}
    cases, counts = {}, {}
    for name, target in targets.items():
        c, counts[name] = cases_for(target, args.context, seed=0)
        cases.update({(name, part): fn for part, fn in c.items()})
    samples = interleaved(cases, args.reps, warmup=3)
    rows = {}
    for name in targets:
        fwd, lin = summarise(samples[(name, "forward")]), summarise(samples[(name, "linears")])
        rows[name] = {"forward": fwd, "linears": lin, "rest_ms": fwd["median_ms"] - lin["median_ms"],
                      "n_linears": counts[name], "path": targets[name].speed_path}
    data = {"machine": machine_info(), "dtype": str(dtype).removeprefix("torch."), "dtype_reason": why,
            "context": args.context, "reps": args.reps, "threads": args.threads, "note": args.note, "rows": rows}
    if args.profile:
        data["profile"] = profile_table(targets["packed"], args.context)

    body = [[name, f"{r['forward']['median_ms']:.1f}", f"{r['linears']['median_ms']:.1f} ({r['n_linears']})",
             f"{r['rest_ms']:.1f}", f"{r['rest_ms'] / r['forward']['median_ms']:.0%}",
             f"{r['forward']['p10_ms']:.1f}-{r['forward']['p90_ms']:.1f}"] for name, r in rows.items()]
    lines = ["# One decode pass: linear layers against the rest", "", machine_line(data["machine"]), "",
             f"SmolLM2-135M-Instruct, {data['dtype']} ({why}), one new token after {args.context} cached ones, "
             f"{args.reps} interleaved repetitions, {args.threads} thread(s). {args.note}".rstrip(), "",
             *md_table(["model", "forward ms", "linears ms (layers)", "rest ms", "rest share", "forward p10-p90"],
                       body, "lrrrrr"), "",
             "*linears*: every linear layer called alone on one row, back to back; *rest* = forward - linears "
             "(norms, rotary embedding, cache append, attention, module calls).", ""]
    lines += [f"- {name}: {r['path']}" for name, r in rows.items()] + [""]
    if args.profile:
        lines += ["Operators of the packed pass (torch.profiler; it inflates small operators):", "",
                  *md_table(["operator", "calls per pass", "self ms per pass"],
                            [[p["op"], f"{p['calls_per_pass']:.0f}", f"{p['self_ms_per_pass']:.2f}"]
                             for p in data["profile"]], "lrr"), ""]
    md = "\n".join(lines)
    write_results(args.out, data, md)
    print(md)
    ratio = statistics.median(samples[("packed", "forward")]) / statistics.median(samples[("stock", "forward")])
    print(f"packed / stock forward: {ratio:.2f}")


if __name__ == "__main__":
    main()
