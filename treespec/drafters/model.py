"""Independent-model drafter: any HF causal LM sharing the target's vocabulary.

The drafter keeps its own KV cache laid out like the target's, growing in place
(:func:`treespec.fastpath.kvcache.growing_cache`):
    [ committed prefix (everything before the root) | tree region (root, expanded nodes...) ]
Each ``expand`` call is one batched forward over the frontier with a tree mask (prefix ‖
ancestors among the already-fed tree slots). ``commit`` gathers the slots of the root and of
the accepted nodes that were fed, crops the rest, and queues any accepted token that was never
fed (an unexpanded leaf) plus the new root, to be fed with the next tree's root expansion.

**Draft vocabulary.** A drafter model's LM head reads one row per vocabulary entry at every
call: for Qwen2.5-Coder-0.5B, 151,936 x 896 weights, about a quarter of the model's bytes.
``draft_vocab`` (token ids) keeps only those rows (EAGLE-3 drafts over a reduced vocabulary for
the same reason): the model's decoder runs as ever and a sliced head scores the kept ids. Every
other token gets a logit 30 below the row's lowest kept logit, so q keeps full support (about
e^-30 of the mass per token) and the argmax is always a kept id. Lossless as every drafter is:
acceptance reads the q the tokens were drafted from; only the chance of proposing a rare token
is given up (:func:`treespec.data.reply_token_ranking` ranks ids by how often replies use them).
With ``context_vocab=True`` the kept ids also grow by every id of the prompt and of the text
committed since: the identifiers a code prompt restates are rare in general and common in its
reply. Their rows are read from the full head (unsliced, as loaded) into a small extra head at
``begin`` and ``commit``; q stays a function of the committed text and the path, so exactness
is untouched.

**4-bit weights.** ``weights="int4"`` replaces the drafter model's linear layers, in place, by
:class:`treespec.fastpath.quant.Int4Linear` (4-bit groups of 32, bf16 activations): a one-token
draft pass reads about a quarter of the bytes. Lossless for the same reason: the target checks the
q the drafter computed, whatever its weights. Pass a model the drafter owns (not one sharing the
target's modules, as ``early_exit_model`` does), and a bf16 one.

``early_exit_drafter(target, k)`` builds a self-speculative drafter: the target's first k decoder
layers + final norm + LM head as a separate module that *shares* the target's weights.
"""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from treespec.drafters.base import PartialTree, TargetFeatures, register_drafter, tree_slot_mask
from treespec.fastpath.kvcache import growing_cache, keep_rows
from treespec.fastpath.packing import is_packed, pack_linears
from treespec.fastpath.quant import Int4Linear, check_int4_dtype, quantize_linears
from treespec.core.masks import attn_implementation_of


