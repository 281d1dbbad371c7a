"""Issue 15: what a new user hit. Each test failed before its fix."""

from __future__ import annotations

import argparse

import pytest
import torch


def byte_tokenizer():
    """A byte-level fast tokenizer with one token per byte (no merges, no download): a CJK
    character or an emoji spans 3-4 tokens, so decoding a prefix can end mid-character."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


# ------------------------------------------------------------------ 1: streamed text
TEXTS = ["日本語: こんにちは, 中文: 你好", "emoji 😀👍🏽 ok", "e\u0301 🇯🇵!"]


@pytest.mark.parametrize("text", TEXTS)
def test_cli_stream_prints_the_text_of_the_api_one_token_at_a_time(text, monkeypatch, capsys):
    from treespec import cli

    tok = byte_tokenizer()
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) > len(text)        # multi-byte characters

    class FakeStream:
        result = None

        def __iter__(self):
            for i in ids:                                             # one token per chunk
                yield [i]

    class FakeGen:
        def stream(self, *a, **kw):
            return FakeStream()

    target = argparse.Namespace(tokenizer=tok)
    monkeypatch.setattr(cli, "_build_generator", lambda args: (target, FakeGen()))
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    assert "\ufffd" not in out
    assert out == text + "\n"


def test_incremental_text_holds_back_an_incomplete_tail_only():
    from treespec.streaming import IncrementalText

    tok = byte_tokenizer()
    ids = tok("a你b")["input_ids"]                                   # a, 3 bytes, b
    inc = IncrementalText(tok)
    assert [inc.push([i]) for i in ids] == ["a", "", "", "你", "b"]
    assert inc.flush() == ""
    inc = IncrementalText(tok)                                        # text that ends mid-character
    assert inc.push(ids[:2]) == "a" and inc.flush() == "\ufffd"     # flushed as the API decodes it


# ------------------------------------------------------------------ 6: validation at the door
def _small_generator(drafter=None, builder=None):
    from treespec import DynamicTreeBuilder, SpeculativeGenerator
    from _engine_helpers import NGramDrafter, peaky_target

    target = peaky_target(8)
    return SpeculativeGenerator(target, drafter or NGramDrafter(8), builder or DynamicTreeBuilder(6, 3, 2))


@pytest.mark.parametrize("question", ["999", "-1", "80"])
def test_demo_refuses_a_question_out_of_range_before_loading_anything(question, monkeypatch, capsys):
    from treespec import cli

    monkeypatch.setattr(cli, "_build_generator", lambda args: pytest.fail("loaded a model"))
    assert cli.main(["demo", "--question", question]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --question") and "0 to 79" in err


def test_python_dash_m_treespec_and_version(monkeypatch, capsys):
    import runpy
    import sys

    import treespec

    assert isinstance(treespec.__version__, str) and treespec.__version__[0].isdigit()
    monkeypatch.setattr(sys, "argv", ["treespec", "--version"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("treespec", run_name="__main__")        # what `python -m treespec` runs
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"treespec {treespec.__version__}"


def test_generator_refuses_a_builder_that_is_not_one():
    from treespec import SpeculativeGenerator
    from _engine_helpers import NGramDrafter, peaky_target

    with pytest.raises(TypeError, match="builder must be a TreeBuilder .*got int"):
        SpeculativeGenerator(peaky_target(8), NGramDrafter(8), 42)
    with pytest.raises(TypeError, match="drafter must be a Drafter .*got int"):
        SpeculativeGenerator(peaky_target(8), 42)


@pytest.mark.parametrize("prompt", [None, 3.5, {"a": 1}, object()])
def test_generate_refuses_a_prompt_of_the_wrong_type(prompt):
    with pytest.raises(TypeError, match="prompt must be text, token ids"):
        _small_generator().generate(prompt, max_new_tokens=2)


def test_generate_refuses_a_hook_or_chat_flag_of_the_wrong_type():
    with pytest.raises(TypeError, match="on_step must be a callable"):
        _small_generator().generate([1, 2], max_new_tokens=2, on_step=5)
    with pytest.raises(TypeError, match="chat must be True or False"):
        _small_generator().generate([1, 2], max_new_tokens=2, chat="yes")


@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_generate_refuses_a_seed_that_is_not_an_int(seed):
    with pytest.raises(TypeError, match="seed must be an int or None"):
        _small_generator().generate([1, 2], max_new_tokens=2, seed=seed)


@pytest.mark.parametrize("temperature, mode", [(0.0, "deterministic"), (1.0, "with_replacement"),
                                               (1.0, "without_replacement")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_drafter_returning_nan_logits_is_named_in_every_mode(temperature, mode, bad):
    from treespec import DynamicTreeBuilder
    from _engine_helpers import NGramDrafter

    class BrokenDrafter(NGramDrafter):
        def expand(self, tree, nodes):
            logits = super().expand(tree, nodes)
            logits[:, 3] = bad
            return logits

    gen = _small_generator(BrokenDrafter(8), DynamicTreeBuilder(6, 3, 2, mode=mode))
    with pytest.raises(ValueError, match="BrokenDrafter returned non-finite draft logits"):
        gen.generate([1, 2], max_new_tokens=4, temperature=temperature, seed=0)


# ------------------------------------------------------------------ 2: one generation at a time
def test_interleaved_streams_refuse_the_second_and_leave_the_first_intact():
    gen = _small_generator()
    ref = gen.generate([1, 2, 3], max_new_tokens=12, seed=0).token_ids.tolist()
    a = gen.stream([1, 2, 3], max_new_tokens=12, seed=0)
    it = iter(a)
    first = next(it)
    b = gen.stream([4, 5], max_new_tokens=12, seed=1)
    with pytest.raises(RuntimeError, match="already generating"):
        next(iter(b))
    rest = [t for chunk in it for t in chunk]
    assert first + rest == ref == a.result.token_ids.tolist()
    for _ in gen.stream([1, 2, 3], max_new_tokens=12):             # an abandoned stream frees it
        break
    assert gen.generate([1, 2, 3], max_new_tokens=12, seed=0).token_ids.tolist() == ref


def test_a_second_thread_is_refused_while_one_generates():
    import threading

    gen = _small_generator()
    ref = gen.generate([1, 2, 3], max_new_tokens=12, seed=0).token_ids.tolist()
    started, tried = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hook(built, acc, step):
        if step == 0:
            started.set()
            assert tried.wait(60)

    def other():
        assert started.wait(60)
        try:
            gen.generate([4, 5], max_new_tokens=4)
        except RuntimeError as err:
            errors.append(err)
        finally:
            tried.set()

    thread = threading.Thread(target=other)
    thread.start()
    out = gen.generate([1, 2, 3], max_new_tokens=12, seed=0, on_step=hook).token_ids.tolist()
    thread.join(60)
    assert out == ref
    assert len(errors) == 1 and "already generating" in str(errors[0])
    with pytest.raises(RuntimeError, match="already generating"):   # re-entry from a hook too
        gen.generate([1, 2], max_new_tokens=4, on_step=lambda *a: gen.generate([1], max_new_tokens=1))


# ------------------------------------------------------------------ 3: dtype-independent identity
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
    from treespec.models import tiny_target

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

    from treespec.models import Target

    return Target.from_hf(copy.deepcopy(target.model).to(dtype), None, target.name)


def test_an_edited_sampled_weight_is_noticed(tmp_path):
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointMismatch
    from treespec.models import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    path = _eagle_checkpoint(target, tmp_path)
    edited = _cast(target, torch.float32)
    with torch.no_grad():
        edited.model.model.embed_tokens.weight[0, 0] *= 1.1        # the first element is sampled
    with pytest.raises(CheckpointMismatch, match="1 of .* sampled weights"):
        load_drafter("eagle", edited, checkpoint=str(path))


def test_calibrate_does_not_offer_float16():
    from treespec import cli

    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["calibrate", "--dtype", "float16"])
    assert exit_.value.code == 2


# ------------------------------------------------------------------ 4: budget errors and huge trees
def test_a_budget_beyond_the_context_is_blamed_on_the_budget():
    from treespec import DynamicTreeBuilder
    from treespec.engine import LargeTreeWarning

    with pytest.warns(LargeTreeWarning):
        gen = _small_generator(builder=DynamicTreeBuilder(budget=100000, depth=3, top_k=2))
    limit = gen.target.max_context
    with pytest.raises(ValueError, match=rf"tree budget 100000 .* use a budget of at most {limit - 3 - 8}\b"):
        gen.generate([1, 2, 3], max_new_tokens=8)
    with pytest.raises(ValueError, match=rf"max_new_tokens={limit} does not fit .* use at most {limit - 3 - 6}\b"):
        _small_generator().generate([1, 2, 3], max_new_tokens=limit)   # the default budget fits


def test_a_huge_tree_warns_with_the_memory_its_verify_takes():
    from treespec import SpeculativeGenerator, StaticTreeBuilder
    from treespec.engine import verify_memory_bytes
    from treespec.drafters import LookupDrafter
    from treespec.models import Target, tiny_llama

    model = tiny_llama(vocab_size=49152, max_position_embeddings=8192)
    target = Target.from_hf(model, None, "wide-vocab")
    need = verify_memory_bytes(model, 4000, 4000)
    assert need > 4000 * 49152 * 12                                  # logits, p and q rows at least
    from treespec.engine import LargeTreeWarning

    with pytest.warns(LargeTreeWarning, match=rf"4000 nodes .* about {need / 2**30:.1f} GiB"):
        SpeculativeGenerator(target, LookupDrafter(49152), _static(4000))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeGenerator(target, LookupDrafter(49152), _static(64))


def _static(n):
    from treespec import StaticTreeBuilder

    return StaticTreeBuilder.default(n)


# ------------------------------------------------------------------ 5: broken checkpoints
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
    from treespec.models import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    path = _eagle_checkpoint(target, tmp_path)
    _corrupt(case, path, target)
    with pytest.raises(CheckpointError) as err:
        load_drafter("eagle", target, checkpoint=str(path))
    message = str(err.value)
    assert str(path) in message and "treespec train eagle" in message, message


@pytest.mark.parametrize("kind", ["medusa", "small"])
def test_missing_tensors_of_other_kinds_are_named(kind, tmp_path):
    from treespec import load_drafter
    from treespec.drafters.checkpoint import CheckpointError, read_header, save_checkpoint
    from safetensors.torch import load_file
    from treespec.models import tiny_target
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
    from treespec import cli, load_drafter
    from treespec.models import tiny_target

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
    from treespec.models import tiny_target

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
    for kind in ("eagle", "eagle3", "medusa", "mtp", "small"):
        assert load_drafter(kind, target).vocab_size == target.vocab_size


# ------------------------------------------------------------------ 8: device-clean steps
def _meta_default_outputs(gen, **kw):
    """Tokens of a generation whose steps run with ``torch.device("meta")`` as the default
    device: a tensor created in a step without an explicit device (the CPU-only habit that puts
    tensors on the wrong device once the target is on a GPU) lands on ``meta`` and the step
    fails or its output changes. What this proves on a CPU-only machine: every tensor the step
    creates (ours and HF's) names its device; not that the named device is right (the CUDA
    tests below check that where a GPU exists)."""
    stream = gen.stream([1, 2, 3, 4], max_new_tokens=10, **kw)
    with torch.device("meta"):
        return [t for chunk in stream for t in chunk]


STEP_CASES = [("eagle3", "dynamic", 0.0), ("eagle3", "best-first", 1.0), ("eagle", "sequoia", 1.0),
              ("medusa", "dynamic", 1.0), ("mtp", "chain", 0.0), ("small", "dynamic", 1.0),
              ("lookup", "static", 0.0), ("early-exit", "dynamic", 1.0)]


def _device_case(kind, tree, mode="with_replacement", device="cpu"):
    from treespec import SpeculativeGenerator
    from treespec.cli import make_builder
    from treespec.models import tiny_target
    import test_drafters_trained as trained

    target = tiny_target(vocab_size=32, seed=0)
    target = type(target).from_hf(target.model.to(device), None, target.name)
    if kind in ("lookup", "early-exit"):
        from treespec import load_drafter

        drafter = load_drafter(kind, target)
    else:
        drafter = trained.make_drafter(kind, target, seed=1)
    builder = make_builder(tree, 8, 3, 2, mode if tree != "static" else "deterministic")
    return SpeculativeGenerator(target, drafter, builder)


@pytest.mark.parametrize("kind, tree, temperature", STEP_CASES)
def test_every_tensor_of_a_step_names_its_device(kind, tree, temperature):
    gen = _device_case(kind, tree, "without_replacement" if tree == "best-first" else "with_replacement")
    ref = gen.generate([1, 2, 3, 4], max_new_tokens=10, temperature=temperature, seed=3).token_ids.tolist()
    assert _meta_default_outputs(gen, temperature=temperature, seed=3) == ref


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("kind, tree, temperature", STEP_CASES)
def test_generation_on_cuda_runs_seeded_and_greedy_equals_hf(kind, tree, temperature):
    gpu = _device_case(kind, tree, device="cuda")
    assert gpu.target.device.type == "cuda"
    out = gpu.generate([1, 2, 3, 4], max_new_tokens=10, temperature=temperature, seed=3)
    assert out.token_ids.device.type == "cpu" and out.stats.steps > 0
    if temperature == 0.0:   # greedy: HF generate of the same model on the same device
        from _engine_helpers import hf_greedy

        ids = torch.tensor([1, 2, 3, 4], device="cuda")
        assert out.token_ids.tolist() == hf_greedy(gpu.target.model, ids, gpu.target.eos_token_ids, 10)[:10]
    again = gpu.generate([1, 2, 3, 4], max_new_tokens=10, temperature=temperature, seed=3)
    assert again.token_ids.tolist() == out.token_ids.tolist()          # seeded runs repeat on the GPU


@cuda
def test_synchronize_waits_for_the_device():
    from treespec.device import synchronize

    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x
    synchronize(y.device)
    assert torch.cuda.current_stream().query()


def test_step_timings_synchronize_the_target_device_before_every_clock_read(monkeypatch):
    import treespec.engine as engine

    gen = _small_generator()
    seen: list[torch.device] = []
    monkeypatch.setattr(engine, "synchronize", lambda device: seen.append(torch.device(device)), raising=False)
    out = gen.generate([1, 2, 3], max_new_tokens=6, seed=0)
    assert seen and set(seen) == {gen.target.device}
    assert len(seen) >= 1 + 4 * out.stats.steps          # prefill, then draft | verify | accept | other


def test_the_drafter_timer_synchronizes_before_reading_the_clock(monkeypatch):
    import treespec.drafters.base as base
    from treespec.drafters.base import TimedDrafter
    from _engine_helpers import NGramDrafter

    events: list[str] = []
    monkeypatch.setattr(base, "synchronize", lambda device: events.append("sync"), raising=False)
    timed = TimedDrafter(NGramDrafter(8), clock=lambda: events.append("clock") or 0.0)
    timed.begin(torch.tensor([1, 2]), None)
    from treespec.drafters.base import PartialTree

    timed.expand(PartialTree.rooted(2), [0])
    assert events == ["sync", "clock", "sync", "clock"]


def test_synchronize_is_a_no_op_on_the_cpu():
    from treespec.device import synchronize

    synchronize("cpu")
    synchronize(torch.device("meta"))
    synchronize(None)


def test_device_flags_reach_the_loaders_and_bad_devices_are_one_error(monkeypatch, capsys):
    import treespec
    from treespec import cli

    seen = {}

    def fake_load_target(name, dtype=None, device="cpu", cache_dir=None, pack=True):
        seen["device"] = device
        raise ValueError("stop here")

    monkeypatch.setattr(treespec, "load_target", fake_load_target)
    assert cli.main(["generate", "--prompt", "hi", "--device", "cpu"]) == 2
    assert seen["device"] == torch.device("cpu")
    assert cli.build_parser().parse_args(["calibrate", "--device", "cpu"]).device == "cpu"
    capsys.readouterr()
    assert cli.main(["generate", "--prompt", "hi", "--device", "banana"]) == 2
    assert capsys.readouterr().err.startswith("error: --device 'banana' is not a device name")
    if not torch.cuda.is_available():
        assert cli.main(["demo", "--device", "cuda:0"]) == 2
        assert "use --device cpu" in capsys.readouterr().err


# ------------------------------------------------------------------ 9: no import loops
# Module ``__getattr__`` forwarders keep pre-move import paths working; they run only when an old
# name is asked for, never while a module imports, so they are not edges of the import graph.
COMPAT_FORWARDERS = {"treespec.cost", "treespec.cost.calibration", "treespec.trees", "treespec.trees.sequoia"}


def _module_graph() -> dict[str, set[str]]:
    """treespec module -> treespec modules it imports anywhere (function bodies included)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parents[1] / "treespec"
    names = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        skip = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
                and name in COMPAT_FORWARDERS for n in ast.walk(f)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + ".") :   # a package's own __init__ is its parent
                    edges.add(t)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_module_graph_has_no_cycles():
    graph = _module_graph()
    # the engine depends on the pure cost model only; measurements that run generations sit above it
    assert "treespec.engine" not in graph["treespec.cost.calibration"]
    assert "treespec.engine" not in graph["treespec.trees.sequoia"]
    assert _cycles(graph) == []


