"""treespec's Medusa heads as vLLM's Medusa draft checkpoint (``MedusaModel``).

Mapping (treespec ``MedusaHeads`` -> exported tensor), exact:
    proj[k].weight / .bias [H, H] / [H]  -> blocks.{k}.layers.0.weight / .bias   (config medusa_fc_bias)
    target LM head [V, H]                -> lm_head.weight, shared by every head (original_lm_head)
Both compute, for head k (0-based in vLLM, k + 1 in treespec), f + SiLU(W_k f + b_k) on the
target's last hidden state after its final norm, then the LM head; head k proposes the token k + 1
positions after the one the target just produced. vLLM drafts a chain of the K heads' top-1
tokens; treespec's heads also serve trees (nodes deeper than K reuse head K, which vLLM cannot).
SGLang has no Medusa format to export to.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from treespec.drafters.base import capabilities
from treespec.export.outdir import check_out, resolve_dtype, write_export

__all__ = ["export_medusa", "medusa_config", "medusa_tensors"]


def _medusa_heads(drafter):
    heads = getattr(drafter, "heads", None)
    if heads is None or not hasattr(heads, "proj"):
        kind = capabilities(drafter).registry_name or type(drafter).__name__
        raise TypeError(f"drafter must be a medusa drafter (load_drafter('medusa', target)), got {kind!r}")
    return heads


def _check_feature(target, heads) -> None:
    last = int(target.model.config.num_hidden_layers)
    if heads.cfg.feature_layer != last:
        raise ValueError(f"the medusa heads read target hidden_states[{heads.cfg.feature_layer}], but vLLM feeds "
                         f"Medusa the final (post-norm) hidden state, hidden_states[{last}]; train heads on it")


def medusa_tensors(target, drafter, dtype: torch.dtype | str = torch.float32) -> dict[str, torch.Tensor]:
    heads = _medusa_heads(drafter)
    dtype = resolve_dtype(dtype)
    out = {}
    for k, lin in enumerate(heads.proj):
        out[f"blocks.{k}.layers.0.weight"] = lin.weight
        out[f"blocks.{k}.layers.0.bias"] = lin.bias
    out["lm_head.weight"] = target.model.get_output_embeddings().weight
    return {k: v.detach().to("cpu", dtype) for k, v in out.items()}


def medusa_config(target, drafter, dtype: torch.dtype | str = torch.float32) -> dict:
    heads = _medusa_heads(drafter)
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.cfg.hidden_size,
        "vocab_size": int(target.vocab_size),
        "truncated_vocab_size": int(target.vocab_size),
        "num_heads": heads.cfg.num_heads,
        "num_hidden_layers": 1,            # one residual block per head
        "medusa_fc_bias": True,
        "original_lm_head": True,          # one lm_head (the target's) shared by every head
        "torch_dtype": str(resolve_dtype(dtype)).removeprefix("torch."),
    }


def export_medusa(target, drafter, out: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
                  force: bool = False, source: str | None = None) -> Path:
    """Write ``drafter`` (medusa heads for ``target``) to ``out`` as vLLM's Medusa draft."""
    heads = _medusa_heads(drafter)
    _check_feature(target, heads)
    out = check_out(out, force)
    note = {
        "format": "Medusa draft (vLLM MedusaModel)",
        "exact_in": "vLLM (medusa.py: ResidualBlock with medusa_fc_bias, original_lm_head)",
        "not_exact_in": {"sglang": "SGLang has no Medusa draft format"},
        "source": {"kind": "medusa", "checkpoint": source, "target": target.name},
    }
    return write_export(out, medusa_config(target, drafter, dtype), medusa_tensors(target, drafter, dtype), note)
