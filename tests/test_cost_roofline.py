"""Cost model: shapes, hardware presets and roofline step times, checked by hand."""

from __future__ import annotations

import pytest

from treespec.planning import (
    HARDWARE_PRESETS,
    DrafterSpec,
    Hardware,
    ModelShape,
    arithmetic_intensity,
    compute_bound_batch,
    get_hardware,
    model_shape,
    pass_bytes,
    pass_flops,
    t_draft,
    t_target,
)

# A toy model small enough to count by hand:
#   attention per layer  q 64·64 + k,v 2·64·32 + o 64·64 = 12288   (x2 layers = 24576)
#   MLP per layer        3·64·128 = 24576                         (x2 layers = 49152)
#   LM head              1000·64 = 64000
#   matmul params        137728;  norms (2·2 + 1)·64 = 320
#   weight bytes         (137728 + 320)·2 = 276096
#   KV bytes per token   2 · 2 layers · 2 kv heads · 16 · 2 bytes = 256
TOY = ModelShape("toy", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=1000)
# 1 TB/s, 100 TFLOP/s, attained in full, 1 ms per pass.
TOY_HW = Hardware("toy", bandwidth=1e12, peak_flops=1e14, bandwidth_efficiency=1.0, compute_efficiency=1.0,
                  overhead_s=1e-3)


def test_toy_shape_by_hand():
    assert TOY.attention_params == 24576
    assert TOY.mlp_params == 49152
    assert TOY.lm_head_params == TOY.embedding_params == 64000
    assert TOY.matmul_params == 137728
    assert TOY.total_params == 24576 + 49152 + 64000 + 64000 + 320
    assert TOY.weight_bytes == 276096
    assert TOY.kv_bytes_per_token == 256
    # 2 FLOPs per weight + QK^T and PV: 4 · 2 layers · 4 heads · 16 · 10 keys
    assert TOY.flops_per_token(10) == 2 * 137728 + 4 * 2 * 4 * 16 * 10


def test_pass_time_by_hand():
    # 2 sequences x 4 tokens, 100 cached tokens each.
    bytes_ = 276096 + 2 * (100 + 4) * 256  # weights once + KV read + KV written
    flops = 2 * 4 * (2 * 137728 + 4 * 2 * 4 * 16 * (100 + 4))
    assert pass_bytes(TOY, 4, 2, 100) == bytes_ == 329344
    assert pass_flops(TOY, 4, 2, 100) == flops == 2629632
    assert t_target(TOY, TOY_HW, 4, 2, 100) == pytest.approx(max(bytes_ / 1e12, flops / 1e14) + 1e-3)
    assert arithmetic_intensity(TOY, 4, 2, 100) == pytest.approx(flops / bytes_)


def test_llama_3_8b_preset_matches_published_size():
    shape = model_shape("llama-3-8b")
    assert shape.total_params == 8_030_261_248  # "8B": 8.03e9 parameters
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token in bf16
    assert model_shape("llama-2-7b").total_params == pytest.approx(6.74e9, rel=1e-3)
    assert model_shape("llama-3-70b").total_params == pytest.approx(70.55e9, rel=1e-3)
    assert model_shape("smollm2-135m").total_params == pytest.approx(134.5e6, rel=1e-3)


def test_shape_from_any_hf_config():
    from transformers import GPT2Config, LlamaConfig

    gpt2 = ModelShape.from_hf_config(GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=100))
    assert (gpt2.layers, gpt2.hidden, gpt2.heads, gpt2.kv_heads, gpt2.head_dim) == (3, 64, 4, 4, 16)
    assert not gpt2.gated_mlp and gpt2.mlp_params == 3 * 2 * 64 * 256  # up/down, 4H inner
    llama = ModelShape.from_hf_config(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                  num_attention_heads=8, num_key_value_heads=2,
                                                  vocab_size=50, dtype="float32"))
    assert llama.gated_mlp and llama.kv_heads == 2 and llama.head_dim == 8
    assert llama.bytes_per_weight == llama.bytes_per_kv == 4.0


