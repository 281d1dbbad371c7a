"""Online distillation: the target runs over each step's sequences and its features are used at
once. Checked against the offline (feature-shard) path, through interruptions, and on restart
from the small portable state that a long run commits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from treespec.train.loop import TrainConfig, lr_at, portable_paths, train_drafter
from treespec.train.online import OnlineData, OnlineStream, part_batch
from treespec.train.recipes import RecipeConfig, make_recipe
from treespec.train.shards import ShardSet, pack_batch

from _shards import (  # noqa: F401  (target, held: shared fixtures)
    LAYERS, V, held, heldout_config, make_shards, online_data, shard_config, synthetic_source, target,
)
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)


def _cfg(**kw) -> TrainConfig:
    base = dict(batch_size=2, max_len=32, warmup=2, save_every_s=1e9, minutes=0, autocast="fp32",
                recipe=RecipeConfig(draft_vocab=16, frequent=8, subset_top=4, medusa_heads=3))
    return TrainConfig(**{**base, **kw})


def _fp32_weights(out, kind: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(out / f"{kind}.train.safetensors").items() if k.startswith("model.")}


# ---------------------------------------------------------------------------------- data
def test_an_online_batch_is_the_offline_batch_of_the_same_sequences(target, tmp_path):
    """The features an online step computes are those feature-shard extraction stores, bit for
    bit, and one training step on either batch gives the same weights (to 1e-6 in fp32)."""
    make_shards(target, tmp_path, shard_config(tokens=120, shard_tokens=200))
    shard = ShardSet(tmp_path).load(0)
    rows = [ex for ex, _ in zip(synthetic_source()(0), range(4))]
    offline = pack_batch([(shard, int(shard["offsets"][r]), int(shard["offsets"][r + 1]),
                           int(shard["reply_start"][r])) for r in range(4)], LAYERS, 32)
    online = part_batch(target, rows, LAYERS, 8, 32, torch.float32)
    for name in ("tokens", "valid", "reply", "top_i", "top_p"):
        assert torch.equal(getattr(online, name), getattr(offline, name)), name
    assert all(torch.equal(online.hidden[l], offline.hidden[l]) for l in LAYERS)

    freq = torch.arange(V)
    weights = []
    for batch in (offline, online):
        recipe = make_recipe("eagle3", target, _cfg().recipe, freq)
        model = recipe.build(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        recipe.loss(model, batch, 0.0)[0].backward()
        opt.step()
        weights.append(model.state_dict())
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0]) <= 1e-6
    # the comparison can fail: the next sequences give other features and another step
    other = part_batch(target, [ex for ex, _ in zip(synthetic_source()(10), range(4))], LAYERS, 8, 32,
                       torch.float32)
    assert not torch.equal(other.hidden[LAYERS[-1]], online.hidden[LAYERS[-1]])


def test_the_stream_continues_from_its_cursor_across_windows_and_epochs():
    data = online_data(records=70, window=16)              # 60 examples: windows of 16, a short last one
    whole = OnlineStream(data, parts=2, batch_size=3, seed=5)
    batches, cursors = [], []
    for step in range(30):
        cursors.append(dict(whole.cursor))
        batches.append([ex.record for ex in whole.next(step)])
    assert whole.cursor["epoch"] >= 1                  # the source ran out and started over
    assert all(len(b) == 6 for b in batches)
    # windows of 16, 16, 16 and 12 examples hold 2 global batches of 6 each (the rest waits an epoch)
    epochs = [c["epoch"] for c in cursors[1:]] + [whole.cursor["epoch"]]
    assert epochs[:8] == [0] * 8 and epochs[8] == 1
    one_epoch = [r for b in batches[:8] for r in b]
    assert len(set(one_epoch)) == len(one_epoch)       # no example twice within an epoch
    for k in (1, 7, 12, 23):
        resumed = OnlineStream(data, parts=2, batch_size=3, seed=5, cursor=cursors[k])
        assert [[ex.record for ex in resumed.next(s)] for s in range(k, 30)] == batches[k:]
    with pytest.raises(ValueError, match="stands at step 3"):
        resumed = OnlineStream(data, parts=2, batch_size=3, seed=5, cursor=cursors[3])
        resumed.next(4)
    other_seed = OnlineStream(data, parts=2, batch_size=3, seed=6)
    assert [ex.record for ex in other_seed.next(0)] != batches[0]


def test_parts_split_a_global_batch_of_similar_lengths():
    def median_span(sort_groups: int) -> int:
        data = OnlineData(source=synthetic_source(), name="synthetic", window=64, sort_groups=sort_groups)
        stream = OnlineStream(data, parts=2, batch_size=4, seed=0)
        spans = [max(len(e.ids) for e in r) - min(len(e.ids) for e in r) for r in map(stream.next, range(8))]
        return sorted(spans)[len(spans) // 2]

    stream = OnlineStream(online_data(window=64), parts=2, batch_size=4, seed=0)
    rows = stream.next(0)
    a, b = stream.part(rows, 0), stream.part(rows, 1)
    assert sorted(ex.record for ex in a + b) == sorted(ex.record for ex in rows) and len(a) == len(b) == 4
    # lengths are 20..32 in the source: sorted over the window's 8 global batches, each spans little
    assert median_span(8) <= 3 < median_span(1)


def test_online_data_refuses_bad_settings():
    with pytest.raises(ValueError, match="window"):
        OnlineData(source=synthetic_source(), window=0)
    with pytest.raises(ValueError, match="raise the window"):
        OnlineStream(online_data(window=4), parts=2, batch_size=4, seed=0)
    with pytest.raises(ValueError, match="fewer than a global batch"):
        OnlineStream(online_data(records=5), parts=1, batch_size=8, seed=0).next(0)


# ---------------------------------------------------------------------------------- training
def test_online_training_resumes_exactly_and_books_cpu_time(target, held, tmp_path):
    kw = dict(online=online_data(), cache_root=held, heldout=heldout_config(), progress=False)
    cfg = _cfg(tokens=400, grad_accum=2, curve=(150,))
    card = train_drafter("eagle3", target, tmp_path / "a", cfg, **kw)
    assert train_drafter("eagle3", target, tmp_path / "b", cfg, interrupt_after=3, **kw) is None
    train_drafter("eagle3", target, tmp_path / "b", cfg, **kw)
    a, b = _fp32_weights(tmp_path / "a", "eagle3"), _fp32_weights(tmp_path / "b", "eagle3")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert 400 <= card["train"]["tokens_seen"] < 400 + 4 * 32
    assert card["data"]["online"]["source"] == "synthetic" and "online" in card["data"]["source"]
    by_machine = card["train"]["cpu_hours_by_machine"]
    assert len(by_machine) == 1 and sum(by_machine.values()) == pytest.approx(card["train"]["cpu_hours"], abs=1e-5)
    assert (tmp_path / "a" / "curve" / "eagle3.tokens00000000150.safetensors").exists()
    with pytest.raises(ValueError, match="not both"):
        train_drafter("eagle3", target, tmp_path / "c", cfg, shards=tmp_path, **kw)
    with pytest.raises(ValueError, match="trained online"):   # the same --out, offline
        train_drafter("eagle3", target, tmp_path / "b", _cfg(tokens=800, grad_accum=2),
                      cache_root=held, heldout=heldout_config(), progress=False, shards=_shards(target, tmp_path))


def test_a_larger_token_budget_stretches_a_resumed_schedule(target, held, tmp_path, capsys):
    """Re-running a finished run with a larger --tokens continues it on a stretched schedule, not
    at the floor lr the old schedule had reached."""
    kw = dict(online=online_data(), cache_root=held, heldout=heldout_config(), progress=False)
    out = tmp_path / "run"
    first = train_drafter("eagle3", target, out, _cfg(tokens=200), **kw)
    steps = first["train"]["steps_done"]
    old_total = json.loads(portable_paths(out, "eagle3")[1].read_text())["total"]
    card = train_drafter("eagle3", target, out, _cfg(tokens=600), **kw)
    assert "the schedule is stretched" in capsys.readouterr().out
    assert 600 <= card["train"]["tokens_seen"] < 600 + 2 * 32
    total = json.loads(portable_paths(out, "eagle3")[1].read_text())["total"]
    assert total >= 2.5 * old_total
    cfg = _cfg(tokens=600)
    assert lr_at(steps, total, cfg) > 2 * lr_at(steps, old_total, cfg)       # off the floor
    again = train_drafter("eagle3", target, out, _cfg(tokens=600), **kw)     # done: nothing stretches
    assert "stretched" not in capsys.readouterr().out and again["train"]["steps_done"] == card["train"]["steps_done"]


def test_a_stretched_schedule_keeps_the_unroll_depth_reached(target, held, tmp_path, capsys):
    """The unroll curriculum reads the share of the schedule done; stretching the schedule for a
    larger --tokens must not send a head that trains at 3 depths back to 1 or 2."""
    kw = dict(online=online_data(), cache_root=held, heldout=heldout_config(), progress=False)
    out = tmp_path / "run"
    cfg = dict(recipe=RecipeConfig(draft_vocab=16, frequent=8, subset_top=4, unroll=3, unroll_ramp=0.5))
    train_drafter("eagle3", target, out, _cfg(tokens=200, **cfg), **kw)

    def depths() -> list[int]:        # unroll depth of every logged step (kd0, kd1, ... per depth)
        log = json.loads(portable_paths(out, "eagle3")[1].read_text())["log"]
        return [sum(k.startswith("kd") for k in row) for row in log]

    first, reached = depths(), json.loads(portable_paths(out, "eagle3")[1].read_text())["curriculum"]
    assert first[-1] == 3 and first[0] == 1            # the ramp ran 1 -> 3 in the first schedule
    train_drafter("eagle3", target, out, _cfg(tokens=800, **cfg), **kw)
    assert "the schedule is stretched" in capsys.readouterr().out
    later = depths()[len(first):]
    assert later and set(later) == {3}, later
    # the state records it, so a restart on another machine keeps it too
    assert json.loads(portable_paths(out, "eagle3")[1].read_text())["curriculum"] >= reached > 0.5


def _shards(target, tmp_path):
    make_shards(target, tmp_path / "shards", shard_config(tokens=600))
    return tmp_path / "shards"


def test_a_run_continues_from_the_portable_state_alone(target, held, tmp_path):
    """What a long run commits (weights, RNG, counters, data cursor; no optimizer) is enough to
    continue it on another machine: the same batches follow, with the lr warmed up again."""
    kw = dict(online=online_data(), cache_root=held, heldout=heldout_config(), progress=False)
    cfg = _cfg(steps=8, rewarm=4)
    whole = train_drafter("eagle3", target, tmp_path / "whole", cfg, **kw)
    out = tmp_path / "moved"
    assert train_drafter("eagle3", target, out, cfg, interrupt_after=5, **kw) is None
    weights, info = portable_paths(out, "eagle3")
    meta = json.loads(info.read_text())
    assert meta["step"] == 5 and meta["cursor"]["step"] == 5 and meta["weights_dtype"] == "float32"
    assert weights.stat().st_size < 2 * sum(v.numel() * 4 for v in _fp32_weights(out, "eagle3").values())
    (out / "eagle3.train.safetensors").unlink()          # another machine: only the committed files
    card = train_drafter("eagle3", target, out, cfg, **kw)
    assert card["train"]["steps_done"] == 8
    assert card["train"]["tokens_seen"] == whole["train"]["tokens_seen"]      # the same batches followed
    restarted, full = _fp32_weights(out, "eagle3"), _fp32_weights(tmp_path / "whole", "eagle3")
    assert any(not torch.equal(restarted[k], full[k]) for k in full)           # a fresh optimizer: not exact
    assert lr_at(5, 8, cfg, rewarm_from=5) == pytest.approx(lr_at(5, 8, cfg) / 4)
    assert lr_at(8, 8, cfg, rewarm_from=5) == pytest.approx(lr_at(8, 8, cfg))
    with pytest.raises(ValueError, match="batch_size 2 there, 4 here"):
        (out / "eagle3.train.safetensors").unlink()
        train_drafter("eagle3", target, out, _cfg(steps=12, batch_size=4), **kw)


def test_the_padded_pass_used_on_cuda_gives_the_per_sequence_features(target):
    """One right-padded forward per part (the CUDA path) computes what the per-sequence passes
    compute, up to the rounding of another matmul shape (rows stored in fp16: a last-bit flip)."""
    from treespec.train.data import target_pass
    from treespec.train.online import _padded_pass

    rows = [ex.ids for ex, _ in zip(synthetic_source()(0), range(4))]
    assert len({len(r) for r in rows}) > 1                     # padding is exercised
    for rec, ids in zip(_padded_pass(target, rows, LAYERS, 8), rows):
        ref = target_pass(target, ids, LAYERS, 8)
        for l in LAYERS:
            h, want = rec[f"h{l}"].float(), ref[f"h{l}"].float()
            assert h.shape == want.shape
            assert float((h - want).abs().max()) <= 2e-3 * float(want.abs().max())
        assert float((rec["top_p"].float() - ref["top_p"].float()).abs().max()) <= 1e-3
        assert torch.equal(rec["top_i"][:, 0], ref["top_i"][:, 0])


# ---------------------------------------------------------------------------------- data files
def test_example_files_round_trip_and_serve_records_from_a_start(tmp_path):
    from treespec.train.online import file_source, read_examples, write_examples
    from treespec.train.shards import Example

    rows = [ex for ex, _ in zip(synthetic_source()(0), range(9))]
    path = tmp_path / "data.jsonl"
    write_examples(path, rows[5:])
    write_examples(path, rows[:5])                                 # appended out of order
    assert read_examples(path) == rows                             # served by record
    assert list(file_source(path)(rows[4].record)) == rows[4:]
    assert list(file_source(path)(rows[-1].record + 1)) == []
    for bad, says in ((rows[:1], "twice"), ([Example(99, [1, 2, 3], 3)], "reply_start"),
                      ([Example(98, [1, 2, 3], 0)], "reply_start")):
        p = tmp_path / f"bad{len(says)}{bad[0].record}.jsonl"
        write_examples(p, rows[:2])
        write_examples(p, bad)
        with pytest.raises(ValueError, match=says):
            read_examples(p)
    p = tmp_path / "notjson.jsonl"
    p.write_text('{"record": 0, "ids": [1, 2], "reply_start": 1}\n{"record": 1, "ids": "ab"\n')
    with pytest.raises(ValueError, match=r"notjson.jsonl:2 is not an example"):
        read_examples(p)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no examples"):
        read_examples(tmp_path / "empty.jsonl")


def test_training_on_a_file_of_examples_equals_training_on_their_source(target, held, tmp_path):
    """``--data FILE``: the same examples read from a file train the same weights as read from the
    source that made them (and other examples train other weights)."""
    from treespec.train.online import file_source, write_examples

    rows = [ex for ex, _ in zip(synthetic_source()(0), range(64))]
    write_examples(tmp_path / "data.jsonl", rows)
    kw = dict(cache_root=held, heldout=heldout_config(), progress=False)
    cfg = _cfg(tokens=200)
    train_drafter("eagle3", target, tmp_path / "a", cfg, online=online_data(records=rows[-1].record + 1), **kw)
    from_file = OnlineData(source=file_source(tmp_path / "data.jsonl"), name="file", top_k=8, window=16,
                           sort_groups=2)
    train_drafter("eagle3", target, tmp_path / "b", cfg, online=from_file, **kw)
    write_examples(tmp_path / "other.jsonl", [ex for ex, _ in zip(synthetic_source(seed=1)(0), range(64))])
    other = OnlineData(source=file_source(tmp_path / "other.jsonl"), name="file", top_k=8, window=16, sort_groups=2)
    train_drafter("eagle3", target, tmp_path / "c", cfg, online=other, **kw)
    a, b, c = (_fp32_weights(tmp_path / d, "eagle3") for d in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_batched_regeneration_is_one_at_a_time_greedy_decoding(target):
    """``regenerate_batch``: one left-padded generate over prompts of different lengths gives each
    prompt the greedy reply ``regenerate`` gives it alone, capped at the original reply's length."""
    from treespec.train.shards import Example, regenerate, regenerate_batch

    rows = [Example(ex.record, ex.ids, 3 + i % 5) for i, (ex, _) in enumerate(zip(synthetic_source()(0), range(6)))]
    assert len({ex.reply_start for ex in rows}) > 1 and len({len(ex.ids) for ex in rows}) > 1   # padding, caps
    batched = regenerate_batch(target, rows, 0.0)
    assert batched == [regenerate(target, ex, 0.0) for ex in rows]
    assert all(len(b.ids) <= len(ex.ids) and b.ids[: ex.reply_start] == ex.ids[: ex.reply_start]
               for b, ex in zip(batched, rows))
    assert [b.ids for b in batched] != [ex.ids for ex in rows]        # the replies are the target's
    assert regenerate_batch(target, [], 0.0) == []
