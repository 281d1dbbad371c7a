"""Drafters: anything that proposes next-token distributions cheaply.

Registered names resolve through ``treespec.load_drafter(name, target)``.
"""

from treespec.drafters.base import (
    Drafter, PartialTree, TargetFeatures, drafter_factory, register_drafter, registered_drafters,
)
from treespec.drafters.lookup import LookupConfig, LookupDrafter
from treespec.drafters.model import ModelDrafter, early_exit_model
# Trained drafters (checkpoints under checkpoints/<target>/); importing registers their names.
from treespec.drafters.eagle import EagleDrafter  # noqa: E402  "eagle", "eagle3"
from treespec.drafters import medusa, mtp, small  # noqa: E402,F401  "medusa", "mtp", "small"

__all__ = [
    "Drafter", "EagleDrafter", "LookupConfig", "LookupDrafter", "ModelDrafter", "PartialTree", "TargetFeatures", "drafter_factory",
    "early_exit_model", "load_drafter", "register_drafter", "registered_drafters",
]


def load_drafter(name: str, target, **options) -> Drafter:
    """Build the registered drafter ``name`` for ``target`` (a treespec.Target). The drafter
    remembers ``name`` as ``registry_name`` (calibrations are keyed by it)."""
    drafter = drafter_factory(name)(target, **options)
    try:
        drafter.registry_name = name
    except AttributeError:  # a drafter with __slots__ or a read-only name: keyed by cost kind
        pass
    return drafter
