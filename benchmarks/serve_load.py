"""Load test of `treespec serve` on loopback: the official openai client (async) against the HTTP
server running as its own process (`treespec serve` on a free 127.0.0.1 port, as it is deployed),
speculation on and off, at several concurrencies. Bounded in count and time; stops by itself and
stops the servers it started.

Per mode (the speculative server, and the same server with speculation off: ``--drafter none``)
and concurrency c: ``--requests`` chat requests of random prompt lengths (MT-bench questions,
1-2 of them joined), half at T = 0 and half at T = 1 (seeded), ``--cancel`` of them closed
mid-stream after 1-3 chunks. Both servers run side by side; a level's requests run in
``--blocks`` consecutive slices, each slice on every server back to back (the order rotating), so
that a drifting load on a shared host hits both modes alike and each slice gives a paired
speculative / plain ratio. Before the
baseline RSS each server is warmed up with the same mix
at the largest concurrency (its KV cache, batched buffers and allocator pools reach their size
for that batch). Checks: nothing lost (every request not cancelled ends with a finish reason,
its usage and, at T = 0, the same text at every level); the cancelled ones free their rows (no
live request and 0 KV rows on /metrics after each level); memory flat (the server process's
RSS after the run within 5 % of after the warm-up). Reports throughput, TTFT and inter-token
latency (p50 / p99; a request's ITL is (last token - first token) / (tokens - 1)), and at c = 1
the HTTP server's tokens/s against ``SpeculativeGenerator`` in this process on the same greedy
prompts, one prompt over HTTP then the same prompt in the generator, so that a drifting load
on a shared host hits both alike. llama.cpp's ``llama-server`` (``make bench-llamacpp``) runs as a
third server where it is built: the GGUF treespec loads for ``--model``, 1 thread, ``--parallel``
= the largest concurrency, the same requests and levels; its T = 1 tokens come from its own
sampler (top_k / min_p off, top_p 1, prompt cache off), so its text is not compared with
treespec's. The speculative server's drafter and tree are `treespec serve`'s serving preset for
the target on this CPU kind unless ``--drafter`` / ``--budget`` / ``--tree`` ... name them.
One result file a machine kind holds a section a target: ``--keep`` keeps the other targets'.

    python benchmarks/serve_load.py --requests 200 --max-tokens 32 --budget auto --keep \\
        --out benchmarks/results/serve_load_avx2
    python benchmarks/serve_load.py --model qwen2.5-coder-1.5b --requests 24 --concurrency 1,4 \\
        --compare-prompts 8 --blocks 2 --keep --out benchmarks/results/serve_load_avx2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness import machine_info, machine_line, md_table, write_results


def pct(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def prompts_for(n: int, rng: random.Random) -> list[str]:
    from treespec.data import mtbench_questions

    qs = [q.turns[0] for q in mtbench_questions()]
    return [" ".join(rng.sample(qs, rng.randint(1, 2))) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`treespec serve` in a child process on a free loopback port; ``close`` sends SIGTERM
    (it drains), then SIGKILL if it has not exited after ``grace`` s."""

    name = "treespec serve"
    # request fields beyond the common ones (model, messages, max_tokens, temperature, seed, stream)
    request_extra: dict = {}
    idle_gauges = ("treespec_live_requests", "treespec_kv_rows")

    def __init__(self, flags: list[str], threads: int, start_timeout: float, grace: float = 60.0):
        self.port, self.grace = free_port(), grace
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-load-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        self.command = self.command_for(flags, threads)
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/health").replace(" ", "").startswith('{"status":"ok"'):
                    break
            except OSError:                     # not listening yet, or 503 while loading
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{self.name} did not answer /health in {start_timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def command_for(self, flags: list[str], threads: int) -> list[str]:
        return [sys.executable, "-m", "treespec", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                "--threads", str(threads), *flags]

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def gauge(self, name: str) -> float:
        for line in self.get("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(f"{name} not in /metrics")

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def log_tail(self, chars: int | None = 4000) -> str:
        """The server's output: its last ``chars`` characters, or all of it (None)."""
        self.log.flush()
        text = Path(self.log.name).read_text()
        return text if chars is None else text[-chars:]

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()
        if self.proc.returncode == 0:           # a clean drain: its log has served its purpose
            Path(self.log.name).unlink(missing_ok=True)
        else:
            print(f"[{self.name} exited with {self.proc.returncode}; its log: {self.log.name}]", file=sys.stderr)
        return self.proc.returncode


class LlamaServerProcess(ServerProcess):
    """llama.cpp's ``llama-server`` on the GGUF treespec loads, in a child process on a free
    loopback port: ``--parallel`` slots, ``ctx_per_slot`` tokens each, ``threads`` threads for
    decoding and prompt batches, /metrics on. SIGTERM stops it."""

    name = "llama-server"
    # OpenAI's T = 1 sampling (llama.cpp's defaults add top_k 40, top_p 0.95, min_p 0.05); no
    # prompt cache (treespec's server has none, and every level repeats the prompts); usage in
    # the stream (treespec's server sends it unasked)
    request_extra = {"top_p": 1.0, "stream_options": {"include_usage": True},
                     "extra_body": {"top_k": 0, "min_p": 0.0, "cache_prompt": False}}
    idle_gauges = ("llamacpp:requests_processing",)

    def __init__(self, binary: Path, gguf: Path, parallel: int, threads: int, start_timeout: float,
                 ctx_per_slot: int = 1024):
        self.binary, self.gguf, self.parallel, self.ctx_per_slot = binary, gguf, parallel, ctx_per_slot
        super().__init__([], threads, start_timeout, grace=30.0)

    def command_for(self, flags: list[str], threads: int) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-t", str(threads), "-tb", str(threads), "--parallel", str(self.parallel),
                "-c", str(self.ctx_per_slot * self.parallel), "--metrics", *flags]


def llama_server_binary() -> Path | None:
    """``llama-server`` of the ``make bench-llamacpp`` build (or ``$TREESPEC_LLAMACPP``), or None."""
    from treespec.runtime.llamacpp import LlamaCppTools

    try:
        return LlamaCppTools.locate(tools=("llama-server",)).bin_dir / "llama-server"
    except FileNotFoundError:
        return None


async def one(client, model: str, prompt: str, max_tokens: int, temperature: float, seed: int,
              cancel_after: int | None, extra: dict):
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, seed=seed, stream=True, **extra)
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
    except Exception as e:                      # noqa: BLE001 - counted as lost, the run goes on
        return {"error": f"{type(e).__name__}: {e}", "t0": t0}
    n = usage.completion_tokens if usage else 0
    return {"cancelled": False, "text": "".join(parts), "finish": finish, "tokens": n, "t0": t0,
            "end": time.perf_counter(), "ttft": (first - t0) if first else None,
            "itl": (last - first) / (n - 1) if first and n > 1 else None}


