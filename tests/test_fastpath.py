"""The CPU fast path (``treespec.fastpath.packing``): packed linear layers and ``dtype="auto"``.

The packed fp32 model must score trees like the stock one (logits within 1e-5 for every tree
size, with tree masks over a cached prefix) and decode greedily like HF ``generate``; packing
must leave parameters, ties and state untouched; the dtype choice must follow the CPU's flags
(an AVX2-only CPU gets fp32 and no bf16 packing), never an assumption.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from treespec import SpeculativeGenerator, Target
from treespec.fastpath.packing import (
    PANEL_MAX_ROWS, CpuInfo, PackedLinear, _read_cpuinfo, cpu_info, linear_isa, linear_kernel, machine_info,
    native_bf16,
    pack_linears, packing_available, resolve_dtype, unpack_linears,
)
from treespec.fastpath.kernels import pack_panels, panel_linear, panel_status
from treespec.core.masks import hf_tree_mask, position_ids
from treespec.core.tree import DraftTree
from treespec.builders import DynamicTreeBuilder

from _engine_helpers import NoisyTargetDrafter, hf_greedy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

needs_packing = pytest.mark.skipif(not packing_available(), reason="this PyTorch build has no oneDNN packing")
needs_panel = pytest.mark.skipif(not panel_status(build=False)[0], reason=panel_status(build=False)[1])
KERNEL_PARAMS = [pytest.param("onednn", marks=needs_packing), pytest.param("panel", marks=needs_panel),
                 pytest.param("blocks", marks=needs_panel)]

AVX2_ONLY = CpuInfo("AMD EPYC (test)", ("avx2", "fma", "f16c"), "AVX2")
AMX = CpuInfo("Intel Xeon (test)", ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), "AVX512")


def small_llama(seed: int = 0, tied: bool = False, dtype=torch.float32) -> LlamaForCausalLM:
    """Big enough for the blocked GEMM paths (hidden 64, vocab 300), small enough to be instant."""
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), sampling="deterministic")


def prefix_and_tree(n: int) -> tuple[torch.Tensor, DraftTree]:
    """A 37-token prefix and an n-node random tree after it, over 300 tokens, seeded by n."""
    rng = random.Random(n)
    prefix = torch.tensor([rng.randrange(300) for _ in range(37)])
    return prefix, random_tree(rng, n, 300)


def tree_logits(model, prefix: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[N, V] logits of every tree node after a cached prefix, as the verifier computes them."""
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix[None], cache=cache, use_cache=True)
        p = prefix.numel()
        out = model(input_ids=tree.tokens[None], position_ids=position_ids(tree, p),
                    attention_mask=hf_tree_mask(tree, p, "sdpa"), cache=cache, use_cache=True)
    return out.logits[0]


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16, 17, 32, 64, 65])
def test_packed_fp32_scores_trees_like_the_stock_model(n, kernel) -> None:
    stock = small_llama()
    packed = copy.deepcopy(stock)
    report = pack_linears(packed, kernel=kernel)
    assert report.packed == 2 * 7 + 1 and "fp32" in report.path and linear_kernel(packed) == kernel
    prefix, tree = prefix_and_tree(n)
    ref, got = tree_logits(stock, prefix, tree), tree_logits(packed, prefix, tree)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@needs_packing
def test_packed_layer_rows_agree_with_f_linear_for_every_row_count() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=True).requires_grad_(False)
    packed = PackedLinear(linear, min_rows=4)
    for rows in (1, 3, 4, 8, 16, 33, 64):
        x = torch.randn(2, rows, 576)                         # [B, N, H]: leading dims kept
        with torch.inference_mode():
            got, ref = packed(x), nn.functional.linear(x, linear.weight, linear.bias)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)   # |y| ~ 10: fp32 rounding only


@needs_packing
@pytest.mark.skipif(not cpu_info().native_bf16, reason="CPU without native bf16 units")
def test_packed_bf16_layer_is_within_bf16_rounding_of_the_exact_product() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(576, 1536, bias=False).to(torch.bfloat16).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(16, 576).to(torch.bfloat16)
    with torch.inference_mode():
        got = packed(x).double()
    exact = x.double() @ linear.weight.double().t()
    scale = x.double().abs() @ linear.weight.double().abs().t()
    # output rounded to bf16 (2^-8 relative) after an fp32 accumulation
    assert bool(((got - exact).abs() <= exact.abs() * 2**-8 + scale * 1e-5).all())


