"""Training data: ShareGPT exchanges with the target's own features and distributions, cached.

Glossary:
    sequence   one chat-templated exchange: the SmolLM2 template of the first user turn (its text
               cut to ``user_tokens`` tokens) followed by the first assistant reply, the whole
               cut to ``max_len`` tokens. ``response[i]`` is True where token i belongs to the
               reply (the tokens a drafter will be asked to propose at inference).
    features   the target's HF ``hidden_states[l]`` for every position, for each layer l in
               ``layers`` (post final norm for l = L), stored fp16.
    top-k      the target's T = 1 next-token distribution at every position, kept as its ``top_k``
               most likely ids (int32) and their probabilities (fp16): the soft labels of
               distillation. p at position t is the law of token t + 1.

The target pass runs once per sequence; results are written in chunks of ``chunk_size``
sequences (one safetensors file each, written to a temp name then renamed), so an interrupted
run resumes at the first missing chunk. The cache lives under
``$TREESPEC_CACHE/train/<target fingerprint>/<data config hash>/`` (default
``~/.cache/treespec/train/...``), never in git.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file

from treespec.data import chat_prompt, sharegpt_conversations
from treespec.targets.loader import Target, default_cache_root, model_fingerprint

# HF hidden_states indices stored for SmolLM2-135M (L = 30): EAGLE-3's low / middle / high layers
# (2, L // 2, L - 3) and the last layer (post final norm: what the LM head reads).
DEFAULT_LAYERS = (2, 15, 27, 30)


@dataclass(frozen=True)
class DataConfig:
    """What goes into the feature cache (every field is part of the cache key)."""

    split: str = "train"          # "train" or "heldout": disjoint runs of ShareGPT records
    sequences: int = 1024         # sequences in this split
    max_len: int = 256            # tokens per sequence (prompt + reply), at most
    user_tokens: int = 96         # the user turn's text is cut to this many tokens
    min_response: int = 32        # skip exchanges whose reply keeps fewer tokens than this
    layers: tuple[int, ...] = DEFAULT_LAYERS
    top_k: int = 32               # kept entries of the target's distribution per position
    chunk_size: int = 64          # sequences per chunk file
    heldout_offset: int = 8000    # held-out records are taken after this many qualifying ones

    def key(self) -> str:
        """Cache directory name. ``sequences`` is not part of it: chunk c always holds the same
        sequences, so a larger run extends a smaller one's cache and a smaller one reads a prefix."""
        fields = {k: v for k, v in asdict(self).items() if k != "sequences"}
        blob = json.dumps(fields, sort_keys=True).encode()
        return f"{self.split}-{hashlib.sha256(blob).hexdigest()[:10]}"


def _mostly_ascii(text: str, share: float = 0.97) -> bool:
    return bool(text) and sum(c.isascii() for c in text) >= share * len(text)


def exchange_ids(tokenizer, cfg: DataConfig, user: str, reply: str) -> tuple[list[int], int] | None:
    """(token ids, index of the first reply token) of one user -> assistant exchange through the
    chat template, or None if it does not qualify (not mostly ASCII, or a reply shorter than
    ``min_response`` tokens once cut to ``max_len``)."""
    if not (_mostly_ascii(user) and _mostly_ascii(reply)):
        return None
    user_ids = tokenizer(user, add_special_tokens=False)["input_ids"][: cfg.user_tokens]
    prompt = chat_prompt(tokenizer, tokenizer.decode(user_ids))
    reply_ids = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
    ids = (prompt + reply_ids)[: cfg.max_len]
    if len(ids) - len(prompt) < cfg.min_response:
        return None
    return ids, len(prompt)


def exchange_of(tokenizer, cfg: DataConfig, conv) -> tuple[list[int], int] | None:
    """The first exchange of a conversation (turns 0 and 1), or None if it does not qualify."""
    (r0, user), (r1, reply) = conv.turns[0], conv.turns[1]
    if r0 != "user" or r1 != "assistant":
        return None
    return exchange_ids(tokenizer, cfg, user, reply)


