"""Medusa drafter: K parallel residual heads on the target's last hidden state.

Glossary:
    f       the target's last hidden state (post final norm) at the last committed position
            before the root, i.e. the state whose LM-head output produced the root.
    head k  ResBlock_k(f) = f + SiLU(W_k f + b_k); q_k = softmax(lm_head(ResBlock_k(f))) with the
            target's frozen LM head. Head k proposes the token k positions after the root, so a
            node at depth d gets head d + 1: q at depth d does NOT depend on the path
            (``path_independent``), only on f. Nodes deeper than K reuse the last head.

Cost: the first ``expand`` of a tree runs all K heads and the LM head once on [K, H] (the LM head
is memory-bound, so K rows cost about what one row costs); later expands of the same tree read
those K rows.

Caching: only f is kept. ``commit`` replaces it with the feature of the last accepted node (the
last row of the features the engine passes), so rollback is trivial and the state equals a
fresh drafter's built from the committed tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from treespec.drafters.base import PartialTree, TargetFeatures, register_drafter
from treespec.drafters.batched import check_calls, check_restorable


@dataclass(frozen=True)
class MedusaConfig:
    """hidden_size: H (the target's); num_heads: K; feature_layer: HF hidden_states index."""

    hidden_size: int
    num_heads: int
    feature_layer: int

    def to_json(self) -> dict:
        return asdict(self)


class MedusaHeads(nn.Module):
    """K residual blocks; ``forward(f [..., H], k)`` -> hidden for head k (1-based) [..., H]."""

    def __init__(self, cfg: MedusaConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.proj = nn.ModuleList(nn.Linear(h, h) for _ in range(cfg.num_heads))
        for lin in self.proj:                       # Medusa's init: each head starts as identity
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, f: torch.Tensor, k: int) -> torch.Tensor:
        return f + F.silu(self.proj[k - 1](f))


class MedusaDrafter:
    """Medusa heads + the target's frozen LM head (see the module docstring)."""

    needs_target_hidden = True
    path_independent = True

    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, vocab_size: int):
        self.heads = heads.eval().requires_grad_(False)
        self.lm_head = lm_head
        self.vocab_size = int(vocab_size)
        self.target_layers = (heads.cfg.feature_layer,)
        self.f: torch.Tensor | None = None          # [H] feature before the root
        self.root_token: int | None = None
        self.rows: torch.Tensor | None = None        # [K, V] logits of every head for this tree
        self.calls = 0

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        self.root_token = int(prompt_ids[-1])
        rows = features.hidden.get(self.target_layers[0])
        # A one-token prompt has no feature yet: a zero feature (heads still return valid logits).
        p = next(self.heads.parameters())
        self.f = rows[-1].to(p) if rows is not None and rows.shape[0] else \
            torch.zeros(self.heads.cfg.hidden_size, dtype=p.dtype, device=p.device)
        self.rows = None

    @torch.inference_mode()
    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        if self.f is None:
            raise RuntimeError("call begin() before expand()")
        if 0 in nodes and tree.tokens[0] != self.root_token:
            raise ValueError(f"root token {tree.tokens[0]} is not the last committed token {self.root_token}")
        k_max = self.heads.cfg.num_heads
        if self.rows is None:
            self.calls += 1
            # [K, H] -> [K, V]
            z = torch.stack([self.heads(self.f, k) for k in range(1, k_max + 1)])
            self.rows = self.lm_head(z).float()
        ks = torch.tensor([min(tree.depth[n] + 1, k_max) - 1 for n in nodes], device=self.rows.device)
        return self.rows.index_select(0, ks)

    def batched(self) -> "BatchMedusaDrafter":
        """The batched form: one heads + LM-head pass for every request of a step."""
        return BatchMedusaDrafter(self.heads, self.lm_head, self.vocab_size)

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        rows = features.hidden[self.target_layers[0]]
        if rows.shape[0] != tokens.numel():
            raise ValueError(f"commit needs {tokens.numel()} feature rows, got {rows.shape[0]}")
        self.f = rows[-1].to(next(self.heads.parameters()))
        self.root_token = int(tokens[-1])
        self.rows = None