@needs_packing
def test_packing_keeps_parameters_ties_and_state() -> None:
    model = small_llama(tied=True)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    embed = model.model.embed_tokens.weight
    pack_linears(model)
    assert isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is embed                          # still tied
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    assert unpack_linears(model) == 15
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is embed


@needs_packing
def test_packed_copy_follows_in_place_weight_changes() -> None:
    linear = nn.Linear(64, 96, bias=False).requires_grad_(False)
    packed = PackedLinear(linear)
    x = torch.randn(8, 64)
    with torch.no_grad():
        linear.weight.mul_(-2.0)                          # e.g. load_state_dict after packing
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), x @ linear.weight.t(), rtol=0, atol=1e-5)


@needs_packing
def test_fp32_fast_path_greedy_equals_hf_generate_on_stock_model() -> None:
    stock = small_llama(seed=3)
    packed = copy.deepcopy(stock)
    pack_linears(packed)
    target = Target.from_hf(packed, tokenizer=None, name="small", pack=False)
    drafter = NoisyTargetDrafter(copy.deepcopy(stock), noise=0.5, seed=1)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=16, depth=4, top_k=3))
    ids = torch.tensor([5, 17, 200, 42, 7])
    out = gen.generate(ids, max_new_tokens=40, temperature=0.0)
    assert out.token_ids.tolist() == hf_greedy(stock, ids, (2,), 40)


AVX512_BF16 = CpuInfo("AMD EPYC (test)", ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni"), "AVX512")


def test_auto_dtype_runs_exact_block_checkpoints_in_fp32_on_every_cpu_with_native_bf16() -> None:
    """Measured on an AVX-512-BF16 EPYC and on an AMX Xeon: the fp32 block kernel beats the bf16
    path when every weight matrix is an exact block type; any other checkpoint keeps bf16."""
    blocks = frozenset({"Q4_1", "Q8_0"})
    for cpu, units in ((AVX512_BF16, "AVX-512 BF16 units"), (AMX, "AMX units")):
        dtype, why = resolve_dtype("auto", "cpu", cpu, weight_types=blocks)
        assert dtype == torch.float32 and "exact block type (Q4_1, Q8_0)" in why and units in why
        for types in (frozenset({"Q4_K", "Q6_K"}), None, frozenset()):     # Qwen's Q4_K_M; unknown
            assert resolve_dtype("auto", "cpu", cpu, weight_types=types)[0] == torch.bfloat16
        assert resolve_dtype("bfloat16", "cpu", cpu, weight_types=blocks)[0] == torch.bfloat16
    assert resolve_dtype("auto", "cpu", AVX2_ONLY, weight_types=blocks)[0] == torch.float32


HOST_FLAGS = _read_cpuinfo(Path("/proc/cpuinfo").read_text())[1] if Path("/proc/cpuinfo").exists() else set()


@needs_packing
@pytest.mark.skipif(not ({"avx512bw", "avx512vl", "avx512dq"} <= HOST_FLAGS or "avx_ne_convert" in HOST_FLAGS),
                    reason="oneDNN packs bf16 weights only on a CPU with AVX-512 BW/VL/DQ or AVX-NE-CONVERT")
def test_bf16_pads_few_rows_of_large_weights_only_where_bf16_units_are_not_amx() -> None:
    """On AVX-512 BF16 without AMX, oneDNN multiplies 1-3 rows by a large bf16 weight slower than
    4 (linear_rows_bf16_epyc.md); those products are padded to BF16_PAD_ROWS zero rows, whose
    outputs are dropped. Small weights, AMX and fp32 are left alone."""
    from treespec.fastpath.packing import BF16_PAD_MIN_WEIGHT, BF16_PAD_ROWS

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2048, 2048), nn.Linear(64, 2048, bias=False)).to(torch.bfloat16)

    assert 2048 * 2048 >= BF16_PAD_MIN_WEIGHT > 64 * 2048
    padded = model()
    report = pack_linears(padded, cpu=AVX512_BF16)
    assert [m.pad_rows for m in padded] == [BF16_PAD_ROWS, 0] and "padded to 4" in report.reason
    amx = model()
    pack_linears(amx, cpu=AMX)
    assert [m.pad_rows for m in amx] == [0, 0]
    reference = model()
    for rows in (1, 2, 3, 4, 6):
        x = torch.randn(2, rows, 2048).to(torch.bfloat16)   # a leading batch dim too
        want = F.linear(x.float(), reference[0].weight.float(), reference[0].bias.float())
        got, plain = padded[0](x), amx[0](x)
        assert got.shape == (2, rows, 2048) and got.dtype == torch.bfloat16
        # the padding only changes which oneDNN kernel runs: within bf16 rounding of the exact
        # product, and no farther from it than the unpadded packed product
        err, err_plain = (got.float() - want).abs().max(), (plain.float() - want).abs().max()
        assert err <= 2 * err_plain + 1e-2, (rows, err, err_plain)
    with pytest.raises(ValueError, match="pad_rows"):
        PackedLinear(nn.Linear(64, 64), kernel="panel", pad_rows=4)
    with pytest.raises(ValueError, match="pad_rows"):
        PackedLinear(nn.Linear(64, 64), pad_rows=-1)


