"""MTP / NextN drafter: a DeepSeek-V3-style sequential module sharing the trunk's embedding and head.

One module, applied recursively (depth d feeds its own output to depth d + 1):
    x_t  = W [ RMSNorm(h_t) ‖ RMSNorm(embed(x_{t+1})) ]        (W: 2H -> H)
    h'_t = TransformerBlock(x_t)                               (one Llama-style block)
    q(x_{t+2}) = softmax(lm_head(final_norm(h'_t)))            (the target's own norm + head)
h_t is the target's last hidden state at committed positions and the module's own output h'
of the parent at tree nodes. Slots, positions and the stable cache are those of
``treespec.drafters.feature.FeatureDrafter``; what differs from EAGLE is the normalisation (both
inputs normalised, output through the trunk's final norm) and the training (DeepSeek's
sequential depths: depth k runs over the whole sequence on depth k - 1's outputs, CE-style
distillation only, no feature regression; see ``treespec.train``).
"""

from __future__ import annotations

import torch
from torch import nn

from treespec.drafters.base import register_drafter
from treespec.drafters.feature import (
    FeatureDrafter, FeatureHead, HeadConfig, RMSNorm, Trunk, load_feature_drafter, register_head,
)


class MTPHead(FeatureHead):
    """DeepSeek-V3 MTP module (see the module docstring)."""

    def __init__(self, cfg: HeadConfig, trunk: Trunk):
        super().__init__(cfg, trunk, cfg.hidden_size)
        h = cfg.hidden_size
        self.hid_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.emb_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.proj = nn.Linear(2 * h, h, bias=False)
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)

    def block_inputs(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.proj(torch.cat((self.hid_norm(feat), self.emb_norm(emb)), dim=-1))
        return self.attn_norm(x), x

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return self.trunk.lm_head(self.trunk.norm(g))


class MTPDrafter(FeatureDrafter):
    """A FeatureDrafter around an MTPHead (stable cache of the module over committed positions)."""


register_head("mtp", lambda cfg, trunk, d2t: MTPHead(cfg, trunk), MTPDrafter)


@register_drafter("mtp")
def _mtp_factory(target, checkpoint: str | None = None, weights: str = "auto") -> FeatureDrafter:
    """DeepSeek-V3-style MTP module on SmolLM2's last hidden state, shipped checkpoint by default."""
    return load_feature_drafter(target, "mtp", checkpoint, weights)
