"""benchmarks/serve_load.py's result file holds a section a target: ``--keep`` keeps the other
targets' runs (also a file written before there were sections), drops the one being replaced,
and refuses runs from another CPU. The committed AVX2 result is the data: nothing is served."""

import json
import pytest

from _benchmarks import BENCH, benchmark_module


@pytest.fixture(scope="module")
def serve_load():
    with benchmark_module("serve_load") as module:
        yield module


def test_keep_takes_the_other_targets_runs_from_the_same_cpu_only(serve_load):
    data = json.loads((BENCH / "results" / "serve_load_avx2.json").read_text())
    smol = data["runs"]["smollm2-135m"]
    one_run = {**smol, "machine": data["machine"]}          # a file of one run, before sections
    args = dict(smol["args"])
    args.pop("model", None)
    one_run["args"] = args
    here = data["machine"]
    assert list(serve_load.kept_runs(data, here, "qwen2.5-coder-1.5b")) == ["smollm2-135m"]
    assert list(serve_load.kept_runs(data, here, "smollm2-135m")) == ["qwen2.5-coder-1.5b"]
    assert list(serve_load.kept_runs(one_run, here, "qwen2.5-coder-1.5b")) == ["smollm2-135m"]
    assert serve_load.kept_runs(one_run, here, "smollm2-135m") == {}
    other = {**here, "torch_cpu_capability": "AVX512"}
    with pytest.raises(ValueError, match="--keep: the runs in --out were measured on"):
        serve_load.kept_runs(data, other, "qwen2.5-coder-1.5b")


def test_every_kept_section_renders_from_its_own_recorded_arguments(serve_load):
    data = json.loads((BENCH / "results" / "serve_load_avx2.json").read_text())
    md = (BENCH / "results" / "serve_load_avx2.md").read_text()
    for run in data["runs"].values():
        assert "\n".join(serve_load.section(run)) in md
