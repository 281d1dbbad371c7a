"""Drafter checkpoints: safetensors + a JSON card, validated against the target on load.

A checkpoint ``<dir>/<name>.safetensors`` holds the drafter's own tensors only (never the
target's shared embedding / LM head) and, in the safetensors metadata under ``"treespec"``, a
JSON header: ``kind`` (the registered drafter name), ``arch`` (what the drafter class needs to
rebuild its modules), ``target`` (name, fingerprint, hidden size, vocab size, structure hash and
weight samples, see ``target_identity``) and ``checksum`` (``tensor_checksum`` of the stored
tensors). ``<dir>/<name>.json`` is the human-facing card: architecture, target, data, steps,
minutes, losses and why, held-out acceptance (written by ``treespec.train``), and the checksum.

``load_checkpoint`` refuses a checkpoint made for another target (hidden size, vocabulary size,
structure, and weight samples within float32 / bfloat16 / float16 rounding; the error names
both fingerprints) and, as one ``CheckpointError`` naming the file and the fix, any file it
cannot trust: unreadable or truncated, a corrupted or incomplete header, tensors that fail the
checksum or hold NaN / inf. ``restore_module`` adds missing, unexpected or misshapen tensors.
Headers without ``checksum`` / weight samples (written before them) still load: the checksum
is then skipped and the target compared by fingerprint, as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from treespec.fastpath.kernels import BLOCK, dequantize_blocks8, quantize_blocks8
from treespec.targets.loader import model_fingerprint

__all__ = [
    "BLOCKS8_SCALE", "CheckpointError", "CheckpointMismatch", "card_path", "load_card", "load_checkpoint", "restore_module",
    "save_checkpoint", "target_identity", "tensor_checksum", "weights_mismatch",
]


class CheckpointError(ValueError):
    """A file that is not a usable treespec drafter checkpoint: unreadable, truncated, corrupted
    (checksum), non-finite, or inconsistent with its own header. The message names the file and
    the fix."""


class CheckpointMismatch(CheckpointError):
    """The checkpoint was trained for another target or is another kind of drafter."""


SHIPPED_DIR = Path(__file__).resolve().parents[2] / "checkpoints"   # the heads this checkout ships


def _fix(path: Path, kind: str | None) -> str:
    """How to replace a damaged checkpoint: a shipped one is restored from git; one of the
    user's own is trained again where it was."""
    kind = kind or "<kind>"
    shipped = Path(path).resolve().is_relative_to(SHIPPED_DIR)
    restore = f"restore the shipped file (`git checkout -- {path}`) or " if shipped else ""
    return f"replace {path.name}: {restore}train one with `treespec train {kind} --out {path.parent}`"


def train_hint(kind: str, path: Path) -> str:
    """How to get a ``kind`` checkpoint where none is: train it into a folder of one's own and
    pass that file."""
    return (f"train one into a folder of your choice with `treespec train {kind} --out DIR` "
            f"(docs/training.md), then load it with load_drafter({kind!r}, target, checkpoint='DIR/{path.name}') "
            f"(CLI: --drafter-option checkpoint=DIR/{path.name})")


def tensor_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 (hex) of the tensors as stored: name, dtype, shape and bytes of each, by name."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# Weight signature: SIGNATURE_SAMPLES evenly spaced elements of every parameter (first and last
# included), rounded to bfloat16 and stored as hex. Two copies of one model in float32, bfloat16
# or float16 give samples s, s' of the same true value x with
#     |s - x| <= 2^-8 |x_dtype| + 2^-8 |x| + 2^-25   (dtype rounding, fp16 subnormals, bf16 rounding)
# so |s - s'| <= SIGNATURE_RTOL * max(|s|, |s'|) + SIGNATURE_ATOL holds with margin, whatever the
# dtypes. No hash of rounded values can promise that (fp16 and bf16 round to different grids and
# some value always sits between them), hence a comparison, not an equality of strings.
SIGNATURE_SAMPLES = 8
SIGNATURE_RTOL = 2.0 ** -5
SIGNATURE_ATOL = 2.0 ** -22
_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size")


def model_structure(model) -> str:
    """Short hash of a model's shape: config shape fields, each parameter's name and shape."""
    digest = hashlib.sha256()
    for key in _SHAPE_KEYS:
        digest.update(f"{key}={getattr(model.config, key, None)};".encode())
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)};".encode())
    return digest.hexdigest()[:16]


