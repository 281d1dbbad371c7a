"""One request, two runtimes: ``SpeculativeGenerator`` against the server's step at batch 1.

The server (``SpeculativeServer``: ragged ``BatchVerifier``, batched drafters, CSR accept) can
serve a single request as a batch of one. Before the generator becomes a front door over it,
this measures both side by side: the same target, drafter family, builder, prompt, temperature
and seed, run in a shuffled order per prompt so machine noise hits both alike. Reported per
drafter and temperature: median tokens/s over prompts (prefill included), τ, the per-step time
split, and at T = 0 whether the two outputs are equal token for token (they must be).

    python benchmarks/one_runtime.py --prompts 20 --max-new-tokens 128 --threads 1

Writes benchmarks/results/one_runtime_<cpu kind>.{json,md} after every prompt.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, md_table, write_results
from treespec.builders import BestFirstBuilder, DynamicTreeBuilder
from treespec.core.sampling import SamplingConfig
from treespec.data import chat_prompt, mtbench_questions
from treespec.fastpath.cpu import cpu_info
from treespec.runtime.server import SpeculativeServer

PATHS = ("generator", "server (B = 1)")


def drafters(target):
    """Two drafter families: a feature head on the target's hidden states, and an independent model."""
    return {
        "eagle3 best-first 16": (lambda: treespec.load_drafter("eagle3", target),
                                 lambda: BestFirstBuilder(16, max_width=4)),
        "small dynamic 16": (lambda: treespec.load_drafter("small", target),
                             lambda: DynamicTreeBuilder(budget=16, depth=5, top_k=4)),
    }


def via_generator(target, make_drafter, make_builder, ids, temperature, seed, max_new):
    gen = treespec.SpeculativeGenerator(target, make_drafter(), make_builder())
    t0 = time.perf_counter()
    res = gen.generate(ids, max_new, temperature=temperature, seed=seed)
    dt = time.perf_counter() - t0
    s = res.stats
    return res.token_ids.tolist(), dt, {"steps": s.steps, "draft": s.draft_time, "verify": s.verify_time,
                                        "accept": s.accept_time, "other": s.other_time, "prefill": s.prefill_time}


def via_server(target, make_drafter, make_builder, ids, temperature, seed, max_new):
    server = SpeculativeServer(target, make_drafter(), make_builder())
    t0 = time.perf_counter()
    rid = server.add_request(ids, SamplingConfig(temperature=temperature), max_new, seed)
    server.run()
    dt = time.perf_counter() - t0
    s = server.stats
    return list(server.finished[rid].tokens), dt, {"steps": s.steps, "draft": s.draft_time, "verify": s.verify_time,
                                                   "accept": s.accept_time, "other": s.other_time,
                                                   "prefill": s.prefill_time}


RUNNERS = {"generator": via_generator, "server (B = 1)": via_server}


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({(r["drafter"], r["temperature"]) for r in records}):
        mine = [r for r in records if (r["drafter"], r["temperature"]) == key]
        row = {"drafter": key[0], "temperature": key[1], "prompts": len({r["prompt"] for r in mine})}
        for path in PATHS:
            rs = [r for r in mine if r["path"] == path]
            steps = sum(r["steps"] for r in rs)
            row[path] = {
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
                "tau": sum(r["tokens"] for r in rs) / steps,
                "ms_per_step": {k: 1e3 * sum(r[k] for r in rs) / steps for k in ("draft", "verify", "accept", "other")},
            }
        pairs = {}
        for r in mine:
            pairs.setdefault(r["prompt"], {})[r["path"]] = r
        ratios = [p[PATHS[1]]["tokens"] / p[PATHS[1]]["seconds"] / (p[PATHS[0]]["tokens"] / p[PATHS[0]]["seconds"])
                  for p in pairs.values() if len(p) == 2]
        row["server_over_generator"] = statistics.median(ratios)
        if key[1] == 0:
            row["greedy_equal"] = all(p[PATHS[0]]["out"] == p[PATHS[1]]["out"] for p in pairs.values() if len(p) == 2)
        rows.append(row)
    return rows


def markdown(data: dict) -> str:
    lines = ["# One request, two runtimes: the generator against the server's step at batch 1", "",
             f"Machine: {machine_line(data['machine'])}.", "",
             f"{data['prompts']} MT-bench first turns (chat template), {data['max_new_tokens']} new tokens, "
             f"fp32 packed SmolLM2-135M target, both paths run per prompt in a shuffled order. "
             "tokens/s: median over prompts, prefill included; ratio: median per-prompt ratio "
             "server / generator. ms/step: draft / verify / accept / other.", "",
             "`python benchmarks/one_runtime.py " + data["command"] + "`", ""]
    table = []
    for r in data["summary"]:
        g, s = r[PATHS[0]], r[PATHS[1]]
        split = lambda x: " / ".join(f"{x['ms_per_step'][k]:.1f}" for k in ("draft", "verify", "accept", "other"))
        table.append([r["drafter"], f"{r['temperature']:g}", r["prompts"], f"{g['tokens_per_s']:.1f}",
                      f"{s['tokens_per_s']:.1f}", f"{r['server_over_generator']:.3f}", f"{g['tau']:.2f}",
                      f"{s['tau']:.2f}", split(g), split(s),
                      {True: "yes", False: "NO"}.get(r.get("greedy_equal"), "-")])
    lines += md_table(["drafter, tree", "T", "prompts", "generator tok/s", "server tok/s", "ratio", "τ gen",
                       "τ server", "ms/step gen", "ms/step server", "greedy equal"], table)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kind = "amx" if cpu_info().native_bf16 else "avx2"
    out = RESULTS / f"one_runtime_{kind}"
    target = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=True)
    rows = drafters(target)
    temps = [float(t) for t in args.temperatures.split(",")]
    questions = mtbench_questions()[: args.prompts]
    rng = random.Random(args.seed)
    warm = torch.tensor(chat_prompt(target.tokenizer, "Hello!"))
    for name, (d, b) in rows.items():           # first-use costs (kernel build, caches) out of the timings
        for path in PATHS:
            RUNNERS[path](target, d, b, warm, 0.0, 0, 8)
    records = []
    command = f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens} --threads {args.threads}"
    for qi, q in enumerate(questions):
        ids = torch.tensor(chat_prompt(target.tokenizer, q.turns[0]))
        cases = [(name, t, path) for name in rows for t in temps for path in PATHS]
        rng.shuffle(cases)
        for name, t, path in cases:
            d, b = rows[name]
            toks, dt, split = RUNNERS[path](target, d, b, ids, t, args.seed + qi, args.max_new_tokens)
            records.append({"prompt": qi, "drafter": name, "temperature": t, "path": path, "tokens": len(toks),
                            "seconds": dt, "out": toks, **split})
        data = {"machine": machine_info(), "prompts": qi + 1, "max_new_tokens": args.max_new_tokens,
                "command": command, "summary": summarize(records), "records": records}
        write_results(out, data, markdown(data))
        print(f"prompt {qi + 1}/{len(questions)}", flush=True)
    print(markdown(data))


if __name__ == "__main__":
    main()
