"""Feature shards: streamed, resumable target-feature extraction and bounded-memory reading.

Glossary:
    example    one training sequence from a *source*: its ``record`` (index in the source's
               stream: the offset a manifest records), token ``ids`` and ``reply_start``.
    source     ``start_record -> Iterator[Example]``, deterministic: ShareGPT through the chat
               template (:func:`sharegpt_source`), or synthetic ids in tests.
    shard      consecutive examples packed until they hold >= ``shard_tokens`` tokens (an example
               is never split; only the last shard may be smaller), stored packed, no padding, in
               ``shard_{s:05d}.safetensors`` (N tokens, S sequences):
                   tokens [N] int32; h{l} [N, H] fp16 for each layer l; top_i [N, K] int32 and
                   top_p [N, K] fp16 (the target's T = 1 law of token t + 1); offsets [S + 1]
                   (sequence r is rows offsets[r]:offsets[r + 1]); reply_start [S] (in-sequence);
                   top1_count [V] (how often each id is the target's top-1: EAGLE-3's draft
                   vocabulary and the KD candidate set, summed over shards without reading them).
               Boundaries depend on the source and the config only, never on who computes a
               shard: with W extracting processes, rank r computes the shards s with s % W == r.
    manifest   ``manifest.json``: config, target name and fingerprint, autocast dtype and why,
               excluded (held-out) records, and one record per finished shard (sequences, tokens,
               reply tokens, first / end source record, wall and CPU seconds). A shard file is
               written to a temp name then renamed, with its record in its own safetensors header;
               the manifest is rewritten after each shard. A shard file the manifest lacks (killed
               between the two writes, or written by another rank) is adopted from its header, so
               nothing is computed twice and shard ids never collide.
    stream     (reading) stream k of ``parts`` owns the shards s with s % parts == k; each epoch it
               visits them in a seeded order, rows shuffled within a shard, and serves batches of
               consecutive rows. Batch n is found from n alone (resume needs no replay) and at most
               two shards of a stream are in memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from treespec.train.data import DEFAULT_LAYERS, Batch, DataConfig, indexed_exchanges, target_pass

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Example:
    record: int
    ids: list[int]
    reply_start: int


Source = Callable[[int], Iterator[Example]]


@dataclass(frozen=True)
class ShardConfig:
    """What goes into a shard directory (every field but ``tokens`` must match to resume)."""

    tokens: int = 10_000_000      # extract until the shards hold at least this many tokens
    shard_tokens: int = 1 << 16   # tokens per shard (65536 ~ 300 MB with 4 layers of H = 576)
    max_len: int = 256            # tokens per sequence (prompt + reply), at most
    user_tokens: int = 96         # the user turn's text is cut to this many tokens
    min_response: int = 32        # skip exchanges whose reply keeps fewer tokens than this
    layers: tuple[int, ...] = DEFAULT_LAYERS
    top_k: int = 32               # kept entries of the target's distribution per position
    heldout_reserve: int = 256    # held-out exchanges (from DataConfig.heldout_offset) never trained on
    exchanges: str = "first"      # "first": each conversation's first user turn + reply; "all": every
                                  # user -> assistant pair as its own sequence (no earlier turns)
    regenerate: float | None = None   # None: ShareGPT's replies; T >= 0: the target's own reply at
                                      # temperature T (0 = greedy), as EAGLE-3 / HASS train (see regenerate)

    def __post_init__(self):
        if self.exchanges not in ("first", "all"):
            raise ValueError(f"ShardConfig.exchanges must be 'first' or 'all', got {self.exchanges!r}")
        if self.regenerate is not None and (not isinstance(self.regenerate, (int, float)) or self.regenerate < 0):
            raise ValueError(f"ShardConfig.regenerate must be None or a temperature >= 0, got {self.regenerate!r}")
        for name in ("tokens", "shard_tokens", "max_len", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ShardConfig.{name} must be a positive int, got {value!r}")

    def key(self) -> dict:
        """The fields a resumed extraction must share (``tokens`` may grow: it extends). Optional
        modes are left out while off, so directories made before a mode existed stay valid."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if k != "tokens" and (k, v) not in (("regenerate", None), ("exchanges", "first"))}

    def exchange_config(self) -> DataConfig:
        return DataConfig(max_len=self.max_len, user_tokens=self.user_tokens, min_response=self.min_response)


