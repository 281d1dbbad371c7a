"""A feature head's decoder block, one drafting call: the module path against the fused kernels.

The shipped eagle3 head of SmolLM2-135M (8-bit blocks, as ``load_drafter`` gives it on the fp32
block and amx targets) over ``--cached`` cached slots, for 1-3 new rows under a tree mask:
- *module path*: ``DraftBlock.forward`` as PyTorch operations (SDPA, the norms, the rotary
  embedding, each layer through ``PackedLinear``), the cache passed as a (k, v) tuple and
  concatenated, as every call was before the fused path;
- *fused*: the same call with the drafter's cache layer (``GrowingLayer``), which takes
  ``draft_block_pre`` / ``draft_block_post`` (``treespec.fastpath.kernels``).
Medians of ``--reps`` interleaved repetitions (machine noise hits both alike); the outputs are
checked to agree first.

    OMP_NUM_THREADS=1 python benchmarks/draft_block.py --out benchmarks/results/draft_block_amx

Writes ``--out``.{json,md} with the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse

import torch

import treespec
from harness import RESULTS, interleaved, machine_info, machine_line, median_ms, publish
from treespec.fastpath.kvcache import GrowingLayer

PATHS = ("module path", "fused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", type=int, default=300)
    ap.add_argument("--rows", default="1,2,3")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "draft_block"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.load_target("smollm2-135m", dtype=torch.float32, pack="amx")
    drafter = treespec.load_drafter("eagle3", target)
    block = drafter.head.block
    gen = torch.Generator().manual_seed(0)
    s = args.cached
    keys = torch.randn(1, block.nkv, s, block.d, generator=gen)
    values = torch.randn(1, block.nkv, s, block.d, generator=gen)
    cases, sizes = {}, [int(r) for r in args.rows.split(",")]
    for t in sizes:
        attn_in = torch.randn(1, t, block.q_proj.in_features, generator=gen)
        residual = torch.randn(1, t, block.o_proj.out_features, generator=gen)
        pos = torch.arange(s, s + t)[None]
        mask = torch.ones(1, 1, t, s + t, dtype=torch.bool)
        mask[..., s:] = torch.ones(t, t, dtype=torch.bool).tril()   # a chain of t nodes
        cache = GrowingLayer()
        cache.update(keys, values)

        def module(t=t, attn_in=attn_in, residual=residual, pos=pos, mask=mask):
            with torch.inference_mode():
                return block(attn_in, residual, pos, (keys, values), mask)[0]

        def fused(t=t, attn_in=attn_in, residual=residual, pos=pos, mask=mask, cache=cache):
            with torch.inference_mode():
                out = block(attn_in, residual, pos, cache, mask)[0]
            cache.crop(-t)
            return out

        with torch.inference_mode():
            assert block._fused_layers(attn_in, cache, mask) is not None, "the fused path does not apply here"
        a, b = module(), fused()
        assert (a - b).abs().max() <= 1e-5 * a.abs().max(), f"the paths disagree ({t} rows)"
        cases[(t, "module path")], cases[(t, "fused")] = module, fused
    samples = interleaved(cases, args.reps, warmup=20)
    results = {}
    lines = ["# A feature head's block, one drafting call: module path against the fused kernels", "",
             f"{machine_line(machine_info())} The shipped eagle3 head of SmolLM2-135M ({drafter.head_weights} "
             f"weights on the vector block kernel) after {s} cached slots; medians of {args.reps} interleaved reps.",
             "", "| new rows | module path µs | fused µs | fused / module |", "| ---: | ---: | ---: | ---: |"]
    for t in sizes:
        us = [median_ms(samples[(t, p)]) * 1e3 for p in PATHS]
        results[t] = dict(zip(PATHS, us))
        lines.append(f"| {t} | {us[0]:.0f} | {us[1]:.0f} | {us[1] / us[0]:.2f} |")
    command = (f"OMP_NUM_THREADS={args.threads} python benchmarks/draft_block.py --cached {s} --rows {args.rows} "
               f"--reps {args.reps} --out {args.out}")
    publish(args.out, lines, command, {"args": vars(args), "us": results})


if __name__ == "__main__":
    main()
