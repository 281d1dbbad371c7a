"""llama.cpp beside treespec: the physical limit of a decode pass, and llama-bench on the same GGUF.

The rows themselves (llama.cpp's plain decoding, its n-gram and draft-model speculation, run
prompt by prompt between treespec's rows) live in :mod:`treespec.runtime.llamacpp`, which
``benchmarks/engine.py --llamacpp``, ``benchmarks/qwen.py --llamacpp`` and ``treespec bench
--llamacpp`` share. This module adds what a result file states beside them:

- **bandwidth**: one core's copy rate, a 1 GiB ``numpy.copyto`` (bytes read + bytes written per
  second, as STREAM's copy counts them), best of a few;
- **bytes a pass reads**: treespec's packed linear layers (``PackedLinear.packed_nbytes``: the
  integer blocks or panels one pass reads), llama.cpp's GGUF tensors (the tied embedding counts
  once: the output layer reads all of it, the lookup one row);
- **the limit**: bandwidth / bytes = target passes per second; a row's tokens/s limit is that
  times its τ (its drafter's reads left out).

    python benchmarks/llamacpp.py                     # bandwidth, bytes, llama-bench tg128 / pp4 / pp16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from harness import machine_info
from treespec.runtime.llamacpp import LlamaCppTools, gguf_path


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """One core's copy bandwidth in bytes/s (read + written), best of ``reps`` copies."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)                  # touch the pages
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file (what a llama.cpp decode pass reads, the embedding
    table included once: tied models read all of it as the output layer)."""
    from gguf import GGUFReader

    return int(sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors))


def target_pass_bytes(target) -> int:
    """Bytes one target pass reads through treespec's linear layers (packed copies where packed,
    the weights otherwise); the embedding lookup reads one row and is left out."""
    import torch

    from treespec.fastpath.packing import PackedLinear

    total = 0
    for module in target.model.modules():
        if isinstance(module, PackedLinear):
            total += module.packed_nbytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def physical_limits(runners: dict, bandwidth: float | None = None) -> dict:
    """Per row group of ``benchmarks/engine.py`` (fp32, bf16, amx, gguf): the bytes a target
    pass reads and the passes per second one core's copy bandwidth allows."""
    import treespec

    bandwidth = bandwidth or copy_bandwidth()
    groups = {}
    for group, rows in runners.items():
        if group == "gguf":
            nbytes, what = gguf_tensor_bytes(gguf_path("smollm2-135m")), "GGUF tensors (Q4_1 / Q8_0 blocks)"
        else:
            gen = next((r for r in rows.values() if isinstance(r, treespec.SpeculativeGenerator)), None)
            if gen is None:
                continue
            nbytes, what = target_pass_bytes(gen.target), "packed linear layers"
        groups[group] = {"bytes_per_pass": nbytes, "what": what, "passes_per_s_limit": bandwidth / nbytes}
    return {"copy_bandwidth_bytes_per_s": bandwidth, "groups": groups}


def llama_bench(tools: LlamaCppTools, gguf: Path, threads: int, reps: int = 3) -> list[dict]:
    """``llama-bench`` tg128 and pp 1 / 4 / 16 on ``gguf`` (its JSON rows)."""
    binary = tools.bin_dir / "llama-bench"
    if not binary.is_file():
        raise FileNotFoundError(f"no llama-bench in {tools.bin_dir}: run `make bench-llamacpp`")
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "1,4,16", "-n", "128", "-r", str(reps),
           "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited {done.returncode}: {done.stderr[-800:]}")
    return [{k: r.get(k) for k in ("n_prompt", "n_gen", "n_threads", "avg_ts", "stddev_ts", "cpu_info")}
            for r in json.loads(done.stdout)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llamacpp", default=None, metavar="BIN_DIR", help="llama.cpp's bin folder (default: the build "
                                                                        "of `make bench-llamacpp`)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-llama-bench", action="store_true")
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    gguf = gguf_path("smollm2-135m")
    out = {"machine": machine_info(), "copy_bandwidth_GBps": bandwidth / 1e9, "gguf": str(gguf), "gguf_tensor_bytes": gguf_tensor_bytes(gguf)}
    out["llama_cpp_passes_per_s_limit"] = bandwidth / out["gguf_tensor_bytes"]
    if not args.no_llama_bench:
        out["llama_bench"] = llama_bench(LlamaCppTools.locate(args.llamacpp), gguf, args.threads)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
