"""scripts/train_gpu.sh, issue 28's prepared GPU run: refused with a clear message where torch
sees no CUDA device, and the whole path (install, online training from the shipped head,
checkpoint and card gathered) on a CPU with DEVICE=cpu (slow)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_gpu.sh"


def run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "RUN": str(tmp_path / "run"), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=1200)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_the_script_says_so_before_installing_anything(tmp_path):
    out = run(tmp_path)          # DEVICE defaults to cuda
    assert out.returncode != 0
    assert "sees no CUDA device" in out.stderr and "DEVICE=cpu" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_whole_run_on_a_cpu_leaves_the_checkpoint_and_its_card(tmp_path):
    out = run(tmp_path, DEVICE="cpu", MINUTES="2", TOKENS="2k", BATCH="2")
    assert out.returncode == 0, out.stderr[-2000:]
    card = json.loads((tmp_path / "run" / "result" / "eagle3.json").read_text())
    assert (tmp_path / "run" / "result" / "eagle3.safetensors").is_file()
    assert card["drafter"] == "eagle3" and card["train"]["tokens_seen"] >= 2000
    assert card["train"]["init_from"].endswith("eagle3.safetensors")   # warm start from the shipped head
    assert len(card["heldout"]["top1_by_depth"]) == 4
    assert "held-out top-1 by depth" in out.stdout