def test_presets_are_the_datasheet_numbers():
    assert (get_hardware("H100").bandwidth, get_hardware("h100").peak_flops) == (3.35e12, 989e12)
    assert (HARDWARE_PRESETS["mi300x"].bandwidth, HARDWARE_PRESETS["mi300x"].peak_flops) == (5.3e12, 1307e12)
    assert (HARDWARE_PRESETS["h200"].bandwidth, HARDWARE_PRESETS["h200"].peak_flops) == (4.8e12, 989e12)
    assert (HARDWARE_PRESETS["a100"].bandwidth, HARDWARE_PRESETS["a100"].peak_flops) == (2.0e12, 312e12)
    assert (HARDWARE_PRESETS["l40"].bandwidth, HARDWARE_PRESETS["l40"].peak_flops) == (864e9, 181e12)
    for hw in HARDWARE_PRESETS.values():
        assert hw.source and hw.overhead_s > 0 and 0 < hw.compute_efficiency <= 1


# ------------------------------------------------------------------------------------- limits


def test_large_batch_turns_compute_bound():
    shape, h100 = model_shape("llama-3-8b"), get_hardware("h100")
    batch = compute_bound_batch(shape, h100, n_tokens=1, context=0)
    assert batch is not None and batch > 1
    hw = h100

    def terms(b: int) -> tuple[float, float]:
        return pass_bytes(shape, 1, b, 0) / hw.effective_bandwidth, pass_flops(shape, 1, b, 0) / hw.effective_flops

    memory_s, compute_s = terms(batch)
    assert compute_s >= memory_s
    memory_s, compute_s = terms(batch - 1)
    assert compute_s < memory_s
    # Far past the ridge, time grows linearly with the batch.
    big = 64 * batch
    ratio = (t_target(shape, hw, 1, 2 * big) - hw.overhead_s) / (t_target(shape, hw, 1, big) - hw.overhead_s)
    assert ratio == pytest.approx(2.0, rel=1e-6)
    # A tree of n tokens per sequence gets there n times sooner (to rounding).
    assert compute_bound_batch(shape, hw, n_tokens=8, context=0) == pytest.approx(batch / 8, abs=1)


def test_long_context_decode_never_compute_bound():
    # Each sequence reads its own KV: FLOPs and bytes both grow with the batch, so the
    # intensity saturates at ~2·params / (context · KV bytes per token) < ridge point.
    assert compute_bound_batch(model_shape("llama-3-8b"), get_hardware("h100"), 1, context=8192) is None


def test_more_bandwidth_never_slows_a_step():
    shape = model_shape("llama-3-8b")
    base = get_hardware("h100")
    faster = Hardware("fast", base.bandwidth * 1.5, base.peak_flops, base.bandwidth_efficiency,
                      base.compute_efficiency, base.overhead_s)
    for n in (1, 4, 16, 64, 256):
        for batch in (1, 8, 64):
            for context in (0, 2048):
                slow, fast = t_target(shape, base, n, batch, context), t_target(shape, faster, n, batch, context)
                assert fast <= slow
                if arithmetic_intensity(shape, n, batch, context) < base.ridge_point:  # memory-bound
                    assert fast - faster.overhead_s == pytest.approx((slow - base.overhead_s) / 1.5)


def test_memory_bound_decode_ratio_mi300x_h100():
    shape = model_shape("llama-3-70b")
    h100 = t_target(shape, get_hardware("h100"), 1, 1, 2048)
    mi300x = t_target(shape, get_hardware("mi300x"), 1, 1, 2048)
    assert h100 / mi300x == pytest.approx(5.3 / 3.35, rel=0.01)  # overhead is < 1 % of the step