def weight_samples(model, per_tensor: int = SIGNATURE_SAMPLES) -> torch.Tensor:
    """FloatTensor[n_params * per_tensor]: the signature's samples (bfloat16 values, as float32)."""
    rows = []
    with torch.no_grad():
        for _, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            index = torch.arange(per_tensor, device=flat.device) * (flat.numel() - 1) // max(per_tensor - 1, 1)
            rows.append(flat[index].to("cpu", torch.bfloat16))
    return torch.cat(rows).float()


def _samples_hex(samples: torch.Tensor) -> str:
    return samples.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes().hex()


def _samples_of_hex(text: str) -> torch.Tensor:
    raw = bytearray(bytes.fromhex(text))
    return torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).float()


def weights_mismatch(recorded: str, model) -> str | None:
    """None when ``model``'s weight samples agree with ``recorded`` (hex) within rounding of
    float32 / bfloat16 / float16 copies; else a sentence saying how many differ."""
    want, have = _samples_of_hex(recorded), weight_samples(model)
    if want.shape != have.shape:
        return f"{want.numel()} sampled weights recorded, {have.numel()} in the target"
    tol = SIGNATURE_RTOL * torch.maximum(want.abs(), have.abs()) + SIGNATURE_ATOL
    same = (want == have) | ((want - have).abs() <= tol)      # == : equal infinities
    bad = int((~same).sum())
    return None if bad == 0 else f"{bad} of {want.numel()} sampled weights differ beyond dtype rounding"


def target_identity(target) -> dict:
    """What a checkpoint records of the target it was trained for. ``structure`` and ``weights``
    (the signature above) are what ``load_checkpoint`` compares; ``fingerprint``
    (``model_fingerprint``) is a short name for humans and caches, equal across float32 /
    bfloat16 copies but not float16 ones."""
    cfg = target.model.config
    return {
        "name": target.name,
        "fingerprint": model_fingerprint(target.model),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(target.vocab_size),
        "structure": model_structure(target.model),
        "weights": _samples_hex(weight_samples(target.model)),
    }


def _target_mismatch(want: dict, target) -> str | None:
    """Why a checkpoint's recorded target is not ``target`` (None when it is)."""
    cfg = target.model.config
    have = {"hidden_size": int(cfg.hidden_size), "vocab_size": int(target.vocab_size)}
    for key, value in have.items():
        if want.get(key) != value:
            return f"{key} {want.get(key)}, the target given has {key} {value}"
    if "weights" not in want:  # cards written before the signature: the fingerprint (fp32/bf16 only)
        fp = model_fingerprint(target.model)
        if want.get("fingerprint") != fp:
            return (f"fingerprint {want.get('fingerprint')}, the target given has fingerprint {fp} (this "
                    f"checkpoint predates dtype-independent signatures: load it on a float32 target)")
        return None
    if want.get("structure") != model_structure(target.model):
        return "another architecture (parameter names or shapes differ)"
    return weights_mismatch(want["weights"], target.model)


def card_path(path: str | os.PathLike) -> Path:
    return Path(path).with_suffix(".json")


STORAGES = ("float16", "blocks8")
BLOCKS8_SCALE = ".q8_scale"   # suffix of the float16 block scales of an 8-bit weight


def save_checkpoint(path: str | os.PathLike, state: dict[str, torch.Tensor], kind: str, arch: dict,
                    target, card: dict | None = None, storage: str = "float16") -> Path:
    """Write ``state`` with its header, and the card. ``storage``: "float16" casts every
    floating tensor to fp16; "blocks8" stores each 2-D one whose width is a multiple of 32 as
    8-bit blocks (lossy, the Q8_0 rounding: measure held-out acceptance before shipping it) and
    the rest in fp16."""
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, blocks8 = {}, []
    for name, value in state.items():
        value = value.detach().to("cpu")
        if not value.is_floating_point():
            tensors[name] = value.contiguous()
        elif storage == "blocks8" and value.dim() == 2 and value.shape[1] % BLOCK == 0:
            tensors[name], tensors[name + BLOCKS8_SCALE] = quantize_blocks8(value.float().contiguous())
            blocks8.append(name)
        else:
            tensors[name] = value.to(torch.float16).contiguous()
    checksum = tensor_checksum(tensors)
    header = {"kind": kind, "arch": arch, "target": target_identity(target), "checksum": checksum}
    if blocks8:
        header["blocks8"] = sorted(blocks8)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"treespec": json.dumps(header)})
    os.replace(tmp, path)
    if card is not None:
        card_path(path).write_text(json.dumps({**card, "checksum": checksum}, indent=1) + "\n")
    return path


