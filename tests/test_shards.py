"""Feature shards: extraction streams, shards by tokens, resumes from its manifest without redoing
or duplicating a shard, splits across ranks; training streams them with bounded memory, stops on
a token limit and writes learning-curve checkpoints. Tiny random target, synthetic source."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from treespec.targets.loader import tiny_target
from treespec.train.loop import TrainConfig, train_drafter
from treespec.train.recipes import RecipeConfig
from treespec.train.shards import (
    ShardConfig, ShardSet, ShardStream, autocast_dtype, extract, finalize, log_points, parse_tokens,
    read_manifest,
)

from _shards import (  # noqa: F401  (target, held: shared fixtures)
    V, held, heldout_config, make_shards, shard_config, synthetic_source, target,
)
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)


@pytest.fixture(scope="module")
def shards(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    make_shards(target, d)
    return d


def _same_shards(a, b, n: int) -> None:
    for s in range(n):
        x = load_file(a / f"shard_{s:05d}.safetensors")
        y = load_file(b / f"shard_{s:05d}.safetensors")
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), (s, k)


def _records(manifest: dict) -> list[dict]:
    """Shard records without the timings (which differ between runs)."""
    return [{k: v for k, v in r.items() if k not in ("wall_s", "cpu_s")} for r in manifest["shards"]]


# ---------------------------------------------------------------------------------- extraction
def test_manifest_records_tokens_offsets_fingerprint_dtype(target, shards):
    m = read_manifest(shards)
    cfg = shard_config()
    assert m["fingerprint"] and m["autocast"] == "float32" and m["source"] == "synthetic"
    assert m["tokens"] == sum(r["tokens"] for r in m["shards"]) >= cfg.tokens
    assert m["tokens"] - m["shards"][-1]["tokens"] < cfg.tokens           # no shard past the limit
    assert all(r["tokens"] >= cfg.shard_tokens for r in m["shards"])     # fixed size (the source did not run out)
    assert m["shards"][0]["first_record"] == 0
    for a, b in zip(m["shards"], m["shards"][1:]):                        # contiguous source offsets
        assert a["end_record"] <= b["first_record"] and b["shard"] == a["shard"] + 1
    x = load_file(shards / "shard_00001.safetensors")
    r = m["shards"][1]
    assert x["tokens"].shape[0] == r["tokens"] == int(x["offsets"][-1])
    assert x["h2"].shape == (r["tokens"], 32) and x["h2"].dtype == torch.float16
    assert x["top_i"].shape == (r["tokens"], 8) and x["reply_start"].shape == (r["sequences"],)
    assert int(x["top1_count"].sum()) == r["tokens"]
    # the first sequence of shard 1 is the source's example at its first record
    first = next(synthetic_source()(r["first_record"]))
    assert x["tokens"][: int(x["offsets"][1])].tolist() == first.ids


def test_interrupted_extraction_resumes_without_redoing_or_duplicating(target, shards, tmp_path):
    first = make_shards(target, tmp_path, stop_after=2)
    assert first.computed == [0, 1] and not first.exhausted
    assert [r["shard"] for r in read_manifest(tmp_path)["shards"]] == [0, 1]
    stamp = (tmp_path / "shard_00000.safetensors").stat().st_mtime_ns
    rest = make_shards(target, tmp_path)
    n = len(read_manifest(shards)["shards"])
    assert rest.computed == list(range(2, n)) and rest.skipped == []      # read from shard 1's end record
    assert (tmp_path / "shard_00000.safetensors").stat().st_mtime_ns == stamp
    assert _records(read_manifest(tmp_path)) == _records(read_manifest(shards))
    _same_shards(shards, tmp_path, n)
    again = make_shards(target, tmp_path)                                   # complete: nothing to do
    assert again.computed == [] and sorted(tmp_path.glob("shard_*")) == sorted(tmp_path.glob("shard_*.safetensors"))


def test_a_shard_missing_from_the_manifest_is_adopted_not_recomputed(target, shards, tmp_path):
    make_shards(target, tmp_path, stop_after=3)
    m = read_manifest(tmp_path)
    m["shards"] = m["shards"][:1]                     # killed after writing shards 1, 2 but not the manifest
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    rest = make_shards(target, tmp_path)
    assert 1 not in rest.computed and 2 not in rest.computed and rest.computed[0] == 3
    assert _records(read_manifest(tmp_path)) == _records(read_manifest(shards))


def test_ranks_extract_disjoint_shards_that_together_equal_one_process(target, shards, tmp_path):
    r0 = make_shards(target, tmp_path, rank=0, world=2)
    r1 = make_shards(target, tmp_path, rank=1, world=2)
    n = len(read_manifest(shards)["shards"])
    assert r0.computed == list(range(0, n, 2)) and r1.computed == list(range(1, n, 2))
    assert _records(finalize(tmp_path)) == _records(read_manifest(shards))
    _same_shards(shards, tmp_path, n)


def test_a_larger_token_limit_extends_the_extraction(target, shards, tmp_path):
    small = make_shards(target, tmp_path, shard_config(tokens=300))
    more = make_shards(target, tmp_path, shard_config(tokens=600))
    assert more.computed and min(more.computed) == small.shards and not set(more.computed) & set(small.computed)
    assert _records(read_manifest(tmp_path)) == _records(read_manifest(shards))


def test_extraction_refuses_another_target_config_or_dtype(target, shards, tmp_path):
    make_shards(target, tmp_path, stop_after=1)
    with pytest.raises(ValueError, match="fingerprint"):
        make_shards(tiny_target(vocab_size=V, seed=1), tmp_path)
    with pytest.raises(ValueError, match="config"):
        make_shards(target, tmp_path, dataclasses.replace(shard_config(), top_k=4))
    with pytest.raises(ValueError, match="autocast"):
        extract(target, shard_config(), tmp_path, synthetic_source(), source_name="synthetic",
                autocast_mode="bf16", progress=False)


def test_bf16_autocast_is_recorded_and_changes_the_features(target, shards, tmp_path):
    extract(target, shard_config(tokens=100), tmp_path, synthetic_source(), source_name="synthetic",
            autocast_mode="bf16", progress=False)
    m = read_manifest(tmp_path)
    assert m["autocast"] == "bfloat16" and m["autocast_reason"] == "requested"
    a = load_file(shards / "shard_00000.safetensors")["h2"].float()
    b = load_file(tmp_path / "shard_00000.safetensors")["h2"].float()
    assert a.shape == b.shape and 0 < (a - b).abs().max() < 0.2 * a.abs().max()


def test_autocast_auto_follows_native_bf16():
    from treespec.fastpath.packing import native_bf16

    dtype, why = autocast_dtype("auto", "cpu")
    assert (dtype == torch.bfloat16) == native_bf16("cpu")[0] and why.startswith("auto: ")
    assert autocast_dtype("fp32", "cpu")[0] == torch.float32
    with pytest.raises(ValueError, match="--autocast 'fp16'"):
        autocast_dtype("fp16", "cpu")


def test_parse_tokens_and_log_points():
    assert [parse_tokens(x) for x in ("3M", "500k", "1.5M", "1e6", "2G", 7)] == \
        [3_000_000, 500_000, 1_500_000, 1_000_000, 2_000_000_000, 7]
    for bad in ("3Q", "", "M", "-1M"):
        with pytest.raises(ValueError, match="--tokens"):
            parse_tokens(bad)
    with pytest.raises(ValueError, match="positive"):
        parse_tokens(0)
    with pytest.raises(TypeError, match="--tokens"):
        parse_tokens(3.5)
    pts = log_points(10_000_000, 5)
    assert pts[0] == 100_000 and pts[-1] == 10_000_000 and len(pts) == 5
    ratios = [b / a for a, b in zip(pts, pts[1:])]
    assert max(ratios) / min(ratios) < 1.01                                 # evenly spaced on a log scale
    with pytest.raises(ValueError, match="--curve"):
        log_points(100, 0)
    with pytest.raises(ValueError, match="shard_tokens"):
        ShardConfig(shard_tokens=0)


# ---------------------------------------------------------------------------------- reading
def test_streams_partition_shards_cover_each_sequence_once_per_epoch_and_bound_memory(shards):
    sset = ShardSet(shards)
    n_seq = sum(r["sequences"] for r in sset.records)
    streams = [ShardStream(sset, k, 2, 2, seed=0) for k in range(2)]
    assert set(streams[0].own) | set(streams[1].own) == set(range(len(sset)))
    assert not set(streams[0].own) & set(streams[1].own)
    seen = []
    for st in streams:
        loads = sset.loads
        for n in range(st.epoch_rows // 2):
            b = st.batch(n)
            assert len(st.cache) <= 2
            seen += [tuple(row[v].tolist()) for row, v in zip(b.tokens, b.valid)]
        assert sset.loads - loads == len(st.own)             # every shard read once per epoch, in turn
    assert len(seen) == n_seq - sum(st.epoch_rows % 2 for st in streams) and len(set(seen)) == len(seen)
    # random access: batch n of a fresh stream == batch n of one that walked there; epochs differ
    fresh = ShardStream(ShardSet(shards), 1, 2, 2, seed=0)
    n = streams[1].epoch_rows // 2 - 1
    assert torch.equal(fresh.batch(n).tokens, streams[1].batch(n).tokens)
    assert not torch.equal(fresh.batch(0).tokens, fresh.batch(streams[1].epoch_rows // 2).tokens)
    with pytest.raises(ValueError, match="fewer than the 99 data streams"):
        ShardStream(sset, 98, 99, 2, seed=0)


# ---------------------------------------------------------------------------------- training
def _cfg(**kw) -> TrainConfig:
    return TrainConfig(batch_size=2, max_len=32, warmup=2, save_every_s=1e9, minutes=0,
                       recipe=RecipeConfig(draft_vocab=16, frequent=8, subset_top=4, medusa_heads=3), **kw)


def test_token_limit_stops_and_writes_curve_checkpoints(target, shards, held, tmp_path):
    from treespec.drafters import load_drafter
    import treespec.drafters.eagle  # noqa: F401

    card = train_drafter("eagle3", target, tmp_path, _cfg(tokens=400, curve=(40, 150, 400)), shards=shards,
                         cache_root=held, heldout=heldout_config(), progress=False)
    per_step_max = 2 * 32
    assert 400 <= card["train"]["tokens_seen"] < 400 + per_step_max
    # the shards were extracted in fp32 (asked for); training autocasts as --autocast auto chooses on this CPU
    trained_in = str(autocast_dtype("auto", "cpu")[0]).removeprefix("torch.")
    assert card["data"]["shards"]["autocast"] == "float32" and card["train"]["autocast"] == trained_in
    assert str(tmp_path) not in json.dumps(card) and str(shards) not in json.dumps(card)
    curve = sorted((tmp_path / "curve").glob("eagle3.tokens*.safetensors"))
    assert [p.name for p in curve] == [f"eagle3.tokens{t:011d}.safetensors" for t in (40, 150, 400)]
    seen = []
    for p, point in zip(curve, (40, 150, 400)):
        c = json.loads(p.with_suffix(".json").read_text())
        assert point <= c["train"]["tokens_seen"] < point + per_step_max and c["recipe"]["draft_vocab"] == 16
        assert c["train"]["cpu_hours"] > 0 and c["checksum"]
        seen.append(c["train"]["steps_done"])
        load_drafter("eagle3", target, checkpoint=str(p))
    assert seen == sorted(seen) and seen[0] < seen[-1]


def test_shard_training_resumes_exactly(target, shards, held, tmp_path):
    """Interrupted + resumed == uninterrupted, with two parts per step (grad_accum)."""
    kw = dict(shards=shards, cache_root=held, heldout=heldout_config(), progress=False)
    cfg = _cfg(tokens=300, grad_accum=2, curve=(100,))
    train_drafter("medusa", target, tmp_path / "a", cfg, **kw)
    assert train_drafter("medusa", target, tmp_path / "b", cfg, interrupt_after=2, **kw) is None
    train_drafter("medusa", target, tmp_path / "b", cfg, **kw)
    for name in ("medusa.safetensors", "curve/medusa.tokens00000000100.safetensors"):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="--grad-accum"):
        train_drafter("medusa", target, tmp_path / "b", _cfg(tokens=600), **kw)
    grown = tmp_path / "grown"                   # the extraction grew since the state was saved
    make_shards(target, grown, shard_config(tokens=300))
    train_drafter("medusa", target, tmp_path / "c", cfg, interrupt_after=1, **{**kw, "shards": grown})
    make_shards(target, grown)
    with pytest.raises(ValueError, match="data order would change"):
        train_drafter("medusa", target, tmp_path / "c", cfg, **{**kw, "shards": grown})


def test_shard_only_options_need_shards(target, tmp_path):
    with pytest.raises(ValueError, match="--shards"):
        train_drafter("medusa", target, tmp_path, _cfg(tokens=100))
    with pytest.raises(ValueError, match="grad_accum"):
        train_drafter("medusa", target, tmp_path, _cfg(grad_accum=0))


def test_cli_refuses_bad_limits_before_loading_anything(tmp_path, capsys):
    from treespec.train.cli import curve_points, main

    # a token limit is an online or a shard run's; the in-memory cache runs by minutes or steps
    assert main(["eagle3", "--out", str(tmp_path), "--cache", "--tokens", "3M"]) == 2
    assert "need online data or --shards DIR" in capsys.readouterr().err
    for bad, says in ((["--extract-tokens", "1M"], "add --shards DIR"), (["--sequences", "64"], "add --cache"),
                      (["--online", "--cache"], "drop --shards / --cache"), (["--procs", "0"], "--procs must be"),
                      (["--regenerate", "0"], "add --shards DIR"), (["--cache", "--shards", "x"], "choose one"),
                      (["--data", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
                      (["--data", str(tmp_path), "--cache"], "drop --shards / --cache")):
        assert main(["eagle3", "--out", str(tmp_path), *bad]) == 2
        assert says in capsys.readouterr().err, bad
    assert main(["eagle3", "--out", str(tmp_path), "--shards", str(tmp_path), "--tokens", "3Q"]) == 2
    assert "--tokens '3Q' is not a token count" in capsys.readouterr().err
    assert curve_points("5", 10_000_000) == log_points(10_000_000, 5)
    assert curve_points("100k,1M", 0) == (100_000, 1_000_000)
    with pytest.raises(ValueError, match="give --tokens"):
        curve_points("5", 0)


def test_regenerated_replies_are_the_targets_own_greedy_continuations(target, shards, tmp_path):
    cfg = dataclasses.replace(shard_config(tokens=100), regenerate=0.0)
    make_shards(target, tmp_path, cfg)
    m = read_manifest(tmp_path)
    assert m["config"]["regenerate"] == 0.0 and "regenerate" not in read_manifest(shards)["config"]
    ref = read_manifest(shards)["shards"][0]
    r = m["shards"][0]
    assert (r["first_record"], r["end_record"], r["source_tokens"]) == \
        (ref["first_record"], ref["end_record"], ref["source_tokens"])        # same boundaries
    x = load_file(tmp_path / "shard_00000.safetensors")
    a, e, start = int(x["offsets"][0]), int(x["offsets"][1]), int(x["reply_start"][0])
    seq = x["tokens"][a:e].tolist()
    original = next(synthetic_source()(r["first_record"]))
    assert seq[:start] == original.ids[:start] and len(seq) <= len(original.ids)
    want = seq[:start]
    with torch.no_grad():
        while len(want) < len(seq):                                          # plain greedy decoding
            want.append(int(target.model(torch.tensor([want])).logits[0, -1].argmax()))
    assert seq == want and seq != original.ids
    with pytest.raises(ValueError, match="regenerate"):
        ShardConfig(regenerate=-1.0)


class _CharTokenizer:
    """Characters as ids, with a one-line chat template (enough for the exchange filter)."""

    chat_template = "user: {text}\nassistant: "

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return self(self.chat_template.format(text=messages[0]["content"]))["input_ids"]


def test_sharegpt_source_first_or_all_exchanges_with_offsets(monkeypatch):
    import treespec.data
    from treespec.data import Conversation
    from treespec.train.shards import PAIR_STRIDE, sharegpt_source

    reply = "r" * 40
    convs = [Conversation("a", (("user", "q0"), ("assistant", reply), ("user", "q1"), ("assistant", reply))),
             Conversation("b", (("user", "q2"), ("assistant", "short"))),                 # reply too short
             Conversation("c", (("user", "q3"), ("assistant", reply), ("user", "q4"), ("assistant", reply)))]
    monkeypatch.setattr(treespec.data, "sharegpt_conversations", lambda min_turns: iter(convs))
    tok = _CharTokenizer()

    def users(cfg, start=0, exclude=(0, 0)):
        return [(ex.record, tok.decode(ex.ids[: ex.reply_start])) for ex in sharegpt_source(tok, cfg, exclude)(start)]

    first = ShardConfig(min_response=20)         # "short" + "<|im_end|>" = 15 characters
    assert [r for r, _ in users(first)] == [0, 2] and "q3" in users(first)[1][1]
    everything = dataclasses.replace(first, exchanges="all")
    got = users(everything)
    assert [r for r, _ in got] == [0, 1, 2 * PAIR_STRIDE, 2 * PAIR_STRIDE + 1]
    assert [u.split()[1] for _, u in got] == ["q0", "q1", "q3", "q4"]
    assert [r for r, _ in users(everything, start=1)] == [1, 2 * PAIR_STRIDE, 2 * PAIR_STRIDE + 1]   # resume
    assert [r for r, _ in users(everything, exclude=(2, 3))] == [0, 1]             # held-out conversations
    assert "exchanges" not in first.key() and everything.key()["exchanges"] == "all"
    with pytest.raises(ValueError, match="exchanges"):
        ShardConfig(exchanges="some")
