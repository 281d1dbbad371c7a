"""`treespec train {eagle,eagle3,medusa,mtp,small} --minutes N --out DIR`.

Builds the target's feature cache on ShareGPT if needed (resumable, chunked, under
``$TREESPEC_CACHE/train``), trains with a progress bar, resumes from ``DIR/<kind>.train.safetensors`` when
re-run with the same ``--out``, and writes ``DIR/<kind>.safetensors`` (fp16) + ``DIR/<kind>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys

from treespec.train.recipes import KINDS

__all__ = ["register"]


def cmd_train(args) -> int:
    import torch

    from treespec.models import load_target
    from treespec.train.data import DataConfig
    from treespec.train.loop import TrainConfig, train_drafter
    from treespec.train.recipes import RecipeConfig

    torch.set_num_threads(args.threads)
    target = load_target(args.model)
    cfg = TrainConfig(minutes=args.minutes, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                      seed=args.seed, threads=args.threads, init_from=args.init_from or "",
                      recipe=RecipeConfig(draft_vocab=args.draft_vocab, unroll_ramp=args.unroll_ramp,
                                          negatives=args.negatives if args.negatives is not None
                                          else (4096 if args.kind == "small" else 0)))
    data = DataConfig(sequences=args.sequences, max_len=args.max_len)
    card = train_drafter(args.kind, target, args.out, cfg, data)
    print(json.dumps({"checkpoint": f"{args.out}/{args.kind}.safetensors", "heldout": card["heldout"],
                      "train_minutes": card["train"]["train_minutes"],
                      "steps": card["train"]["steps_done"]}, indent=1))
    return 0


def register(subparsers) -> None:
    """Add the ``train`` subcommand to the main ``treespec`` parser."""
    p = subparsers.add_parser("train", help="train a drafter on the target's own features (ShareGPT)")
    p.add_argument("kind", choices=KINDS, help="which drafter")
    p.add_argument("--out", required=True, help="output directory (checkpoint, card, resumable state)")
    p.add_argument("--minutes", type=float, default=15.0, help="training wall-clock budget of this run")
    p.add_argument("--steps", type=int, default=0, help="fixed number of steps instead of --minutes")
    p.add_argument("--model", default="smollm2-135m", help="target name")
    p.add_argument("--sequences", type=int, default=1024, help="ShareGPT exchanges in the feature cache")
    p.add_argument("--max-len", type=int, default=256, help="tokens per exchange")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=4096, help="eagle3 reduced vocabulary size")
    p.add_argument("--unroll-ramp", type=float, default=0.5,
                   help="eagle3/mtp: share of steps over which unroll depths grow 1 -> 3 (0 = 3 from the start)")
    p.add_argument("--negatives", type=int, default=None,
                   help="uniform negative ids per step in the KD softmax (default 4096 for small, else 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="warm start from a checkpoint of the same kind (new optimizer and schedule)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.set_defaults(func=cmd_train)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treespec-train")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
