"""Online distillation data: each step runs the target over its own sequences, trains on the
features at once and throws them away; nothing per token is stored.

Glossary:
    window        ``window`` consecutive examples of the source (ShareGPT exchanges), read
                  together and shuffled with a seed of (seed, epoch, window index).
    global batch  the ``parts x batch_size`` examples of one step. Part k (of ``parts = world x
                  grad_accum``) is one micro-batch of one process: rows k, k + parts, ... of the
                  global batch. A window is cut into global batches of similar lengths (sorted in
                  groups of ``sort_groups`` global batches, then the batches shuffled), so padding
                  wastes little of the target's pass.
    cursor        where the stream stands: ``{epoch, window, record, batch, step}``; ``record`` is
                  the first source record of the window, ``batch`` the next global batch in it.
                  Saved with the weights: a resumed run re-reads the window from ``record`` and
                  continues at ``batch``, with the same batches as an uninterrupted run on any
                  machine (the source is deterministic).
Features: on a CPU every sequence goes through the target alone, which is what feature-shard
extraction computes (no padding, bit for bit); on CUDA a part runs as one right-padded batch.
Either way the features and probabilities are rounded to the shards' storage dtypes (fp16), so
a head trained online reads exactly what the offline path reads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

import torch

from treespec.train.data import Batch, target_pass
from treespec.train.shards import Example, Source, _seeded, autocast, pack_batch

__all__ = ["OnlineData", "OnlineStream", "part_batch"]


@dataclass(frozen=True)
class OnlineData:
    """Where online batches come from (what ``train_drafter(..., online=)`` takes)."""

    source: Source = field(repr=False)   # start record -> examples, deterministic (sharegpt_source)
    name: str = "sharegpt"               # recorded in the card and checked on resume
    top_k: int = 32                      # kept entries of the target's law per position
    window: int = 4096                   # examples read and shuffled together
    sort_groups: int = 16                # global batches sorted by length together
    vocab_windows: int = 1               # windows whose tokens count ids (eagle3's draft vocabulary)
    note: str = ""                       # the card's description of the data
    excluded_records: tuple[int, int] = (0, 0)   # held-out source records, never trained on

    def __post_init__(self):
        for name in ("top_k", "window", "sort_groups", "vocab_windows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"OnlineData.{name} must be a positive int, got {value!r}")


class OnlineStream:
    """The global batches of an :class:`OnlineData` source (see the module docstring)."""

    def __init__(self, data: OnlineData, parts: int, batch_size: int, seed: int, cursor: dict | None = None):
        self.data, self.parts, self.b, self.seed = data, parts, batch_size, seed
        self.size = parts * batch_size
        if data.window < self.size:
            raise ValueError(f"OnlineData.window ({data.window}) holds fewer examples than a global batch "
                             f"({parts} parts x {batch_size}); raise the window")
        self.cursor = dict(cursor) if cursor else {"epoch": 0, "window": 0, "record": 0, "batch": 0, "step": 0}
        self._batches: list[list[Example]] | None = None
        self._next_record: int | None = None     # first record after the window (None: the epoch ends)
        self._reader: tuple[int, Iterator[Example]] | None = None   # (next record, open source iterator)
        self._first: list[Example] | None = None                    # the first window

    def _read(self, record: int) -> list[Example]:
        """``window`` examples from ``record`` on, continuing the open iterator when it stands there."""
        if record == 0 and self._first is not None:
            self._reader = None
            return list(self._first)
        if self._reader is None or self._reader[0] != record:
            self._reader = (record, iter(self.data.source(record)))
        rows = list(itertools.islice(self._reader[1], self.data.window))
        self._reader = (rows[-1].record + 1, self._reader[1]) if rows else None
        if record == 0:
            self._first = rows          # read again for the frequency, the mean length and each epoch
        return rows

    def _load(self) -> None:
        c = self.cursor
        rows = self._read(c["record"])
        if len(rows) < self.size:
            if c["record"] == 0:
                raise ValueError(f"the {self.data.name} source holds {len(rows)} examples, fewer than a global "
                                 f"batch of {self.size}")
            c.update(epoch=c["epoch"] + 1, window=0, record=0)     # the source ran out: next epoch
            return self._load()
        self._next_record = rows[-1].record + 1 if len(rows) == self.data.window else None
        perm = torch.randperm(len(rows), generator=_seeded(self.seed, c["epoch"], c["window"])).tolist()
        rows = [rows[i] for i in perm]
        span = self.size * self.data.sort_groups
        ordered = [ex for s in range(0, len(rows), span) for ex in sorted(rows[s:s + span], key=lambda e: len(e.ids))]
        batches = [ordered[s:s + self.size] for s in range(0, len(ordered) - self.size + 1, self.size)]
        order = torch.randperm(len(batches), generator=_seeded(self.seed, c["epoch"], c["window"], -1)).tolist()
        self._batches = [batches[i] for i in order]

    def next(self, step: int) -> list[Example]:
        """The global batch of ``step`` (steps are read in order: a stream is a cursor)."""
        c = self.cursor
        if step != c["step"]:
            raise ValueError(f"the online stream stands at step {c['step']}, asked for step {step}; "
                             "resume from the cursor saved with the same step")
        if self._batches is None:
            self._load()
        if c["batch"] >= len(self._batches):
            if self._next_record is None:
                c.update(epoch=c["epoch"] + 1, window=0, record=0, batch=0)
            else:
                c.update(window=c["window"] + 1, record=self._next_record, batch=0)
            self._load()
        rows = self._batches[c["batch"]]
        c["batch"] += 1
        c["step"] += 1
        return rows

    def part(self, rows: list[Example], k: int) -> list[Example]:
        """Part ``k`` of a global batch: rows k, k + parts, ... (lengths spread over the parts)."""
        return rows[k:: self.parts]

    def frequency(self, vocab_size: int) -> torch.Tensor:
        """LongTensor[V]: how often each id is a reply token in the first ``vocab_windows`` windows
        (the source in file order; EAGLE-3's draft vocabulary and the KD candidate set)."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        record = 0
        for _ in range(self.data.vocab_windows):
            rows = self._read(record)
            for ex in rows:
                counts += torch.bincount(torch.tensor(ex.ids[ex.reply_start:]), minlength=vocab_size)[:vocab_size]
            if len(rows) < self.data.window:
                break
            record = rows[-1].record + 1
        return counts

    def mean_length(self, max_len: int | None = None) -> float:
        """Mean example length over the first window (a token limit's steps are planned with it)."""
        rows = self._read(0)
        lengths = [min(len(ex.ids), max_len) if max_len else len(ex.ids) for ex in rows]
        return sum(lengths) / max(len(lengths), 1)


@torch.inference_mode()
def _padded_pass(target, rows: list[list[int]], layers: tuple[int, ...], top_k: int) -> list[dict]:
    """``target_pass`` for a right-padded batch (one forward); per-sequence records."""
    device = target.device
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), t, dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, device=device)
        mask[i, : len(r)] = 1
    hs = target.model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    last = hs[len(hs) - 1]
    out = []
    for i, r in enumerate(rows):
        n = len(r)
        top = target.model.lm_head(last[i, :n]).float().softmax(-1).topk(top_k, -1)
        rec = {f"h{l}": hs[l][i, :n].to(torch.float16).cpu() for l in layers}
        rec.update(top_p=top.values.to(torch.float16).cpu(), top_i=top.indices.to(torch.int32).cpu())
        out.append(rec)
    return out


def part_batch(target, rows: list[Example], layers: tuple[int, ...], top_k: int, max_len: int | None,
               dtype: torch.dtype) -> Batch:
    """The training batch of ``rows``: the target's features and top-k law computed now (under
    ``dtype`` autocast), stored as shards store them, assembled as a shard stream assembles them."""
    ids = [ex.ids[:max_len] if max_len else ex.ids for ex in rows]
    with autocast(target.device, dtype):
        if target.device.type == "cpu":
            recs = [target_pass(target, r, layers, top_k) for r in ids]
        else:
            recs = _padded_pass(target, ids, layers, top_k)
    seqs = []
    for ex, r, rec in zip(rows, ids, recs):
        rec["tokens"] = torch.tensor(r, dtype=torch.int32)
        seqs.append((rec, 0, len(r), ex.reply_start))
    return pack_batch(seqs, layers, max_len)
