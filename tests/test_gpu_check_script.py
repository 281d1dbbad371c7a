"""scripts/gpu_check.sh, the prepared GPU check: its smoke run takes every code path of the real
one on a CPU (CUDA tests, the verify-pass table with its predictions, the real SmolLM2 with
eagle3), it refuses clearly where no GPU is, and a model wheel split for the trip is joined only
when its parts are whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True, text=True, timeout=600)


@pytest.mark.slow   # the real SmolLM2 with eagle3 and three verify-pass models, ~35 s: make test-slow
def test_the_smoke_run_takes_every_path_on_a_cpu(tmp_path):
    out = run("--smoke", DEVICE="cpu", OUT=str(tmp_path))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    data = json.loads((tmp_path / "gpu_cpu_smoke.json").read_text())
    assert {r["model"] for r in data["verify"]} == {"smollm2-135m", "qwen2.5-coder-1.5b", "llama-3-8b"}
    for r in data["verify"]:
        assert r["eager_ms"] > 0 and r["graph_ms"] is None and "CUDA" in r["graph_note"]
        assert r["nodes"] > 1 or r["eager_ratio"] == 1.0
    real = data["real"]
    assert "skipped" not in real, real
    assert real["greedy_equal"] == real["prompts"] == 1 and real["tau"] >= 1.0
    md = (tmp_path / "gpu_cpu_smoke.md").read_text()
    assert "| llama-3-8b |" in md and "greedy = plain" in md and "CPU:" in md
    assert "== 1. CUDA tests" in out.stdout


def test_the_predictions_stand_beside_the_measurements():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = [{"model": "llama-3-8b", "batch": 1, "nodes": n, "eager_ms": 20.0 + n, "graph_ms": 10.0 + n}
            for n in (1, 16)]
    gpu_check.add_predictions(rows, "h100", 512, smoke=False)
    one, sixteen = rows
    assert one["predicted_ratio"] == 1.0 and sixteen["predicted_ratio"] > 1.0
    assert 1.0 < one["predicted_ms"] < 20.0          # 16 GB of bf16 weights at H100 bandwidth: ~7 ms
    assert sixteen["graph_ratio"] == pytest.approx(26 / 11)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_the_check_says_so(tmp_path):
    out = run(OUT=str(tmp_path))              # DEVICE defaults to cuda
    assert out.returncode != 0
    assert "sees no CUDA device" in out.stderr and "DEVICE=cpu" in out.stderr
    assert not list(tmp_path.iterdir())


def test_a_split_wheel_is_joined_only_when_its_parts_are_whole(tmp_path):
    wheel = tmp_path / "model-1.0-py3-none-any.whl"
    payload = os.urandom(3000)
    for i, piece in enumerate((payload[:1000], payload[1000:2000], payload[2000:])):
        (tmp_path / f"{wheel.name}.part{i:02d}").write_bytes(piece)
    import hashlib

    (tmp_path / f"{wheel.name}.sha256").write_text(hashlib.sha256(payload[:2000] + b"x").hexdigest() + "\n")
    script = f"source {ROOT}/scripts/lib/offline.sh; install_wheels {sys.executable} {tmp_path}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "does not match" in out.stderr and "copy the parts again" in out.stderr
    assert not wheel.exists()                # nothing half-joined is left to install later
