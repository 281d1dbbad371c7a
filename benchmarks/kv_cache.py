"""HF's ``DynamicCache`` against treespec's in-place cache (``treespec.fastpath.kvcache``) on the target.

One target forward as the verifier runs it, after a cached context of ``--contexts`` tokens:
a plain decode step (1 token, no mask) and a 3-node tree step (a root and two children under a
tree mask), each followed by the crop back to the context, the two caches interleaved rep by rep
(machine noise hits both alike). The logits are checked equal between the caches first.

    OMP_NUM_THREADS=1 python benchmarks/kv_cache.py --out benchmarks/results/kv_cache_amx

Writes ``--out``.{json,md} with the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

import treespec
from harness import RESULTS, interleaved, machine_info, machine_line, median_ms, publish
from treespec.core.masks import tree_forward_args
from treespec.core.tree import DraftTree
from treespec.fastpath.kvcache import growing_cache

CACHES = {"HF DynamicCache": lambda config: DynamicCache(config=config), "in-place (GrowingLayer)": growing_cache}
TREES = {"plain step (1 node)": [-1], "3-node tree step": [-1, 0, 0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="150,400", help="cached tokens before the step")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "kv_cache"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=True)
    model = target.model
    impl = model.config._attn_implementation
    gen = torch.Generator().manual_seed(0)
    cases, results = {}, {}
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(100, model.config.vocab_size - 100, (1, context), generator=gen)
        caches = {}
        with torch.inference_mode():
            for name, make in CACHES.items():
                caches[name] = make(model.config)
                model(input_ids=ids, cache=caches[name], use_cache=True, logits_to_keep=1)
        for tree_name, parents in TREES.items():
            tree = DraftTree(ids[0, :len(parents)].clone(), torch.tensor(parents), None, "deterministic")
            pos, mask = tree_forward_args(tree, context, impl, torch.float32)

            def step(cache=None, tree=tree, pos=pos, mask=mask):
                with torch.inference_mode():
                    out = model(input_ids=tree.tokens[None], position_ids=pos, attention_mask=mask, cache=cache,
                                use_cache=True).logits
                cache.crop(-tree.num_nodes)
                return out

            outs = [step(cache) for cache in caches.values()]
            assert torch.equal(*outs), f"the caches disagree ({tree_name}, context {context})"
            for name, cache in caches.items():
                cases[(context, tree_name, name)] = lambda cache=cache, step=step: step(cache)
    samples = interleaved(cases, args.reps, warmup=3)
    lines = ["# The target's KV cache: HF's DynamicCache against the in-place one", "",
             f"{machine_line(machine_info())} SmolLM2-135M fp32 on the block kernel; one forward as the "
             f"verifier runs it, then the crop back; medians of {args.reps} interleaved reps.", "",
             "| context | step | " + " | ".join(f"{n} ms" for n in CACHES) + " | in-place / HF |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for context in (int(c) for c in args.contexts.split(",")):
        for tree_name in TREES:
            ms = [median_ms(samples[(context, tree_name, n)]) for n in CACHES]
            results[f"{context}/{tree_name}"] = dict(zip(CACHES, ms))
            lines.append(f"| {context} | {tree_name} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[1] / ms[0]:.3f} |")
    command = (f"OMP_NUM_THREADS={args.threads} python benchmarks/kv_cache.py --contexts {args.contexts} "
               f"--reps {args.reps} --out {args.out}")
    publish(args.out, lines, command, {"args": vars(args), "ms": results})


if __name__ == "__main__":
    main()