async def level(url: str, prompts, temps, seeds, cancels, concurrency: int, max_tokens: int, deadline: float,
                extra: dict | None = None):
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    sem = asyncio.Semaphore(concurrency)
    out: list = [None] * len(prompts)

    async def run(i):
        async with sem:
            if time.monotonic() > deadline:
                out[i] = {"skipped": True}
                return
            out[i] = await one(client, model, prompts[i], max_tokens, temps[i], seeds[i], cancels[i], extra or {})

    t0 = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    await client.close()
    return out, wall


def summarize(rows, wall: float) -> dict:
    done = [r for r in rows if r and not r.get("cancelled") and not r.get("skipped") and not r.get("error")]
    toks = sum(r["tokens"] for r in done)
    return {"completed": len(done), "cancelled": sum(1 for r in rows if r and r.get("cancelled")),
            "skipped": sum(1 for r in rows if r and r.get("skipped")),
            "errors": sum(1 for r in rows if r and r.get("error")), "tokens": toks, "wall_s": wall,
            "tokens_per_s": toks / wall if wall else 0.0,
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in done if r["ttft"] is not None], 0.5),
            "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in done if r["ttft"] is not None], 0.99),
            "itl_p50_ms": 1e3 * pct([r["itl"] for r in done if r["itl"] is not None], 0.5),
            "itl_p99_ms": 1e3 * pct([r["itl"] for r in done if r["itl"] is not None], 0.99)}