def output_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output embedding (what its logits' last dim will be)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def check_weights(weights: str | None) -> str | None:
    """``weights`` if it is a value ``ModelDrafter`` takes (None: the model's own, "int4"), else
    a ValueError."""
    if weights not in (None, "int4"):
        raise ValueError(f"weights must be None (the model's own) or 'int4', got {weights!r}")
    return weights


class ModelDrafter:
    """Drafts with an independent HF causal LM (see module docstring)."""

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = False

    def __init__(self, model: torch.nn.Module, target_vocab_size: int | None = None,
                 cost_kind: str = "early_exit", draft_vocab=None, weights: str | None = None,
                 context_vocab: bool = False):
        from treespec.targets.loader import check_architecture, context_limit

        check_architecture(model)   # its own tree passes need what the target's do
        limit, why = context_limit(model)
        self.max_context, self.max_context_reason = limit, f"the drafter model's {why}"
        self.model = model.eval()
        self.cost_kind = cost_kind    # the cost model's name for one pass of this drafter
        self.vocab_size = output_vocab_size(model)
        if target_vocab_size is not None and target_vocab_size != self.vocab_size:
            raise ValueError(
                f"drafter vocab size {self.vocab_size} != target vocab size {target_vocab_size}; "
                "an independent drafter must share the target's tokenizer and vocabulary"
            )
        self.attn_impl = attn_implementation_of(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # HF causal LMs take logits_to_keep: the LM head then runs on the last row only
        self._slices_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # [K] kept token ids, ascending, and the head over them (None: the model's own head)
        self.draft_vocab, self.vocab_head = self._sliced_head(model, draft_vocab)
        if not isinstance(context_vocab, bool):
            raise TypeError(f"context_vocab must be a bool, got {type(context_vocab).__name__}")
        if context_vocab and draft_vocab is None:
            raise ValueError("context_vocab=True adds the context's ids to a draft_vocab; without "
                             "draft_vocab every id is drafted already: pass draft_vocab or drop context_vocab")
        self.context_vocab = context_vocab
        # context_vocab: [E] ids of the context outside draft_vocab, in order of first use, and
        # their head rows [E, D] (and bias [E]); refilled at begin, grown at commit
        self.context_ids: list[int] = []
        self._context_index: torch.Tensor | None = None     # [E] context_ids on the device
        self._context_rows: torch.Tensor | None = None
        self._context_bias: torch.Tensor | None = None
        # looked up once: get_decoder() searches attributes, and _forward runs every draft pass
        self._decoder = model.get_decoder() if self.vocab_head is not None else None
        self.weights, self.quant_report = self._quantize(weights)
        self.cache: DynamicCache | None = None
        # compiled passes over a static cache (treespec.runtime.compiled.compile_drafter), or None
        self.passes = None
        self.prefix_len = 0           # committed tokens before the root that are cached
        self.pending: list[int] = []  # committed tokens not yet fed; the last one is the root
        self.slots: dict[int, int] = {}  # tree node -> cache position
        self.calls = 0                # forward passes, for tests and stats

    # ------------------------------------------------------------------ protocol
    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        if self.passes is None:
            self.cache = growing_cache(self.model.config)   # new rows written in place, no torch.cat a layer
        else:   # the static cache, sized for the prompt (later passes grow it where they must)
            self.passes.reserve(prompt_ids.numel() + self.passes.buckets[-1] + 1)
            self.cache = self.passes.cache
        self.prefix_len = 0
        self.pending = [int(t) for t in prompt_ids.tolist()]
        self.slots = {}
        if self.context_vocab:
            self.context_ids, self._context_index, self._context_rows, self._context_bias = [], None, None, None
            self._add_context_ids(self.pending)

    @torch.inference_mode()
    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("call begin() before expand()")
        if 0 in nodes:
            if len(nodes) != 1:
                raise ValueError("the root must be expanded on its own, before any other node")
            return self._expand_root(tree.tokens[0])
        missing = [n for n in nodes if tree.parents[n] not in self.slots or n in self.slots]
        if missing:
            raise ValueError(f"nodes {missing} cannot be expanded: each node is expanded once, "
                             "after its parent")
        base = self.prefix_len + len(self.slots)       # cache length before this call
        ids = torch.tensor([tree.tokens[n] for n in nodes], device=self.device)[None]
        pos = torch.tensor([self.prefix_len + tree.depth[n] for n in nodes], device=self.device)[None]
        # [F, base + F]: prefix ‖ ancestor slots ‖ self
        allowed = tree_slot_mask(tree, nodes, self.slots, self.prefix_len, base, self.device)
        logits = self._forward(ids, pos, allowed, base)
        for row, n in enumerate(nodes):
            self.slots[n] = base + row
        return logits

    @torch.inference_mode()
    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        accepted = [0] + path.tolist()
        fed = []
        for n in accepted:
            if n not in self.slots:
                break
            fed.append(self.slots[n])
        toks = tokens.tolist()
        # Tokens of accepted nodes we never fed (unexpanded leaves), then the new root.
        self.pending = toks[len(fed) - 1:] if fed else self.pending + toks
        self._keep(fed)
        self.slots = {}
        if self.context_vocab:
            self._add_context_ids(toks)

    def batched(self):
        """The batched form (``treespec.drafters.batched``): one forward of this drafter's model
        for every request of a step, weights shared."""
        from treespec.drafters.batch_model import BatchModelDrafter

        if self.draft_vocab is not None:
            raise ValueError("the batched drafter scores the full vocabulary; build this ModelDrafter "
                             "without draft_vocab to serve it batched")
        return BatchModelDrafter(self.model, self.vocab_size, self.cost_kind)  # sets the same max_context

    # ------------------------------------------------------------------ internals
    def _expand_root(self, root_token: int) -> torch.Tensor:
        if self.slots:
            raise ValueError("the root was already expanded for this tree")
        if not self.pending or self.pending[-1] != root_token:
            raise ValueError(f"root token {root_token} is not the last committed token "
                             f"{self.pending[-1:] or None}")
        n = len(self.pending)
        ids = torch.tensor(self.pending, device=self.device)[None]
        pos = torch.arange(self.prefix_len, self.prefix_len + n, device=self.device)[None]
        logits = self._forward(ids, pos, None, self.prefix_len, last_only=True)   # the prompt's rows need no logits
        self.prefix_len += n - 1
        self.slots = {0: self.prefix_len}
        self.pending = []
        return logits

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed.to(self.device)[None, None]
        if self.attn_impl != "eager":
            return allowed
        out = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return out.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor | None, start: int,
                 last_only: bool = False) -> torch.Tensor:
        """[1, F] ids written at cache slots ``start``, ... -> [F, V] float logits ([1, V], the last
        row's, with ``last_only``). ``allowed``: [F, start + F] the slots each row reads; None:
        the whole prefix and the rows before it (causal)."""
        self.calls += 1
        rows = self._run(ids, pos, allowed, start, last_only)
        if self.vocab_head is None:
            return rows.float()                                                            # [F, V]
        kept = self.vocab_head(rows).float()                                               # [F, K]
        extra = None
        if self._context_rows is not None:                                                 # [F, E]
            extra = torch.nn.functional.linear(rows, self._context_rows, self._context_bias).float()
        floor = kept.amin(-1, keepdim=True) if extra is None else \
            torch.minimum(kept.amin(-1, keepdim=True), extra.amin(-1, keepdim=True))
        out = (floor - 30.0).expand(-1, self.vocab_size).clone()                          # [F, V]
        out[:, self.draft_vocab] = kept
        if extra is not None:
            out[:, self._context_index] = extra
        return out

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, allowed: torch.Tensor | None, start: int,
             last_only: bool) -> torch.Tensor:
        """The model's call (``_forward``'s arguments): its logits [F, V] or, with a sliced head,
        the decoder's output [F, D]; compiled where the drafter has passes, else eager."""
        if self.passes is not None:
            if allowed is None:
                f = ids.shape[1]
                allowed = torch.ones(f, start + f, dtype=torch.bool)
                allowed[:, start:] = torch.ones(f, f, dtype=torch.bool).tril()
            out, _ = self.passes.run(ids[0], pos[0], allowed, start, last_only=last_only)
            self.cache = self.passes.cache                  # a pass past the cache's size grows it
            return out
        mask = None if allowed is None else self._mask(allowed)
        if self.vocab_head is None:
            keep = {"logits_to_keep": 1} if last_only and self._slices_logits else {}
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache,
                             use_cache=True, **keep).logits
        else:
            out = self._decoder(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache,
                                use_cache=True).last_hidden_state
        return out[0, -1:] if last_only else out[0]

    def _add_context_ids(self, tokens: list[int]) -> None:
        """Add the ids of ``tokens`` that neither ``draft_vocab`` nor the context holds yet."""
        have = set(self.context_ids)
        new = []
        for t in tokens:
            if t not in have and t not in self._kept:
                have.add(t)
                new.append(t)
        if not new:
            return
        weight, bias = self._head_source(self.model)
        idx = torch.tensor(new, device=weight.device)
        rows = weight.index_select(0, idx).to(self.device, self.dtype)
        self._context_rows = rows if self._context_rows is None else torch.cat([self._context_rows, rows])
        if bias is not None:
            b = bias.index_select(0, idx).to(self.device, self.dtype)
            self._context_bias = b if self._context_bias is None else torch.cat([self._context_bias, b])
        self.context_ids += new
        self._context_index = torch.tensor(self.context_ids, device=self.device)

    @staticmethod
    def _head_source(model: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(weight [V, D], bias [V] or None) of ``model``'s LM head, unquantized where it can be."""
        out = model.get_output_embeddings()
        weight, bias = getattr(out, "weight", None), getattr(out, "bias", None)   # nn.Linear or PackedLinear
        if weight is None and getattr(model.config, "tie_word_embeddings", False):
            # a tied head already in 4 bits (a model quantized by weights="int4"): the input
            # embeddings still hold its rows, unquantized
            weight, bias = model.get_input_embeddings().weight, None
        elif weight is None and isinstance(out, Int4Linear):
            # an untied one: its dense copy of the 4-bit weights
            weight = out.dense_weight
        return weight, bias

    def _sliced_head(self, model: torch.nn.Module, draft_vocab) -> tuple[torch.Tensor | None, torch.nn.Module | None]:
        """(kept ids, a linear layer over their rows of the LM head) for ``draft_vocab``; (None, None)."""
        if draft_vocab is None:
            return None, None
        ids = torch.as_tensor(draft_vocab)
        if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError("draft_vocab must be a non-empty 1-D sequence of token ids, got "
                             f"{ids.dtype} of shape {tuple(ids.shape)}")
        ids = ids.long().unique()                                        # sorted
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size:
            raise ValueError(f"draft_vocab holds ids outside 0..{self.vocab_size - 1}: pass ids of this "
                             "drafter's vocabulary")
        cfg = model.config
        scaled = [k for k in ("final_logit_softcapping", "logit_scale") if getattr(cfg, k, None) not in (None, 1.0)]
        # a 4-bit head's rows come from its dense copy (weights="int4" quantizes the slice again,
        # to the same groups up to bf16 rounding) or, tied, from the input embeddings
        weight, bias = self._head_source(model)
        if scaled or weight is None or weight.dim() != 2 or not hasattr(model, "get_decoder"):
            has = f"its logits scaled ({', '.join(scaled)})" if scaled else "no linear LM head after a decoder"
            raise ValueError(f"draft_vocab needs a plain linear LM head after the decoder; {type(model).__name__} "
                             f"has {has}: drop draft_vocab")
        rows = ids.to(weight.device)
        sliced = torch.nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device=self.device,
                                 dtype=self.dtype)
        with torch.no_grad():
            sliced.weight.copy_(weight[rows])
            if bias is not None:
                sliced.bias.copy_(bias[rows])
        # a Sequential so that the packer can swap the layer in place (load_drafter packs drafters
        # like their target); a model already packed gets its slice packed now
        head = torch.nn.Sequential(sliced).requires_grad_(False).eval()
        if is_packed(model):
            pack_linears(head)
        self._kept = set(ids.tolist())
        return ids.to(self.device), head

    def _quantize(self, weights: str | None):
        """(weights, the quantizer's report) for ``weights`` None (as loaded) or "int4"."""
        if check_weights(weights) is None:
            return None, None
        if self.vocab_head is None:
            return weights, quantize_linears(self.model)     # checks the dtype and device first
        report = quantize_linears(self.model, skip=(self.model.get_output_embeddings(),))   # unused: sliced
        quantize_linears(self.vocab_head)
        return weights, report

    def _keep(self, slots: list[int]) -> None:
        """Keep cache positions ``slots`` (ascending, starting at the root slot) after the prefix."""
        if self.passes is None:
            keep_rows(self.cache, self.prefix_len, slots)
        else:
            self.passes.keep(self.prefix_len, slots)
        self.prefix_len += len(slots)


