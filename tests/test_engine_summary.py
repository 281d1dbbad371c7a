"""benchmarks/engine.py's summary: the ratio of median rates against the fastest plain decoding,
and the same comparison paired by prompt and pooled. Synthetic rows: nothing is loaded or timed."""

import pytest

from _benchmarks import benchmark_module


@pytest.fixture(scope="module")
def engine():
    with benchmark_module("engine") as module:
        yield module


def rows(rates: list[float]) -> list[dict]:
    return [{"tokens": 60, "time": 60 / r} for r in rates]


def test_paired_and_pooled_ratios_against_the_fastest_plain_decoding(engine):
    # the host ran fast for the plain row's last three prompts and slow for the speculative row's
    # first three: by prompt the speculative row is 1.5x everywhere but the third prompt
    plain = [10.0, 10.0, 40.0, 40.0, 40.0]
    spec = [15.0, 15.0, 15.0, 60.0, 60.0]
    data = {"rows": {"0": {"amx treespec plain": rows(plain), "amx treespec auto": rows(spec)}}}
    e = engine.summarize(data)["0"]["rows"]["amx treespec auto"]
    assert e["vs_fastest_plain"] == pytest.approx(15.0 / 40.0)                      # medians: 15 / 40
    assert e["vs_fastest_plain_paired"] == pytest.approx(1.5)                       # 1.5, 1.5, 0.375, 1.5, 1.5
    seconds = lambda rates: sum(60 / r for r in rates)                              # noqa: E731
    assert e["vs_fastest_plain_pooled"] == pytest.approx(seconds(plain) / seconds(spec))
    reference = engine.summarize(data)["0"]["rows"]["amx treespec plain"]
    assert reference["vs_fastest_plain_paired"] == reference["vs_fastest_plain_pooled"] == pytest.approx(1.0)
