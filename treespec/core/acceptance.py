"""What every acceptance rule shares: the Acceptance record, the rule names, one exact draw.

Kept apart from the rules so that the token-level rules (``rejection``) and the joint rules
(``joint``) import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

# Residual mass under which a rejection is round-off, not probability (see module docstring).
_NULL_MASS = 1e-12

# Acceptance rules: token-level (this module, every tree), block (chains) and traversal (trees),
# the last two in treespec.core.joint. All exact.
VerifyRule = Literal["token", "block", "traversal"]
VERIFY_RULES: tuple[str, ...] = ("token", "block", "traversal")


@dataclass(frozen=True)
class Acceptance:
    """Result of verifying one tree.

    Attributes:
        path:           LongTensor[A]; accepted node indices, root excluded, root -> leaf order.
        tokens:         LongTensor[A + 1]; the accepted tokens followed by the one new token
                        (residual or bonus).
        depth_attempts: tuple[int, ...] of length D; 1 where the walk stood at depth d with at
                        least one child to try (so depth d + 1 was attempted).
        depth_accepts:  tuple[int, ...] of length D; 1 where a child at depth d + 1 was accepted.
        children_tried: total number of child tokens tested.
    """

    path: torch.Tensor
    tokens: torch.Tensor
    depth_attempts: tuple[int, ...]
    depth_accepts: tuple[int, ...]
    children_tried: int

    @property
    def num_accepted(self) -> int:
        return int(self.path.numel())


def _long_tensor(values: list[int]) -> torch.Tensor:
    """LongTensor from a short list (via numpy: cheaper than torch.tensor per call)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _draw(r: torch.Tensor, u: float) -> int:
    """One token from the unnormalised non-negative vector r [V] (mass > 0), uniform u."""
    cdf = torch.cumsum(r, 0, dtype=torch.float64)
    total = cdf[-1].item()
    if not total > 0.0:
        raise ValueError("cannot draw from a distribution with zero mass; target_probs has a "
                         "row that sums to 0")
    idx = int(torch.searchsorted(cdf, u * total, right=True))
    if idx >= r.numel():  # u * total rounded up to total: take the last token with mass
        idx = int(r.nonzero()[-1])
    return idx