def early_exit_model(target_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """The target's first ``num_layers`` decoder layers + final norm + LM head, weights shared.

    Works for Llama-family HF models (``model.model.layers``, ``.norm``, ``.embed_tokens``,
    ``.rotary_emb``). The result is a separate module: its own config, its own KV cache.
    """
    inner = getattr(target_model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "norm") or not hasattr(inner, "embed_tokens"):
        raise TypeError(f"early-exit needs a Llama-style model (model.layers/norm/embed_tokens); "
                        f"got {type(target_model).__name__}")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be in [1, {total - 1}] for a {total}-layer target, "
                         f"got {num_layers}")
    cfg = copy.deepcopy(target_model.config)
    cfg.num_hidden_layers = num_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation_of(target_model))
    draft.model.embed_tokens = inner.embed_tokens
    draft.model.layers = torch.nn.ModuleList(list(layers)[:num_layers])
    draft.model.norm = inner.norm
    draft.model.rotary_emb = inner.rotary_emb
    draft.lm_head = target_model.get_output_embeddings()
    leftovers = [n for n, t in list(draft.named_parameters()) + list(draft.named_buffers()) if t.is_meta]
    if leftovers:
        raise TypeError(f"early-exit could not share these tensors of {type(target_model).__name__}: "
                        f"{leftovers[:5]}")
    return draft.eval()