def test_auto_dtype_follows_the_cpu_flags() -> None:
    assert resolve_dtype("auto", "cpu", AMX)[0] == torch.bfloat16
    dtype, why = resolve_dtype("auto", "cpu", AVX2_ONLY)
    assert dtype == torch.float32 and "emulated" in why
    assert resolve_dtype("float32")[0] == torch.float32
    assert resolve_dtype(torch.bfloat16)[0] == torch.bfloat16
    assert native_bf16("cpu", AMX)[0] and not native_bf16("cpu", AVX2_ONLY)[0]
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("float33")
    with pytest.raises(TypeError, match="dtype"):
        resolve_dtype(16)


def test_avx2_only_cpu_gets_no_bf16_packing() -> None:
    model = small_llama(dtype=torch.bfloat16)
    report = pack_linears(model, cpu=AVX2_ONLY)
    assert report.packed == 0 and report.path == "stock" and "native bf16" in report.reason
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@needs_packing
def test_fp32_packing_starts_where_each_cpu_kind_gains() -> None:
    """The row count from which oneDNN-packed fp32 is used follows the CPU (measured per kind, see
    ``fastpath.FP32_MIN_ROWS``): 4 on AVX-512 parts, 2 on AVX2-only ones."""
    for cpu, rows in ((AMX, 4), (AVX2_ONLY, 2)):
        model = small_llama()
        report = pack_linears(model, cpu=cpu, kernel="onednn")
        layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert layers and {m.min_rows for m in layers} == {rows} and {m.kernel for m in layers} == {"onednn"}
        assert f">= {rows} rows" in report.reason


@needs_panel
def test_fp32_kernel_follows_the_cpu_kind() -> None:
    """Every CPU with AVX2, AVX-512 ones included (both measured: the block GEMM reads fewer
    bytes per pass), gets the block kernel for 1..PANEL_MAX_ROWS fp32 rows; oneDNN and the plain
    panels are there when asked for by name."""
    for cpu in (AVX2_ONLY, AMX):
        model = small_llama()
        report = pack_linears(model, cpu=cpu)
        layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert {(m.kernel, m.min_rows, m.max_rows) for m in layers} == {("blocks", 1, PANEL_MAX_ROWS)}
        assert report.path == f"blocks (fp32, 1..{PANEL_MAX_ROWS} rows; 15 as fp32 panels)"
    if packing_available():
        assert linear_kernel(_packed(small_llama(), cpu=AMX, kernel="onednn")) == "onednn"
    assert linear_kernel(_packed(small_llama(), cpu=AMX, kernel="panel")) == "panel"


def _packed(model, **kw):
    pack_linears(model, **kw)
    return model