def wait_idle(server: ServerProcess, timeout: float = 30.0) -> bool:
    """True once the server holds no live request and no KV row (the cancelled ones freed;
    llama-server: no slot processing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(server.gauge(g) == 0 for g in server.idle_gauges):
            return True
        time.sleep(0.1)
    return False


SERVE_FLAGS = ("drafter", "budget", "tree", "min_confidence", "draft_max_batch", "kernel")


def resolve_serving(args) -> None:
    """The speculative server's drafter, tree, --kernel and --compile into ``args``: those
    given, the rest as `treespec serve --model M` fills them from its serving preset for this
    CPU kind (the plain server and the generator take the same kernel and compilation)."""
    from treespec.cli.main import build_parser
    from treespec.cli.presets import apply_serve_preset

    flags = ["serve", "--model", args.model]
    for name in SERVE_FLAGS:
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    flags += [] if args.compile is None else ["--compile" if args.compile else "--no-compile"]
    served = build_parser().parse_args(flags)
    apply_serve_preset(served)
    for name in (*SERVE_FLAGS, "compile"):
        setattr(args, name, getattr(served, name))


def speculative_flags(args) -> list[str]:
    """`treespec serve` flags naming the speculative server's drafter and tree in full."""
    flags = ["--model", args.model, "--drafter", args.drafter, "--budget", args.budget]
    if args.budget != "auto":
        flags += ["--tree", args.tree, "--depth", str(args.depth), "--top-k-draft", str(args.top_k_draft),
                  "--min-confidence", str(args.min_confidence)]
        flags += ["--draft-max-batch", str(args.draft_max_batch)] if args.draft_max_batch else []
    return flags


