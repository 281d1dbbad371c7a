"""Drafter checkpoints: one file loads on every dtype copy of its target, an edited or broken
file is one clear error naming it, and the shipped checkpoints carry verified checksums."""

from __future__ import annotations

import pytest
import torch


def _eagle_checkpoint(target, path):
    from treespec.drafters.checkpoint import save_checkpoint
    from treespec.drafters.eagle import random_feature_drafter

    d = random_feature_drafter(target, "eagle", seed=1)
    return save_checkpoint(path / "eagle.safetensors", dict(d.head.state_dict()), "eagle",
                           d.head.cfg.to_json(), target, card={"kind": "eagle"})


@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16, torch.float16])
def test_a_checkpoint_loads_on_every_dtype_copy_of_its_target(saved, tmp_path):
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointMismatch
    from treespec.targets.loader import tiny_target

    # a scale that puts weights on many binades, fp16 subnormals included
    target = tiny_target(vocab_size=32, seed=0)
    with torch.no_grad():
        for i, p in enumerate(target.model.parameters()):
            p.mul_(10.0 ** (i % 5 - 3))
    path = _eagle_checkpoint(_cast(target, saved), tmp_path)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        drafter = load_drafter("eagle", _cast(target, dtype), checkpoint=str(path))
        assert drafter.dtype == dtype
    other = tiny_target(vocab_size=32, seed=1)
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(CheckpointMismatch, match="weights"):
            load_drafter("eagle", _cast(other, dtype), checkpoint=str(path))


def _cast(target, dtype):
    import copy

    from treespec.targets.loader import Target

    return Target.from_hf(copy.deepcopy(target.model).to(dtype), None, target.name, pack=False)


def test_an_edited_sampled_weight_is_noticed(tmp_path):
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointMismatch
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    path = _eagle_checkpoint(target, tmp_path)
    edited = _cast(target, torch.float32)
    with torch.no_grad():
        edited.model.model.embed_tokens.weight[0, 0] *= 1.1        # the first element is sampled
    with pytest.raises(CheckpointMismatch, match="1 of .* sampled weights"):
        load_drafter("eagle", edited, checkpoint=str(path))


