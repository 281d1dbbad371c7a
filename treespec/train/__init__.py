"""Drafter training on the target's own features and distributions.

    data        ShareGPT exchanges -> cached target features + top-k distributions (chunked)
    shards      the same, streamed into fixed-size shards with a manifest (resumable, per rank),
                and read back as bounded-memory data streams
    dist        torchrun process group (gloo / NCCL) and the few collectives the loop uses
    objectives  unrolls (TTT, sequential), top-k distillation loss, held-out depth metrics
    recipes     one recipe per drafter: build / loss / metrics / export (loss choices explained)
    loop        the seeded, resumable, time-limited loop; checkpoint + card
    cli         ``treespec train {eagle,eagle3,medusa,mtp} --minutes N --out DIR`` (or
                ``--shards DIR --tokens 10M --curve 5``); ``torchrun ... -m treespec.train ...``
"""

from treespec.train.data import DataConfig, build_cache
from treespec.train.loop import TrainConfig, heldout_of_checkpoint, train_drafter
from treespec.train.recipes import KINDS, RecipeConfig

__all__ = ["DataConfig", "KINDS", "RecipeConfig", "TrainConfig", "build_cache", "heldout_of_checkpoint",
           "train_drafter"]