def read_header(path: str | os.PathLike, kind: str | None = None) -> dict:
    """The checkpoint's treespec header; ``CheckpointError`` for anything unreadable."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated or corrupted: {err}); "
                              f"{_fix(path, kind)}") from None
    if "treespec" not in meta:
        raise CheckpointMismatch(f"{path} is not a treespec drafter checkpoint (no 'treespec' header); "
                                 f"{_fix(path, kind)}")
    try:
        header = json.loads(meta["treespec"])
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} has a corrupted treespec header (not JSON: {err}); {_fix(path, kind)}") from None
    missing = [k for k in ("kind", "arch", "target") if not isinstance(header, dict) or k not in header]
    if missing or not isinstance(header["arch"], dict) or not isinstance(header["target"], dict):
        raise CheckpointError(f"{path} has an incomplete treespec header (missing or malformed: "
                              f"{', '.join(missing) or 'arch/target'}); {_fix(path, kind)}")
    return header


def _read_tensors(path: Path, kind: str, header: dict) -> dict[str, torch.Tensor]:
    """The stored tensors, checked against the header's checksum (when it has one), 8-bit
    blocks read back as float32, and checked for non-finite values."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path}: its tensors cannot be read ({err}); {_fix(path, kind)}") from None
    want = header.get("checksum")
    if want is not None and tensor_checksum(tensors) != want:
        raise CheckpointError(f"{path} is corrupted: its tensors do not match the checksum in its header; "
                              f"{_fix(path, kind)}")
    for name in header.get("blocks8", ()):
        scale = tensors.pop(name + BLOCKS8_SCALE, None)
        try:
            tensors[name] = dequantize_blocks8(tensors[name], scale)
        except (KeyError, ValueError, AttributeError) as err:
            raise CheckpointError(f"{path}: its 8-bit weight {name!r} cannot be read ({err}); "
                                  f"{_fix(path, kind)}") from None
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise CheckpointError(f"{path} holds non-finite weights (NaN or inf) in {', '.join(sorted(bad))}: the "
                              f"training diverged; {_fix(path, kind)}")
    return tensors


def restore_module(path: str | os.PathLike, kind: str, header: dict, state: dict[str, torch.Tensor],
                   build: Callable[[dict], nn.Module], tied: tuple[str, ...] = ()) -> nn.Module:
    """``build(header["arch"])`` loaded with ``state``; an arch the drafter cannot build, or
    missing / extra / wrongly shaped tensors, raise one ``CheckpointError`` naming the file.
    ``tied``: module entries the checkpoint leaves out on purpose (aliases of stored tensors)."""
    path = Path(path)
    try:
        module = build(header["arch"])
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{path}: its 'arch' header cannot build a {kind} drafter ({err}); "
                              f"{_fix(path, kind)}") from None
    have = module.state_dict()
    missing = [k for k in have if k not in state and k not in tied]
    extra = [k for k in state if k not in have]
    shapes = [f"{k} {tuple(state[k].shape)} (the arch needs {tuple(have[k].shape)})"
              for k in state if k in have and state[k].shape != have[k].shape]
    if missing or extra or shapes:
        parts = [f"{label} {', '.join(names)}" for label, names in
                 (("missing", missing), ("unexpected", extra), ("wrong shape", shapes)) if names]
        raise CheckpointError(f"{path} does not match its {kind} architecture ({'; '.join(parts)}); "
                              f"{_fix(path, kind)}")
    module.load_state_dict(state, strict=False)
    return module


def load_checkpoint(path: str | os.PathLike, target, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(state in the target's dtype, header); refuses another kind or another target."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no {kind} checkpoint at {path}; {train_hint(kind, path)}")
    header = read_header(path, kind)
    if header.get("kind") != kind:
        raise CheckpointMismatch(f"{path} is a {header.get('kind')!r} checkpoint, not {kind!r}; pass a {kind} "
                                 f"checkpoint or train one with `treespec train {kind}`")
    want = header["target"]
    why = _target_mismatch(want, target)
    if why is not None:
        raise CheckpointMismatch(
            f"{path} was trained for target {want.get('name')!r} (fingerprint {want.get('fingerprint')}), "
            f"not the target given, {target.name!r} (fingerprint {model_fingerprint(target.model)}): {why}; "
            f"train a drafter for this target with `treespec train {kind}`")
    state = {k: t.to(target.dtype) if t.is_floating_point() else t
             for k, t in _read_tensors(path, kind, header).items()}
    return state, header


def load_card(path: str | os.PathLike) -> dict:
    """The JSON card next to a checkpoint."""
    card = card_path(path)
    try:
        return json.loads(card.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{card} is not valid JSON ({err}); restore it (`git checkout -- {card}`) or "
                              f"re-save the checkpoint") from None
