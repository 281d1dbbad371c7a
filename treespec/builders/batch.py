"""build_batch: grow the draft trees of many requests, ONE batched drafter call per round.

Each request's builder runs as its ``grow`` generator (``TreeBuilder``): it yields an
``ExpandCall`` where a lone builder would call its drafter. A round collects the pending call
of every request still growing and answers them all with one ``expand_batch``; each generator
then draws its children from its own generator and moves on. Requests finish in different
rounds (different budgets, early stops); the others keep going. A request's builder sees
exactly the calls and answers it would see alone, in the same order, so its draws (from its own
generator) are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from treespec.drafters.batched import BatchDrafter, Key, RequestDrafter
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import BuiltTree, ExpandCall, TreeBuilder


@dataclass(frozen=True)
class BuildJob:
    """One request's tree for this step: its key in the BatchDrafter, its builder (its own
    budget), its root token, sampling config and generator."""

    key: Key
    builder: TreeBuilder
    root_token: int
    sampling: SamplingConfig
    generator: torch.Generator | None


def build_batch(drafter: BatchDrafter, jobs: Sequence[BuildJob]) -> list[BuiltTree]:
    """The BuiltTree of every job, in job order (see the module docstring). A builder without
    ``grow`` builds alone through a ``RequestDrafter`` (one drafter call per request)."""
    built: dict[Key, BuiltTree] = {}
    growing: dict[Key, tuple] = {}           # key -> (generator, its pending ExpandCall)

    def advance(key: Key, steps, answer) -> None:
        try:
            call = steps.send(answer)
        except StopIteration as done:
            built[key] = done.value
            return
        if not isinstance(call, ExpandCall):
            raise TypeError(f"a builder's grow() must yield ExpandCall, got {type(call).__name__}")
        growing[key] = (steps, call)

    for job in jobs:
        view = RequestDrafter(drafter, job.key)
        grow = getattr(job.builder, "grow", None)
        if grow is None:
            built[job.key] = job.builder.build(view, job.root_token, job.sampling, job.generator)
        else:
            advance(job.key, grow(view, job.root_token, job.sampling, job.generator), None)
    while growing:
        keys = list(growing)
        answers = drafter.expand_batch([(k, growing[k][1].tree, growing[k][1].nodes) for k in keys])
        for key, answer in zip(keys, answers):
            steps = growing.pop(key)[0]
            advance(key, steps, answer)
    return [built[job.key] for job in jobs]
