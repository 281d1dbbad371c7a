"""Data-parallel training across processes (``torchrun``): who am I, and the few collectives used.

Glossary:
    rank / world   this process's index / the number of processes (``RANK`` / ``WORLD_SIZE``,
                   set by ``torchrun``); ``local_rank`` picks the GPU on a node.
    part           one micro-batch of a step. A step's global batch is ``parts = world x
                   grad_accum`` parts of ``batch_size`` sequences, part k read from data stream k
                   (``treespec.train.shards.ShardStream``); rank r computes parts
                   r * accum .. (r + 1) * accum - 1. The loss is the mean of the parts' losses, so
                   N processes and 1 process with ``grad_accum = N`` take the same steps.
Backends: gloo on CPU, NCCL on CUDA. Gradients are averaged by ``DistributedDataParallel``;
rank 0 alone writes files.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Dist", "init_from_env"]


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls) -> "Dist":
        """This process's place in the initialised process group (a single process if none)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))

    def sum(self, values: list[float], device: torch.device | str = "cpu") -> list[float]:
        """Element-wise sum of ``values`` over all ranks (float64; the values themselves if alone)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()

    def gather_bytes(self, t: torch.Tensor, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Every rank's uint8 tensor ``t`` (same shape on all ranks), in rank order."""
        if not self.active:
            return [t]
        t = t.to(device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [o.cpu() for o in out]

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def init_from_env(device: str = "cpu", timeout_minutes: float = 720.0) -> tuple[Dist, torch.device]:
    """Join the process group ``torchrun`` describes in the environment (a no-op for one process).

    ``device``: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per process: ``cuda:LOCAL_RANK``).
    ``timeout_minutes``: how long a rank waits at a collective; extraction imbalance between ranks
    is waited out at a barrier, hence the long default.
    """
    from treespec.fastpath.device import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return Dist.current(), dev