def _rewrite(path, tensors=None, metadata=None):
    """Rewrite a safetensors file with other tensors and/or other metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta = f.metadata()
        old = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors if tensors is not None else old, str(path),
              metadata=metadata if metadata is not None else old_meta)


def _corrupt(case, path, target):
    import json

    from treespec.drafters.checkpoint import read_header, save_checkpoint

    raw = path.read_bytes()
    header = read_header(path)
    from safetensors.torch import load_file

    state = load_file(str(path))
    if case == "foreign":                                              # another project's file
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(2)}, str(path))
    elif case == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif case == "header bytes":
        path.write_bytes(raw[:20] + bytes(b ^ 0x5A for b in raw[20:40]) + raw[40:])
    elif case == "length prefix":
        path.write_bytes(bytes([0xFF] * 8) + raw[8:])
    elif case == "tensor bytes":
        path.write_bytes(raw[:-10] + bytes(b ^ 0xFF for b in raw[-10:]))
    elif case == "bad json":
        _rewrite(path, metadata={"treespec": '{"kind": "eagle", "arch": '})
    elif case == "no target":
        _rewrite(path, metadata={"treespec": json.dumps({k: v for k, v in header.items() if k != "target"})})
    elif case == "not a dict":
        _rewrite(path, metadata={"treespec": "[1, 2]"})
    else:
        if case == "missing tensor":
            state.pop(sorted(state)[0])
        elif case == "extra tensor":
            state["bogus.weight"] = torch.zeros(3)
        elif case == "wrong shape":
            key = next(k for k in sorted(state) if state[k].dim() == 2)
            state[key] = state[key][:, :-1].contiguous()
        elif case == "nan weight":
            key = sorted(state)[0]
            state[key] = state[key].clone()
            state[key].view(-1)[0] = float("nan")
        elif case == "bad arch":
            header["arch"] = {**header["arch"], "num_heads": "nine", "colour": 1}
        save_checkpoint(path, state, header["kind"], header["arch"], target)


CORRUPTIONS = ["foreign", "truncated", "header bytes", "length prefix", "tensor bytes", "bad json", "no target", "not a dict",
               "missing tensor", "extra tensor", "wrong shape", "nan weight", "bad arch"]


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_a_broken_checkpoint_is_one_clear_error_naming_the_file(case, tmp_path):
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointError
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    path = _eagle_checkpoint(target, tmp_path)
    _corrupt(case, path, target)
    with pytest.raises(CheckpointError) as err:
        load_drafter("eagle", target, checkpoint=str(path))
    message = str(err.value)
    assert str(path) in message and "treespec train eagle" in message, message


@pytest.mark.parametrize("kind", ["medusa", "mtp"])
def test_missing_tensors_of_other_kinds_are_named(kind, tmp_path):
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointError, read_header, save_checkpoint
    from safetensors.torch import load_file
    from treespec.targets.loader import tiny_target
    import test_drafters_trained as trained

    target = tiny_target(vocab_size=32, seed=0)
    path = trained._save_random(kind, target, tmp_path)
    state, header = load_file(str(path)), read_header(path)
    gone = sorted(state)[-1]
    state.pop(gone)
    save_checkpoint(path, state, kind, header["arch"], target)
    with pytest.raises(CheckpointError, match=f"missing.*{gone}"):
        load_drafter(kind, target, checkpoint=str(path))


def test_the_cli_prints_a_broken_checkpoint_as_one_error_line(tmp_path, monkeypatch, capsys):
    from treespec import load_drafter
    from treespec.cli import main as cli
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    path = _eagle_checkpoint(target, tmp_path)
    _corrupt("truncated", path, target)
    monkeypatch.setattr(cli, "_build_generator",
                        lambda args: load_drafter("eagle", target, checkpoint=str(path)))
    assert cli.main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}") and err.count("\n") == 1


def test_the_checksum_is_recorded_in_header_and_card_and_old_files_still_load(tmp_path):
    import json

    from treespec import load_drafter
    from treespec.drafters.checkpoint import read_header, tensor_checksum
    from safetensors.torch import load_file
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    path = _eagle_checkpoint(target, tmp_path)
    header = read_header(path)
    assert header["checksum"] == tensor_checksum(load_file(str(path)))
    assert json.loads(path.with_suffix(".json").read_text())["checksum"] == header["checksum"]
    header.pop("checksum")                                             # a checkpoint from before
    _rewrite(path, metadata={"treespec": json.dumps(header)})
    load_drafter("eagle", target, checkpoint=str(path))


# ------------------------------------------------------------------ 5, 10: the shipped checkpoints
SHIPPED = sorted((__import__("pathlib").Path(__file__).parents[1] / "checkpoints").glob("*/*.safetensors"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_cards_carry_a_verified_checksum_and_no_machine_path(path):
    import json
    import re

    from safetensors.torch import load_file

    from treespec.drafters.checkpoint import read_header, tensor_checksum

    header = read_header(path)
    card_text = path.with_suffix(".json").read_text()
    card = json.loads(card_text)
    assert header["checksum"] == tensor_checksum(load_file(str(path))) == card["checksum"]
    assert {"structure", "weights"} <= header["target"].keys()
    assert not re.search(r'"(/|~|[A-Za-z]:\\\\)', card_text), "a card records an absolute path"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shipped_drafters_load_on_a_low_precision_smollm2(dtype):
    from treespec import load_drafter, load_target

    target = load_target("smollm2-135m", dtype=dtype)
    for kind in ("eagle", "eagle3", "medusa", "mtp"):
        assert load_drafter(kind, target).vocab_size == target.vocab_size


def test_blocks8_storage_reads_back_the_block_rounding_exactly(tmp_path):
    """storage="blocks8": every 2-D weight whose width is a multiple of 32 is stored as int8 with
    an fp16 scale per 32 and read back as exactly round_to_blocks8 of it (the numbers the block
    kernel's int8 path runs); the rest is float16; the drafter loads and drafts from it."""
    from safetensors import safe_open

    from treespec import load_drafter
    from treespec.drafters.checkpoint import BLOCKS8_SCALE, load_checkpoint, read_header, save_checkpoint
    from treespec.drafters.eagle import random_feature_drafter
    from treespec.fastpath.kernels import round_to_blocks8
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    head = random_feature_drafter(target, "eagle", seed=1).head
    state = {k: v.float() for k, v in head.state_dict().items()}
    path = save_checkpoint(tmp_path / "eagle.safetensors", state, "eagle", head.cfg.to_json(), target, storage="blocks8")
    header = read_header(path)
    blocked = [k for k, v in state.items() if v.dim() == 2 and v.shape[1] % 32 == 0]
    assert blocked and header["blocks8"] == sorted(blocked)
    with safe_open(str(path), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.int8 and f.get_tensor(k + BLOCKS8_SCALE).dtype == torch.float16
                   for k in blocked)
    loaded, _ = load_checkpoint(path, target, "eagle")
    assert set(loaded) == set(state)
    for k, v in state.items():
        want = round_to_blocks8(v) if k in blocked else v.half().float()
        assert torch.equal(loaded[k], want), k
    assert load_drafter("eagle", target, checkpoint=str(path)).vocab_size == 32
    with pytest.raises(ValueError, match="storage must be one of"):
        save_checkpoint(tmp_path / "x.safetensors", state, "eagle", head.cfg.to_json(), target, storage="int4")


def test_a_blocks8_weight_without_its_scales_is_one_error_naming_it(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from treespec import load_drafter
    from treespec.drafters.checkpoint import BLOCKS8_SCALE, CheckpointError, read_header, save_checkpoint, \
        tensor_checksum
    from treespec.drafters.eagle import random_feature_drafter
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    head = random_feature_drafter(target, "eagle", seed=1).head
    path = save_checkpoint(tmp_path / "eagle.safetensors", dict(head.state_dict()), "eagle", head.cfg.to_json(),
                           target, storage="blocks8")
    header, tensors = read_header(path), load_file(str(path))
    gone = header["blocks8"][0]
    tensors.pop(gone + BLOCKS8_SCALE)
    header["checksum"] = tensor_checksum(tensors)          # consistent file, missing scales
    save_file(tensors, str(path), metadata={"treespec": json.dumps(header)})
    with pytest.raises(CheckpointError, match=f"8-bit weight '{gone}' cannot be read"):
        load_drafter("eagle", target, checkpoint=str(path))
