"""Load test of `treespec serve` on loopback: the official openai client (async) against the HTTP
server, speculation on and off, at several concurrencies. Bounded in count and time; stops by
itself.

Per mode (the speculative server, and the same server with speculation off: ``drafter=None``)
and concurrency c: ``--requests`` chat requests of random prompt lengths (MT-bench questions,
1-2 of them joined), half at T = 0 and half at T = 1 (seeded), ``--cancel`` of them closed
mid-stream after 1-3 chunks. Checks: nothing lost (every request not cancelled ends with a
finish reason, its usage and, at T = 0, the text its run alone gives); the cancelled ones free
their rows (no live request, an empty cache after each level); memory flat (RSS after the run
within 5 % of after warm-up). Reports throughput, TTFT and inter-token latency (p50 / p99; a
request's ITL is (last token - first token) / (tokens - 1)), and at c = 1 the HTTP server's
tokens/s against ``SpeculativeGenerator`` on the same greedy prompts. llama.cpp's llama-server
is compared where it is built (it is not on these machines: the row says so).

    python benchmarks/serve_load.py --requests 200 --max-tokens 32 --out benchmarks/results/serve_load_avx512bf16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from harness import machine_info, machine_line, md_table, publish


def pct(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def prompts_for(n: int, rng: random.Random) -> list[str]:
    from treespec.data import mtbench_questions

    qs = [q.turns[0] for q in mtbench_questions()]
    return [" ".join(rng.sample(qs, rng.randint(1, 2))) for _ in range(n)]


class Live:
    """uvicorn serving an app on a free loopback port in a thread."""

    def __init__(self, app):
        import socket

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=120)
        self.sock.close()


async def one(client, prompt: str, max_tokens: int, temperature: float, seed: int, cancel_after: int | None):
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=temperature,
        seed=seed, stream=True)
    first = last = None
    parts, chunks, finish, usage = [], 0, None, None
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            first = first or now
            last = now
            chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage:
            usage = chunk.usage
        if cancel_after is not None and chunks >= cancel_after:
            await stream.close()
            return {"cancelled": True, "t0": t0}
    n = usage.completion_tokens if usage else 0
    return {"cancelled": False, "text": "".join(parts), "finish": finish, "tokens": n, "t0": t0, "end": time.perf_counter(),
            "ttft": (first - t0) if first else None, "itl": (last - first) / (n - 1) if first and n > 1 else None}


async def level(url: str, prompts, temps, seeds, cancels, concurrency: int, max_tokens: int, deadline: float):
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)
    out: list = [None] * len(prompts)

    async def run(i):
        async with sem:
            if time.monotonic() > deadline:
                out[i] = {"skipped": True}
                return
            out[i] = await one(client, prompts[i], max_tokens, temps[i], seeds[i], cancels[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def rss_mb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


def summarize(rows, wall: float) -> dict:
    done = [r for r in rows if r and not r.get("cancelled") and not r.get("skipped")]
    toks = sum(r["tokens"] for r in done)
    return {"completed": len(done), "cancelled": sum(1 for r in rows if r and r.get("cancelled")),
            "skipped": sum(1 for r in rows if r and r.get("skipped")), "tokens": toks, "wall_s": wall,
            "tokens_per_s": toks / wall if wall else 0.0,
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in done if r["ttft"] is not None], 0.5),
            "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in done if r["ttft"] is not None], 0.99),
            "itl_p50_ms": 1e3 * pct([r["itl"] for r in done if r["itl"] is not None], 0.5),
            "itl_p99_ms": 1e3 * pct([r["itl"] for r in done if r["itl"] is not None], 0.99)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency level and mode")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cancel", type=float, default=0.1, help="share of requests closed mid-stream")
    p.add_argument("--drafter", default="eagle3")
    p.add_argument("--budget", default="8", help="tree nodes incl. the root, or auto (needs the calibration)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare-prompts", type=int, default=20, help="greedy prompts of the c = 1 comparison")
    p.add_argument("--minutes", type=float, default=40.0, help="time bound: later requests are skipped (reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/serve_load")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from treespec import DynamicTreeBuilder, SpeculativeGenerator, SpeculativeServer, load_drafter, load_target
    from treespec.cli.serve.app import make_app

    deadline = time.monotonic() + 60 * args.minutes
    target = load_target("smollm2-135m")
    builder = "auto" if args.budget == "auto" else DynamicTreeBuilder(budget=int(args.budget), depth=4, top_k=2)
    if builder == "auto":
        from treespec.cli.main import ensure_calibration

        ensure_calibration(target, args.drafter, batches=[int(c) for c in args.concurrency.split(",") if c != "1"])
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = random.Random(args.seed)
    n = args.requests
    prompts = prompts_for(n, rng)
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(n)]
    seeds = [rng.randrange(2**31) for _ in range(n)]
    cancels = [rng.randint(1, 3) if rng.random() < args.cancel else None for _ in range(n)]
    modes = {"speculative": lambda: SpeculativeServer(target, load_drafter(args.drafter, target), builder),
             "plain": lambda: SpeculativeServer(target, None)}
    result: dict = {"args": vars(args), "modes": {}}
    greedy_ref: dict[int, str] = {}
    for mode, make in modes.items():
        server = make()
        app = make_app(server, "m", max_queue=max(levels) * 2 + 8, max_batch=max(levels), default_max_tokens=args.max_tokens)
        live = Live(app)
        warm = asyncio.run(level(live.url, prompts[:4], [0.0] * 4, seeds[:4], [None] * 4, 2, args.max_tokens,
                                 deadline))
        rss_warm = rss_mb()
        rows_by_level, lost = {}, []
        for c in levels:
            rows, wall = asyncio.run(level(live.url, prompts, temps, seeds, cancels, c, args.max_tokens, deadline))
            front = app.state.front
            t_wait = time.monotonic() + 30
            while (front.engine.live or server.live) and time.monotonic() < t_wait:
                time.sleep(0.05)
            freed = front.engine.live == 0 and server.verifier.batch_size == 0 and not server.live
            for i, r in enumerate(rows):
                if r is None or r.get("cancelled") or r.get("skipped"):
                    continue
                if r["finish"] not in ("stop", "length") or (r["finish"] == "length" and r["tokens"] != args.max_tokens):
                    lost.append((mode, c, i, "no finish"))
                if temps[i] == 0.0 and mode == "speculative":
                    if i in greedy_ref and greedy_ref[i] != r["text"]:
                        lost.append((mode, c, i, "greedy text differs between levels"))
                    greedy_ref.setdefault(i, r["text"])
            s = summarize(rows, wall)
            s["rows_freed"] = freed
            rows_by_level[c] = s
            print(f"[{mode} c={c}] {s}", file=sys.stderr, flush=True)
        rss_after = rss_mb()
        result["modes"][mode] = {"levels": rows_by_level, "rss_warm_mb": rss_warm, "rss_after_mb": rss_after,
                                 "lost": lost, "warmup_ok": all(r and not r.get("skipped") for r in warm[0])}
        if mode == "speculative" and 1 in levels:
            # goal: at c = 1, HTTP tokens/s within 10 % of SpeculativeGenerator on the same greedy prompts
            k = args.compare_prompts
            http_rows, http_wall = asyncio.run(level(live.url, prompts[:k], [0.0] * k, seeds[:k], [None] * k, 1,
                                                     args.max_tokens, deadline + 600))
            gen = SpeculativeGenerator(target, load_drafter(args.drafter, target), builder)
            t0 = time.perf_counter()
            gen_tokens = sum(gen.generate(q, args.max_tokens).stats.new_tokens for q in prompts[:k])
            gen_wall = time.perf_counter() - t0
            http_tokens = sum(r["tokens"] for r in http_rows)
            same = sum(r["text"] == gen.generate(q, args.max_tokens).text for r, q in zip(http_rows, prompts[:k]))
            result["c1_goal"] = {"prompts": k, "http_tokens_per_s": http_tokens / http_wall,
                                 "generator_tokens_per_s": gen_tokens / gen_wall,
                                 "ratio": (http_tokens / http_wall) / (gen_tokens / gen_wall), "same_text": same}
            result["speculative_tau"] = server.stats.tau
            result["speculative_acceptance_by_position"] = server.stats.depth_acceptance
        live.close()
    result["llama_server"] = "built" if shutil.which("llama-server") else "not built"
    write(result, args)
    return 0


def write(result: dict, args) -> None:
    info = machine_info()
    spec, plain = result["modes"]["speculative"], result["modes"]["plain"]
    rows = []
    for c in spec["levels"]:
        for name, m in (("treespec speculative", spec), ("treespec plain (speculation off)", plain)):
            s = m["levels"][c]
            rows.append([name, c, s["completed"], s["cancelled"], s["skipped"], f"{s['tokens_per_s']:.1f}",
                         f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f}", f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f}",
                         "yes" if s["rows_freed"] else "NO"])
        rows.append(["llama.cpp llama-server", c, "-", "-", "-", result["llama_server"], "-", "-", "-"])
    lines = [f"# Load test of `treespec serve` (loopback, openai client)", "", machine_line(info), "",
             f"SmolLM2-135M ({args.drafter}, budget {args.budget}), {args.requests} chat requests per level, "
             f"max_tokens {args.max_tokens}, T = 0 / 1 alternating (seeded), {args.cancel:.0%} closed mid-stream.", ""]
    lines += md_table(["server", "concurrency", "completed", "cancelled", "skipped (time bound)", "tokens/s",
                       "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "rows freed"], rows, "llrrrrrrl")
    lines += [""]
    for name, m in (("speculative", spec), ("plain", plain)):
        growth = (m["rss_after_mb"] - m["rss_warm_mb"]) / m["rss_warm_mb"]
        lines.append(f"- {name}: lost requests {len(m['lost'])}; RSS after warm-up {m['rss_warm_mb']:.0f} MB, "
                     f"after the run {m['rss_after_mb']:.0f} MB ({growth:+.1%}; goal within 5 %)")
    if "c1_goal" in result:
        g = result["c1_goal"]
        lines.append(f"- c = 1, {g['prompts']} greedy prompts: HTTP {g['http_tokens_per_s']:.1f} tokens/s, "
                     f"SpeculativeGenerator {g['generator_tokens_per_s']:.1f} tokens/s: **{g['ratio']:.2f}x** "
                     f"(goal >= 0.90); same text {g['same_text']}/{g['prompts']}")
        lines.append(f"- speculative server: tau {result['speculative_tau']:.2f}, acceptance by position "
                     + ", ".join(f"{a:.2f}" for a in result["speculative_acceptance_by_position"]))
    lines.append(f"- llama.cpp's llama-server: {result['llama_server']} on this machine")
    command = "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])
    publish(Path(args.out), lines, command, result)


if __name__ == "__main__":
    sys.exit(main())
