"""Greedy token agreement with HF ``generate``, fp32 against bf16 weights.

In fp32 the engine's greedy output equals HF ``generate`` token for token (tested). In bf16 the
rounding differs between kernel paths (a 4-D tree mask, N tokens per pass), so argmax can flip
at near-ties. This script measures how often, with no drafting and with an eagle3 tree.

    python benchmarks/bf16_agreement.py --prompts 3 --max-new-tokens 64

Writes benchmarks/results/bf16_agreement.{json,md}.
"""

from __future__ import annotations

import argparse

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, write_results
from treespec.data import chat_prompt, mtbench_questions
from treespec.builders import DynamicTreeBuilder

CONFIGS = {"no drafting": lambda: DynamicTreeBuilder(budget=1),
           "eagle3 tree8": lambda: DynamicTreeBuilder(budget=8, depth=4, top_k=4)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (None when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "bf16_agreement"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for dtype in ("float32", "bfloat16"):
        target = treespec.load_target("smollm2-135m", dtype=getattr(torch, dtype))
        drafter = treespec.load_drafter("eagle3", target)
        gens = {name: treespec.SpeculativeGenerator(target, drafter, make()) for name, make in CONFIGS.items()}
        for i, q in enumerate(mtbench_questions()[: args.prompts]):
            ids = torch.tensor(chat_prompt(target.tokenizer, q.turns[0]))
            with torch.inference_mode():
                ref = target.model.generate(ids[None], do_sample=False, max_new_tokens=args.max_new_tokens,
                                            eos_token_id=list(target.eos_token_ids), pad_token_id=2,
                                            temperature=None, top_p=None, top_k=None)[0, ids.numel():].tolist()
            for name, gen in gens.items():
                out = gen.generate(ids, max_new_tokens=args.max_new_tokens).token_ids.tolist()
                rows.append(dict(dtype=dtype, prompt=i, method=name, identical=out == ref,
                                 first_divergence=first_divergence(out, ref)))
                print(rows[-1], flush=True)
    lines = [f"# Greedy agreement with HF generate ({args.prompts} MT-bench prompts x {args.max_new_tokens} tokens)",
             "", machine_line(), "", "| weights | method | prompts identical to HF generate | first divergence (token index) |",
             "| --- | --- | ---: | --- |"]
    for dtype in ("float32", "bfloat16"):
        for name in CONFIGS:
            sel = [r for r in rows if r["dtype"] == dtype and r["method"] == name]
            div = ", ".join(str(r["first_divergence"]) for r in sel if r["first_divergence"] is not None) or "-"
            lines.append(f"| {dtype} | {name} | {sum(r['identical'] for r in sel)} / {len(sel)} | {div} |")
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.out, {"machine": machine_info(), "args": vars(args), "rows": rows}, md)


if __name__ == "__main__":
    main()
