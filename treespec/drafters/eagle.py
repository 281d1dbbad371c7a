"""EAGLE (EAGLE-2 style) and EAGLE-3 feature heads.

Heads: ``EagleHead`` (fc[embed ‖ f] -> one decoder block -> the target's frozen LM head; the
block output regresses f_{t+1}), ``Eagle3Head`` (f = fc[norm f_low ‖ norm f_mid ‖ norm f_high];
the block's attention reads [norm embed ‖ norm h]; logits over a reduced draft vocabulary
through the target's LM-head rows of those tokens; ``draft_to_target`` maps draft ids to
target ids). Slots, features, the stable cache and the runtime (``FeatureDrafter``) are shared
with ``treespec.drafters.mtp`` and live in ``treespec.drafters.feature`` (see its glossary);
the names below are re-exported from there so ``treespec.drafters.eagle.X`` keeps working.
"""

from __future__ import annotations

import torch
from torch import nn

from treespec.drafters.base import register_drafter
from treespec.drafters.feature import (  # noqa: F401  (re-exported: the pre-split import paths)
    DraftBlock, FeatureDrafter, FeatureHead, HeadConfig, HeadKind, RMSNorm, Trunk, build_head, drafter_for,
    load_feature_drafter, random_feature_drafter, register_head, shipped_checkpoint,
)


class EagleHead(FeatureHead):
    """EAGLE-1/2: g = Block(fc[embed(x_{t+1}) ‖ f_t]); q = softmax(lm_head(g)); g ≈ f_{t+1}."""

    def __init__(self, cfg: HeadConfig, trunk: Trunk):
        super().__init__(cfg, trunk, cfg.hidden_size)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)

    def block_inputs(self, emb, feat):
        x = self.fc(torch.cat((emb * self.cfg.embed_scale, feat), dim=-1))
        return self.attn_norm(x), x

    def logits(self, g):
        return self.trunk.lm_head(g)


class Eagle3Head(FeatureHead):
    """EAGLE-3: fused low/mid/high features, attention over [norm embed ‖ norm h], draft vocab.

    ``d2t`` (LongTensor[Vd], a buffer saved with the head) maps draft ids to target ids; the
    logits use the target's LM-head rows of those tokens after the head's own final norm.
    """

    def __init__(self, cfg: HeadConfig, trunk: Trunk, d2t: torch.Tensor):
        h = cfg.hidden_size
        super().__init__(cfg, trunk, 2 * h)
        if d2t.dim() != 1 or d2t.numel() != cfg.draft_vocab:
            raise ValueError(f"draft_to_target must have {cfg.draft_vocab} entries, got {tuple(d2t.shape)}")
        vocab = trunk.lm_head.weight.shape[0]
        if d2t.numel() and (int(d2t.min()) < 0 or int(d2t.max()) >= vocab):
            raise ValueError(f"draft_to_target ids must lie in [0, {vocab}) (the target's vocabulary), "
                             f"got [{int(d2t.min())}, {int(d2t.max())}]")
        if torch.unique(d2t).numel() != d2t.numel():
            raise ValueError("draft_to_target maps two draft ids to one target id")
        self.feature_norms = nn.ModuleList(RMSNorm(h, cfg.rms_norm_eps) for _ in cfg.target_layers)
        self.fc = nn.Linear(h * len(cfg.target_layers), h, bias=False)
        self.emb_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.hid_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.out_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("d2t", d2t.long().clone())

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.d2t

    def head_weight(self) -> torch.Tensor:
        """[Vd, H]: the target's LM-head rows of the draft vocabulary (frozen)."""
        return self._projection().weight

    def _projection(self) -> nn.Module:
        """The draft-vocabulary projection: a frozen linear layer over ``head_weight``'s rows,
        packed like the target's LM head when that one is a ``PackedLinear`` (on the block
        kernel the rows of a Q8_0 head stay 8-bit blocks: a quarter of the bytes a draft call
        reads through stock ``F.linear``). Rebuilt when the target's head changes (device,
        dtype, an in-place edit). Kept out of the module tree: not a parameter of the head."""
        from treespec.fastpath.packing import PackedLinear, pad_rows_for

        lm_head = self.trunk.lm_head
        w = lm_head.weight
        key = (w.device, w.dtype, w._version, type(lm_head), getattr(lm_head, "kernel", None))
        cached = self.__dict__.get("_proj")
        if cached is None or cached[0] != key:
            # a normal tensor even when first called under inference_mode (packing reads its
            # version counter)
            with torch.inference_mode(False), torch.no_grad():
                rows = w.index_select(0, self.d2t.to(w.device)).contiguous()
            linear = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(rows, requires_grad=False)
            if isinstance(lm_head, PackedLinear):
                linear = PackedLinear(linear, lm_head.min_rows, lm_head.kernel, lm_head.max_rows,
                                      pad_rows_for(rows, lm_head.pad_rows))
            cached = (key, linear)
            self.__dict__["_proj"] = cached
        return cached[1]

    def fuse(self, hidden):
        parts = [n(hidden[l]) for n, l in zip(self.feature_norms, self.cfg.target_layers)]
        return self.fc(torch.cat(parts, dim=-1))

    def block_inputs(self, emb, feat):
        return torch.cat((self.emb_norm(emb), self.hid_norm(feat)), dim=-1), feat

    def logits(self, g):
        return self._projection()(self.out_norm(g))


class EagleDrafter(FeatureDrafter):
    """EAGLE-2 / EAGLE-3 drafter: a FeatureDrafter around an EagleHead or Eagle3Head."""



def _build_eagle3(cfg: HeadConfig, trunk: Trunk, d2t: torch.Tensor | None) -> Eagle3Head:
    if d2t is None:
        raise ValueError("an eagle3 head needs its draft->target id map")
    return Eagle3Head(cfg, trunk, d2t)


register_head("eagle", lambda cfg, trunk, d2t: EagleHead(cfg, trunk), EagleDrafter)
register_head("eagle3", _build_eagle3, EagleDrafter)


@register_drafter("eagle")
def _eagle_factory(target, checkpoint: str | None = None, weights: str = "auto") -> FeatureDrafter:
    """EAGLE-2 style feature head (last hidden state), shipped checkpoint by default."""
    return load_feature_drafter(target, "eagle", checkpoint, weights)


@register_drafter("eagle3")
def _eagle3_factory(target, checkpoint: str | None = None, weights: str = "auto") -> FeatureDrafter:
    """EAGLE-3 style head (fused low/mid/high features, reduced draft vocabulary)."""
    return load_feature_drafter(target, "eagle3", checkpoint, weights)
