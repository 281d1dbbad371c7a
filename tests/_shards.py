"""Test helpers for training data: synthetic exchanges, feature shards and held-out caches made
with a tiny random target (no tokenizer, no ShareGPT)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from treespec.targets.loader import tiny_target
from treespec.train.data import DataConfig, _chunk, cache_dir
from treespec.train.online import OnlineData
from treespec.train.shards import Example, ShardConfig, extract

V = 32
LAYERS = (0, 1, 2)      # every hidden_states index of the 2-layer tiny Llama


def synthetic_source(seed: int = 0, records: int = 10_000):
    """A deterministic source: record r -> 20..32 random ids (reply from id 6); every 7th record
    does not qualify (as ShareGPT's non-English or short exchanges), so records have gaps."""

    def stream(start: int):
        for r in range(start, records):
            if r % 7 == 3:
                continue
            g = torch.Generator().manual_seed(seed * 100_003 + r)
            n = int(torch.randint(20, 33, (1,), generator=g))
            yield Example(r, torch.randint(3, V, (n,), generator=g).tolist(), 6)

    return stream


def shard_config(tokens: int = 600, shard_tokens: int = 128) -> ShardConfig:
    return ShardConfig(tokens=tokens, shard_tokens=shard_tokens, max_len=32, layers=LAYERS, top_k=8)


def make_shards(target, directory: Path, cfg: ShardConfig | None = None, **kw):
    return extract(target, cfg or shard_config(), directory, synthetic_source(), source_name="synthetic",
                   autocast_mode="fp32", progress=False, **kw)


def synthetic_cache(target, cfg: DataConfig, root, seed: int) -> None:
    """Random-token 'exchanges' with the tiny target's features, written like build_cache does."""
    g = torch.Generator().manual_seed(seed)
    out = cache_dir(target, cfg, root)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for _ in range(cfg.sequences):
        n = int(torch.randint(20, 33, (1,), generator=g))
        rows.append((torch.randint(3, V, (n,), generator=g).tolist(), 6))
    for c in range(0, cfg.sequences, cfg.chunk_size):
        save_file(_chunk(target, cfg, rows[c:c + cfg.chunk_size]), out / f"chunk_{c // cfg.chunk_size:05d}.safetensors")


def heldout_config() -> DataConfig:
    return DataConfig(split="heldout", sequences=8, max_len=32, layers=LAYERS, top_k=8, chunk_size=8)


def online_data(records: int = 10_000, window: int = 16) -> OnlineData:
    """Online training data from :func:`synthetic_source` (windows of 16 examples)."""
    return OnlineData(source=synthetic_source(records=records), name="synthetic", top_k=8, window=window,
                      sort_groups=2)


@pytest.fixture(scope="module")
def target():
    """The tiny random target the training tests share (imported by the test modules)."""
    return tiny_target(vocab_size=V, seed=0)


@pytest.fixture(scope="module")
def held(target, tmp_path_factory):
    """A cache root holding the synthetic held-out split the cards are measured on."""
    root = tmp_path_factory.mktemp("held")
    synthetic_cache(target, heldout_config(), root, 1)
    return root
