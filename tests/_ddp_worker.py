"""One rank of the data-parallel test (launched by torch.distributed.run from test_ddp.py):
trains a drafter for the tiny target on the test's feature shards (or online, on the synthetic
source) under gloo."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from treespec.targets.loader import tiny_target
from treespec.train.dist import init_from_env
from treespec.train.loop import TrainConfig, train_drafter
from treespec.train.recipes import RecipeConfig

from _shards import V, heldout_config, online_data


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="eagle3")
    ap.add_argument("--shards", default=None)
    ap.add_argument("--online", action="store_true", help="train online on the synthetic source")
    ap.add_argument("--out", required=True)
    ap.add_argument("--held", required=True, help="cache root holding the synthetic held-out split")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--interrupt-after", type=int, default=None,
                    help="first stop after this many steps, then resume in the same process group")
    args = ap.parse_args()
    init_from_env("cpu")
    cfg = TrainConfig(steps=args.steps, batch_size=2, max_len=32, warmup=2, save_every_s=1e9, autocast="fp32",
                      recipe=RecipeConfig(draft_vocab=16, frequent=8, subset_top=4))
    target = tiny_target(vocab_size=V, seed=0)
    kw = dict(shards=args.shards, online=online_data() if args.online else None, cache_root=args.held,
              heldout=heldout_config(), progress=False)
    if args.interrupt_after is not None:      # stop half-way (state saved, no export), then resume
        assert train_drafter(args.kind, target, args.out, cfg, interrupt_after=args.interrupt_after, **kw) is None
    train_drafter(args.kind, target, args.out, cfg, **kw)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