def compare_c1(server: ServerProcess, args, prompts: list[str], deadline: float) -> dict:
    """HTTP (c = 1, greedy, streamed) against SpeculativeGenerator in this process on the same
    prompts with the same tree, prompt by prompt, alternating which goes first."""
    import torch

    from treespec import SpeculativeGenerator, load_drafter, load_target
    from treespec.cli.trees import make_builder

    torch.set_num_threads(args.threads)
    target = load_target(args.model, pack=True if args.kernel == "auto" else args.kernel)
    if args.compile:
        from treespec.runtime.compiled import compile_target

        target = compile_target(target)
    builder = ("auto" if args.budget == "auto"
               else make_builder(args.tree, int(args.budget), args.depth, args.top_k_draft,
                                 min_confidence=args.min_confidence))
    gen = SpeculativeGenerator(target, load_drafter(args.drafter, target), builder)
    gen.generate(prompts[0], 4)   # warm
    http = {"tokens": 0, "s": 0.0}
    lib = {"tokens": 0, "s": 0.0}
    same, ratios = 0, []
    for i, q in enumerate(prompts):
        if time.monotonic() > deadline:
            break

        def over_http():
            (row,), wall = asyncio.run(level(server.url, [q], [0.0], [0], [None], 1, args.max_tokens, deadline))
            return row, wall

        def in_process():
            t0 = time.perf_counter()
            res = gen.generate(q, args.max_tokens)
            return res, time.perf_counter() - t0

        if i % 2 == 0:
            (row, h_wall), (res, g_wall) = over_http(), in_process()
        else:
            (res, g_wall), (row, h_wall) = in_process(), over_http()
        if row.get("error"):
            raise RuntimeError(f"the c = 1 comparison request failed: {row['error']}")
        http["tokens"] += row["tokens"]
        http["s"] += h_wall
        lib["tokens"] += res.stats.new_tokens
        lib["s"] += g_wall
        same += row["text"] == res.text
        ratios.append((row["tokens"] / h_wall) / (res.stats.new_tokens / g_wall))
    n = len(ratios)
    return {"prompts": n, "http_tokens_per_s": http["tokens"] / http["s"],
            "generator_tokens_per_s": lib["tokens"] / lib["s"],
            "ratio": (http["tokens"] / http["s"]) / (lib["tokens"] / lib["s"]),
            "median_prompt_ratio": pct(ratios, 0.5), "same_text": same,
            "generator_tree": str(getattr(gen.builder, "config", gen.builder))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="requests per concurrency level and mode")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cancel", type=float, default=0.1, help="share of requests closed mid-stream")
    p.add_argument("--model", default="smollm2-135m", help="the target of every server (a treespec name)")
    p.add_argument("--drafter", default=None, help="the speculative server's drafter; default: the serving preset's")
    p.add_argument("--budget", default=None,
                   help="tree nodes incl. the root, or auto (the server measures what its calibration lacks); "
                        "default: the serving preset's tree")
    p.add_argument("--tree", default=None, help="a numeric --budget's builder (default: the preset's, else dynamic)")
    p.add_argument("--depth", type=int, default=4, help="depth of a numeric --budget's dynamic tree")
    p.add_argument("--top-k-draft", type=int, default=2, help="children per node of a numeric --budget's tree")
    p.add_argument("--min-confidence", type=float, default=None, help="a numeric --budget's stop (as serve's)")
    p.add_argument("--draft-max-batch", type=int, default=None,
                   help="a numeric --budget's tree drafted up to this many live requests (as serve's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the generator")
    p.add_argument("--kernel", default=None,
                   help="the target's linear kernel on every treespec server and the generator; default: the "
                        "serving preset for this CPU kind (treespec.cli.presets), as `treespec serve` picks it")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compiled passes on every treespec server and the generator; default: the serving preset")
    p.add_argument("--compare-prompts", type=int, default=20, help="greedy prompts of the c = 1 comparison")
    p.add_argument("--minutes", type=float, default=40.0,
                   help="time bound of the levels: later requests are skipped (reported)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds a server may take to answer /health (auto may calibrate first)")
    p.add_argument("--blocks", type=int, default=4,
                   help="slices of a level, each run on every server in turn (the order rotating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--llama-server", default="auto", choices=("auto", "off"),
                   help="auto: llama.cpp's llama-server as a third server where `make bench-llamacpp` built it")
    p.add_argument("--out", default="benchmarks/results/serve_load")
    p.add_argument("--keep", action="store_true",
                   help="keep the other targets' runs already in --out (one file a machine kind, a section a target)")
    args = p.parse_args()

    if args.blocks < 1 or args.blocks > args.requests:
        p.error(f"--blocks must be between 1 and --requests ({args.requests}), got {args.blocks}")
    resolve_serving(args)
    started = time.monotonic()
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = random.Random(args.seed)
    n = args.requests
    prompts = prompts_for(n, rng)
    temps = [0.0 if i % 2 == 0 else 1.0 for i in range(n)]
    seeds = [rng.randrange(2**31) for _ in range(n)]
    cancels = [rng.randint(1, 3) if rng.random() < args.cancel else None for _ in range(n)]
    common = ["--max-batch", str(max(levels)), "--max-queue", str(max(levels) * 2 + 8),
              "--max-tokens-default", str(args.max_tokens), "--kernel", args.kernel,
              "--compile" if args.compile else "--no-compile"]
    modes = {"speculative": speculative_flags(args), "plain": ["--model", args.model, "--drafter", "none"]}
    result: dict = {"args": vars(args), "modes": {}, "load_average_start": os.getloadavg()}
    deadline = started + 60 * args.minutes
    # The servers run side by side (an idle one costs nothing); see the slices of a level below.
    servers: dict[str, ServerProcess] = {}
    llama = llama_server_binary() if args.llama_server == "auto" else None
    result["llama_server"] = "not built" if llama is None and args.llama_server == "auto" else (
        "off" if llama is None else str(llama))
    try:
        for mode, flags in modes.items():
            servers[mode] = ServerProcess(flags + common, args.threads, args.start_timeout)
        if llama is not None:
            from treespec.runtime.llamacpp import gguf_path

            servers["llama-server"] = LlamaServerProcess(llama, gguf_path(args.model), max(levels),
                                                         args.threads, args.start_timeout)
            result["llama_server_command"] = servers["llama-server"].command
        state = {mode: {"levels": {}, "lost": [], "rss_by_level_mb": {}, "greedy": {}, "greedy_differs": []}
                 for mode in servers}
        m = max(levels)
        k = min(n, 2 * m)
        for mode, server in servers.items():     # warm-up at the largest concurrency, then the baseline
            warm, _ = asyncio.run(level(server.url, prompts[:k], temps[:k], seeds[:k], cancels[:k], m,
                                        args.max_tokens, deadline, server.request_extra))
            wait_idle(server)
            state[mode]["rss_warm_mb"] = server.rss_mb()
            state[mode]["warmup_ok"] = all(r and not r.get("skipped") and not r.get("error") for r in warm)
        names = list(servers)
        for c in levels:
            # The level's requests in --blocks consecutive slices; each slice runs on every server in
            # turn, the order rotating from slice to slice, so that a load drifting on a shared host
            # over the minutes of a level hits every server alike (a paired ratio per slice).
            slices = [list(range(j * n // args.blocks, (j + 1) * n // args.blocks)) for j in range(args.blocks)]
            got = {mode: {"rows": [None] * n, "wall": 0.0, "freed": True, "blocks": []} for mode in servers}
            for j, idx in enumerate(slices):
                if not idx:
                    continue
                order = names[j % len(names):] + names[:j % len(names)]
                for mode in order:
                    server, g = servers[mode], got[mode]
                    rows, wall = asyncio.run(level(server.url, [prompts[i] for i in idx], [temps[i] for i in idx],
                                                   [seeds[i] for i in idx], [cancels[i] for i in idx], c,
                                                   args.max_tokens, deadline, server.request_extra))
                    g["freed"] &= wait_idle(server)
                    for i, r in zip(idx, rows):
                        g["rows"][i] = r
                    g["wall"] += wall
                    g["blocks"].append(summarize(rows, wall)["tokens_per_s"])
            for mode, server in servers.items():
                st, g = state[mode], got[mode]
                rows = g["rows"]
                st["rss_by_level_mb"][c] = server.rss_mb()
                for i, r in enumerate(rows):
                    if r is None or r.get("cancelled") or r.get("skipped"):
                        continue
                    if r.get("error"):
                        st["lost"].append((mode, c, i, r["error"]))
                        continue
                    if r["finish"] not in ("stop", "length") or (r["finish"] == "length"
                                                                 and r["tokens"] != args.max_tokens):
                        st["lost"].append((mode, c, i, "no finish"))
                    if temps[i] == 0.0:          # a greedy request's text at its first level
                        if i in st["greedy"] and st["greedy"][i] != r["text"]:
                            if mode == "llama-server":   # batched float sums: reported, not a loss
                                st["greedy_differs"].append((c, i))
                            else:
                                st["lost"].append((mode, c, i, "greedy text differs between levels"))
                        st["greedy"].setdefault(i, r["text"])
                summary = summarize(rows, g["wall"])
                summary["rows_freed"] = g["freed"]
                summary["block_tokens_per_s"] = g["blocks"]
                summary["load_average"] = os.getloadavg()[0]
                st["levels"][c] = summary
                print(f"[{mode} c={c}] {summary}", file=sys.stderr, flush=True)
        for mode, server in servers.items():
            st = state[mode]
            result["modes"][mode] = {
                "levels": st["levels"], "rss_warm_mb": st["rss_warm_mb"], "rss_after_mb": server.rss_mb(),
                "rss_by_level_mb": st["rss_by_level_mb"], "lost": st["lost"], "warmup_ok": st["warmup_ok"],
                "greedy_differs_between_levels": st["greedy_differs"]}
            if mode == "llama-server":
                continue
            metrics = server.get("/metrics")
            result["modes"][mode].update({
                "server_log": [line for line in server.log_tail(None).splitlines()
                               if line.startswith(("[auto", "[treespec serve", "[target", "[adding",
                                                   "[no calibration"))],
                "tau": gauge_of(metrics, "treespec_tau"),
                "acceptance_by_position": [float(line.split()[-1]) for line in metrics.splitlines()
                                           if line.startswith("treespec_acceptance_rate{")],
            })
        if 1 in levels:
            result["c1_goal"] = compare_c1(servers["speculative"], args, prompts[:args.compare_prompts],
                                           deadline + 600)
    finally:
        for mode, server in servers.items():
            result["modes"].setdefault(mode, {})["exit_code"] = server.close()
    result["load_average_end"] = os.getloadavg()
    write(result, args)
    return 0


def gauge_of(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


MODEL_NAMES = {"smollm2-135m": "SmolLM2-135M", "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B"}


def write(result: dict, args) -> None:
    """This run's section, after the other targets' runs already in ``--out`` with ``--keep``
    (a run of the same target is replaced), as ``--out``.{json,md}."""
    import json

    info = machine_info()
    runs = {args.model: {**result, "command": "python benchmarks/serve_load.py " + " ".join(sys.argv[1:])}}
    old = Path(args.out).with_suffix(".json")
    if args.keep and old.exists():
        runs = kept_runs(json.loads(old.read_text()), info, args.model) | runs
    lines = ["# Load test of `treespec serve` (loopback, openai client, server in its own process)", "",
             machine_line(info)]
    for model, run in runs.items():
        lines += ["", f"## {MODEL_NAMES.get(model, model)}", "", *section(run), "", f"Reproduce: `{run['command']}`"]
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(Path(args.out), {"machine": info, "runs": runs}, md)


def kept_runs(data: dict, info: dict, model: str) -> dict:
    """The runs of targets other than ``model`` in a result file's ``data`` (sections, or one
    run written before there were sections), which must come from this CPU: one file holds one
    machine kind."""
    theirs = (data["machine"]["cpu_model"], data["machine"]["torch_cpu_capability"])
    if theirs != (info["cpu_model"], info["torch_cpu_capability"]):
        raise ValueError(f"--keep: the runs in --out were measured on {theirs[0]} ({theirs[1]}), not this "
                         f"{info['cpu_model']} ({info['torch_cpu_capability']}); give another --out")
    runs = data.get("runs") or {data["args"].get("model", "smollm2-135m"): data}
    return {m: r for m, r in runs.items() if m != model}


def section(result: dict) -> list[str]:
    """The Markdown of one run (its ``args`` as recorded, the target's name defaulting to the
    SmolLM2 of runs recorded before there was a choice)."""
    args = argparse.Namespace(**{"model": "smollm2-135m", "tree": None, "min_confidence": None,
                                 "draft_max_batch": None, **result["args"]})
    spec, plain = result["modes"]["speculative"], result["modes"]["plain"]
    llama = result["modes"].get("llama-server")
    rows = []
    for c in spec["levels"]:
        for name, m in (("treespec speculative", spec), ("treespec plain (speculation off)", plain),
                        ("llama.cpp llama-server", llama)):
            if m is None:
                rows.append([name, c, "-", "-", "-", "-", result["llama_server"], "-", "-", "-", "-"])
                continue
            s = m["levels"][c]
            rows.append([name, c, s["completed"], s["cancelled"], s["skipped"], s["errors"], f"{s['tokens_per_s']:.1f}",
                         f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f}",
                         f"{s['itl_p50_ms']:.1f} / {s['itl_p99_ms']:.1f}", "yes" if s["rows_freed"] else "NO",
                         f"{s['load_average']:.1f}"])
    la0, la1 = result["load_average_start"], result["load_average_end"]
    tree = f"budget {args.budget}"
    if args.budget != "auto" and args.tree:
        tree = f"{args.tree} of {args.budget} nodes" + (f" cut at {args.min_confidence:g}" if args.min_confidence else "")
        tree += f", drafted up to {args.draft_max_batch} live request(s)" if args.draft_max_batch else ""
    lines = [f"{MODEL_NAMES.get(args.model, args.model)} ({args.drafter}, {tree}; --kernel {args.kernel}, passes "
             f"{'compiled' if args.compile else 'eager'}, on every treespec server and the generator), "
             f"{args.requests} chat requests per level, "
             f"max_tokens {args.max_tokens}, T = 0 / 1 alternating (seeded), {args.cancel:.0%} closed mid-stream; "
             f"server and generator on {args.threads} torch thread(s). Host load average (1 min) "
             f"{la0[0]:.1f} at the start, {la1[0]:.1f} at the end, on {os.cpu_count()} cores shared with other work.",
             ""]
    lines += md_table(["server", "concurrency", "completed", "cancelled", "skipped (time bound)", "errors",
                       "tokens/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms", "rows freed", "load avg"], rows,
                      "llrrrrrrrlr")
    lines += [""]
    for name, m in (("speculative", spec), ("plain", plain), ("llama-server", llama)):
        if m is None:
            continue
        growth = (m["rss_after_mb"] - m["rss_warm_mb"]) / m["rss_warm_mb"]
        by = ", ".join(f"c={c}: {v:.0f}" for c, v in m["rss_by_level_mb"].items())
        lines.append(f"- {name}: lost requests {len(m['lost'])}; server RSS after the warm-up at the largest "
                     f"concurrency {m['rss_warm_mb']:.0f} MB, after each level {by} MB, at the end "
                     f"{m['rss_after_mb']:.0f} MB ({growth:+.1%}; goal within 5 %); exit code {m['exit_code']}")
    lines.append(f"- speculative server: tau {spec['tau']:.2f}, acceptance by position "
                 + (", ".join(f"{a:.2f}" for a in spec["acceptance_by_position"]) or "none (no draft)"))
    for c in spec["levels"]:
        a, b = spec["levels"][c], plain["levels"][c]
        pairs = [x / y for x, y in zip(a["block_tokens_per_s"], b["block_tokens_per_s"]) if y]
        lines.append(f"- c = {c}: speculative / plain tokens/s **{a['tokens_per_s'] / b['tokens_per_s']:.2f}x** "
                     f"over the level; per slice ({len(pairs)}, each run on both servers back to back) "
                     + ", ".join(f"{r:.2f}" for r in pairs) + f", median {pct(pairs, 0.5):.2f}x")
    for line in spec["server_log"]:
        if line.startswith("[auto"):
            lines.append(f"- server: {line.strip('[]')}")
    if "c1_goal" in result:
        g = result["c1_goal"]
        lines.append(f"- c = 1, {g['prompts']} greedy prompts, HTTP and generator alternating prompt by prompt: "
                     f"HTTP {g['http_tokens_per_s']:.1f} tokens/s, SpeculativeGenerator "
                     f"{g['generator_tokens_per_s']:.1f} tokens/s: **{g['ratio']:.2f}x** (median per prompt "
                     f"{g['median_prompt_ratio']:.2f}x; goal >= 0.90); "
                     f"same text {g['same_text']}/{g['prompts']}; generator tree {g['generator_tree']}")
    if llama is None:
        lines.append(f"- llama.cpp's llama-server: {result['llama_server']} on this machine")
    else:
        flags = " ".join(Path(a).name if a.startswith("/") else a for a in result["llama_server_command"])
        lines.append(f"- llama.cpp's llama-server (`{flags}`): "
                     "its T = 1 tokens come from its own sampler (top_k 0, min_p 0, top_p 1, seeded), so its "
                     "text is not checked against treespec's; greedy texts that differ between its levels "
                     f"(batched float sums, not counted as lost): {len(llama['greedy_differs_between_levels'])}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
