"""A feature head as trained (fp32) against the same head rounded to 8-bit blocks (``weights="int8"``).

Two measurements, on the shipped checkpoint (``--kind``, default eagle3) of SmolLM2-135M on the
fp32 block kernel:

1. **Held-out acceptance**, teacher-forced on the held-out ShareGPT split the checkpoint's card
   reports (``treespec.train.loop.heldout_metrics``, ``--sequences`` rows): top-1 agreement and
   beta (sum of min(p, q) over the target's top 32) by draft depth, for the head as trained and
   for the same module with its linear layers rounded by
   ``treespec.fastpath.quant.round_linears_to_blocks8``.
2. **Speed**, ``--prompts`` MT-bench first turns x ``--max-new-tokens``, T = 0: the 3-node tree
   ``builder="auto"`` picks on this machine (budget 3, depth 1, two drafts; fixed here so both
   heads run the same tree) with each head, interleaved prompt by prompt. Drafting ms a step,
   tau, median tokens/s, and whether both outputs equal plain greedy decoding.

    OMP_NUM_THREADS=1 python benchmarks/head_weights.py --out benchmarks/results/head_weights_amx

Writes ``--out``.{json,md} with the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, write_results
from treespec.data import chat_prompt, mtbench_questions
from treespec.fastpath.quant import round_linears_to_blocks8
from treespec.train.loop import (RecipeConfig, card_path, heldout_chunks, heldout_metrics, load_checkpoint,
                                 make_recipe, rebuild)
from treespec.drafters.feature import shipped_checkpoint

HEADS = ("trained", "int8")


def acceptance(target, kind: str, sequences: int) -> dict:
    """Held-out top-1 and beta by depth of the shipped head, as trained and rounded to 8 bits."""
    path = shipped_checkpoint(target, kind)
    state, header = load_checkpoint(path, target, kind)
    card = json.loads(card_path(path).read_text())
    recipe = make_recipe(kind, target, RecipeConfig(**card.get("recipe", {})),
                         torch.zeros(target.vocab_size, dtype=torch.long))
    chunks = heldout_chunks(target, recipe.layers, sequences)
    out = {}
    for weights in HEADS:
        model = rebuild(recipe, kind, state, header, target)
        if weights == "int8":
            rounded, skipped = round_linears_to_blocks8(model)
            out["rounded_layers"], out["skipped_layers"] = rounded, list(skipped)
        metrics = heldout_metrics(recipe, model, chunks, sequences)
        out[weights] = {k: metrics[k] for k in ("top1_by_depth", "beta_top32_by_depth", "positions", "sequences")}
    return out


def speed(target, kind: str, prompts: int, max_new: int) -> dict:
    """Both heads on the same 3-node tree, T = 0, interleaved prompt by prompt."""
    gens = {w: treespec.SpeculativeGenerator(target, treespec.load_drafter(kind, target, weights=w),
                                             treespec.DynamicTreeBuilder(budget=3, depth=1, top_k=2))
            for w in HEADS}
    plain = treespec.SpeculativeGenerator(target, treespec.load_drafter(kind, target, weights="trained"),
                                          treespec.DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    ids = [torch.tensor(chat_prompt(target.tokenizer, q.turns[0])) for q in mtbench_questions()[:prompts]]
    for g in (*gens.values(), plain):   # warm-up
        g.generate(ids[-1], 8, temperature=0.0)
    rows = {w: [] for w in HEADS}
    for p in ids:
        reference = plain.generate(p, max_new, temperature=0.0).token_ids
        for w, g in gens.items():
            r = g.generate(p, max_new, temperature=0.0)
            s = r.stats
            total = s.prefill_time + s.draft_time + s.verify_time + s.accept_time + s.other_time
            rows[w].append({"tokens": s.new_tokens, "steps": s.steps, "draft": s.draft_time,
                            "verify": s.verify_time, "time": total,
                            "same_as_plain": bool(torch.equal(r.token_ids, reference))})
    out = {}
    for w, rs in rows.items():
        steps = sum(r["steps"] for r in rs)
        out[w] = {"tau": sum(r["tokens"] for r in rs) / steps,
                  "draft_ms_per_step": 1e3 * sum(r["draft"] for r in rs) / steps,
                  "verify_ms_per_step": 1e3 * sum(r["verify"] for r in rs) / steps,
                  "tokens_per_s": statistics.median(r["tokens"] / r["time"] for r in rs),
                  "same_as_plain": sum(r["same_as_plain"] for r in rs), "prompts": len(rs), "per_prompt": rs}
    return out


def render(data: dict) -> str:
    a, s = data["acceptance"], data["speed"]
    depths = len(a["trained"]["top1_by_depth"])
    lines = [f"# {data['kind']}: the head as trained against 8-bit blocks", "",
             f"{machine_line(data['machine'])} SmolLM2-135M fp32 on the block kernel.", "",
             f"## Held-out acceptance ({a['trained']['sequences']} held-out sequences, "
             f"{a['trained']['positions']} positions; {a['rounded_layers']} linear layers rounded)", "",
             "| head | " + " | ".join(f"top-1 d{d + 1}" for d in range(depths)) + " | "
             + " | ".join(f"beta d{d + 1}" for d in range(depths)) + " |",
             "| --- |" + " ---: |" * (2 * depths)]
    for w in HEADS:
        e = a[w]
        lines.append(f"| {w} | " + " | ".join(f"{v:.4f}" for v in e["top1_by_depth"]) + " | "
                     + " | ".join(f"{v:.4f}" for v in e["beta_top32_by_depth"]) + " |")
    lines += ["", f"## Speed ({s['trained']['prompts']} MT-bench prompts x {data['max_new_tokens']} tokens, T = 0, "
              "the 3-node tree of builder=\"auto\", heads interleaved prompt by prompt)", "",
              "| head | τ | draft ms / step | verify ms / step | tokens/s (median) | = plain greedy |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for w in HEADS:
        e = s[w]
        lines.append(f"| {w} | {e['tau']:.3f} | {e['draft_ms_per_step']:.2f} | {e['verify_ms_per_step']:.1f} | "
                     f"{e['tokens_per_s']:.1f} | {e['same_as_plain']}/{e['prompts']} |")
    lines += ["", f"Reproduce: `{data['command']}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", default="eagle3", choices=("eagle3", "eagle", "mtp"))
    ap.add_argument("--sequences", type=int, default=64, help="held-out sequences (the card reports 8)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "head_weights"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.load_target("smollm2-135m", dtype=torch.float32, pack="blocks")
    data = {"machine": machine_info(), "kind": args.kind, "max_new_tokens": args.max_new_tokens,
            "command": (f"OMP_NUM_THREADS={args.threads} python benchmarks/head_weights.py --kind {args.kind} "
                        f"--sequences {args.sequences} --prompts {args.prompts} --max-new-tokens "
                        f"{args.max_new_tokens} --out {args.out}"),
            "acceptance": acceptance(target, args.kind, args.sequences),
            "speed": speed(target, args.kind, args.prompts, args.max_new_tokens)}
    md = render(data)
    print(md)
    write_results(args.out, data, md)


if __name__ == "__main__":
    main()
