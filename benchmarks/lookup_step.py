"""Where a prompt-lookup step's time goes on Qwen2.5-Coder-1.5B: HF's prompt lookup against ours.

``lookup_policies.py`` found that our lookup drafts as well as HF's (equal τ at equal chain
length, replayed on the same outputs), yet in ``qwen.md`` HF prompt lookup decodes code edits
faster. This script splits both runs, on the same code-editing prompts at T = 0, into:

- the target's forward passes, counted and timed by hooks on the model (the first one is the
  prefill; each later one verifies a draft), with the tokens each pass takes in;
- everything else per decode pass: drafting, acceptance, cache work, the loop's Python.

Rows (all on treespec's packed path, interleaved per prompt): ``hf-packed`` (plain HF decoding),
``hf-lookup`` (HF ``prompt_lookup_num_tokens=10``), ``lookup chain10 conf0.1`` (qwen.py's row:
up to 10 drafts, stopping where no suffix recurs or the votes split below 0.1) and
``lookup chain10`` (always up to 10 drafts while a suffix recurs, as HF does).

    python benchmarks/lookup_step.py --prompts 5 --out benchmarks/results/lookup_step
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from harness import RESULTS, machine_info, machine_line, md_table, write_results


class ForwardTimer:
    """Context manager: every call of ``model``'s own forward, its wall time and its input length."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.calls: list[tuple[int, float]] = []     # (input tokens, seconds)
        self._t0 = 0.0
        self._tokens = 0
        self._handles = []

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._tokens = int(ids.shape[-1]) if ids is not None else 0
        self._t0 = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        self.calls.append((self._tokens, time.perf_counter() - self._t0))

    def __enter__(self):
        self._handles = [self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         self.model.register_forward_hook(self._post, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


def main() -> None:
    import treespec
    from qwen import EDIT_PROMPTS, TARGET, hf_timed
    from treespec.data import chat_prompt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=5, help="the first N code-editing prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--out", default=str(RESULTS / "lookup_step"))
    ap.add_argument("--note", default="shared 2-core CPU", help="the machine's state, for the table")
    args = ap.parse_args()
    if not 1 <= args.prompts <= len(EDIT_PROMPTS):
        raise SystemExit(f"--prompts must lie in 1..{len(EDIT_PROMPTS)}")
    torch.set_num_threads(args.threads)
    target = treespec.load_target(TARGET, dtype=args.dtype)
    eos = list(target.eos_token_ids)
    gens = {"lookup chain10 conf0.1": treespec.SpeculativeGenerator(
                target, "lookup", treespec.ChainBuilder(budget=11, min_confidence=0.1)),
            "lookup chain10": treespec.SpeculativeGenerator(target, "lookup", treespec.ChainBuilder(budget=11))}
    rows = {name: {"tokens": 0, "seconds": 0.0, "passes": 0, "fed": 0, "prefill_s": 0.0, "forward_s": 0.0,
                   "same_as_plain": 0} for name in ("hf-packed", "hf-lookup", *gens)}
    warm = torch.tensor(chat_prompt(target.tokenizer, "Say hi."))
    hf_timed(target.model, warm, eos, 4, 0.0, 0)                     # first-call costs out of the way

    def book(name: str, tokens: list[int], seconds: float, calls: list[tuple[int, float]], plain) -> None:
        row = rows[name]
        row["tokens"] += len(tokens)
        row["seconds"] += seconds
        row["prefill_s"] += calls[0][1]
        row["passes"] += len(calls) - 1
        row["fed"] += sum(n for n, _ in calls[1:])
        row["forward_s"] += sum(s for _, s in calls[1:])
        row["same_as_plain"] += int(plain is None or tokens == plain)

    for i, text in enumerate(EDIT_PROMPTS[:args.prompts]):
        ids = torch.tensor(chat_prompt(target.tokenizer, text))
        with ForwardTimer(target.model) as ft:
            plain, dt = hf_timed(target.model, ids, eos, args.max_new_tokens, 0.0, 0)
        book("hf-packed", plain, dt, ft.calls, None)
        with ForwardTimer(target.model) as ft:
            toks, dt = hf_timed(target.model, ids, eos, args.max_new_tokens, 0.0, 0, prompt_lookup_num_tokens=10)
        book("hf-lookup", toks, dt, ft.calls, plain)
        for name, gen in gens.items():
            with ForwardTimer(target.model) as ft:
                t0 = time.perf_counter()
                res = gen.generate(ids, args.max_new_tokens, temperature=0.0, seed=0)
                dt = time.perf_counter() - t0
            book(name, res.token_ids.tolist(), dt, ft.calls, plain)
        print(f"[{i + 1}/{args.prompts}] prompt of {ids.numel()} tokens", file=sys.stderr, flush=True)

    table = []
    for name, r in rows.items():
        decode = r["seconds"] - r["prefill_s"]
        table.append([name, f"{r['tokens'] / r['seconds']:.2f}", f"{r['tokens'] / max(r['passes'], 1):.2f}",
                      r["passes"], f"{r['fed'] / max(r['passes'], 1):.1f}",
                      f"{1e3 * r['prefill_s'] / args.prompts:.0f}",
                      f"{1e3 * r['forward_s'] / max(r['passes'], 1):.0f}",
                      f"{1e3 * (decode - r['forward_s']) / max(r['passes'], 1):.1f}",
                      f"{r['same_as_plain']}/{args.prompts}"])
    info = {**machine_info(), "torch_threads": args.threads, "note": args.note}
    md = [f"# Prompt lookup on {TARGET}: where a step's time goes",
          "",
          f"{args.prompts} code-editing prompts x {args.max_new_tokens} new tokens, T = 0, "
          f"target path: {target.speed_path}; {args.note}.",
          machine_line(info),
          "",
          "tokens per pass = new tokens / decode passes (the prefill pass not counted; HF's first token "
          "comes from its prefill, ours from the first verify pass); fed = tokens a decode pass takes in "
          "(draft + 1); forward = the model's forward call, timed by hooks; rest = decode time outside "
          "the forward calls, per pass (drafting, acceptance, cache work, the loop).",
          "",
          *md_table(["row", "tokens/s", "tokens per pass", "decode passes", "fed per pass", "prefill ms per prompt",
                     "forward ms per pass", "rest ms per pass", "greedy = hf-packed"], table),
          "",
          f"Reproduce: `python benchmarks/lookup_step.py --prompts {args.prompts} --out {args.out}`"]
    write_results(args.out, {"machine": info, "config": vars(args), "speed_path": target.speed_path, "rows": rows},
                  "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
