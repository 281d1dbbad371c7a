"""An independent small Llama distilled from the target, run through ``ModelDrafter``.

The model has its own weights (embedding tied to its LM head) and the target's tokenizer and
vocabulary; it was trained by ``treespec train small`` on the target's own next-token
distributions (top-k distillation), with its embedding initialised from the principal
directions of the target's embedding. It needs no target features.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from treespec.drafters.base import register_drafter
from treespec.drafters.model import ModelDrafter

# Architecture of the shipped small drafter (the target's vocabulary; everything else small).
SMALL_ARCH = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)


def small_config(target, arch: dict | None = None) -> LlamaConfig:
    """A LlamaConfig for a small drafter of ``target`` (vocab, rope, eps and ids from the target)."""
    tc = target.model.config
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(vocab_size=target.vocab_size, max_position_embeddings=tc.max_position_embeddings,
                       rms_norm_eps=tc.rms_norm_eps, rope_parameters=dict(rope),
                       bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
                       pad_token_id=getattr(tc, "pad_token_id", None),
                       attn_implementation="sdpa", **(arch or SMALL_ARCH))


def small_model(target, arch: dict | None = None, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised small Llama for ``target`` (seeded)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(small_config(target, arch))
    return model.to(target.device, target.dtype).eval()


def export_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """State without the tied LM-head alias (safetensors stores each tensor once)."""
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_small(target, checkpoint: str | Path | None = None) -> ModelDrafter:
    from treespec.drafters.checkpoint import load_checkpoint, restore_module
    from treespec.drafters.feature import shipped_checkpoint

    path = Path(checkpoint) if checkpoint is not None else shipped_checkpoint(target, "small")
    state, header = load_checkpoint(path, target, "small")
    model = restore_module(path, "small", header, state, lambda arch: small_model(target, arch),
                           tied=("lm_head.weight",))
    model.tie_weights()
    drafter = ModelDrafter(model.eval().requires_grad_(False), target.vocab_size)
    drafter.weights_checksum = header.get("checksum")
    return drafter


@register_drafter("small")
def _small_factory(target, checkpoint: str | None = None) -> ModelDrafter:
    """A small Llama distilled from the target (shipped checkpoint by default)."""
    return load_small(target, checkpoint)
