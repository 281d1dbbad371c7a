"""Device-clean steps: every tensor a step creates names its device, timings synchronize the
device before reading the clock, and host tensors are made only where a step means to."""

from __future__ import annotations

import pytest
import torch

from _engine_helpers import small_generator


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
              ("medusa", "dynamic", 1.0), ("mtp", "chain", 0.0), ("model", "dynamic", 1.0),
              ("lookup", "static", 0.0), ("early-exit", "dynamic", 1.0)]


def _device_case(kind, tree, mode="with_replacement", device="cpu"):
    from treespec import SpeculativeGenerator
    from treespec.cli.main import make_builder
    from treespec.targets.loader import tiny_target
    import test_drafters_trained as trained

    target = tiny_target(vocab_size=32, seed=0)
    target = type(target).from_hf(target.model.to(device), None, target.name, pack=False)
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
    from treespec.fastpath.device import synchronize

    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x
    synchronize(y.device)
    assert torch.cuda.current_stream().query()


def test_step_timings_synchronize_the_target_device_before_every_clock_read(monkeypatch):
    import treespec.runtime.generator as engine

    gen = small_generator()
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
    from treespec.fastpath.device import synchronize

    synchronize("cpu")
    synchronize(torch.device("meta"))
    synchronize(None)


def test_device_flags_reach_the_loaders_and_bad_devices_are_one_error(monkeypatch, capsys):
    import treespec
    from treespec.cli import main as cli

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
HOST_SITES = {"builders/base.py:finish", "runtime/generator.py:_loop", "core/tree.py:_ancestry", "core/tree.py:_validate",
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
