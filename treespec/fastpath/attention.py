"""Tree attention on grouped KV heads without copying them (SDPA with ``enable_gqa`` under a mask),
and row attention for the amx targets.

Glossary
--------
- **GQA** — grouped-query attention: ``num_key_value_heads`` < ``num_attention_heads``; each KV
  head serves a group of query heads (SmolLM2-135M: 3 KV heads for 9 query heads).
- **repeat_kv** — what HF's stock ``sdpa`` attention does for GQA whenever a mask is given on
  the CPU: it copies every cached key and value once per query head of the group before the
  kernel runs. A decode step without a mask avoids it (HF's ``pack_gqa``), but a tree pass
  always has a mask, so every tree of 2 or more nodes pays a copy of the whole cache, twice
  (keys and values) per layer, on top of its rows (what that costs: ``docs/cpu-fast-path.md``).
- **grouped sdpa** — :data:`GROUPED_SDPA`, an attention implementation registered through HF's
  own extension points (``AttentionInterface`` and ``AttentionMaskInterface``; no modeling file
  forked, nothing of transformers replaced). With a mask, on the CPU, it calls PyTorch's SDPA with
  ``enable_gqa=True``, which reads each KV head in place for its whole group; every other call
  (no mask, no GQA, another device, features SDPA's GQA path does not take) goes to HF's own
  ``sdpa`` function unchanged. The masks are HF's ``sdpa`` masks (bool).

- **row attention** — :data:`ROW_ATTENTION`, for targets whose linear layers round their inputs
  (``load_target(..., pack="amx")``): one-token steps and tree passes row by row, each query
  row over exactly the keys it may see with the operations it would get alone (the rows share
  only the reads of each block of keys), so a tree's row has the bits of the step that decodes
  its path; a prompt's pass goes to grouped sdpa.

Same numbers: PyTorch's CPU SDPA computes every (query head, key) pair with the same kernel and
the same order whether the KV head is read in place or from a copy, so logits and cache rows
are bit-identical to stock ``sdpa`` (tested on a tiny model with tree masks and a cached
prefix, and on the real model by the greedy token-for-token checks against HF ``generate``).
On CUDA, SDPA's GQA path with a mask falls back to its slow math kernel, so the stock path
stays there.

:func:`use_grouped_attention` switches a loaded model (``model.set_attn_implementation``);
:func:`treespec.load_target` does it on the CPU speed path, and ``pack=False`` keeps stock
attention as well as stock linear layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from treespec.fastpath.kernels import ROW_HEAD_DIMS, row_attention_kernel

GROUPED_SDPA = "treespec_grouped_sdpa"
_row_isa: int | None = None   # the row kernel's ISA number for compiled graphs (set by use_row_attention)


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature: query [B, Hq, T, d], key/value [B, Hkv, S, d]
    -> (output [B, T, Hq, d], None)."""
    groups = getattr(module, "num_key_value_groups", 1)
    # HF's sdpa handles (or refuses) what the grouped call is not used for: no mask, no GQA,
    # another device, a position bias, a softcap, attention weights asked for
    if (attention_mask is None or groups == 1 or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    if attention_mask.ndim == 4:  # as HF's sdpa: the mask may be longer than the keys
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=False, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


ROW_ATTENTION = "treespec_row_attention"


def row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """:data:`ROW_ATTENTION`: one-token steps and tree passes (a bool mask) row by row
    (``row_attention`` in ``treespec/fastpath/csrc/panel_gemm.cpp``): a tree node's row is the
    bits of the one-token step that decodes its path. Everything else (a prompt's causal pass,
    another device or dtype, features the kernel lacks) goes to :func:`grouped_sdpa_attention`;
    a prompt's pass is the same in plain and speculative decoding, so it need not match them."""
    step = query.shape[2] == 1 and attention_mask is None
    tree = attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.ndim == 4
    if (not (step or tree) or query.device.type != "cpu" or query.dtype != torch.float32 or dropout
            or query.shape[-1] not in ROW_HEAD_DIMS or kwargs.get("sliding_window")
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask = attention_mask if tree else query.new_empty(0, dtype=torch.bool)
    if torch.compiler.is_compiling():   # inside a compiled graph: the kernel as its operator, no graph break
        from treespec.fastpath import ops

        if _row_isa is None:
            raise RuntimeError("row attention in a compiled graph needs use_row_attention(model) first")
        return ops.row_attention(query, key, value, mask, scale, _row_isa), None
    return row_attention_kernel(query, key, value, mask, scale), None


def _register(name: str, attention) -> str:
    """Register ``attention`` with HF under ``name``, with HF's sdpa (bool) masks (idempotent)."""
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def register_grouped_attention() -> str:
    """Register :data:`GROUPED_SDPA` with HF (idempotent); returns the name."""
    return _register(GROUPED_SDPA, grouped_sdpa_attention)


def use_grouped_attention(model: torch.nn.Module) -> tuple[bool, str]:
    """Switch ``model`` from HF's ``sdpa`` to :data:`GROUPED_SDPA` where that saves the copies.

    Returns (switched, why). Only a CPU model on ``sdpa`` with grouped KV heads is switched.
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == GROUPED_SDPA:
        return True, "grouped sdpa (already)"
    if impl != "sdpa":
        return False, f"stock {impl or 'eager'} (grouped KV reads need sdpa)"
    text = config.get_text_config(decoder=True)
    heads, kv_heads = text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if kv_heads == heads:
        return False, "stock sdpa (no grouped KV heads)"
    device = next(model.parameters()).device
    if device.type != "cpu":
        return False, f"stock sdpa (SDPA's grouped path with a mask is slow on {device.type})"
    model.set_attn_implementation(register_grouped_attention())
    return True, (f"grouped sdpa ({kv_heads} KV heads read in place by their {heads // kv_heads} "
                  f"query heads each under a tree mask; stock sdpa copies them)")


def register_row_attention() -> str:
    """Register :data:`ROW_ATTENTION` with HF (idempotent); returns the name."""
    return _register(ROW_ATTENTION, row_attention)


def use_row_attention(model: torch.nn.Module) -> tuple[bool, str]:
    """Switch a CPU fp32 model on ``sdpa`` (or grouped sdpa) to :data:`ROW_ATTENTION` where the
    kernel runs (AVX2 + FMA or AVX-512 F); returns (switched, why). For targets whose linear layers
    round their inputs (``kernel="amx"`` or ``"x8"``): there a last-bit difference between a
    tree pass and a one-token step can flip a rounding and grow, so their rows must be the same
    bits."""
    from treespec.fastpath.kernels import _isa_index, panel_status

    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == ROW_ATTENTION:
        return True, "row attention (already)"
    if impl not in ("sdpa", GROUPED_SDPA):
        return False, f"stock {impl or 'eager'} (row attention replaces sdpa)"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return False, f"{impl} (row attention is a CPU fp32 kernel)"
    ok, why = panel_status()
    if not ok:
        return False, f"{impl} (row attention needs the vector kernels: {why})"
    global _row_isa
    _row_isa = _isa_index(None)      # read here, outside any graph a compiler traces
    model.set_attn_implementation(register_row_attention())
    return True, ("row attention (one-token steps and tree passes row by row, each row the bits of the step "
                  "that decodes its path, a block of keys read once for all rows; prompts through grouped sdpa)")
