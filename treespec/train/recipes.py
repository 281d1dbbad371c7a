"""One recipe per drafter: how to build it, its loss, its held-out metrics and its checkpoint.

Loss choices (recorded in each card's ``loss`` field):
    eagle   EAGLE-1/2: smooth-L1 regression of the block output g_t onto the target's next
            feature f_{t+1} (weight 1) + top-k KD of lm_head(g_t) against p_{t+1} (weight 0.5),
            inputs perturbed with uniform feature noise (±0.2) so the head tolerates its own
            imperfect features at depth >= 1. Regression gives a dense 576-dim signal per token,
            which is what makes a one-layer head learn fast on little data.
    eagle3  EAGLE-3: top-k KD only (the fused input is not the target's last state, so there is
            nothing to regress onto), over a TTT unroll of 3 depths weighted 1, 0.8, 0.64, on
            the reduced draft vocabulary (target probabilities renormalised over it).
    mtp     DeepSeek-V3 MTP: top-k KD at each of 3 sequential depths (weights 1, 0.8, 0.64),
            no regression, each depth causal over the previous depth's outputs.
    Both unrolls follow a curriculum (``unroll_ramp``): 1 depth, then 2, then 3 over the first
    half of the steps. On a CPU a depth-1 step costs a third of a depth-3 step, so the head
    first learns the shallow prediction cheaply, then adapts to its own features.
    medusa  Medusa-2 self-distillation: top-k KD of head k against p_{t+k}, weights 0.8^(k-1).
Why distillation rather than cross-entropy on the ShareGPT tokens: acceptance is
sum min(p, q) = 1 - TVD(p, q) and greedy acceptance is argmax agreement, both functions of the
*target's* distribution; the ShareGPT replies were written by another model, so their tokens
would teach that model's law instead. Forward KL to p bounds the TVD (Pinsker) and is smooth.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from treespec.drafters.eagle import FeatureHead, HeadConfig, Trunk, build_head
from treespec.drafters.medusa import MedusaConfig, MedusaHeads
from treespec.train.data import Batch
from treespec.train.objectives import (
    DepthMetrics, VocabSubset, _shift, depth_view, masked_mean, sequential_unroll, topk_kd, ttt_unroll,
)

EVAL_DEPTHS = 4
DEPTH_WEIGHTS = (1.0, 0.8, 0.64, 0.512)


@dataclass(frozen=True)
class RecipeConfig:
    """Knobs of a recipe (stored in the card)."""

    draft_vocab: int = 4096          # eagle3's reduced vocabulary
    frequent: int = 2048             # always-present ids of the KD candidate set S
    subset_top: int = 8              # + the target's top-n ids at the batch's positions
    negatives: int = 0               # + this many uniformly drawn ids (sampled softmax)
    feature_noise: float = 0.2       # eagle: uniform input-feature noise amplitude
    reg_weight: float = 1.0          # eagle: smooth-L1 weight
    kd_weight: float = 0.5           # eagle: KD weight
    unroll: int = 3                  # eagle3 TTT depths / mtp sequential depths (at the end)
    unroll_ramp: float = 0.5         # depths grow 1 -> unroll over this fraction of the steps
    medusa_heads: int = 4
    embed_rms_match: bool = True     # eagle: scale embeddings to the features' RMS (embed_scale)


class Recipe:
    """Base: ``kind``, ``layers`` (cached target layers needed), build/loss/metrics/export."""

    kind: str
    loss_note: str

    def __init__(self, target, cfg: RecipeConfig, frequency: torch.Tensor):
        self.target = target
        self.cfg = cfg
        self.L = target.model.config.num_hidden_layers
        self.lm_w = target.model.get_output_embeddings().weight      # [V, H], frozen
        self.order = torch.sort(frequency, descending=True, stable=True).indices   # most frequent first
        self.subset = VocabSubset(self.order[: cfg.frequent], target.vocab_size, cfg.negatives)

    layers: tuple[int, ...] = ()

    def build(self, seed: int) -> nn.Module:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch, progress: float) -> tuple[torch.Tensor, dict]:
        """(loss, logged parts) of one batch; ``progress`` in [0, 1] is the largest share of its
        schedule the run has reached (it does not go back when a schedule is stretched)."""
        raise NotImplementedError

    def unroll_at(self, progress: float) -> int:
        """Depths unrolled at this point of training: 1 at the start, ``unroll`` after the ramp
        (a curriculum: one depth costs a third of three, so the head first gets many cheap steps)."""
        if self.cfg.unroll_ramp <= 0:
            return self.cfg.unroll
        return min(self.cfg.unroll, 1 + int(progress / self.cfg.unroll_ramp * (self.cfg.unroll - 1)))

    def metrics(self, model: nn.Module, batch: Batch, acc: DepthMetrics) -> None:
        raise NotImplementedError

    def export(self, model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
        raise NotImplementedError

    # helpers
    def kd_full(self, z: torch.Tensor, view, mask: torch.Tensor) -> torch.Tensor:
        """Top-k KD over the subset S with the target's LM-head rows; z: [B, T, H] head input."""
        ids = self.subset.ids(view.top_i[mask][:, : self.cfg.subset_top])
        logits = F.linear(z[mask], self.lm_w[ids])
        return topk_kd(logits, view.top_i[mask], view.top_p[mask], self.subset.lookup(ids)).mean()