class BatchMedusaDrafter:
    """Medusa for many requests (``treespec.drafters.batched``): per request only f (and this
    tree's [K, V] rows); the requests whose tree needs its rows get them from ONE pass of the
    K heads and the LM head over [R, K, H]."""

    needs_target_hidden = True
    path_independent = True

    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, vocab_size: int):
        self.one = MedusaDrafter(heads, lm_head, vocab_size)   # checks and begin/commit rules
        self.heads, self.lm_head = self.one.heads, lm_head
        self.vocab_size, self.target_layers = self.one.vocab_size, self.one.target_layers
        self.state: dict = {}                 # key -> (f [H], root token, rows [K, V] | None)
        self.calls = 0

    def begin(self, key, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        if key in self.state:
            raise ValueError(f"request {key!r} was already begun")
        self.one.begin(prompt_ids, features)
        self.state[key] = (self.one.f, self.one.root_token, None)

    @torch.inference_mode()
    def expand_batch(self, calls):
        check_calls(calls, self.state.__contains__)
        for key, tree, _ in calls:
            if tree.tokens[0] != self.state[key][1]:
                raise ValueError(f"root token {tree.tokens[0]} is not the last committed token "
                                 f"{self.state[key][1]}")
        need = [key for key, _, _ in calls if self.state[key][2] is None]
        if need:
            self.calls += 1
            k_max = self.heads.cfg.num_heads
            f = torch.stack([self.state[key][0] for key in need])                 # [R, H]
            z = torch.stack([self.heads(f, k) for k in range(1, k_max + 1)], 1)   # [R, K, H]
            for key, rows in zip(need, self.lm_head(z).float()):                 # [K, V] each
                self.state[key] = self.state[key][:2] + (rows,)
        out = []
        for key, tree, nodes in calls:
            rows = self.state[key][2]
            ks = torch.tensor([min(tree.depth[n] + 1, rows.shape[0]) - 1 for n in nodes], device=rows.device)
            out.append((rows.index_select(0, ks), None))
        return out

    def commit(self, key, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        self._get(key)
        self.one.commit(path, tokens, features)
        self.state[key] = (self.one.f, self.one.root_token, None)

    def drop(self, key) -> None:
        self._get(key)
        del self.state[key]

    def checkpoint(self) -> dict:
        return dict(self.state)       # (f, root token, rows) tuples, never modified in place

    def restore(self, state: dict) -> None:
        check_restorable(state, self.state)
        self.state = dict(state)

    def _get(self, key):
        if key not in self.state:
            raise KeyError(f"request {key!r} was never begun (or was dropped)")
        return self.state[key]


def random_medusa(target, num_heads: int = 4, seed: int = 0, scale: float = 0.1) -> MedusaDrafter:
    """Untrained heads with random (not identity) weights, for tests."""
    cfg = MedusaConfig(target.model.config.hidden_size, num_heads, target.model.config.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = MedusaHeads(cfg)
        for lin in heads.proj:
            nn.init.normal_(lin.weight, std=scale)
    return MedusaDrafter(heads.to(target.device, target.dtype), target.model.get_output_embeddings(),
                         target.vocab_size)


def load_medusa(target, checkpoint: str | Path | None = None) -> MedusaDrafter:
    from treespec.drafters.checkpoint import load_checkpoint, restore_module
    from treespec.drafters.feature import shipped_checkpoint

    path = Path(checkpoint) if checkpoint is not None else shipped_checkpoint(target, "medusa")
    state, header = load_checkpoint(path, target, "medusa")
    heads = restore_module(path, "medusa", header, state, lambda arch: MedusaHeads(MedusaConfig(**arch)))
    return MedusaDrafter(heads.to(target.device, target.dtype), target.model.get_output_embeddings(),
                         target.vocab_size)


@register_drafter("medusa")
def _medusa_factory(target, checkpoint: str | None = None) -> MedusaDrafter:
    """Medusa-style parallel heads on SmolLM2's last hidden state, shipped checkpoint by default."""
    return load_medusa(target, checkpoint)
