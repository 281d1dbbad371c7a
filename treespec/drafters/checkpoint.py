"""Drafter checkpoints: fp16 safetensors + a JSON card, validated against the target on load.

A checkpoint ``<dir>/<name>.safetensors`` holds the drafter's own tensors only (never the
target's shared embedding / LM head) and, in the safetensors metadata under ``"treespec"``, a
JSON header: ``kind`` (the registered drafter name), ``arch`` (what the drafter class needs to
rebuild its modules) and ``target`` (name, fingerprint, hidden size, vocab size).
``<dir>/<name>.json`` is the human-facing card: architecture, target, data, steps, minutes,
losses and why, held-out acceptance (written by ``treespec.train``).

``load_checkpoint`` refuses a checkpoint made for another target: hidden size, vocabulary size
and model fingerprint are compared and the error names both values.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treespec.models import model_fingerprint

__all__ = ["CheckpointMismatch", "card_path", "load_card", "load_checkpoint", "save_checkpoint", "target_identity"]


class CheckpointMismatch(ValueError):
    """The checkpoint was trained for another target or is another kind of drafter."""


def target_identity(target) -> dict:
    """What a checkpoint records of the target it was trained for."""
    cfg = target.model.config
    return {
        "name": target.name,
        "fingerprint": model_fingerprint(target.model),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(target.vocab_size),
    }


def card_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


def save_checkpoint(path: str | os.PathLike, state: dict[str, torch.Tensor], kind: str, arch: dict,
                    target, card: dict | None = None, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``state`` (floating tensors cast to ``dtype``) with its header, and the card."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()).contiguous()
               for k, v in state.items()}
    header = {"kind": kind, "arch": arch, "target": target_identity(target)}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"treespec": json.dumps(header)})
    os.replace(tmp, path)
    if card is not None:
        card_path(path).write_text(json.dumps(card, indent=1) + "\n")
    return path


def read_header(path: str | os.PathLike) -> dict:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "treespec" not in meta:
        raise CheckpointMismatch(f"{path} is not a treespec drafter checkpoint (no 'treespec' header)")
    return json.loads(meta["treespec"])


def load_checkpoint(path: str | os.PathLike, target, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(state in the target's dtype, header); refuses another kind or another target."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {kind} checkpoint at {path}; train one with "
                                f"`treespec train {kind} --out {path.parent}`")
    header = read_header(path)
    if header.get("kind") != kind:
        raise CheckpointMismatch(f"{path} is a {header.get('kind')!r} checkpoint, not {kind!r}")
    want, have = header["target"], target_identity(target)
    for key in ("hidden_size", "vocab_size", "fingerprint"):
        if want.get(key) != have[key]:
            raise CheckpointMismatch(
                f"{path} was trained for target {want.get('name')!r} ({key} {want.get(key)}), "
                f"but the target given is {have['name']!r} ({key} {have[key]}); "
                f"train a drafter for this target with `treespec train {kind}`")
    state = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            state[k] = t.to(target.dtype) if t.is_floating_point() else t
    return state, header


def load_card(path: str | os.PathLike) -> dict:
    """The JSON card next to a checkpoint."""
    return json.loads(card_path(path).read_text())