def indexed_exchanges(tokenizer, cfg: DataConfig, start_record: int = 0) -> Iterator[tuple[int, list[int], int]]:
    """(record, token ids, reply start) of the qualifying exchanges whose record (index among the
    ShareGPT conversations with >= 2 turns, in file order) is >= ``start_record``; records before
    it are skipped without tokenising. The split is ignored: the caller picks records."""
    for record, conv in enumerate(sharegpt_conversations(min_turns=2)):
        if record < start_record:
            continue
        row = exchange_of(tokenizer, cfg, conv)
        if row is not None:
            yield record, row[0], row[1]


def exchanges(tokenizer, cfg: DataConfig) -> Iterator[tuple[list[int], int]]:
    """(token ids, index of the first reply token) for the qualifying ShareGPT exchanges of a split."""
    start = 0 if cfg.split == "train" else cfg.heldout_offset
    for seen, (_, ids, reply_start) in enumerate(indexed_exchanges(tokenizer, cfg)):
        if seen >= start:
            yield ids, reply_start


def cache_dir(target: Target, cfg: DataConfig, root: str | os.PathLike | None = None) -> Path:
    base = Path(root) if root is not None else default_cache_root() / "train"
    return base / model_fingerprint(target.model) / cfg.key()


@torch.inference_mode()
def target_pass(target: Target, ids: list[int], layers: tuple[int, ...], top_k: int) -> dict[str, torch.Tensor]:
    """Features [T, H] per layer and the top-k of p at every position, for one sequence."""
    x = torch.tensor(ids, device=target.device)[None]
    out = target.model.model(input_ids=x, output_hidden_states=True)
    hs = out.hidden_states
    # [T, V] in slices to bound memory
    last = hs[len(hs) - 1][0]
    top_p, top_i = [], []
    for s in range(0, last.shape[0], 128):
        logp = target.model.lm_head(last[s:s + 128]).float().softmax(-1)
        v, i = logp.topk(top_k, -1)
        top_p.append(v)
        top_i.append(i)
    rec = {f"h{l}": hs[l][0].to(torch.float16).cpu() for l in layers}
    rec["top_p"] = torch.cat(top_p).to(torch.float16).cpu()
    rec["top_i"] = torch.cat(top_i).to(torch.int32).cpu()
    return rec


