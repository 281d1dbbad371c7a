"""Drafters: anything that proposes next-token distributions cheaply.

``treespec.load_drafter(name, target)`` resolves ``name`` as a registered name
(``registered_drafters()``), a ``package.module:factory`` reference, or an entry point of the
``treespec.drafters`` group (``plugin_drafters()``); every command's ``--drafter`` goes through it.
"""

import inspect

import torch

from treespec.drafters.base import (
    ENTRY_POINT_GROUP, Drafter, PartialTree, TargetFeatures, check_drafter_protocol, drafter_factory, drafter_key,
    merged_options, missing_members, plugin_drafters, register_drafter, registered_drafters, split_drafter_key,
)
from treespec.drafters.batched import BatchDrafter, LoopBatchDrafter, as_batch_drafter
from treespec.drafters.lookup import LookupConfig, LookupDrafter
from treespec.drafters.hybrid import HybridConfig, HybridDrafter, SwitchDrafter  # "hybrid", "switch", "lookup+eagle3", ...
from treespec.drafters.model import ModelDrafter, early_exit_model
# Trained drafters (checkpoints under checkpoints/<target>/); importing registers their names.
from treespec.drafters.eagle import EagleDrafter  # noqa: E402  "eagle", "eagle3"
from treespec.drafters import medusa, mtp  # noqa: E402,F401  "medusa", "mtp"

__all__ = [
    "BatchDrafter", "LoopBatchDrafter", "as_batch_drafter",
    "Drafter", "EagleDrafter", "HybridConfig", "HybridDrafter", "LookupConfig", "LookupDrafter", "ModelDrafter",
    "SwitchDrafter",
    "ENTRY_POINT_GROUP", "PartialTree", "TargetFeatures", "check_drafter_protocol", "drafter_factory", "drafter_key",
    "missing_members", "plugin_drafters", "split_drafter_key",
    "early_exit_model", "load_drafter", "register_drafter", "registered_drafters",
]


def load_drafter(name: str, target, **options) -> Drafter:
    """Build the drafter ``name`` for ``target`` (a treespec.Target). ``name`` is a registered
    name, a ``package.module:factory`` reference or a ``treespec.drafters`` entry point
    (``drafter_factory``). ``options`` go to the factory (e.g. lookup's ``min_ngram``); a name
    it does not take is a ValueError. ``name`` may carry options itself, as
    ``"qwen2.5-coder-0.5b[weights=int4]"``. What the factory returns must be a Drafter: a
    TypeError names each protocol member it lacks.

    A drafter with a model of its own gets the target's linear layers' path (packed as the
    target's are); for a target with compiled passes,
    :func:`treespec.runtime.compiled.compile_drafter_for` compiles its calls too.

    The drafter remembers ``drafter_key(name, options)`` as ``registry_name``: calibrations
    are keyed by it, so a drafter loaded with other options is measured on its own."""
    name, options = merged_options(name, options)
    factory = drafter_factory(name)
    params = inspect.signature(factory).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = list(params)[1:]   # after the target
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise ValueError(f"drafter {name!r} takes no option {', '.join(map(repr, unknown))}; its options are "
                             f"{takes or 'none'}")
    drafter = factory(target, **options)
    check_drafter_protocol(drafter, f"drafter {name!r}")
    _pack_like_target(drafter, target)
    try:
        drafter.registry_name = drafter_key(name, options)
    except AttributeError:  # a drafter with __slots__ or a read-only name: keyed by cost kind
        pass
    return drafter


def _pack_like_target(drafter, target) -> None:
    """Give a drafter's own linear layers the target's fast path (``treespec.fastpath.packing``):
    packed when the target's are. Drafters run in the target's dtype, so the same rule holds."""
    from contextlib import nullcontext

    from treespec.fastpath.kernels import block_store
    from treespec.fastpath.packing import PackedLinear, linear_kernel, pack_linears
    from treespec.targets.loader import blocks_store_dir

    if not any(isinstance(m, PackedLinear) for m in target.model.modules()):
        return
    for attr in ("head", "model", "vocab_head"):
        module = getattr(drafter, attr, None)
        if isinstance(module, torch.nn.Module) and module is not target.model:
            # an independent drafter model's blocks are kept for the next load (the 0.5B's take
            # a minute to check; a trained head is small and changes as it trains), and it takes
            # an x8 target's kernel: its drafts need no exact product, and x8 halves its passes
            kernel = "x8" if attr == "model" and linear_kernel(target.model) == "x8" else None
            with block_store(blocks_store_dir()) if attr == "model" else nullcontext():
                pack_linears(module, kernel=kernel)