def parse_tokens(text: str | int, name: str = "--tokens") -> int:
    """``"3M"``, ``"500k"``, ``"1.5M"``, ``"2G"``, ``"1e6"`` or an int -> a positive token count."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    elif isinstance(text, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kKmMgG]?)\s*", text)
        if m is None:
            raise ValueError(f"{name} {text!r} is not a token count; write e.g. 3M, 500k, 1.5M or 3000000")
        value = int(round(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2).lower()]))
    else:
        raise TypeError(f"{name} must be a str like '3M' or an int, got {type(text).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


def log_points(total: int, count: int, first_share: float = 0.01) -> tuple[int, ...]:
    """``count`` token counts log-spaced from ``first_share * total`` to ``total`` (learning curve)."""
    if count < 1:
        raise ValueError(f"--curve must be >= 1 point, got {count}")
    if count == 1:
        return (total,)
    lo = math.log(first_share * total)
    step = (math.log(total) - lo) / (count - 1)
    return tuple(sorted({int(round(math.exp(lo + i * step))) for i in range(count)}))


# ---------------------------------------------------------------------------------- sources
def heldout_records(tokenizer, heldout: DataConfig, reserve: int) -> tuple[int, int]:
    """[first, end) ShareGPT records spanning the first ``reserve`` held-out exchanges of ``heldout``."""
    first = None
    for seen, (record, _, _) in enumerate(indexed_exchanges(tokenizer, heldout)):
        if seen == heldout.heldout_offset:
            first = record
        if seen == heldout.heldout_offset + reserve - 1:
            return first, record + 1
    raise ValueError("ShareGPT has fewer exchanges than the held-out offset + reserve")


PAIR_STRIDE = 1000   # exchanges="all": source offset = conversation index x 1000 + pair index


def sharegpt_source(tokenizer, cfg: ShardConfig, exclude: tuple[int, int]) -> Source:
    """ShareGPT exchanges through the chat template, skipping the conversations in ``exclude``
    (indices among the conversations with >= 2 turns, in file order). ``cfg.exchanges == "first"``:
    one per conversation, offset = the conversation's index; ``"all"``: every user -> assistant
    pair (turns i, i + 1), offset = conversation x :data:`PAIR_STRIDE` + the pair's index."""
    from treespec.data import sharegpt_conversations
    from treespec.train.data import exchange_ids, exchange_of

    data = cfg.exchange_config()
    stride = PAIR_STRIDE if cfg.exchanges == "all" else 1

    def pairs(conv):
        if cfg.exchanges == "first":
            yield exchange_of(tokenizer, data, conv)
            return
        for (r0, user), (r1, reply) in zip(conv.turns, conv.turns[1:]):
            if (r0, r1) == ("user", "assistant"):
                yield exchange_ids(tokenizer, data, user, reply)

    def stream(start: int) -> Iterator[Example]:
        for index, conv in enumerate(sharegpt_conversations(min_turns=2)):
            if (index + 1) * stride <= start or exclude[0] <= index < exclude[1]:
                continue            # skipped without tokenising
            for pair, row in enumerate(pairs(conv)):
                if pair >= stride:
                    raise ValueError(f"ShareGPT conversation {conv.id} has over {stride} exchanges")
                if row is not None and index * stride + pair >= start:
                    yield Example(index * stride + pair, row[0], row[1])

    return stream