def _pad(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    out = rows[0].new_zeros((len(rows), length) + tuple(rows[0].shape[1:]))
    for r, t in enumerate(rows):
        out[r, : t.shape[0]] = t
    return out


def _chunk(target: Target, cfg: DataConfig, rows: list[tuple[list[int], int]], tick=None) -> dict:
    """Padded chunk tensors for ``rows`` (token ids, reply start)."""
    recs = []
    for ids, _ in rows:
        recs.append(target_pass(target, ids, cfg.layers, cfg.top_k))
        if tick is not None:
            tick(1)
    length = max(len(ids) for ids, _ in rows)
    tensors = {k: _pad([r[k] for r in recs], length) for k in recs[0]}
    tensors["tokens"] = _pad([torch.tensor(ids) for ids, _ in rows], length)
    tensors["length"] = torch.tensor([len(ids) for ids, _ in rows])
    tensors["reply_start"] = torch.tensor([s for _, s in rows])
    return tensors


def compute_chunk(target: Target, cfg: DataConfig, sequences: int) -> dict[str, torch.Tensor]:
    """The first ``sequences`` of a split as one in-memory chunk (no cache written)."""
    stream = exchanges(target.tokenizer, cfg)
    rows = [r for r, _ in zip(stream, range(sequences))]
    return _chunk(target, cfg, rows)


def chunk_count(cfg: DataConfig) -> int:
    return (cfg.sequences + cfg.chunk_size - 1) // cfg.chunk_size


def build_cache(target: Target, cfg: DataConfig, root: str | os.PathLike | None = None,
                progress: bool = True) -> Path:
    """Compute (or finish computing) the feature cache of ``cfg``; returns its directory."""
    from tqdm import tqdm

    out = cache_dir(target, cfg, root)
    out.mkdir(parents=True, exist_ok=True)
    manifest = out / "manifest.json"
    n_chunks = chunk_count(cfg)
    todo = [c for c in range(n_chunks) if not (out / f"chunk_{c:05d}.safetensors").exists()]
    if todo:
        bar = tqdm(total=cfg.sequences, desc=f"target features ({cfg.split})", disable=not progress,
                   initial=(n_chunks - len(todo)) * cfg.chunk_size)
        stream = exchanges(target.tokenizer, cfg)
        for c in range(n_chunks):
            rows = [next(stream, None) for _ in range(cfg.chunk_size)]
            rows = [r for r in rows if r is not None]
            path = out / f"chunk_{c:05d}.safetensors"
            if c not in todo or not rows:
                continue
            tensors = _chunk(target, cfg, rows, bar.update)
            tmp = path.with_suffix(".tmp")
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
            os.replace(tmp, path)
        bar.close()
    manifest.write_text(json.dumps({"config": {**asdict(cfg), "sequences": n_chunks * cfg.chunk_size},
                                    "target": target.name, "fingerprint": model_fingerprint(target.model)},
                                   indent=1))
    return out


@dataclass
class Batch:
    """A padded batch of cached sequences (B sequences, T positions).

    Fields:
        tokens:  LongTensor[B, T];  valid: BoolTensor[B, T] (inside the sequence);
        reply:   BoolTensor[B, T]   True where the token is part of the assistant reply;
        hidden:  layer -> FloatTensor[B, T, H] (float32);
        top_i:   LongTensor[B, T, K]; top_p: FloatTensor[B, T, K]  (p at t = law of token t + 1).
    """

    tokens: torch.Tensor
    valid: torch.Tensor
    reply: torch.Tensor
    hidden: dict[int, torch.Tensor]
    top_i: torch.Tensor
    top_p: torch.Tensor

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(self.tokens.to(device), self.valid.to(device), self.reply.to(device),
                     {l: h.to(device) for l, h in self.hidden.items()}, self.top_i.to(device),
                     self.top_p.to(device))


def load_chunks(directory: Path, layers: tuple[int, ...], count: int | None = None) -> list[dict[str, torch.Tensor]]:
    """The first ``count`` chunks (default all) of a cache directory, only the requested layers."""
    chunks = []
    for path in sorted(directory.glob("chunk_*.safetensors"))[:count]:
        raw = load_file(path)
        chunks.append({k: v for k, v in raw.items() if not k.startswith("h") or int(k[1:]) in layers})
    if not chunks or (count is not None and len(chunks) < count):
        raise FileNotFoundError(f"no feature chunks in {directory}; build them with build_cache")
    return chunks


def iterate_batches(chunks: list[dict[str, torch.Tensor]], batch_size: int,
                    generator: torch.Generator, max_len: int | None = None) -> Iterator[Batch]:
    """Endless random batches over all cached sequences (seeded by ``generator``)."""
    index = [(c, r) for c, ch in enumerate(chunks) for r in range(ch["tokens"].shape[0])]
    if len(index) < batch_size:
        raise ValueError(f"{len(index)} cached sequences cannot fill a batch of {batch_size}")
    while True:
        order = torch.randperm(len(index), generator=generator).tolist()
        for s in range(0, len(order) - batch_size + 1, batch_size):
            yield make_batch(chunks, [index[i] for i in order[s:s + batch_size]], max_len)


def make_batch(chunks: list[dict[str, torch.Tensor]], rows: list[tuple[int, int]],
               max_len: int | None = None) -> Batch:
    lengths = [int(chunks[c]["length"][r]) for c, r in rows]
    t = max(lengths) if max_len is None else min(max(lengths), max_len)

    def take(key: str) -> torch.Tensor:
        out = []
        for c, r in rows:
            x = chunks[c][key][r, :t]
            if x.shape[0] < t:
                x = torch.cat([x, x.new_zeros((t - x.shape[0],) + tuple(x.shape[1:]))])
            out.append(x)
        return torch.stack(out)

    pos = torch.arange(t)
    length = torch.tensor(lengths)[:, None]
    start = torch.tensor([int(chunks[c]["reply_start"][r]) for c, r in rows])[:, None]
    layers = sorted(int(k[1:]) for k in chunks[0] if k.startswith("h"))
    return Batch(
        tokens=take("tokens").long(),
        valid=pos[None] < length,
        reply=(pos[None] >= start) & (pos[None] < length),
        hidden={l: take(f"h{l}").float() for l in layers},
        top_i=take("top_i").long(),
        top_p=take("top_p").float(),
    )