# ---------------------------------------------------------------------------------- feature heads
def init_block_from_target(head: FeatureHead, target, layer: int) -> None:
    """Copy the target decoder layer ``layer`` into the head's block (the halves of a 2H-input
    attention both get the target's weights / sqrt(2))."""
    src = target.model.model.layers[layer]
    blk = head.block
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(src.self_attn, name).weight
            dst = getattr(blk, name).weight
            dst.copy_(w if dst.shape == w.shape else torch.cat((w, w), 1) / 2 ** 0.5)
        # Residual-branch outputs scaled by 0.1: the block starts close to the identity
        # (the target's late layers write huge activations a post-norm input cannot absorb).
        blk.o_proj.weight.copy_(src.self_attn.o_proj.weight * 0.1)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(blk, name).weight.copy_(getattr(src.mlp, name).weight)
        blk.down_proj.weight.mul_(0.1)
        blk.mlp_norm.weight.copy_(src.post_attention_layernorm.weight)
        if hasattr(head, "attn_norm"):
            head.attn_norm.weight.copy_(src.input_layernorm.weight)


class FeatureRecipe(Recipe):
    """eagle, eagle3 and mtp: a FeatureHead trained on cached target features."""

    def __init__(self, kind: str, target, cfg: RecipeConfig, frequency: torch.Tensor):
        super().__init__(target, cfg, frequency)
        self.kind = kind
        self.head_cfg = HeadConfig.for_target(kind, target.model.config, cfg.draft_vocab)
        if kind == "eagle" and cfg.embed_rms_match:
            # fc reads [embed ‖ f]; SmolLM2's embeddings are ~15x smaller than its post-norm
            # states, so Adam would need thousands of steps to grow the embedding half of fc.
            # A constant factor bringing the embedding to the feature's RMS fixes that.
            emb = target.model.model.embed_tokens.weight.float()
            w = target.model.model.norm.weight.float()     # post-norm RMS ~ RMS of the norm weight
            scale = float(w.pow(2).mean().sqrt() / emb.pow(2).mean().sqrt())
            self.head_cfg = dataclasses.replace(self.head_cfg, embed_scale=round(scale, 2))
        self.layers = tuple(sorted(set(self.head_cfg.target_layers) | {self.L}))
        # EAGLE-3's draft vocabulary: the most frequent target top-1 ids, in id order.
        self.d2t = self.order[: cfg.draft_vocab].sort().values if kind == "eagle3" else None
        self.loss_note = {
            "eagle": "smooth-L1(g_t, f_{t+1}) + 0.5 * top-32 KD(lm_head(g_t), p_{t+1}); uniform feature "
                     "noise 0.2; regression gives a dense per-token signal (EAGLE-1/2)",
            "eagle3": "top-32 KD on the draft vocabulary over a training-time-test unroll, depth "
                      "weights 1/0.8/0.64 (EAGLE-3); no regression: the fused input is not a target "
                      "state. Curriculum: 1 depth, then 2, then 3 over the first half of the steps",
            "mtp": "top-32 KD at sequential DeepSeek-V3 depths (each causal over the previous "
                   "depth's outputs), depth weights 1/0.8/0.64; no regression. Curriculum: 1, 2, "
                   "then 3 depths over the first half of the steps",
        }[kind]

    def build(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = build_head(self.head_cfg, Trunk.of(self.target.model), self.d2t)
        init_block_from_target(head, self.target, self.L - 1)
        h = self.head_cfg.hidden_size
        with torch.no_grad():
            if self.kind == "eagle":        # fc[embed ‖ f]: start by passing f through
                head.fc.weight[:, h:] += torch.eye(h)
                head.fc.bias.zero_()
            elif self.kind == "mtp":        # proj[norm h ‖ norm embed]: same idea
                head.proj.weight[:, :h] += torch.eye(h)
            else:                           # eagle3 fc[low ‖ mid ‖ high]: start from the high layer
                head.fc.weight.mul_(0.1)
                head.fc.weight[:, 2 * h:] += torch.eye(h)
        return head.float().train()

    def _feat0(self, head, batch: Batch) -> torch.Tensor:
        return head.fuse({l: batch.hidden[l] for l in self.head_cfg.target_layers})

    def loss(self, head, batch, progress):
        logs = {}
        if self.kind == "eagle":
            g = ttt_unroll(head, self._feat0(head, batch), batch, 1, self.cfg.feature_noise)[0]
            view = depth_view(batch, 0)
            f_next = _shift(batch.hidden[self.L], 1)
            reg = masked_mean(F.smooth_l1_loss(g, f_next, reduction="none").mean(-1), view.mask)
            kd = self.kd_full(g, view, view.mask)
            logs = {"reg": reg.item(), "kd": kd.item()}
            return self.cfg.reg_weight * reg + self.cfg.kd_weight * kd, logs
        n = self.unroll_at(progress)
        feat0 = self._feat0(head, batch)
        outs = ttt_unroll(head, feat0, batch, n) if self.kind == "eagle3" else \
            sequential_unroll(head, feat0, batch, n)
        total, wsum = 0.0, 0.0
        for j, g in enumerate(outs):
            view = depth_view(batch, j)
            if self.kind == "eagle3":
                lookup = torch.full((self.target.vocab_size,), -1, dtype=torch.long, device=head.d2t.device)
                lookup[head.d2t] = torch.arange(head.d2t.numel(), device=head.d2t.device)
                m = view.mask
                kd = topk_kd(head.logits(g[m]), view.top_i[m], view.top_p[m], lookup).mean()
            else:
                kd = self.kd_full(head.trunk.norm(g), view, view.mask)
            logs[f"kd{j}"] = kd.item()
            total = total + DEPTH_WEIGHTS[j] * kd
            wsum += DEPTH_WEIGHTS[j]
        return total / wsum, logs

    @torch.no_grad()
    def metrics(self, head, batch, acc):
        outs = ttt_unroll(head, self._feat0(head, batch), batch, EVAL_DEPTHS)
        for j, g in enumerate(outs):
            view = depth_view(batch, j)
            m = view.mask
            logits = head.logits(g[m]).float()
            if self.kind == "eagle3":
                full = torch.full((logits.shape[0], self.target.vocab_size), -torch.inf, device=logits.device)
                logits = full.index_copy_(1, head.d2t, logits)
            acc.add(j, logits.softmax(-1), view.top_i[m], view.top_p[m], torch.ones(len(logits), dtype=torch.bool, device=logits.device))

    def export(self, head):
        return dict(head.state_dict()), self.head_cfg.to_json()


# ---------------------------------------------------------------------------------- medusa
class MedusaRecipe(Recipe):
    kind = "medusa"
    loss_note = "top-32 KD of head k against p_{t+k} (Medusa-2 self-distillation), head weights 0.8^(k-1)"

    def __init__(self, target, cfg, frequency):
        super().__init__(target, cfg, frequency)
        self.layers = (self.L,)
        self.mcfg = MedusaConfig(target.model.config.hidden_size, cfg.medusa_heads, self.L)

    def build(self, seed):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MedusaHeads(self.mcfg).float().train()

    def loss(self, heads, batch, progress):
        f = batch.hidden[self.L]
        total, wsum, logs = 0.0, 0.0, {}
        for k in range(1, self.mcfg.num_heads + 1):
            view = depth_view(batch, k - 1)
            kd = self.kd_full(heads(f, k), view, view.mask)
            logs[f"kd{k}"] = kd.item()
            total = total + DEPTH_WEIGHTS[k - 1] * kd
            wsum += DEPTH_WEIGHTS[k - 1]
        return total / wsum, logs

    @torch.no_grad()
    def metrics(self, heads, batch, acc):
        f = batch.hidden[self.L]
        for j in range(EVAL_DEPTHS):
            view = depth_view(batch, j)
            m = view.mask
            z = heads(f[m], min(j + 1, self.mcfg.num_heads))
            acc.add(j, F.linear(z, self.lm_w).float().softmax(-1), view.top_i[m], view.top_p[m],
                    torch.ones(int(m.sum()), dtype=torch.bool, device=m.device))

    def export(self, heads):
        return dict(heads.state_dict()), self.mcfg.to_json()


KINDS = ("eagle", "eagle3", "medusa", "mtp")


def make_recipe(kind: str, target, cfg: RecipeConfig, frequency: torch.Tensor) -> Recipe:
    if kind in ("eagle", "eagle3", "mtp"):
        return FeatureRecipe(kind, target, cfg, frequency)
    if kind == "medusa":
        return MedusaRecipe(target, cfg, frequency)
    raise KeyError(f"unknown drafter kind {kind!r}; trainable kinds: {', '.join(KINDS)}")