# ---------------------------------------------------------------------------------- extraction
def autocast_dtype(mode: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """``auto``: bf16 where ``device`` multiplies bf16 natively (:func:`treespec.fastpath.packing.native_bf16`),
    else fp32; ``bf16`` / ``fp32`` force it. Returns the dtype and the reason."""
    from treespec.fastpath.packing import native_bf16

    if mode == "auto":
        ok, why = native_bf16(device)
        return (torch.bfloat16 if ok else torch.float32), f"auto: {why}"
    if mode in ("bf16", "bfloat16"):
        return torch.bfloat16, "requested"
    if mode in ("fp32", "float32"):
        return torch.float32, "requested"
    raise ValueError(f"--autocast {mode!r}: use auto, bf16 or fp32")


def autocast(device: torch.device | str, dtype: torch.dtype):
    """A bf16 autocast context on ``device`` (disabled for fp32)."""
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


@dataclass
class ExtractReport:
    directory: Path
    computed: list[int]          # shards this call computed
    skipped: list[int]           # shards already done (or another rank's)
    shards: int                  # shards in the extraction
    tokens: int                  # tokens in all of them
    exhausted: bool              # the source ran out before ``cfg.tokens``


def _header(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["treespec_shard"])


def read_manifest(directory: str | os.PathLike) -> dict | None:
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _done_shards(directory: Path, manifest: dict | None, ident: dict) -> dict[int, dict]:
    """Finished shards: the manifest's, plus shard files it lacks whose header matches ``ident``."""
    done = {r["shard"]: r for r in (manifest or {}).get("shards", [])}
    for path in sorted(directory.glob("shard_*.safetensors")):
        s = int(path.stem.split("_")[1])
        if s in done:
            continue
        rec = _header(path)
        if {k: rec.get(k) for k in ident} != ident:
            raise ValueError(f"{path} was made with another config or target than this extraction; "
                             "delete it or use another --shards directory")
        done[s] = {k: v for k, v in rec.items() if k not in ident}
    return done


def regenerate(target, ex: Example, temperature: float) -> Example:
    """``ex`` with its reply replaced by the target's own continuation of the prompt (greedy at
    T = 0, else sampled with a seed per record), at most as long as the original reply: shard
    boundaries are computed from the source alone, so every rank agrees on them without
    generating; EOS ends a reply early (the shard then holds fewer tokens, as its record says)."""
    return regenerate_batch(target, [ex], temperature, seed=ex.record)[0]


REGENERATE_BATCH = 16   # prompts per generate call when extraction regenerates replies


@torch.inference_mode()
def regenerate_batch(target, rows: list[Example], temperature: float, seed: int = 0) -> list[Example]:
    """:func:`regenerate` for many examples in ONE HF ``generate`` call over their left-padded
    prompts: each reply is the target's own continuation, at most as long as the original reply
    and ended by the first EOS. Greedy replies equal one-at-a-time greedy decoding up to float
    rounding in the padded pass (rows with near-tied logits can differ); sampled ones draw from
    one generator seeded with ``seed``, so they differ from :func:`regenerate`'s per-record seeds.
    A batch of 16 makes about 60 reply tokens a second on one AVX2 core (fp32 SmolLM2-135M)."""
    if not rows:
        return []
    eos = list(target.eos_token_ids)
    pad = eos[0] if eos else 0
    prompts = [ex.ids[: ex.reply_start] for ex in rows]
    caps = [len(ex.ids) - ex.reply_start for ex in rows]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(max_new_tokens=max(caps), do_sample=temperature > 0, top_k=None, top_p=None,
              repetition_penalty=None, temperature=temperature if temperature > 0 else None,
              eos_token_id=eos or None, pad_token_id=pad)
    devices = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device), **kw)
    done = []
    for ex, p, cap, new in zip(rows, prompts, caps, out[:, width:].tolist()):
        new = new[:cap]
        end = next((j + 1 for j, t in enumerate(new) if t in eos), len(new))
        done.append(Example(ex.record, p + new[:end], ex.reply_start))
    return done