def test_panel_kernel_refuses_what_it_cannot_run() -> None:
    plain = CpuInfo("Old CPU (test)", (), "DEFAULT")
    ok, why = panel_status(plain, build=False)
    assert not ok and "avx2" in why
    with pytest.raises(ValueError, match="not available here.*avx2"):
        pack_linears(small_llama(), cpu=plain, kernel="panel")
    with pytest.raises(ValueError, match="float32 only"):
        pack_linears(small_llama(dtype=torch.bfloat16), kernel="panel")
    with pytest.raises(ValueError, match="kernel must be"):
        pack_linears(small_llama(), kernel="mkl")
    with pytest.raises(ValueError, match="float32"):
        pack_panels(torch.zeros(16, 8, dtype=torch.float64))
    # a CPU without AVX2 falls back to oneDNN (or stock), saying nothing is wrong
    report = pack_linears(small_llama(), cpu=plain)
    assert "panel" not in report.path


@needs_panel
def test_panel_kernel_builds_on_an_avx2_cpu() -> None:
    """Where the CPU has AVX2 + FMA and a compiler is present, the kernel must build: a broken
    build would otherwise silently drop every fp32 pass back to the slow path."""
    import shutil

    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on PATH")
    ok, why = panel_status()
    assert ok, why


@needs_panel
@pytest.mark.parametrize("k", [64, 100, 576])
@pytest.mark.parametrize("n_out", [40, 300])
def test_panel_linear_matches_the_exact_product_for_every_row_count(k, n_out) -> None:
    """Every tile shape (1..6 rows, several blocks of 6), K not a multiple of the 64-wide chunk,
    N not a multiple of the 16-wide panel, with a bias: within fp32 rounding of the float64 product."""
    torch.manual_seed(k + n_out)
    weight, bias = torch.randn(n_out, k), torch.randn(n_out)
    panels = pack_panels(weight)
    for rows in (1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 17, 64):
        x = torch.randn(rows, k)
        got = panel_linear(x, panels, n_out, bias).double()
        exact = x.double() @ weight.double().t() + bias.double()
        scale = x.double().abs() @ weight.double().abs().t() + bias.double().abs()
        assert got.shape == (rows, n_out)
        # a k-term fp32 FMA chain: |error| <= k * 2^-24 * sum |x_i w_i| (first-order bound)
        assert bool(((got - exact).abs() <= scale * k * 2.0**-24).all()), rows


@needs_panel
def test_panel_rows_are_batch_invariant() -> None:
    """A row's output does not depend on the other rows of the pass: bit-identical alone and in a
    64-row pass, at every position (each tile shape), so a 1-token decode step and a tree pass
    compute the same linear outputs."""
    torch.manual_seed(0)
    weight = torch.randn(200, 576)
    panels = pack_panels(weight)
    x = torch.randn(64, 576)
    together = panel_linear(x, panels, 200)
    for rows in (1, 5, 6, 13, 64):
        part = panel_linear(x[:rows], panels, 200)
        assert torch.equal(part, together[:rows]), rows
    alone = torch.stack([panel_linear(x[i:i + 1], panels, 200)[0] for i in range(64)])
    assert torch.equal(alone, together)


@needs_panel
def test_panel_layer_uses_the_stock_op_outside_its_rows_and_with_autograd() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = PackedLinear(linear, kernel="panel")
    big = torch.randn(PANEL_MAX_ROWS + 1, 64)
    with torch.inference_mode():
        assert torch.equal(layer(big), nn.functional.linear(big, linear.weight, linear.bias))
    x = torch.randn(3, 64, requires_grad=True)
    layer(x).sum().backward()                                # training still works: stock op
    assert x.grad is not None and linear.weight.grad is not None
    with pytest.raises(ValueError, match="float32 only"):
        PackedLinear(nn.Linear(8, 8).to(torch.bfloat16), kernel="panel")


def test_packing_is_skipped_where_it_does_not_apply() -> None:
    assert pack_linears(small_llama(), enabled=False).path == "stock"
    fp16 = small_llama(dtype=torch.float16)
    assert pack_linears(fp16, cpu=AMX).path == "stock"
    meta = small_llama().to("meta")
    report = pack_linears(meta, cpu=AMX)
    assert report.packed == 0 and "CPU path" in report.reason
    with pytest.raises(TypeError, match="nn.Module"):
        pack_linears("model")
    with pytest.raises(TypeError, match="nn.Linear"):
        PackedLinear(nn.Conv1d(2, 2, 1))