def test_arithmetic_intensity_matches_seed_formula():
    # Weight matmuls only (context 0, attention FLOPs ~0): AI ≈ k·B·n / (1 + KV/W), k = 2/b.
    shape = model_shape("llama-3-8b")
    for n, batch in ((1, 1), (16, 1), (8, 16)):
        kv = batch * n * shape.kv_bytes_per_token
        approx = (2 / shape.bytes_per_weight) * batch * n / (1 + kv / shape.weight_bytes)
        assert arithmetic_intensity(shape, n, batch, 0) == pytest.approx(approx, rel=0.01)


# ------------------------------------------------------------------------------------- drafters


def test_drafter_costs_by_hand():
    hw = TOY_HW
    # EAGLE: one target-width layer + 2H->H fusion + LM head, one pass per level.
    eagle = TOY.replace(layers=1, extra_params=2 * 64 * 64)
    level = max(pass_bytes(eagle, 1) / 1e12, pass_flops(eagle, 1) / 1e14) + 1e-3
    assert t_draft(TOY, DrafterSpec("eagle"), hw, [1, 1, 1]) == pytest.approx(3 * level)
    # A smaller draft vocab shrinks the LM head read.
    assert t_draft(TOY, DrafterSpec("eagle", draft_vocab=100), hw, [1]) < level
    # Early exit: the first k target layers + the full LM head.
    exit2 = t_draft(TOY, DrafterSpec("early_exit", layers=2), hw, [1, 3])
    assert exit2 == pytest.approx(t_target(TOY, hw, 1) + t_target(TOY, hw, 3))
    # Independent model: its own shape.
    small = TOY.replace(name="small", layers=1, hidden=32, heads=2, kv_heads=1)
    assert t_draft(TOY, DrafterSpec("model", shape=small), hw, [1, 2]) == pytest.approx(
        t_target(small, hw, 1) + t_target(small, hw, 2))
    # Medusa: one pass of D heads (H x H + V x H each), whatever the widths.
    heads = 3 * (64 * 64 + 1000 * 64)
    assert t_draft(TOY, DrafterSpec("medusa"), hw, [1, 4, 9]) == pytest.approx(
        max(heads * 2 / 1e12, 2 * heads / 1e14) + 1e-3)
    assert t_draft(TOY, DrafterSpec("lookup"), hw, [1, 4]) == 0.0
    assert t_draft(TOY, DrafterSpec("eagle"), hw, []) == 0.0


# ------------------------------------------------------------------------------------- errors


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(KeyError, match=r"unknown hardware 'tpu'.*'a100', 'h100', 'h200', 'l40', 'mi300x'"):
        get_hardware("tpu")
    with pytest.raises(KeyError, match=r"unknown model 'gpt-5'; known models"):
        model_shape("gpt-5")
    with pytest.raises(ValueError, match="n_tokens must be a positive int"):
        t_target(TOY, TOY_HW, 0)
    with pytest.raises(ValueError, match="batch must be a positive int"):
        t_target(TOY, TOY_HW, 1, batch=-2)
    with pytest.raises(ValueError, match="context must be an int >= 0"):
        t_target(TOY, TOY_HW, 1, context=-1)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Hardware("bad", bandwidth=0, peak_flops=1e12)
    with pytest.raises(ValueError, match=r"compute_efficiency must be in \(0, 1\]"):
        Hardware("bad", bandwidth=1e12, peak_flops=1e12, compute_efficiency=1.5)
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        TOY.replace(hidden=0)
    with pytest.raises(ValueError, match=r"kv_heads \(3\) must divide heads \(4\)"):
        TOY.replace(kv_heads=3)
    with pytest.raises(ValueError, match="unknown drafter kind 'oracle'"):
        DrafterSpec("oracle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'model' drafter needs its shape"):
        DrafterSpec("model")
    with pytest.raises(ValueError, match="widths must be positive ints"):
        t_draft(TOY, DrafterSpec("eagle"), TOY_HW, [1, 0])
    with pytest.raises(ValueError, match=r"early-exit layers \(5\) exceed the target's \(2\)"):
        t_draft(TOY, DrafterSpec("early_exit", layers=5), TOY_HW, [1])