def _compute_shard(target, cfg: ShardConfig, rows: list[Example], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    recs = []
    with autocast(target.device, dtype):
        if cfg.regenerate is not None:   # REGENERATE_BATCH prompts per generate call, seeded by their first record
            rows = [ex for i in range(0, len(rows), REGENERATE_BATCH)
                    for ex in regenerate_batch(target, rows[i:i + REGENERATE_BATCH], cfg.regenerate, rows[i].record)]
        for ex in rows:
            recs.append(target_pass(target, ex.ids, cfg.layers, cfg.top_k))
    tensors = {k: torch.cat([r[k] for r in recs]).contiguous() for k in recs[0]}
    tensors["tokens"] = torch.tensor([t for ex in rows for t in ex.ids], dtype=torch.int32)
    lengths = torch.tensor([len(ex.ids) for ex in rows])
    tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    tensors["reply_start"] = torch.tensor([ex.reply_start for ex in rows])
    tensors["top1_count"] = torch.bincount(tensors["top_i"][:, 0].long(), minlength=target.vocab_size)
    return tensors


def _packed(source: Source, cfg: ShardConfig, start_record: int, first_shard: int,
            tokens_before: int) -> Iterator[tuple[int, list[Example], int]]:
    """(shard id, its examples, tokens before it) from ``start_record`` on, until ``cfg.tokens``."""
    s, rows, n, total = first_shard, [], 0, tokens_before
    if total >= cfg.tokens:          # already there: do not even open the source
        return
    for ex in source(start_record):
        if total >= cfg.tokens:
            return
        rows.append(ex)
        n += len(ex.ids)
        if n >= cfg.shard_tokens:
            yield s, rows, total
            s, rows, total, n = s + 1, [], total + n, 0
    if rows and total < cfg.tokens:
        yield s, rows, total


def extract(target, cfg: ShardConfig, directory: str | os.PathLike, source: Source, *,
            source_name: str = "sharegpt", exclude: tuple[int, int] = (0, 0), autocast_mode: str = "auto",
            rank: int = 0, world: int = 1, progress: bool = True, stop_after: int | None = None) -> ExtractReport:
    """Compute (or finish) the shards of ``cfg`` that belong to ``rank`` of ``world``.

    Resumes from ``directory``: finished shards are skipped, and reading starts at the end record
    of the longest finished prefix of shards (no re-tokenising of what is done). Rank 0 writes the
    manifest; other ranks only write shard files (rank 0 adopts them). ``stop_after``: return after
    computing this many shards (an interrupted run, for tests).
    """
    from tqdm import tqdm

    from treespec.targets.loader import model_fingerprint

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dtype, why = autocast_dtype(autocast_mode, target.device)
    dtype_name = str(dtype).removeprefix("torch.")
    ident = {"config": cfg.key(), "fingerprint": model_fingerprint(target.model), "source": source_name,
             "autocast": dtype_name}
    manifest = read_manifest(out)
    if manifest is not None:
        theirs = {k: manifest.get(k) for k in ident}
        if theirs != ident:
            diff = [k for k in ident if theirs[k] != ident[k]]
            raise ValueError(f"{out} holds another extraction (its {', '.join(diff)} differ: "
                             f"{ {k: theirs[k] for k in diff} } vs { {k: ident[k] for k in diff} }); "
                             "use another --shards directory, or the same --autocast / config")
    done = _done_shards(out, manifest, ident)

    def write_manifest(exhausted: bool) -> None:
        shards = [{"shard": s, **done[s]} for s in sorted(done)]
        _write_json(out / MANIFEST, {
            "format": FORMAT, **ident, "autocast_reason": why, "target": target.name,
            "tokens_target": max(cfg.tokens, (manifest or {}).get("tokens_target", 0)),
            "excluded_records": list(exclude), "exhausted": exhausted,
            "tokens": sum(r["tokens"] for r in shards), "sequences": sum(r["sequences"] for r in shards),
            "cpu_seconds": round(sum(r["cpu_s"] for r in shards), 2), "shards": shards})

    prefix = 0
    while prefix in done:
        prefix += 1
    start = done[prefix - 1]["end_record"] if prefix else 0
    before = sum(done[s].get("source_tokens", done[s]["tokens"]) for s in range(prefix))  # packing: source tokens
    computed, skipped, last, total = [], [], prefix - 1, before
    bar = tqdm(desc=f"features (rank {rank})", unit="tok", unit_scale=True, disable=not progress,
               total=cfg.tokens, initial=before)
    for s, rows, tokens_before in _packed(source, cfg, start, prefix, before):
        n = sum(len(ex.ids) for ex in rows)
        last, total = s, tokens_before + n
        if s in done or s % world != rank:
            skipped.append(s)
            bar.update(n)
            continue
        if stop_after is not None and len(computed) >= stop_after:
            break
        t0, c0 = time.perf_counter(), time.process_time()
        tensors = _compute_shard(target, cfg, rows, dtype)
        n_stored = int(tensors["offsets"][-1])       # < n when regenerated replies ended early
        rec = {"sequences": len(rows), "tokens": n_stored, "source_tokens": n,
               "reply_tokens": n_stored - int(tensors["reply_start"].sum()),
               "first_record": rows[0].record, "end_record": rows[-1].record + 1,
               "wall_s": round(time.perf_counter() - t0, 3), "cpu_s": round(time.process_time() - c0, 3)}
        path = out / f"shard_{s:05d}.safetensors"
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file(tensors, tmp, metadata={"treespec_shard": json.dumps({**ident, **rec})})
        os.replace(tmp, path)
        done[s] = rec
        computed.append(s)
        bar.update(n)
        if rank == 0:
            write_manifest(False)
    bar.close()
    exhausted = total < cfg.tokens and (stop_after is None or len(computed) < stop_after)
    if rank == 0:
        done = _done_shards(out, read_manifest(out), ident)
        write_manifest(exhausted)
    return ExtractReport(out, computed, skipped, last + 1, total, exhausted)


def finalize(directory: str | os.PathLike) -> dict:
    """Rank 0, after every rank's extraction: adopt all shard files into the manifest; returns it."""
    out = Path(directory)
    manifest = read_manifest(out)
    if manifest is None:
        raise FileNotFoundError(f"no {MANIFEST} in {out}; run the extraction first")
    ident = {k: manifest[k] for k in ("config", "fingerprint", "source", "autocast")}
    done = _done_shards(out, manifest, ident)
    shards = [{"shard": s, **done[s]} for s in sorted(done)]
    manifest.update(shards=shards, tokens=sum(r["tokens"] for r in shards),
                    sequences=sum(r["sequences"] for r in shards),
                    cpu_seconds=round(sum(r["cpu_s"] for r in shards), 2))
    _write_json(out / MANIFEST, manifest)
    return manifest


# ---------------------------------------------------------------------------------- reading
class ShardSet:
    """The finished shards of a directory, read lazily (only the requested layers)."""

    def __init__(self, directory: str | os.PathLike, layers: tuple[int, ...] | None = None):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if self.manifest is None:
            raise FileNotFoundError(f"no {MANIFEST} in {self.directory}; extract features first "
                                    "(treespec train ... --shards DIR --extract-tokens N)")
        recs = self.manifest["shards"]
        if [r["shard"] for r in recs] != list(range(len(recs))):
            missing = sorted(set(range(len(recs) + 1)) - {r["shard"] for r in recs})[:5]
            raise ValueError(f"{self.directory}: shards {missing} are missing; finish the extraction first")
        self.records = recs
        have = tuple(self.manifest["config"]["layers"])
        self.layers = have if layers is None else tuple(layers)
        if not set(self.layers) <= set(have):
            raise ValueError(f"{self.directory} holds layers {have}, not {self.layers}")
        self.loads = 0                                   # shard files read (tests bound memory with it)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def tokens(self) -> int:
        return sum(r["tokens"] for r in self.records)

    def mean_length(self, max_len: int | None = None) -> float:
        """Mean sequence length in tokens (capped at ``max_len``: a proxy, per-shard means)."""
        mean = self.tokens / sum(r["sequences"] for r in self.records)
        return min(mean, max_len) if max_len else mean

    def path(self, s: int) -> Path:
        return self.directory / f"shard_{s:05d}.safetensors"

    def load(self, s: int) -> dict[str, torch.Tensor]:
        keep = {"tokens", "offsets", "reply_start", "top_i", "top_p"} | {f"h{l}" for l in self.layers}
        with safe_open(str(self.path(s)), framework="pt") as f:
            self.loads += 1
            return {k: f.get_tensor(k) for k in f.keys() if k in keep}

    def frequency(self, vocab_size: int) -> torch.Tensor:
        """LongTensor[V]: target top-1 counts over all shards (summed from the shards' headers)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for s in range(len(self)):
            with safe_open(str(self.path(s)), framework="pt") as f:
                counts += f.get_tensor("top1_count")[:vocab_size]
        return counts


def _seeded(*parts: int) -> torch.Generator:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()
    return torch.Generator().manual_seed(int(digest[:15], 16))


def _pad(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    out = rows[0].new_zeros((len(rows), length) + tuple(rows[0].shape[1:]))
    for r, t in enumerate(rows):
        out[r, : min(t.shape[0], length)] = t[:length]
    return out


class ShardStream:
    """Stream ``k`` of ``parts`` over a :class:`ShardSet` (see the module docstring)."""

    def __init__(self, shards: ShardSet, k: int, parts: int, batch_size: int, seed: int,
                 max_len: int | None = None, cached: int = 2):
        self.shards, self.k, self.b, self.seed, self.max_len = shards, k, batch_size, seed, max_len
        self.own = [s for s in range(len(shards)) if s % parts == k]
        if not self.own:
            raise ValueError(f"{shards.directory} has {len(shards)} shards, fewer than the {parts} data streams "
                             f"(world size x --grad-accum); extract more tokens or use smaller --shard-tokens")
        self.sizes = [shards.records[s]["sequences"] for s in self.own]
        self.epoch_rows = sum(self.sizes)
        if self.epoch_rows < batch_size:
            raise ValueError(f"stream {k} holds {self.epoch_rows} sequences, fewer than a batch of {batch_size}")
        self.cache: OrderedDict[int, dict] = OrderedDict()
        self.cached = cached

    def _shard(self, s: int) -> dict[str, torch.Tensor]:
        if s not in self.cache:
            self.cache[s] = self.shards.load(s)
            while len(self.cache) > self.cached:
                self.cache.popitem(last=False)
        self.cache.move_to_end(s)
        return self.cache[s]

    def _row(self, i: int) -> tuple[int, int]:
        """(shard, row in it) of the stream's i-th row over all epochs."""
        epoch, i = divmod(i, self.epoch_rows)
        order = torch.randperm(len(self.own), generator=_seeded(self.seed, self.k, epoch)).tolist()
        for j in order:
            if i < self.sizes[j]:
                s = self.own[j]
                rows = torch.randperm(self.sizes[j], generator=_seeded(self.seed, self.k, epoch, s))
                return s, int(rows[i])
            i -= self.sizes[j]
        raise AssertionError("unreachable")

    def batch(self, n: int) -> Batch:
        """The stream's n-th batch: rows n * b .. (n + 1) * b - 1."""
        picks = [self._row(i) for i in range(n * self.b, (n + 1) * self.b)]
        seqs = []
        for s, r in picks:
            sh = self._shard(s)
            seqs.append((sh, int(sh["offsets"][r]), int(sh["offsets"][r + 1]), int(sh["reply_start"][r])))
        return pack_batch(seqs, self.shards.layers, self.max_len)


def pack_batch(seqs: list[tuple[dict[str, torch.Tensor], int, int, int]], layers: tuple[int, ...],
               max_len: int | None = None) -> Batch:
    """A padded :class:`Batch` of packed sequences: ``(tensors, start, end, reply_start)`` names
    rows ``start:end`` of ``tensors`` (tokens [N], h{l} [N, H], top_i / top_p [N, K], as a shard
    stores them); cut to ``max_len`` positions."""
    lengths = [e - a for _, a, e, _ in seqs]
    t = max(lengths) if max_len is None else min(max(lengths), max_len)

    def take(key: str) -> torch.Tensor:
        return _pad([sh[key][a:e] for sh, a, e, _ in seqs], t)

    pos = torch.arange(t)
    length = torch.tensor(lengths)[:, None]
    start = torch.tensor([st for *_, st in seqs])[:, None]
    return Batch(tokens=take("tokens").long(), valid=pos[None] < length,
                 reply=(pos[None] >= start) & (pos[None] < length),
                 hidden={l: take(f"h{l}").float() for l in layers},
                 top_i=take("top_i").long(), top_p=take("top_p").float())