def test_cpuinfo_parsing_and_machine_record() -> None:
    text = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 fma amx_bf16 avx512_bf16\n" \
           "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n"
    model, flags = _read_cpuinfo(text)
    assert model == "Test CPU 9000" and {"avx2", "amx_bf16", "avx512_bf16"} <= flags
    record = machine_info()
    assert {"cpu_model", "cpu_flags", "torch_threads"} <= set(record)
    assert record["torch_threads"] == torch.get_num_threads()


def test_every_benchmark_records_the_machine() -> None:
    """Numbers from different machines are never compared blindly: each script writes the CPU
    model, its flags and the thread count (``machine_info``) into its result file."""
    from pathlib import Path

    benchmarks = Path(__file__).parents[1] / "benchmarks"
    scripts = sorted(benchmarks.glob("*.py"))
    assert scripts
    # the drafter grid (drafters.py, hybrid.py) records it in the harness, for every script that runs it
    grid = (benchmarks / "harness.py").read_text()
    assert "machine_info()" in grid[grid.index("def drafter_grid("):]
    # harness.publish writes machine_info() into the result it publishes
    assert "machine_info()" in grid[grid.index("def publish("):grid.index("def md_table(")]
    missing = [p.name for p in scripts
               if not any(call in p.read_text() for call in ("machine_info()", "drafter_grid(", "publish("))]
    assert not missing, f"benchmarks without machine_info(): {missing}"


def test_demo_calibrates_once_and_caches_it(tmp_path, monkeypatch) -> None:
    """`make demo` on a machine without a calibration measures one (saying so, with a progress
    bar), stores it under the dtype- and path-specific name, and reuses it the next time."""
    import io

    from treespec.cli.main import ensure_calibration
    from treespec.planning import Calibration, default_calibration_path
    from treespec.targets.loader import tiny_llama

    from _engine_helpers import word_tokenizer

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    words = [f"w{i}" for i in range(30)]
    model = tiny_llama(vocab_size=len(words) + 2, max_position_embeddings=1024)
    pack_linears(model)
    target = Target.from_hf(model, word_tokenizer(words), name="tiny-demo", pack=False)
    out = io.StringIO()
    path = ensure_calibration(target, "lookup", out=out)
    assert path == default_calibration_path("tiny-demo", torch.float32, linear_kernel(model), isa=linear_isa(model))
    assert "measuring it once" in out.getvalue() and "calibrating" in out.getvalue()
    cal = Calibration.load(path)
    assert "lookup" in cal.acceptance and "lookup@T1" in cal.acceptance and cal.target(16) > 0
    again = io.StringIO()   # reused silently (the check of its pass time against a fresh one has its own test:
    with monkeypatch.context() as quiet:   # on a loaded host the two differ, and saying so is right)
        quiet.setattr("treespec.calibrate.passes.pass_time_disagrees", lambda *a, **k: None)
        assert ensure_calibration(target, "lookup", out=again) == path and again.getvalue() == ""
    # an older file without the T = 1 acceptance, asked for batched passes: only those are added
    data = json.loads(path.read_text())
    del data["acceptance"]["lookup@T1"]
    path.write_text(json.dumps(data))
    more = io.StringIO()
    assert ensure_calibration(target, "lookup", out=more, batches=(2,)) == path
    assert "lookup acceptance at T = 1; batched passes at B = 2" in more.getvalue()
    assert "measuring it once" not in more.getvalue()
    cal2 = Calibration.load(path)
    assert "lookup@T1" in cal2.acceptance and set(cal2.batch_target) == {2} and cal2.target == cal.target
    # the same cache seen from another machine (a shared home directory): measured again
    data = json.loads(path.read_text())
    data["device"] = "Another CPU [avx2 fma avx512f amx_bf16]; " + data["device"].split("; ", 1)[1]
    path.write_text(json.dumps(data))
    moved = io.StringIO()
    assert ensure_calibration(target, "lookup", out=moved) == path
    assert "does not fit this machine" in moved.getvalue() and "Another CPU" in moved.getvalue()
    assert Calibration.load(path).device != data["device"]
    # a file written before timing spreads were recorded: auto's minimum gain needs them
    assert Calibration.load(path).timing_noise is not None
    data = json.loads(path.read_text())
    del data["target"]["spread"]
    path.write_text(json.dumps(data))
    spreadless = io.StringIO()
    assert ensure_calibration(target, "lookup", out=spreadless) == path
    assert "predates timing spreads" in spreadless.getvalue()
    assert Calibration.load(path).timing_noise is not None


