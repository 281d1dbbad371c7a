"""Writing an export directory: refuse to clobber, write atomically, leave a provenance note.

An export directory holds what a serving stack reads (``config.json``, ``model.safetensors``)
and ``treespec_export.json`` (what was exported, from what, and every known mismatch). A
non-empty ``out`` is refused unless ``force``; ``force`` replaces only a directory that already
holds a treespec export (it has that note), never an arbitrary one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

NOTE = "treespec_export.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch floating dtype from a dtype or its name (``float32``, ``bfloat16``, ``float16``)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise TypeError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or its name), got {dtype!r}")
    return dtype


def check_out(out: str | os.PathLike, force: bool) -> Path:
    """``out`` as a Path after the clobber checks (see the module docstring)."""
    if not isinstance(force, bool):
        raise TypeError(f"force must be True or False, got {force!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out {out} is a file; pass a directory path (new or empty)")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ValueError(f"out {out} is not empty; choose a new directory, or pass --force "
                             f"(force=True) to replace a previous treespec export there")
        if not (out / NOTE).is_file():
            raise ValueError(f"out {out} holds files that are not a treespec export (no {NOTE}); --force only "
                             f"replaces a previous export: choose a new or empty directory")
    return out


def write_export(out: Path, config: dict, tensors: dict[str, torch.Tensor], note: dict) -> Path:
    """Write config.json, model.safetensors and the note into a sibling temporary directory,
    then move it to ``out`` (replacing a previous export there, see ``check_out``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()                                   # (not mkdtemp: keep the umask's permissions)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        weights = tmp / "model.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, weights, metadata={"format": "pt"})
        weights.chmod((tmp / "config.json").stat().st_mode)   # safetensors writes 0600
        (tmp / NOTE).write_text(json.dumps(note, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
