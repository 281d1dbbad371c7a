"""benchmarks/qwen.py's shards: a full run split across cores must merge into the result one
process would have written (pooled counters summed, prompts in their order), and shards of
different runs must be refused. Synthetic counters: nothing is loaded or timed."""

import argparse

import pytest

from _benchmarks import benchmark_module


@pytest.fixture(scope="module")
def qwen():
    with benchmark_module("qwen") as module:
        yield module


def shard_result(qwen, k: int, n: int = 2, seed: int = 0, done: int | None = None,
                 kinds: tuple[str, ...] | None = None) -> dict:
    """What ``qwen.py --per-kind 2 --shard k/n`` would save: per prompt, hf and hf-packed emit 8
    tokens in (1 + k) and k seconds, a speculative row 8 tokens in 2 steps with depth counts."""
    from harness import Pool

    args = argparse.Namespace(max_new_tokens=8, temperatures="0", dtype="float32", kernel=None, compile=None,
                              threads=1, seed=seed, shard=f"{k}/{n}", note="test", prompts=None, per_kind=2,
                              kinds=kinds or qwen.KINDS)
    mine = qwen.select(qwen.prompts(None, 2, kinds or qwen.KINDS), (k, n))[:done]
    pools = {}
    for kind, _ in mine:
        for where in ("all", kind):
            for name, seconds in (("hf", 1.0 + k), ("hf-packed", float(k))):
                pool = pools.setdefault((name, 0.0, where), Pool())
                pool.tokens, pool.seconds = pool.tokens + 8, pool.seconds + seconds
            pool = pools.setdefault(("spec", 0.0, where), Pool())
            pool.tokens, pool.seconds = pool.tokens + 8, pool.seconds + 0.5
            pool.steps, pool.emitted = pool.steps + 2, pool.emitted + 8
            pool.draft, pool.verify = pool.draft + 0.1, pool.verify + 0.4
            pool.attempts = [a + b for a, b in zip(pool.attempts or [0] * k, [2] * k)]
            pool.accepts = [a + b for a, b in zip(pool.accepts or [0] * k, [1] * k)]
    greedy = {("spec", "hf-packed"): [True] * len(mine)}
    run = qwen.options(args, ["hf", "hf-packed", "spec"])
    return qwen.report(args, run, [0.0], mine, True, pools, greedy, {}, "test path", 60.0 * k)


def test_shards_partition_the_prompts_and_each_holds_every_kind(qwen):
    items = qwen.prompts(None, 2)
    one, two = qwen.select(items, (1, 2)), qwen.select(items, (2, 2))
    assert sorted(one + two) == sorted(items) and not set(one) & set(two)
    assert {k for k, _ in one} == {k for k, _ in two} == set(qwen.KINDS)


def test_merged_shards_sum_their_counters_in_prompt_order(qwen, tmp_path):
    merged = qwen.merge([shard_result(qwen, 2), shard_result(qwen, 1)], "two shards")
    assert merged["config"]["prompts"] == 6 and merged["config"]["prompt_kinds"] == {
        "coding": 2, "reasoning": 2, "code-edit": 2}
    assert merged["state"]["prompt_keys"] == [qwen.prompt_key(i) for i in qwen.prompts(None, 2)]
    rows = {(r["method"], r["kind"]): r for r in merged["rows"]}
    # hf: 6 prompts x 8 tokens over 3 x 2 s (shard 1) + 3 x 3 s (shard 2)
    assert rows[("hf", "all")]["tokens"] == 48 and rows[("hf", "all")]["seconds"] == 15.0
    assert rows[("hf-packed", "all")]["tokens_per_s"] == round(48 / 9.0, 2)
    spec = rows[("spec", "all")]
    assert spec["tau"] == 4.0 and spec["steps"] == 12 and spec["greedy_equal_hf-packed"] == "6/6"
    assert spec["acceptance_by_depth"] == [0.5, 0.5]   # depth 2 only from shard 2: 3 x 1 of 3 x 2
    assert merged["wall_minutes"] == 2.0 and merged["config"]["shards"] == {"2/2": 2.0, "1/2": 1.0}
    assert merged["config"]["reduced"]          # --per-kind 2 is a reduced selection
    qwen.save(tmp_path / "merged", merged)
    text = (tmp_path / "merged.md").read_text()
    assert "2 shards side by side" in text and "6 prompts" in text


def test_a_shard_cut_short_merges_as_the_prompts_it_measured(qwen):
    merged = qwen.merge([shard_result(qwen, 1), shard_result(qwen, 2, done=1)], "cut short")
    assert merged["config"]["prompts"] == 4 and merged["config"]["reduced"]
    rows = {(r["method"], r["kind"]): r for r in merged["rows"]}
    assert rows[("hf", "all")]["tokens"] == 32