def test_a_cached_calibration_measures_a_new_or_replaced_drafter_again(tmp_path, monkeypatch) -> None:
    """Acceptance belongs to a drafter's weights: when the shipped checkpoint a drafter name loads
    changes (a new head), or the cache never measured that drafter, the drafter is measured again
    and the target's timings and the other drafters' measurements are kept. builder="auto" does
    not plan a drafter from acceptance measured on other weights."""
    import io
    import warnings

    import treespec.drafters.feature as feature
    from treespec.cli.main import ensure_calibration
    from treespec.drafters import load_drafter
    from treespec.drafters.checkpoint import read_header, save_checkpoint
    from treespec.planning import Calibration
    from treespec.runtime.generator import CalibrationMismatchWarning, auto_builder
    from treespec.targets.loader import tiny_llama

    from _engine_helpers import word_tokenizer

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    words = [f"w{i}" for i in range(30)]
    model = tiny_llama(vocab_size=len(words) + 2, max_position_embeddings=1024)
    target = Target.from_hf(model, word_tokenizer(words), name="tiny-weights", pack=False)
    shipped = tmp_path / "checkpoints" / "eagle3.safetensors"    # what load_drafter("eagle3") reads
    monkeypatch.setattr(feature, "shipped_checkpoint", lambda target, name: shipped.with_name(f"{name}.safetensors"))

    def ship(seed: int) -> str:
        head = feature.random_feature_drafter(target, "eagle3", seed=seed, draft_vocab=16).head
        save_checkpoint(shipped, dict(head.state_dict()), "eagle3", head.cfg.to_json(), target)
        return read_header(shipped)["checksum"]

    first_head = ship(seed=1)
    path = ensure_calibration(target, "eagle3", out=io.StringIO())
    first = Calibration.load(path)
    assert first.weights == {"eagle3": first_head}
    assert ensure_calibration(target, "eagle3", out=(same := io.StringIO())) == path and same.getvalue() == ""
    # a drafter the cache never measured: measured alone, next to the one it has
    assert ensure_calibration(target, "lookup", out=(other := io.StringIO())) == path
    said = other.getvalue()
    assert "no measurement of drafter 'lookup'" in said and "target's timings are kept" in said, said
    both = Calibration.load(path)
    assert both.target == first.target and both.acceptance["eagle3"] == first.acceptance["eagle3"]
    assert "lookup" in both.acceptance and "lookup@T1" in both.acceptance
    assert both.weights == {"eagle3": first_head}    # lookup loads no checkpoint
    # a new head shipped: auto refuses the old head's acceptance until eagle3 is measured again
    new_head = ship(seed=2)
    drafter = load_drafter("eagle3", target)
    assert drafter.weights_checksum == new_head != first_head
    with pytest.warns(CalibrationMismatchWarning, match=f"checkpoint {first_head[:12]}.*checkpoint {new_head[:12]}"):
        auto_builder(target, drafter, both)
    assert ensure_calibration(target, "eagle3", out=(new := io.StringIO())) == path
    said = new.getvalue()
    assert f"with checkpoint {first_head[:12]}; the shipped checkpoint is now {new_head[:12]}" in said, said
    assert "measuring it once" not in said
    again = Calibration.load(path)
    assert again.weights == {"eagle3": new_head} and again.target == first.target
    assert again.acceptance["lookup"] == both.acceptance["lookup"] and "eagle3@T1" in again.acceptance
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationMismatchWarning)
        auto_builder(target, drafter, again)
    # a file written before weights were recorded: its drafter is measured again once
    data = json.loads(path.read_text())
    del data["weights"]
    path.write_text(json.dumps(data))
    assert ensure_calibration(target, "eagle3", out=(old := io.StringIO())) == path
    assert "weights it did not record" in old.getvalue(), old.getvalue()
    assert Calibration.load(path).weights == {"eagle3": new_head}


