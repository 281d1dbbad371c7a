"""Two versions of the block kernel inside a whole generation: what ``kernel_ab.py``'s layer
timings are worth end to end.

Compiles the kernel at a git revision (``--base``) and the working tree's, as ``kernel_ab.py``
does, loads SmolLM2-135M once on the block kernel (the blobs packed by the working tree's
``pack_blocks``; the two revisions must lay blocks out alike, checked on a probe weight) and
decodes each of ``--prompts`` MT-bench first turns with both kernels, the versions alternating
first prompt by prompt: plain decoding (a one-node tree, the generator's own loop) and the
shipped eagle3 on a fixed dynamic tree (``--tree budget,depth,top_k``), T = 0.

    OMP_NUM_THREADS=1 python benchmarks/kernel_e2e.py --base 6537e73 --out benchmarks/results/kernel_e2e_amx

Writes ``--out``.{json,md}: median tokens/s per version and row, their ratio, how many outputs
are the same tokens under both kernels, and the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, write_results
from kernel_ab import exact_blocks, revisions
from treespec.builders.dynamic import DynamicTreeBuilder
from treespec.data import chat_prompt, mtbench_questions
from treespec.fastpath import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision of the kernel to compare against")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--tree", default="4,2,2", help="budget,depth,top_k of the speculative row")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "kernel_e2e"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    budget, depth, top_k = (int(v) for v in args.tree.split(","))
    isa = kernels.ISAS.index(kernels.kernel_isa())
    versions = revisions(args.base, isa)
    probe = exact_blocks(64, 96, 4, torch.Generator().manual_seed(0))
    blobs = [packer(probe).blob for _, _, packer in versions.values()]
    if not torch.equal(*blobs):
        raise SystemExit(f"{args.base}'s pack_blocks lays the blocks out differently: one packed target cannot "
                         "serve both kernels")
    target = treespec.load_target("smollm2-135m")
    drafter = treespec.load_drafter("eagle3", target)
    rows = {"plain": treespec.SpeculativeGenerator(target, drafter, DynamicTreeBuilder(1, 1, 1)),
            f"eagle3 tree {args.tree}": treespec.SpeculativeGenerator(target, drafter,
                                                                     DynamicTreeBuilder(budget, depth, top_k))}
    names = list(versions)
    real_kernel = kernels._kernel
    rates = {(v, r): [] for v in names for r in rows}
    outputs = {(v, r): [] for v in names for r in rows}
    try:
        for i, question in enumerate(mtbench_questions()[: args.prompts]):
            ids = torch.tensor(chat_prompt(target.tokenizer, question.turns[0]))
            for v in names if i % 2 == 0 else names[::-1]:
                module = versions[v][0]
                kernels._kernel = lambda module=module: module   # every block layer calls through it
                for r, gen in rows.items():
                    result = gen.generate(ids, args.max_new_tokens, temperature=0.0)
                    rates[(v, r)].append(result.stats.tokens_per_s)
                    outputs[(v, r)].append(result.token_ids.tolist())
            print(f"prompt {i + 1}/{args.prompts} done", flush=True)
    finally:
        kernels._kernel = real_kernel
    a, b = names
    med = {key: statistics.median(vals) for key, vals in rates.items()}
    m = machine_info()
    lines = [f"# Block kernel end to end: {a} vs {b}", "", machine_line(m), "",
             f"SmolLM2-135M on the block kernel ({kernels.kernel_isa()} code), {args.prompts} MT-bench first turns "
             f"x {args.max_new_tokens} new tokens, T = 0; the versions alternate first prompt by prompt. "
             "Medians of per-prompt tokens/s (prefill included).", "",
             f"| row | {a} tokens/s | {b} tokens/s | {b} / {a} | same tokens |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        same = sum(x == y for x, y in zip(outputs[(a, r)], outputs[(b, r)]))
        lines.append(f"| {r} | {med[(a, r)]:.1f} | {med[(b, r)]:.1f} | {med[(b, r)] / med[(a, r)]:.3f} | "
                     f"{same}/{args.prompts} |")
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.out, {"machine": m, "args": vars(args), "versions": names,
                             "tokens_per_s": {f"{v} | {r}": vals for (v, r), vals in rates.items()}}, md)


if __name__ == "__main__":
    main()
