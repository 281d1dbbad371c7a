"""The feature-head runtime shared by EAGLE, EAGLE-3 and MTP drafters (one home for them).

Glossary:
    feature     f_t: what the target computed at committed position t, from the target hidden
                states the head asks for (``target_layers``). EAGLE: the last hidden state (post
                final norm, what the LM head reads). EAGLE-3: a linear fusion of a low, a middle
                and a high layer. MTP: the last hidden state, renormalised by the module.
    slot t      one drafter position. Its input pairs the feature f_t with the embedding of the
                token *after* position t:  slot t = (embed(x_{t+1}), f_t)  at rotary position t.
                Its output g_t is the drafter's guess of f_{t+1}; logits(g_t) is q(x_{t+2}).
    root slot   the committed slot whose token is the root (x_{t+1} = root): its logits are q of
                the root's children. For a tree node u (depth d >= 1) the slot pairs u's token
                with g of u's parent (the drafter's own predicted feature) at position
                root_pos + d.
    stable cache  the drafter's KV cache holds committed slots only, each computed from the
                target's TRUE features. ``expand`` appends a tree region after them; ``commit``
                drops the whole tree region and queues the new committed slots (old root +
                accepted nodes, with the true features the engine passes), which are fed when
                the next root is expanded. So after any commit the cache equals the cache of a
                fresh drafter that ``begin``s on the committed tokens.

Engine conventions (treespec.drafters.base): at ``begin`` features cover prompt_ids[:-1], so
slots 0 .. P-2 pair (prompt_ids[t + 1], f_t) and slot P-2 is the root slot. At ``commit`` the
features cover the old root and the accepted nodes and ``tokens`` are the accepted tokens + the
new token: new slot i pairs (tokens[i], features[i]).

Here: ``HeadConfig``, ``Trunk`` (the target's frozen modules a head shares), ``RMSNorm``,
``DraftBlock`` (one Llama-style block), ``FeatureHead`` (the base every head subclasses),
``FeatureDrafter`` (begin / expand / commit over a head), and the head registry: each head
module (``treespec.drafters.eagle``: eagle, eagle3; ``treespec.drafters.mtp``: mtp) registers
how to build its head and which drafter class drives it, so ``build_head``, ``drafter_for`` and
``load_feature_drafter`` serve every kind without this module importing the head modules
(the old eagle <-> mtp import loop).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from treespec.drafters.base import PartialTree, TargetFeatures, fused_slots, tree_slot_mask
from treespec.fastpath.kernels import (ROW_HEAD_DIMS, draft_block_post, draft_block_pre, kernel_isa, panel_status,
                                       row_attention_kernel)
from treespec.fastpath.kvcache import GrowingLayer
from treespec.fastpath.packing import PackedLinear

HeadKind = Literal["eagle", "eagle3", "mtp"]


# ---------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HeadConfig:
    """Shape of a feature head (defaults follow the target's own decoder layer)."""

    kind: HeadKind
    hidden_size: int                  # H, equal to the target's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    target_layers: tuple[int, ...]    # HF hidden_states indices the head reads
    draft_vocab: int = 0              # EAGLE-3's reduced vocabulary size; 0 = the target's vocab
    embed_scale: float = 1.0          # EAGLE: constant factor on the token embedding before fc

    @classmethod
    def for_target(cls, kind: HeadKind, config, draft_vocab: int = 0) -> "HeadConfig":
        """A head shaped like one decoder layer of ``config`` (a HF Llama-style config)."""
        layers = config.num_hidden_layers
        if kind == "eagle3":  # EAGLE-3's low / middle / high layers: 2, L // 2, L - 3
            target_layers = (min(2, layers), layers // 2, max(layers - 3, 0))
        else:
            target_layers = (layers,)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        return cls(
            kind=kind,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            intermediate_size=config.intermediate_size,
            rope_theta=theta,
            rms_norm_eps=float(config.rms_norm_eps),
            target_layers=target_layers,
            draft_vocab=draft_vocab if kind == "eagle3" else 0,
        )

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layers"] = list(self.target_layers)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "HeadConfig":
        return cls(**{**d, "target_layers": tuple(d["target_layers"])})


@dataclass
class Trunk:
    """The target's frozen modules a head shares (never saved with the head).

    embed: token embedding; lm_head: the output projection [V, H]; norm: the final norm.
    """

    embed: nn.Module
    lm_head: nn.Module
    norm: nn.Module

    @classmethod
    def of(cls, model: nn.Module) -> "Trunk":
        inner = model.model
        return cls(inner.embed_tokens, model.get_output_embeddings(), inner.norm)


# ---------------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:   # one fused op (the same arithmetic, fp32 throughout)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class DraftBlock(nn.Module):
    """One Llama-style decoder block whose attention reads ``in_dim`` inputs.

    forward(attn_in [B, T, in_dim], residual [B, T, H], pos LongTensor[B, T],
            past (k, v) each [B, Hkv, S, d], None, or an HF cache layer holding them (its
            ``update`` appends the new positions: a drafter's GrowingLayer), mask BoolTensor[B|1, 1, T, S + T])
        -> (out [B, T, H], (k, v) of the T new positions, each [B, Hkv, T, d])
    Every mask row must allow at least one key (its own position).
    """

    def __init__(self, cfg: HeadConfig, in_dim: int):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(in_dim, nh * d, bias=False)
        self.k_proj = nn.Linear(in_dim, nkv * d, bias=False)
        self.v_proj = nn.Linear(in_dim, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _fused_layers(self, attn_in, past, mask) -> tuple[list, str | None] | None:
        """(the seven layers' integer blocks, their ISA) where a drafting call can take the fused
        kernels (``treespec.fastpath.kernels.draft_block_pre`` / ``_post``): no autograd, one
        fp32 CPU sequence appending to a cache layer under a bool mask, every linear layer on the
        vector block kernel, the row attention kernel available. Else None (the module path)."""
        if (past is None or isinstance(past, tuple) or attn_in.shape[0] != 1
                or not self._row_attention_applies(attn_in, mask, 1, attn_in.shape[1])):
            return None
        layers = (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj, self.down_proj)
        if not all(isinstance(layer, PackedLinear) for layer in layers) or len({l.isa for l in layers}) != 1:
            return None
        blocks = [layer.blocks() for layer in layers]
        if any(b is None for b in blocks) or self.mlp_norm.weight.dtype != torch.float32:
            return None
        return blocks, layers[0].isa

    def _forward_fused(self, attn_in, residual, pos, past, mask, blocks, isa):
        """``forward`` in two compiled calls around the cache update (same formulas, float32)."""
        t = attn_in.shape[1]
        q, k, v = draft_block_pre(attn_in.reshape(t, -1).contiguous(), pos.reshape(t).contiguous(), self.inv_freq,
                                  self.nh, self.nkv, self.d, blocks[:3], isa)
        # [T, nkv d] -> [1, nkv, T, d]
        k = k.view(1, t, self.nkv, self.d).transpose(1, 2)
        v = v.view(1, t, self.nkv, self.d).transpose(1, 2)
        k_all, v_all = past.update(k, v)
        out = draft_block_post(q, k_all, v_all, mask, residual.reshape(t, -1).contiguous(), self.mlp_norm.weight,
                               self.mlp_norm.eps, self.nh, self.d, blocks[3:], isa)
        return out.view(1, t, -1), (k, v)

    def _attend(self, q, k_all, v_all, mask) -> torch.Tensor:
        """softmax(q K^T / sqrt(d)) V under ``mask`` -> [B, T, nh, d]. Drafting (no autograd, fp32
        on a CPU with the AVX-512 kernels) takes the row kernel of the amx targets, which reads
        each grouped KV head in place for a few rows at a fraction of SDPA's fixed cost
        (``treespec.fastpath.attention``); training and every other case take SDPA."""
        if self._row_attention_applies(q, mask, q.shape[0], q.shape[2]):
            return row_attention_kernel(q, k_all, v_all, mask, self.d ** -0.5)
        o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=self.nkv != self.nh)
        return o.transpose(1, 2)

    def _row_attention_applies(self, x: torch.Tensor, mask, batch: int, rows: int) -> bool:
        """Whether attention over ``rows`` query rows of ``batch`` sequences (x: any of the call's
        tensors, for its dtype and device) takes the row kernel: no autograd, fp32 on the CPU, a
        bool mask [batch, 1, rows, S], the kernel available."""
        return (not torch.is_grad_enabled() and x.dtype == torch.float32 and x.is_cpu and mask is not None
                and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[:3] == (batch, 1, rows)
                and self._row_kernel())

    def _row_kernel(self) -> bool:
        """Whether the row attention kernel serves this block (AVX-512 kernels built, d compiled for)."""
        usable = self.__dict__.get("_row_usable")
        if usable is None:
            usable = self.d in ROW_HEAD_DIMS and panel_status()[0] and kernel_isa() == "avx512"
            self.__dict__["_row_usable"] = usable
        return usable

    def rope(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [B, 1, T, d]
        ang = pos[..., None].float() * self.inv_freq
        ang = torch.cat((ang, ang), dim=-1)[:, None]
        return ang.cos(), ang.sin()

    def forward(self, attn_in, residual, pos, past, mask):
        if (fused := self._fused_layers(attn_in, past, mask)) is not None:
            return self._forward_fused(attn_in, residual, pos, past, mask, *fused)
        b, t, _ = attn_in.shape
        # (B, nh, T, d) / (B, nkv, T, d)
        q = self.q_proj(attn_in).view(b, t, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(attn_in).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = self.v_proj(attn_in).view(b, t, self.nkv, self.d).transpose(1, 2)
        cos, sin = self.rope(pos)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is None or isinstance(past, tuple):
            k_all = k if past is None else torch.cat((past[0], k), dim=2)
            v_all = v if past is None else torch.cat((past[1], v), dim=2)
        else:   # a cache layer (the drafter's GrowingLayer): appends the new rows, returns them all
            k_all, v_all = past.update(k, v)
        h = residual + self.o_proj(self._attend(q, k_all, v_all, mask).reshape(b, t, self.nh * self.d))
        m = self.mlp_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m)), (k, v)


# ---------------------------------------------------------------------------------------- heads
class FeatureHead(nn.Module):
    """Base of the heads driven by ``FeatureDrafter`` (see the module docstring).

    Subclasses define ``fuse`` (target hidden states -> feature f), ``block_inputs`` (token
    embedding + feature -> block attention input and residual) and ``logits`` (block output g
    -> logits over the draft vocabulary).
    """

    def __init__(self, cfg: HeadConfig, trunk: Trunk, in_dim: int):
        super().__init__()
        self.cfg = cfg
        self.trunk = trunk           # plain attribute: the target's modules are not ours
        self.block = DraftBlock(cfg, in_dim)

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layers

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """LongTensor[Vd] mapping draft ids to target ids, or None when Vd = V."""
        return None

    def fuse(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """[..., H] feature from the target hidden states (each [..., H])."""
        return hidden[self.cfg.target_layers[-1]]

    def block_inputs(self, emb: torch.Tensor, feat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, tokens, feat, pos, past=None, mask=None):
        """tokens LongTensor[B, T], feat [B, T, H] -> (g [B, T, H], (k, v)); see DraftBlock."""
        with torch.no_grad():
            emb = self.trunk.embed(tokens)
        attn_in, residual = self.block_inputs(emb.to(feat.dtype), feat)
        return self.block(attn_in, residual, pos, past, mask)


# ---------------------------------------------------------------------------------------- registry
# kind -> (build(cfg, trunk, d2t) -> FeatureHead, FeatureDrafter subclass). Filled when the head
# modules are imported (``treespec.drafters`` imports them all); a duplicate kind is an error.
_HEADS: dict[str, tuple[Callable[..., "FeatureHead"], type]] = {}


def register_head(kind: str, build: Callable[..., "FeatureHead"], drafter_cls: type) -> None:
    """Register how to build heads of ``kind`` and the drafter class that drives them."""
    if kind in _HEADS:
        raise ValueError(f"a feature head kind {kind!r} is already registered")
    _HEADS[kind] = (build, drafter_cls)


def _head_entry(kind: str) -> tuple[Callable[..., "FeatureHead"], type]:
    try:
        return _HEADS[kind]
    except KeyError:
        raise ValueError(f"unknown feature head kind {kind!r}; expected {', '.join(sorted(_HEADS))}") from None


def build_head(cfg: HeadConfig, trunk: Trunk, d2t: torch.Tensor | None = None) -> "FeatureHead":
    """The head of ``cfg.kind`` (``d2t`` is required for eagle3)."""
    return _head_entry(cfg.kind)[0](cfg, trunk, d2t)


# ---------------------------------------------------------------------------------------- runtime
class FeatureDrafter:
    """Drives a FeatureHead through begin / expand / commit with a stable cache.

    State between calls: ``cache``, the head's KV cache (a ``GrowingLayer``: keys and values
    [1, Hkv, S, d] written in place, committed slots first, then the tree region of the current
    tree), ``committed`` (S of committed slots), ``pending`` (tokens and
    features of committed slots not yet fed), per-tree maps node -> g and node -> cache slot.
    """

    needs_target_hidden = True
    path_independent = False
    head_weights = "trained"     # or "int8": the head's linear layers rounded to 8-bit blocks (load_feature_drafter)

    def __init__(self, head: FeatureHead, vocab_size: int):
        self.head = head.eval().requires_grad_(False)
        self.vocab_size = int(vocab_size)
        self.target_layers = head.target_layers
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        d2t = head.draft_to_target
        self.d2t = None if d2t is None else d2t.to(self.device)
        self.calls = 0
        # the head's calls compiled over a static cache (treespec.runtime.compiled.compile_drafter),
        # or None: eager calls over a growing cache
        self.compiled = None
        self._reset()

    def _reset(self) -> None:
        self.cache = GrowingLayer()
        if self.compiled is not None:
            self.compiled.length = 0
        self.committed = 0
        self.pending_tokens: list[int] = []
        self.pending_feats: torch.Tensor | None = None
        self.root_token: int | None = None
        self.root_pos = -1
        self.g: dict[int, torch.Tensor] = {}
        self.slot: dict[int, int] = {}

    # ------------------------------------------------------------------ protocol
    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        self._reset()
        ids = [int(t) for t in prompt_ids.tolist()]
        self.root_token = ids[-1]
        self._queue(ids[1:], features)

    @torch.inference_mode()
    def _expand_draft(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        """Draft-vocabulary logits [F, Vd] (Vd = V without a reduced vocabulary)."""
        if self.root_token is None:
            raise RuntimeError("call begin() before expand()")
        if 0 in nodes:
            if len(nodes) != 1:
                raise ValueError("the root must be expanded on its own, before any other node")
            if tree.tokens[0] != self.root_token:
                raise ValueError(f"root token {tree.tokens[0]} is not the last committed token {self.root_token}")
            if 0 in self.g:
                raise ValueError("the root was already expanded for this tree")
            return self._expand_root()
        bad = [n for n in nodes if tree.parents[n] not in self.g or n in self.g]
        if bad:
            raise ValueError(f"nodes {bad} cannot be expanded: each node is expanded once, after its parent")
        base = self._cached()
        toks = torch.tensor([tree.tokens[n] for n in nodes], device=self.device)[None]
        feat = torch.stack([self.g[tree.parents[n]] for n in nodes])[None]
        pos = torch.tensor([self.root_pos + tree.depth[n] for n in nodes], device=self.device)[None]
        # [F, base + F]: committed slots ‖ ancestors' tree slots ‖ self
        allowed = tree_slot_mask(tree, nodes, self.slot, self.committed, base, self.device)
        g = self._run(toks, feat, pos, allowed)
        for row, n in enumerate(nodes):
            self.g[n] = g[row]
            self.slot[n] = base + row
        return self.head.logits(g)

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        return self._full_logits(self._expand_draft(tree, nodes))

    def expand_compact(self, tree: PartialTree, nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``expand`` over the draft vocabulary only: (logits [F, Vd] float32, target ids [Vd]),
        ids None when the head scores the whole vocabulary. Builders use it to keep their
        O(V) passes (softmax, top-k, draws) on Vd columns instead of V."""
        return self._expand_draft(tree, nodes).float(), self.d2t

    def batched(self):
        """The batched form (``treespec.drafters.batched``): one head forward for every request
        of a step, the head shared."""
        from treespec.drafters.batch_feature import BatchFeatureDrafter

        return BatchFeatureDrafter(self.head, self.vocab_size)

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        toks = [int(t) for t in tokens.tolist()]
        if features.length != len(toks):
            raise ValueError(f"commit needs features for the old root and the {len(toks) - 1} accepted "
                             f"nodes ({len(toks)} rows), got {features.length}")
        # Stable cache: drop every tree slot (and a featureless temporary root slot).
        if (extra := self._cached() - self.committed) > 0:
            if self.compiled is not None:
                self.compiled.length -= extra
            else:
                self.cache.crop(-extra)
        self.g, self.slot = {}, {}
        self.root_token = toks[-1]
        self._queue(toks, features)

    # ------------------------------------------------------------------ internals
    def _queue(self, tokens: list[int], features: TargetFeatures) -> None:
        """Queue committed slots (tokens[i], feature row i) to be fed at the next root expansion."""
        feats = fused_slots(self.head, self.target_layers, self.device, self.dtype, tokens, features)
        if feats is None:
            return
        self.pending_tokens += tokens
        self.pending_feats = feats if self.pending_feats is None else torch.cat((self.pending_feats, feats))

    def _expand_root(self) -> torch.Tensor:
        """Feed the pending committed slots; returns the root slot's draft logits [1, Vd]."""
        n = len(self.pending_tokens)
        if n == 0:
            # A one-token prompt: no target feature yet. The root gets a temporary slot with a
            # zero feature at position 0, dropped at commit like a tree slot.
            toks = torch.tensor([[self.root_token]], device=self.device)
            feat = torch.zeros(1, 1, self.head.cfg.hidden_size, device=self.device, dtype=self.dtype)
            allowed = torch.ones(1, 1, dtype=torch.bool, device=self.device)
            g = self._run(toks, feat, torch.zeros(1, 1, dtype=torch.long, device=self.device), allowed)
            self.root_pos, self.slot[0] = 0, 0
        else:
            s = self.committed
            toks = torch.tensor(self.pending_tokens, device=self.device)[None]
            pos = torch.arange(s, s + n, device=self.device)[None]
            allowed = torch.ones(n, s + n, dtype=torch.bool, device=self.device)
            allowed[:, s:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            g = self._run(toks, self.pending_feats[None], pos, allowed)
            self.committed = s + n
            self.root_pos = s + n - 1
            self.pending_tokens, self.pending_feats = [], None
        self.g[0] = g[-1]
        return self.head.logits(g[-1:])

    def _run(self, toks, feat, pos, allowed) -> torch.Tensor:
        """One head forward over new slots appended to the cache; returns g [T, H]."""
        self.calls += 1
        if self.compiled is not None:
            return self.compiled.run(toks, feat, pos, allowed)
        g, _ = self.head(toks, feat, pos, self.cache, allowed[None, None])   # appends to the cache
        return g[0]

    def _cached(self) -> int:
        """Slots in the head's cache (committed, then the current tree's)."""
        if self.compiled is not None:
            return self.compiled.length
        return self.cache.keys.shape[2] if self.cache.is_initialized else 0

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[F, Vd] draft logits -> [F, V] float32; tokens outside the draft vocabulary get -inf."""
        logits = logits.float()
        if self.d2t is None:
            return logits
        out = torch.full((logits.shape[0], self.vocab_size), -math.inf, device=logits.device)
        return out.index_copy_(1, self.d2t, logits)

    def committed_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of the committed slots, each [1, Hkv, S, d] (for tests)."""
        if self.compiled is not None:
            layer = self.compiled.layer
            return layer.keys[:, :, :self.committed], layer.values[:, :, :self.committed]
        if not self.cache.is_initialized:
            b = self.head.block
            empty = torch.zeros(1, b.nkv, 0, b.d, device=self.device, dtype=self.dtype)
            return empty, empty.clone()
        return self.cache.keys[:, :, : self.committed], self.cache.values[:, :, : self.committed]


# ---------------------------------------------------------------------------------------- factories
def shipped_checkpoint(target, name: str) -> Path:
    """checkpoints/<target name>/<name>.safetensors in the source tree."""
    return Path(__file__).resolve().parents[2] / "checkpoints" / target.name / f"{name}.safetensors"


def shipped_checksum(target, name: str, options: dict | None = None) -> str | None:
    """The ``weights_checksum`` of ``load_drafter(name, target, **options)`` on the shipped
    checkpoint: its tensor checksum, with ``+int8`` where a feature head's ``weights`` resolve to
    "int8" for ``target``; None when ``name`` has none (lookup, hybrid, a model drafter) or its
    header predates checksums."""
    from treespec.drafters.checkpoint import read_header

    path = shipped_checkpoint(target, name)
    checksum = read_header(path, name).get("checksum") if path.is_file() else None
    if name not in _HEADS:
        return checksum
    return _weights_checksum(checksum, head_weights((options or {}).get("weights", "auto"), target))


def _weights_checksum(checksum: str | None, weights: str) -> str | None:
    """A head's ``weights_checksum``: its checkpoint's, ``+int8`` when rounded to 8-bit blocks."""
    return f"{checksum}+int8" if checksum and weights == "int8" else checksum


def random_feature_drafter(target, kind: HeadKind, seed: int = 0, draft_vocab: int = 0,
                           scale: float = 1.0, draft_ids: torch.Tensor | None = None) -> FeatureDrafter:
    """An untrained head for ``target`` (tests): seeded init; eagle3 uses ``draft_ids`` as its
    draft vocabulary (default: the first Vd token ids)."""
    if draft_ids is not None:
        draft_vocab = draft_ids.numel()
    cfg = HeadConfig.for_target(kind, target.model.config, draft_vocab or (target.vocab_size // 2))
    trunk = Trunk.of(target.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        d2t = None
        if kind == "eagle3":
            d2t = torch.arange(cfg.draft_vocab) if draft_ids is None else draft_ids
        head = build_head(cfg, trunk, d2t)
        if scale != 1.0:
            with torch.no_grad():
                for p in head.parameters():
                    if p.dim() > 1:
                        p.mul_(scale)
    return drafter_for(head.to(target.device, target.dtype), target.vocab_size)


def drafter_for(head: FeatureHead, vocab_size: int) -> FeatureDrafter:
    """The drafter class registered for a head's kind (MTPDrafter for mtp, EagleDrafter for eagle*)."""
    return _head_entry(head.cfg.kind)[1](head, vocab_size)


# ``weights`` of a feature head: "auto" (8-bit where the target itself is stored as integer
# blocks, else as trained), "trained" (the checkpoint's numbers in the target's dtype), "int8"
# (8-bit blocks for the fp32 block kernel). Strings, so a drafter key can carry them.
HEAD_WEIGHTS = ("auto", "trained", "int8")


def head_weights(weights: str, target) -> str:
    """``weights`` (one of :data:`HEAD_WEIGHTS`) resolved for ``target``: "int8" or "trained".

    "auto" is "int8" where the target's linear layers are stored as integer blocks (the fp32
    block kernel found exact 4/8-bit blocks: SmolLM2's GGUF). There an 8-bit head reads 1.125
    bytes a weight instead of 4: the shipped eagle3's drafting phase takes 1.59 against 2.19 ms a
    step on one AMX core with its held-out acceptance unchanged
    (``benchmarks/results/head_weights_amx.md``). A target
    with no blocks (bf16, a GPU, random test weights) keeps the head as trained."""
    from treespec.fastpath.packing import BLOCK_KERNELS, linear_kernel, stores_blocks

    if weights not in HEAD_WEIGHTS:
        raise ValueError(f"weights must be one of {HEAD_WEIGHTS} ('auto': 8-bit where the target is stored as "
                         f"integer blocks, else as trained), got {weights!r}")
    if weights == "auto":
        return "int8" if stores_blocks(target.model) else "trained"
    if weights == "int8" and (kernel := linear_kernel(target.model)) not in BLOCK_KERNELS:
        raise ValueError(f"weights='int8' stores the head as 8-bit blocks for the fp32 block kernel, but the target "
                         f"{target.name!r} runs its linear layers on {kernel!r} ({target.dtype}): load it with "
                         "dtype=torch.float32, pack='blocks' (or 'amx'), or keep weights='trained'")
    return weights


def load_feature_drafter(target, kind: HeadKind, checkpoint: str | Path | None = None,
                         weights: str = "auto") -> FeatureDrafter:
    """A trained head from ``checkpoint`` (default: the shipped one), validated against ``target``.

    ``weights`` (:func:`head_weights`): "int8" rounds the head's linear layers to 8-bit blocks
    (:func:`treespec.fastpath.quant.round_linears_to_blocks8`); ``weights_checksum`` then gets a
    ``+int8`` suffix, so a calibration of the fp32 head is not taken for this one."""
    from treespec.drafters.checkpoint import load_checkpoint, restore_module
    from treespec.fastpath.quant import round_linears_to_blocks8

    resolved = head_weights(weights, target)
    path = Path(checkpoint) if checkpoint is not None else shipped_checkpoint(target, kind)
    state, header = load_checkpoint(path, target, kind)
    trunk = Trunk.of(target.model)
    head = restore_module(path, kind, header, state,
                          lambda arch: build_head(HeadConfig.from_json(arch), trunk, state.get("d2t")))
    head = head.to(target.device, target.dtype)
    if resolved == "int8":
        round_linears_to_blocks8(head)
    drafter = drafter_for(head, target.vocab_size)
    drafter.weights_checksum = _weights_checksum(header.get("checksum"), resolved)
    drafter.head_weights = resolved
    return drafter
