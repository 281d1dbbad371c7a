"""A damaged calibration file is named with the command that rebuilds it, never a traceback;
``--budget auto`` measures it again by itself. A damaged conversion cache (a target converted
from its GGUF) is named and rebuilt from the GGUF, saying so."""

from __future__ import annotations

import pytest

from treespec.planning.calibration import Calibration, DamagedCalibration


def test_a_truncated_calibration_is_named_with_its_rebuild_command(tmp_path):
    path = tmp_path / "calibration-x.json"
    path.write_text('{"version": 1, "model": "x", "shape": {"vocab": 3')
    with pytest.raises(DamagedCalibration, match=rf"the calibration file {path} is damaged \(JSONDecodeError.*"
                                                 r"`treespec calibrate --model <name> --weights pretrained`"):
        Calibration.load(path)


def test_auto_treats_a_damaged_calibration_as_absent(tmp_path, monkeypatch):
    from treespec.cli import main as cli
    from treespec.targets.loader import tiny_target

    path = tmp_path / "calibration-x.json"
    path.write_text("{not json")
    cal, why = cli._cached_calibration(path, tiny_target(vocab_size=32))
    assert cal is None and str(path) in why and "damaged" in why and why.endswith("rebuilding it")


def test_the_cli_prints_error_for_a_damaged_calibration(tmp_path, capsys, monkeypatch):
    from treespec.cli import main as cli

    path = tmp_path / "calibration-x.json"
    path.write_text("{not json")
    assert cli.main(["plan", "--hardware", "local", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: the calibration file {path} is damaged" in err and "Traceback" not in err


def write_tiny_llama_gguf(path, seed: int = 0) -> None:
    """A 2-layer Llama GGUF (float32 tensors, byte-level BPE over 258 tokens, a chat template)
    written with the gguf package: what the conversion cache converts, in a fraction of a second."""
    import numpy as np
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "<|endoftext|>"]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 32, 64, 2, 4, 2
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])          # the last one a control token
    w.add_token_merges(["h e"])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", weight(vocab, hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv_heads * head_dim, hidden)),
                            ("attn_v", (kv_heads * head_dim, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", weight(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("damaged, how", [("model.safetensors", "truncate"), ("tokenizer.json", "truncate"),
                                          ("config.json", "garble")])
def test_a_damaged_conversion_cache_is_rebuilt_from_its_gguf(tmp_path, capsys, damaged, how):
    import torch

    from treespec.targets.loader import _load_converted

    gguf = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(gguf)
    root = tmp_path / "cache"
    first = _load_converted(gguf, "tiny-gguf", torch.float32, "cpu", root)
    (converted,) = [p for p in root.iterdir() if p.is_dir()]
    ids = torch.tensor([first.tokenizer("hello there").input_ids])
    with torch.inference_mode():
        want = first.model(ids).logits
    capsys.readouterr()

    file = converted / damaged
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if how == "truncate" else b"{not json")
    again = _load_converted(gguf, "tiny-gguf", torch.float32, "cpu", root)
    err = capsys.readouterr().err
    assert f"[the converted target at {converted} is damaged (" in err and f"rebuilding it from {gguf}]" in err
    assert "Traceback" not in err
    assert file.read_bytes() == data                                   # rebuilt as it was
    assert torch.tensor([again.tokenizer("hello there").input_ids]).equal(ids)
    with torch.inference_mode():
        assert torch.equal(again.model(ids).logits, want)
    _load_converted(gguf, "tiny-gguf", torch.float32, "cpu", root)     # now intact: loaded quietly
    assert "damaged" not in capsys.readouterr().err