def test_a_run_of_one_kind_selects_and_merges_that_kind_only(qwen):
    edits = qwen.prompts(None, None, ("code-edit",))
    assert edits and {k for k, _ in edits} == {"code-edit"}
    assert [t for _, t in edits] == [t for k, t in qwen.prompts(None) if k == "code-edit"]
    merged = qwen.merge([shard_result(qwen, 1, kinds=("code-edit",)), shard_result(qwen, 2, kinds=("code-edit",))],
                        "edits")
    assert merged["config"]["prompt_kinds"] == {"code-edit": 2} and merged["config"]["reduced"]
    assert merged["config"]["selection"]["kinds"] == ["code-edit"]
    with pytest.raises(ValueError, match="choose from"):
        qwen.prompts(None, None, ("poetry",))
    assert qwen.parse_kinds(" code-edit, coding ") == ("code-edit", "coding")
    with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
        qwen.parse_kinds("code-edit,poetry")


def test_merge_refuses_shards_of_different_runs(qwen):
    with pytest.raises(ValueError, match="1/N ... N/N"):
        qwen.merge([shard_result(qwen, 1), shard_result(qwen, 1)], "same shard twice")
    with pytest.raises(ValueError, match="different options"):
        qwen.merge([shard_result(qwen, 1), shard_result(qwen, 2, seed=1)], "other seed")
    with pytest.raises(ValueError, match="at least two"):
        qwen.merge([shard_result(qwen, 1)], "alone")


@pytest.mark.parametrize("text", ["2", "0/2", "3/2", "a/b"])
def test_bad_shard_names_the_form(qwen, text):
    with pytest.raises(ValueError, match="--shard"):
        qwen.parse_shard(text)


def test_pools_split_off_the_prefill_only_where_every_run_timed_it(qwen):
    from harness import Pool
    from treespec.runtime.generator import GenerationStats

    llama = Pool()
    llama.add_run(10, 5.0, prefill=1.0, prompt_tokens=100)
    llama.add_run(10, 5.0, prefill=3.0, prompt_tokens=100)
    row = llama.row(None)
    assert row["decode_tokens_per_s"] == round(20 / 6.0, 2) and row["prefill_ms_per_prompt_token"] == 20.0
    ours = Pool()
    ours.add_stats(GenerationStats(new_tokens=8, steps=4, prompt_tokens=50, prefill_time=0.5, verify_time=1.5))
    assert ours.row(None)["decode_tokens_per_s"] == round(8 / 1.5, 2)
    assert ours.row(None)["prefill_ms_per_prompt_token"] == 10.0
    hf = Pool()
    hf.add_run(10, 5.0)                                   # HF generate: no split
    assert "decode_tokens_per_s" not in hf.row(None)
    assert llama.merged(hf).prefill is None and llama.merged(llama).prefill == 8.0
    old = {k: v for k, v in llama.state().items() if k not in ("prefill", "prompt_tokens")}
    assert Pool.from_state(old).prefill is None           # saved before prefills were counted: unknown, not 0
    lines = qwen.goals([{"method": "llama.cpp plain", "temperature": 0.0, "kind": "all", **llama.row(None)},
                        {"method": "spec", "temperature": 0.0, "kind": "all", **ours.row(None)}])
    goal = next(line for line in lines if line.startswith("| T = 0, all prompts, over llama.cpp's plain"))
    assert f"| {8 / 1.5 / (20 / 6.0):.2f}x | 10.0 / 20.0 | 25% |" in goal


def test_a_run_at_another_thread_count_is_kept_whole_as_a_section(qwen, tmp_path):
    merged = qwen.merge([shard_result(qwen, 1), shard_result(qwen, 2)], "two shards")
    other = shard_result(qwen, 1, n=1)
    other["config"]["threads"] = 2
    both = qwen.with_runs(merged, [other])
    assert both["other_runs"] == [other] and both["rows"] == merged["rows"]
    qwen.save(tmp_path / "r", both)
    text = (tmp_path / "r.md").read_text()
    assert text.count("## Goals") == 2 and "# 2 threads (REDUCED configuration)" in text
    assert text.index("# 2 threads") > text.index("## Goals")      # after the result's own tables
    with pytest.raises(ValueError, match="two runs at 1 thread"):
        qwen.with_runs(merged, [shard_result(qwen, 1, n=1)])     # a second 1-thread run is a shard's job
    elsewhere = {**other, "state": {**other["state"], "options": {**other["state"]["options"], "cpu": "another"}}}
    with pytest.raises(ValueError, match="one machine kind"):
        qwen.with_runs(merged, [elsewhere])


def test_the_result_names_the_physical_limit_of_a_pass(qwen):
    merged = qwen.merge([shard_result(qwen, 1), shard_result(qwen, 2)], "two shards")
    assert merged["config"]["limit"] is None and qwen.physical_limit(merged) == []
    merged["config"]["limit"] = {"pass_bytes": 1.02e9, "read_bytes_per_s": 1.2e10}
    merged["rows"].append({"method": "plain", "kind": "all", "temperature": 0.0, "steps": 10, "verify_ms_per_step": 109.4})
    line = qwen.physical_limit(merged)[0]
    assert "reads 1.02 GB" in line and "12.0 GB/s, that is 85 ms" in line and "pass took 109 ms" in line
    assert "the other shards running" in line
