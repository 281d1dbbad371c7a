"""Verify-pass cost t(n) by path: what one target forward over an n-node tree costs.

Paths (SmolLM2-135M, one process, same prompt prefix, interleaved point by point so machine
noise hits all alike): fp32 with HF's stock linear layers, fp32 with oneDNN-packed weights, fp32 on
the panel GEMM (``treespec.fastpath.kernels``, where it builds; all exact fp32 paths), the block kernel
with HF's stock sdpa attention instead of treespec's grouped sdpa (same numbers, KV heads copied
per query head), the block kernel on its AVX2 code where the CPU runs its AVX-512 code (same
bits), bf16 stock, bf16 packed (bf16 rows only where the CPU has native bf16 units), and the
integer blocks on the AMX tile unit with x rounded to bf16 (``pack="amx"``, where the CPU has AMX-BF16),
the integer blocks times x rounded to 8-bit integers per block of 32 (``pack="x8"``, with row
attention; and the same with each block's scales as floats instead of K-quants' shared form,
``x8_records(..., sub_scales=False)``), and the block kernel with that row attention instead of
grouped sdpa.
Each point is one ``TreeVerifier.score`` (forward over n tree nodes with the tree mask after a
cached prefix of P tokens, then softmax) followed by ``compact`` back to the prefix; the median of
``--reps`` is kept. Beside them, the machine's physical limit per dtype:
max(weight bytes / measured bandwidth, 2 * linear params * n / measured GEMM peak).

``--model`` takes several targets (one table each, e.g. ``smollm2-135m,qwen2.5-coder-1.5b``).
``--llamacpp DIR`` adds llama.cpp's pass of n tokens after the same P cached ones on the same
GGUF and thread count (``llama-bench -d P -p n -n 0``, one run of every n between treespec's
repetitions), the engine a CPU user would run instead.

    python benchmarks/verify_cost.py --threads 1

Writes benchmarks/results/verify_cost.{json,md,png} with the CPU model, its flags and threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import sys
import time

import torch

import treespec
from harness import (RESULTS, figure, interleaved, machine_info, measure_bandwidth, median_ms, save_figure,
                     stored_bytes, time_calls, write_results)
from treespec.fastpath.packing import cpu_info
from treespec.fastpath.kernels import amx_status, kernel_isa, pack_blocks, panel_status, x8_records
from treespec.fastpath.attention import use_row_attention
from treespec.fastpath.packing import PackedLinear
from treespec.core.sampling import SamplingConfig
from treespec.core.tree import DraftTree
from treespec.runtime.verifier import TreeVerifier
from treespec.targets.loader import TARGET_LOADERS

NS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    """A bushy random tree (each node's parent among the earlier ones, biased to recent)."""
    parents = [-1] + [rng.randrange(max(0, i - 4), i) for i in range(1, n)]
    return DraftTree(torch.tensor([rng.randrange(vocab) for _ in range(n)]), torch.tensor(parents),
                     sampling="deterministic")


def measure_gemm_peak(dtype: torch.dtype, size: int = 1024, reps: int = 7) -> float:
    """FLOP/s of a cache-friendly square GEMM in ``dtype`` (median of reps)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size ** 3 / (median_ms(time_calls(lambda: a @ b, reps, warmup=2)) / 1e3)


def linear_params(model: torch.nn.Module) -> int:
    """Weights a forward multiplies by (every linear layer, the LM head included)."""
    return sum(m.weight.numel() for m in model.modules() if hasattr(m, "weight") and m.weight is not None
               and m.weight.dim() == 2 and not isinstance(m, torch.nn.Embedding))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefix", type=int, default=300, help="cached prefix tokens P")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--paths", default="", help="comma-separated subset of the paths (default: every one this CPU runs)")
    ap.add_argument("--out", default=str(RESULTS / "verify_cost"))
    ap.add_argument("--note", default="", help="a sentence for the result (what else ran on the host)")
    ap.add_argument("--model", default="smollm2-135m", help="target name(s), comma-separated: one table each")
    ap.add_argument("--llamacpp", default="", help="llama.cpp's build/bin (llama-bench): its pass of n tokens beside")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ns = [int(x) for x in args.ns.split(",")]
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    if not models or set(models) - set(TARGET_LOADERS):
        raise SystemExit(f"--model takes target names of {sorted(TARGET_LOADERS)}, comma-separated; got {args.model!r}")
    t_start, load_start = time.time(), os.getloadavg()[0]
    sections, results = [], {}
    for model_name in models:
        result, md_lines = measure_model(args, model_name, ns)
        results[model_name] = result
        sections += md_lines
    result = {"load": [load_start, os.getloadavg()[0]], "machine": machine_info(), "args": vars(args),
              "wall_s": time.time() - t_start, "models": results}
    m = result["machine"]
    lines = [
        f"# Verify-pass cost t(n): {', '.join(models)}, prefix {args.prefix} tokens",
        "",
        f"CPU: {m['cpu_model']}; flags: {', '.join(m['cpu_flags'])}; torch {m['torch']} "
        f"({m['torch_cpu_capability']}), {m['torch_threads']} thread(s). Medians of {args.reps} interleaved "
        f"repetitions; one point = TreeVerifier.score over an n-node tree (tree mask, positions, softmax). "
        f"Host load average (1 min) {result['load'][0]:.1f} at the start, {result['load'][1]:.1f} at the end. "
        f"{args.note}".rstrip(),
        "",
        *sections,
        f"Reproduce: `python benchmarks/verify_cost.py {shlex.join(sys.argv[1:])}`",
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    js, _ = write_results(args.out, result, md)
    try:
        fig, axes = figure(1, len(models), size=(7.0 * len(models), 4.5))
        for ax, (model_name, r) in zip(axes[0], results.items()):
            for name, row in r["t_ms"].items():
                ax.plot(ns, [row[str(n)] for n in ns], marker="o", label=name)
            for k, row in r["limit_ms"].items():
                ax.plot(ns, [row[str(n)] for n in ns], linestyle="--", label=f"physical limit {k}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tree nodes n")
            ax.set_ylabel("verify pass (ms)")
            ax.set_title(f"{model_name}, {m['torch_threads']} thread(s), {m['cpu_model'][:30]}")
            ax.legend(fontsize=7)
        save_figure(fig, js.with_suffix(".png"))
    except ImportError:
        print("matplotlib not installed: no plot")


def llama_bench_pass_ms(bin_dir: str, gguf: str, ns: list[int], prefix: int, threads: int) -> dict[int, float]:
    """llama.cpp's time for one pass of n tokens after ``prefix`` cached ones (``llama-bench -d``),
    one run each, in ms."""
    import json
    import subprocess
    from pathlib import Path

    cmd = [str(Path(bin_dir) / "llama-bench"), "-m", gguf, "-t", str(threads), "-d", str(prefix),
           "-p", ",".join(map(str, ns)), "-n", "0", "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return {int(row["n_prompt"]): row["avg_ns"] / 1e6 for row in json.loads(out)}


def measure_model(args: argparse.Namespace, model_name: str, ns: list[int]) -> tuple[dict, list[str]]:
    """One model's paths, interleaved: (its result, its Markdown section)."""

    paths = {"fp32 stock": (torch.float32, False), "fp32 onednn": (torch.float32, "onednn")}
    if panel_status()[0]:
        paths["fp32 panel"] = (torch.float32, "panel")
        paths["fp32 blocks"] = (torch.float32, "blocks")
    if cpu_info().native_bf16:
        paths.update({"bf16 stock": (torch.bfloat16, False), "bf16 packed": (torch.bfloat16, True)})
    if amx_status()[0]:
        paths["fp32 amx"] = (torch.float32, "amx")
    if panel_status()[0]:
        paths["fp32 x8"] = (torch.float32, "x8")
        # the same target with every weight on per-block float scales: what K-quants' shared ones save
        paths["fp32 x8 per-block scales"] = (torch.float32, "x8")
    verifiers, described = {}, {}
    if "fp32 blocks" in paths:   # the same kernel with HF's stock attention: what grouped sdpa saves
        paths["fp32 blocks, stock sdpa"] = (torch.float32, "blocks")
        if kernel_isa() == "avx512":   # the same bits from the AVX2 kernels: what AVX-512 saves
            paths["fp32 blocks, AVX2"] = (torch.float32, "blocks")
        # the attention the x8 and amx paths run (each row as alone): what it costs over grouped sdpa
        paths["fp32 blocks, row attention"] = (torch.float32, "blocks")
    if args.paths:
        asked = [p.strip() for p in args.paths.split(",") if p.strip()]
        if not asked or set(asked) - set(paths):
            raise SystemExit(f"--paths takes a subset of {list(paths)} on this CPU, got {args.paths!r}")
        paths = {k: v for k, v in paths.items() if k in asked}
    if model_name != "smollm2-135m":   # larger targets: their fast paths only (the others are SmolLM2's study)
        paths = {k: v for k, v in paths.items()
                 if k in ("fp32 blocks", "fp32 x8", "fp32 x8 per-block scales", "fp32 amx", "bf16 packed")}
    vocab = None
    for name, (dtype, pack) in paths.items():
        target = treespec.load_target(model_name, dtype=dtype, pack=pack)
        vocab = vocab or target.model.config.vocab_size
        prompt = torch.tensor([random.Random(0).randrange(vocab) for _ in range(args.prefix + 1)])
        if name.endswith("stock sdpa"):
            target.model.set_attn_implementation("sdpa")
            target = dataclasses.replace(target, speed_path=target.speed_path.split("; attention:")[0]
                                         + "; attention: stock sdpa (switched back for comparison)")
        if name.endswith("row attention"):
            use_row_attention(target.model)
            target = dataclasses.replace(target, speed_path=target.speed_path.split("; attention:")[0]
                                         + "; attention: row attention (switched for comparison)")
        if name.endswith("AVX2"):
            for layer in target.model.modules():
                if isinstance(layer, PackedLinear):
                    layer.isa = "avx2"
            target = dataclasses.replace(target, speed_path=target.speed_path.replace("AVX-512 kernels", "AVX2 kernels"))
        if name.endswith("per-block scales"):
            for layer in target.model.modules():
                if isinstance(layer, PackedLinear) and getattr(layer._packed, "layout", "") == "x8k":
                    layer._packed = x8_records(pack_blocks(layer.weight), sub_scales=False)
            target = dataclasses.replace(target, speed_path=target.speed_path.split("; attention:")[0]
                                         + " (each block's scales as floats, switched back for comparison); attention:"
                                         + target.speed_path.split("; attention:")[1])
        described[name] = target.speed_path
        v = TreeVerifier(target.model, SamplingConfig(temperature=1.0))
        v.prefill(prompt)
        verifiers[name] = v
    trees = {n: random_tree(random.Random(n), n, vocab) for n in ns}

    def score_and_undo(name: str, n: int) -> float:
        """One timed verify pass, then its n rows cropped from the cache (prefix unchanged)."""
        v = verifiers[name]
        t0 = time.perf_counter()
        v.score(trees[n])
        dt = time.perf_counter() - t0
        for layer in v.cache.layers:
            layer.crop(-n)
        return dt

    points = {(name, n): (lambda name=name, n=n: score_and_undo(name, n)) for name in paths for n in ns}
    llama: dict[int, list[float]] = {n: [] for n in ns}
    gguf = None
    if args.llamacpp:
        from treespec.runtime.llamacpp import gguf_path

        gguf = str(gguf_path(model_name))

    def after_rep(rep: int) -> None:
        if gguf is not None:     # llama.cpp's passes between treespec's repetitions
            for n, t in llama_bench_pass_ms(args.llamacpp, gguf, ns, args.prefix, args.threads).items():
                llama[n].append(t)
        print(f"{model_name}: rep {rep + 1}/{args.reps} done", flush=True)

    t_start = time.time()                       # warm-up (every shape once), then interleaved reps
    samples = interleaved(points, args.reps, warmup=1, self_timed=True, on_rep=after_rep)
    for name, v in verifiers.items():
        assert v.prefix_len == args.prefix and v.cache.layers[0].keys.shape[-2] == args.prefix, name

    bandwidth = measure_bandwidth()
    peaks = {"fp32": measure_gemm_peak(torch.float32)}
    if "bf16 packed" in paths or "fp32 amx" in paths:
        peaks["bf16"] = measure_gemm_peak(torch.bfloat16)
    model = next(iter(verifiers.values())).model
    params = linear_params(model)

    def roofline(nbytes: float, peak: float) -> dict[int, float]:
        """Seconds per pass of n rows: the weight read or the multiply-adds, whichever is longer."""
        return {n: max(nbytes / bandwidth, 2 * params * n / peak) for n in ns}

    limit = {dt_name: roofline(params * (4 if dt_name == "fp32" else 2), peak) for dt_name, peak in peaks.items()}
    for name, peak in (("fp32 blocks", "fp32"), ("fp32 amx", "bf16")):   # the FLOPs from the bytes read
        if name in verifiers:
            limit[name] = roofline(stored_bytes(verifiers[name].model), peaks[peak])

    ms = {name: {n: median_ms(samples[(name, n)]) for n in ns} for name in paths}
    if gguf is not None:
        ms["llama.cpp"] = {n: sorted(v)[len(v) // 2] for n, v in llama.items()}
        described["llama.cpp"] = (f"llama.cpp's llama-bench on {os.path.basename(gguf)}: one pass of n tokens "
                                  f"after {args.prefix} cached (-d {args.prefix} -p n -n 0), the median of one run "
                                  f"per repetition")
    result = {
        "paths": described,
        "wall_s": time.time() - t_start,
        "bandwidth_GBps": bandwidth / 1e9,
        "gemm_peak_GFLOPs": {k: v / 1e9 for k, v in peaks.items()},
        "linear_params": params,
        "stored_bytes": {name: stored_bytes(v.model) for name, v in verifiers.items()},
        "t_ms": {name: {str(n): t for n, t in row.items()} for name, row in ms.items()},
        "limit_ms": {k: {str(n): t * 1e3 for n, t in row.items()} for k, row in limit.items()},
        **{f"ratio_{k}_1": {name: row[k] / row[1] for name, row in ms.items() if k in row and 1 in row}
           for k in (4, 8, 16)},
    }
    lines = [
        f"## {model_name}",
        "",
        f"Measured here: streaming read {bandwidth / 1e9:.1f} GB/s; GEMM peak "
        + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items())
        + f"; {params / 1e6:.1f} M linear weights per forward; bytes a pass reads: "
        + ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in result["stored_bytes"].items() if v) + ".",
        "",
        "Paths: " + "; ".join(f"**{k}** = {v}" for k, v in described.items()),
        "",
        "| n | " + " | ".join(ms) + " | " + " | ".join(f"limit {k}" for k in limit) + " |",
        "| ---: | " + " | ".join("---:" for _ in ms) + " | " + " | ".join("---:" for _ in limit) + " |",
    ]
    for n in ns:
        lines.append(f"| {n} | " + " | ".join(f"{row[n]:.1f}" for row in ms.values()) + " | "
                     + " | ".join(f"{row[n] * 1e3:.1f}" for row in limit.values()) + " |")
    lines.append("")
    for n in (4, 8, 16):
        ratios = result[f"ratio_{n}_1"]
        if ratios:
            lines.append(f"t({n}) / t(1): " + ", ".join(f"{k} **{v:.2f}**" for k, v in ratios.items())
                         + "; physical limit: " + ", ".join(f"{k} {row[n] / row[1]:.2f}" for k, row in limit.items())
                         + "  ")
    lines += ["", "Times in ms.", ""]
    for v in verifiers.values():     # free the model before the next one loads
        v.model = None
    return result, lines

if __name__ == "__main__":
    main()