@register_drafter("early-exit")
def _early_exit_factory(target, num_layers: int | None = None) -> ModelDrafter:
    """Self-speculative drafter from the target's first layers (default: a quarter of them)."""
    total = len(target.model.model.layers)
    k = num_layers if num_layers is not None else max(1, total // 4)
    return ModelDrafter(early_exit_model(target.model, k), target.vocab_size)


@register_drafter("target")
def _self_factory(target) -> ModelDrafter:
    """The target drafting for itself: every draft is accepted at T = 0 (a sanity check)."""
    return ModelDrafter(target.model, target.vocab_size)


QWEN_VOCAB = 151_936   # LM-head rows of the Qwen2.5(-Coder) models


def frequent_vocab(tokenizer, size: int, always=()) -> list[int]:
    """The ``size`` ids ShareGPT replies use most (:func:`treespec.data.reply_token_ranking`,
    cached per tokenizer under the treespec cache) plus ``always`` (end-of-turn ids and the
    tokenizer's special tokens), sorted: a ``draft_vocab`` for :class:`ModelDrafter`."""
    import hashlib
    import json

    from treespec.data import reply_token_ranking
    from treespec.targets.loader import default_cache_root

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"draft_vocab must be a positive int (ids kept), got {size!r}")
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    path = default_cache_root() / f"reply-token-ranking-{hashlib.sha256(vocab).hexdigest()[:12]}.json"
    if path.exists():
        ranking = json.loads(path.read_text())
    else:
        ranking = reply_token_ranking(tokenizer)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ranking))
    return sorted(set(ranking[:size]) | {int(t) for t in always} | set(tokenizer.all_special_ids))


