"""Engine benchmark: vanilla HF decoding vs HF assisted generation vs treespec chain / tree.

All methods run side by side, prompt by prompt (interleaved, so machine noise hits all alike),
greedy (T = 0), on MT-bench first turns through the chat template, with the same draft model.

    python benchmarks/engine.py --prompts 10 --max-new-tokens 128

Writes benchmarks/results/engine.{json,md}. Reported per method: median tokens/s over prompts,
speedup (ratio of medians of per-prompt tokens/s to vanilla's), τ, and for treespec the time
split and the engine overhead = share of decode time spent outside model forwards (measured
with forward hooks on the target and draft modules).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import treespec
from treespec.cli import make_builder
from treespec.data import mtbench_questions
from treespec.drafters import ModelDrafter, early_exit_model

RESULTS = Path(__file__).parent / "results"


class ForwardTimer:
    """Accumulates wall time spent inside the forward of the given modules (via hooks)."""

    def __init__(self, *modules: torch.nn.Module):
        self.total = 0.0
        self._start: dict[int, float] = {}
        self._handles = []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._pre))
            self._handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        self._start[id(module)] = time.perf_counter()

    def _post(self, module, args, out):
        self.total += time.perf_counter() - self._start.pop(id(module))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def hf_generate(model, ids, max_new, eos, assistant=None, lookup=0):
    kwargs = dict(do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
                  repetition_penalty=None, temperature=None, top_p=None, top_k=None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids[None], **kwargs)
        dt = time.perf_counter() - t0
    return out[0, ids.numel():], dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=4, help="early-exit drafter depth")
    ap.add_argument("--chain-k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    ap.add_argument("--out", default=str(RESULTS / "engine"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target = treespec.load_target("smollm2-135m")
    model, eos = target.model, list(target.eos_token_ids)
    draft_model = early_exit_model(model, args.draft_layers)
    drafter = ModelDrafter(draft_model, target.vocab_size)
    methods = {
        "treespec chain": make_builder("chain", args.chain_k + 1, args.depth, args.top_k),
        "treespec tree": make_builder("dynamic", args.budget, args.depth, args.top_k),
    }
    gens = {name: treespec.SpeculativeGenerator(target, drafter, b) for name, b in methods.items()}
    lookup = treespec.load_drafter("lookup", target)
    gens["treespec chain + lookup"] = treespec.SpeculativeGenerator(
        target, lookup, make_builder("chain", args.chain_k + 1, args.depth, args.top_k))
    questions = mtbench_questions()[: args.prompts]
    encode = gens["treespec tree"].encode

    # Warm-up (allocator, kernels) on a short prompt, not measured.
    warm = encode("Hello!")
    hf_generate(model, warm, 8, eos)
    hf_generate(model, warm, 8, eos, draft_model)
    hf_generate(model, warm, 8, eos, lookup=args.chain_k)
    for g in gens.values():
        g.generate(warm, max_new_tokens=8)

    rows: dict[str, list[dict]] = {k: [] for k in ["vanilla", "HF assisted", "HF prompt lookup", *gens]}
    for qi, q in enumerate(questions):
        ids = encode(q.turns[0])
        ref, dt = hf_generate(model, ids, args.max_new_tokens, eos)
        rows["vanilla"].append({"tokens": ref.numel(), "time": dt})
        out, dt = hf_generate(model, ids, args.max_new_tokens, eos, draft_model)
        rows["HF assisted"].append({"tokens": out.numel(), "time": dt,
                                    "matches_vanilla": bool(torch.equal(out, ref))})
        out, dt = hf_generate(model, ids, args.max_new_tokens, eos, lookup=args.chain_k)
        rows["HF prompt lookup"].append({"tokens": out.numel(), "time": dt,
                                         "matches_vanilla": bool(torch.equal(out, ref))})
        for name, g in gens.items():
            timer = ForwardTimer(model, draft_model)
            t0 = time.perf_counter()
            res = g.generate(ids, max_new_tokens=args.max_new_tokens)
            dt = time.perf_counter() - t0
            timer.close()
            s = res.stats
            rows[name].append({
                "tokens": s.new_tokens, "time": dt, "tau": s.tau, "steps": s.steps,
                "draft": s.draft_time, "verify": s.verify_time, "accept": s.accept_time,
                "other": s.other_time, "prefill": s.prefill_time,
                "forward_time": timer.total,
                "overhead_share": max(dt - timer.total, 0.0) / dt,
                "matches_vanilla": bool(torch.equal(res.token_ids, ref)),
                "depth_acceptance": s.depth_acceptance,
            })
        print(f"prompt {qi + 1}/{len(questions)} done", flush=True)

    def med(name, key):
        return statistics.median(r[key] for r in rows[name])

    base_tps = statistics.median(r["tokens"] / r["time"] for r in rows["vanilla"])
    summary = []
    for name, rs in rows.items():
        tps = statistics.median(r["tokens"] / r["time"] for r in rs)
        entry = {"method": name, "tokens_per_s": tps, "speedup": tps / base_tps,
                 "matches_vanilla": all(r.get("matches_vanilla", True) for r in rs)}
        if "tau" in rs[0]:
            total = sum(r["time"] for r in rs)
            entry.update({
                "tau": med(name, "tau"),
                "split": {k: sum(r[k] for r in rs) / total for k in ("prefill", "draft", "verify", "accept", "other")},
                "overhead_share": med(name, "overhead_share"),
            })
        summary.append(entry)

    lines = [
        f"# Engine benchmark ({len(questions)} MT-bench prompts x {args.max_new_tokens} tokens, T=0)",
        "",
        f"Target SmolLM2-135M-Instruct fp32; draft = early-exit, first {args.draft_layers} layers "
        f"(shared weights); chain k={args.chain_k}; tree = EAGLE-2 dynamic budget={args.budget}, "
        f"depth={args.depth}, top_k={args.top_k}; lookup rows use prompt n-gram lookup (no model), "
        f"{args.chain_k} tokens per step. torch threads {torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()}. Medians over prompts, measured side by side.",
        "",
        "| method | tokens/s | speedup | tau | prefill / draft / verify / accept / other | overhead outside forwards | same tokens as vanilla |",
        "| --- | ---: | ---: | ---: | --- | ---: | :---: |",
    ]
    for e in summary:
        split = " / ".join(f"{100 * v:.0f}%" for v in e["split"].values()) if "split" in e else "-"
        tau = f"{e['tau']:.2f}" if "tau" in e else "-"
        ovh = f"{100 * e['overhead_share']:.1f}%" if "overhead_share" in e else "-"
        lines.append(f"| {e['method']} | {e['tokens_per_s']:.1f} | {e['speedup']:.2f}x | {tau} | {split} | {ovh} | "
                     f"{'yes' if e['matches_vanilla'] else 'NO'} |")
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