def test_every_module_imports_and_old_paths_still_work():
    """Every module imports (any ``import treespec.X`` runs ``treespec/__init__`` first, so the
    import order is that file's; the static graph above is what rules out loops), and the
    names moved by the de-looping still resolve at their old paths."""
    import importlib
    import pkgutil

    import treespec

    names = [m.name for m in pkgutil.walk_packages(treespec.__path__, "treespec.")]
    assert len(names) > 40 and "treespec.measure" in names and "treespec.drafters.feature" in names
    for name in names:
        importlib.import_module(name)
    from treespec.cost import calibrate_drafter
    from treespec.cost.calibration import calibrate_drafter as c2
    from treespec.drafters.eagle import FeatureDrafter, HeadConfig, Trunk, build_head  # noqa: F401
    from treespec.measure import calibrate_drafter as a, measure_acceptance_vector as b
    from treespec.trees import measure_acceptance_vector
    from treespec.trees.sequoia import measure_acceptance_vector as m2

    assert a is calibrate_drafter is c2 and b is measure_acceptance_vector is m2
    with pytest.raises(AttributeError):
        treespec.trees.no_such_name


class _HostTensorSites:
    """A TorchFunctionMode recording where a step asks for host tensors on purpose: factory
    calls with ``device="cpu"``, ``.cpu()``, and ``.to("cpu", ...)`` (the string, as our code
    writes it; a device object taken from a CPU tensor is the target's device here and is not
    counted). Each call is keyed by the first treespec frame (file:function) that made it."""

    FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.rand,
                 torch.randn, torch.randint, torch.as_tensor}

    def __init__(self):
        from pathlib import Path
        from torch.overrides import TorchFunctionMode

        import treespec

        root = str(Path(treespec.__file__).parent)
        sites: dict[str, int] = {}

        def site() -> str:
            import sys

            frame = sys._getframe(2)
            while frame is not None and not frame.f_code.co_filename.startswith(root):
                frame = frame.f_back
            if frame is None:
                return "<outside treespec>"
            return f"{frame.f_code.co_filename[len(root) + 1:]}:{frame.f_code.co_name}"

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                host = (func in _HostTensorSites.FACTORIES and kwargs.get("device") == "cpu") \
                    or func is torch.Tensor.cpu \
                    or (func is torch.Tensor.to and ("cpu" in args[1:] or kwargs.get("device") == "cpu"))
                if host:
                    key = site()
                    sites[key] = sites.get(key, 0) + 1
                return func(*args, **kwargs)

        self.mode, self.sites = Mode(), sites


# Host tensors a step makes on purpose: the tree's structure (builders grow it in Python), the
# accepted path's indices, the tree's derived depth/validation rows, and the lookup drafter's q
# (built from numpy n-gram votes). Nothing V-sized leaves the device elsewhere.
HOST_SITES = {"trees/base.py:finish", "engine.py:_loop", "tree.py:_ancestry", "tree.py:_validate",
              "drafters/lookup.py:expand"}


@pytest.mark.parametrize("kind, tree, temperature", STEP_CASES)
def test_a_step_makes_host_tensors_only_where_it_means_to(kind, tree, temperature):
    gen = _device_case(kind, tree, "without_replacement" if tree == "best-first" else "with_replacement")
    stream = gen.stream([1, 2, 3, 4], max_new_tokens=10, temperature=temperature, seed=3)
    record = _HostTensorSites()
    with record.mode:
        tokens = [t for chunk in stream for t in chunk]
    assert tokens and gen.generate([1, 2, 3, 4], max_new_tokens=10, temperature=temperature,
                                   seed=3).token_ids.tolist() == tokens
    assert set(record.sites) <= HOST_SITES, record.sites