@register_drafter("qwen2.5-coder-0.5b")
def _qwen_coder_small_factory(target, draft_vocab: int | None = None, weights: str | None = None,
                              context_vocab: bool = False) -> ModelDrafter:
    """Qwen2.5-Coder-0.5B-Instruct drafting for a target with its tokenizer (the 1.5B), in the
    target's dtype and on its device; parts installed by ``make models-qwen``. ``draft_vocab``:
    draft over that many of the most used ids only (:func:`frequent_vocab`; its LM head is about
    a quarter of the 0.5B's bytes at the full 151,936). ``weights="int4"``: the 0.5B's linear
    layers in 4 bits (a bf16 target only; see :class:`ModelDrafter`). ``context_vocab``: with
    ``draft_vocab``, also draft every id of the prompt and of the committed text."""
    from treespec.drafters.checkpoint import CheckpointMismatch
    from treespec.targets.loader import load_qwen_coder_0_5b

    if check_weights(weights) is not None:   # refused before 2 GB are loaded
        check_int4_dtype(target.dtype, f"the target {target.name}, whose dtype the drafter takes,")
    if target.vocab_size != QWEN_VOCAB:   # refused before 2 GB are loaded
        raise CheckpointMismatch(f"qwen2.5-coder-0.5b drafts in Qwen2.5's {QWEN_VOCAB}-token vocabulary; "
                                 f"{target.name} has {target.vocab_size} (use it with qwen2.5-coder-1.5b)")
    # the target's tokenizer: the 0.5B's must equal it (checked below)
    kept = None if draft_vocab is None else frequent_vocab(target.tokenizer, draft_vocab, target.eos_token_ids)
    draft = load_qwen_coder_0_5b(dtype=target.dtype, device=target.device)
    if target.tokenizer is not None and target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise ValueError(f"qwen2.5-coder-0.5b's tokenizer differs from {target.name}'s: an independent drafter "
                         "must share the target's vocabulary (use it with qwen2.5-coder-1.5b)")
    return ModelDrafter(draft.model, target.vocab_size, draft_vocab=kept, weights=weights,
                        context_vocab=context_vocab)