def test_without_drafter_drops_every_measurement_of_that_drafter_only() -> None:
    from treespec.planning import Calibration, Curve, LoopCost, ModelShape

    curve = Curve((1, 2), (1.0, 2.0))
    cal = Calibration(
        model="m", shape=ModelShape("m", layers=1, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32),
        context=16, target=curve, drafters={"eagle3": curve, "eagle": curve},
        drafter_layers={"eagle3": 1, "eagle": 1},
        acceptance={"eagle3": (0.5,), "eagle3@T1": (0.4,), "eagle3@T1/without_replacement": (0.45,),
                    "eagle": (0.3,), "eagle@T1": (0.2,)},
        batch_drafters={"eagle3": {2: curve}}, loop={"plain": LoopCost(0.001), "eagle3": LoopCost(0.002)},
        weights={"eagle3": "c" * 64, "eagle": "d" * 64})
    left = cal.without_drafter("eagle3")
    assert set(left.drafters) == {"eagle"} and set(left.drafter_layers) == {"eagle"}
    assert set(left.acceptance) == {"eagle", "eagle@T1"}   # "eagle" is not a prefix match of "eagle3"
    assert left.batch_drafters == {} and set(left.loop) == {"plain"} and left.weights == {"eagle": "d" * 64}
    assert left.target == cal.target
    assert set(cal.without_drafter("eagle").acceptance) == {"eagle3", "eagle3@T1", "eagle3@T1/without_replacement"}


def test_a_cached_calibration_whose_pass_time_is_off_is_flagged(tmp_path, monkeypatch) -> None:
    """A calibration measured under another load (its t(n) far from what a pass takes now) is
    reused, but ensure_calibration says so and how to re-measure; passes too short to time
    reliably are not checked."""
    import io

    from treespec.calibrate.passes import STALE_CHECK_MIN_SECONDS
    from treespec.cli.main import ensure_calibration
    from treespec.targets.loader import tiny_llama

    from _engine_helpers import word_tokenizer

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    words = [f"w{i}" for i in range(30)]
    model = tiny_llama(vocab_size=len(words) + 2, max_position_embeddings=1024)
    target = Target.from_hf(model, word_tokenizer(words), name="tiny-stale", pack=False)
    path = ensure_calibration(target, "lookup", out=io.StringIO())
    data = json.loads(path.read_text())
    measured = data["target"]["seconds"][0]
    # 1000x the pass (and above the check whatever this host's load made it): flagged; a t(1)
    # under the check, 2x or 1000x off the pass as it may be: not checked
    for t1, flagged in ((max(1000 * measured, 2 * STALE_CHECK_MIN_SECONDS), True),
                        (STALE_CHECK_MIN_SECONDS / 2, False)):
        changed = json.loads(json.dumps(data))
        changed["target"]["seconds"] = [t * t1 / measured for t in data["target"]["seconds"]]
        path.write_text(json.dumps(changed))
        out = io.StringIO()
        assert ensure_calibration(target, "lookup", out=out) == path
        said = out.getvalue()
        assert ("a 1-token pass takes" in said and "Delete the file" in said) is flagged, said
        assert json.loads(path.read_text())["target"]["seconds"] == changed["target"]["seconds"]   # kept


@needs_packing
def test_demo_stock_baseline_restores_the_fast_path() -> None:
    """The demo also times plain decoding with stock linear layers: it unpacks the target for
    that run and packs it again with the same kernel; a stock target has no second baseline."""
    from treespec.cli.main import stock_decode_speed

    model = small_llama(seed=5)
    pack_linears(model)
    kernel = linear_kernel(model)
    target = Target.from_hf(model, tokenizer=None, name="small", pack=False)
    ids = torch.tensor([5, 17, 200])
    assert stock_decode_speed(target, ids, 4) > 0
    assert linear_kernel(model) == kernel and kernel != "stock"
    unpack_linears(model)
    assert stock_decode_speed(target, ids, 4) is None


@pytest.mark.parametrize("kernel", KERNEL_PARAMS)
def test_a_trainable_weight_gets_its_gradient_through_either_kernel(kernel) -> None:
    """A packed kernel has no backward: with grad mode on and a weight that requires grad, the
    layer must run the stock op even when the input itself needs no gradient (the first layer
    of a head trained on frozen features), or the weight's gradient would silently be lost."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = PackedLinear(copy.deepcopy(linear), min_rows=1, kernel=kernel)
    x = torch.randn(8, 64)                                   # no requires_grad
    layer(x).square().sum().backward()
    linear(x).square().sum().backward()
    assert layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, linear.weight.grad, rtol=0, atol=0)
