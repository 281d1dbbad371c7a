"""SpeculativeGenerator: the draft -> verify -> accept -> compact -> commit loop.

One step (DESIGN.md):
    built = builder.build(drafter, root, sampling, gen)        draft a tree
    out   = verifier.score(built.tree)                         ONE target forward, p: [N, V]
    acc   = accept(built.tree, out.probs, gen)                 exact rejection sampling
    verifier.compact([root] + acc.path)                        target KV = prefix + accepted
    drafter.commit(source[acc.path], acc.tokens, features)     drafter catches up
The new token becomes the next root. Generation stops at EOS or ``max_new_tokens``; the last
chunk is truncated, never overshooting.

Glossary of stats: τ (tau) = emitted tokens / target forwards (prefill excluded); per-depth
acceptance = accepted / attempted at each depth; time split = draft / verify / accept / other
(compaction, commit, bookkeeping).
"""

from __future__ import annotations

import operator
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator, Literal, Sequence

import torch

from treespec.fastpath.device import synchronize
from treespec.drafters import load_drafter
from treespec.drafters.base import Drafter, PartialTree, TargetFeatures, capabilities, check_drafter_protocol
from treespec.targets.loader import Target
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import BuiltTree, TreeBuilder, check_int, finish
from treespec.builders.chain import ChainBuilder
from treespec.builders.dynamic import DynamicTreeBuilder
from treespec.core.rejection import VERIFY_RULES, Acceptance, VerifyRule, accept, accept_root_logits

# Called after every step with (built tree, acceptance, step index); e.g. to draw trees.
StepHook = Callable[[BuiltTree, Acceptance, int], None]
from treespec.runtime.verifier import TreeVerifier
from treespec.runtime.compiled import warm_drafter


class DepthCounts:
    """Acceptance by draft position for a stats dataclass with ``depth_attempts`` and
    ``depth_accepts`` (lists, one entry per depth 1, 2, ...): one generation's or a server's."""

    depth_attempts: list[int]
    depth_accepts: list[int]

    @property
    def depth_acceptance(self) -> list[float]:
        """Acceptance rate of each draft position (1, 2, ...): accepted / attempted."""
        return [a / t if t else 0.0 for a, t in zip(self.depth_accepts, self.depth_attempts)]

    def _add_depths(self, attempts: Sequence[int], accepts: Sequence[int]) -> None:
        grow = len(attempts) - len(self.depth_attempts)
        if grow > 0:
            self.depth_attempts += [0] * grow
            self.depth_accepts += [0] * grow
        for d, (t, a) in enumerate(zip(attempts, accepts)):
            self.depth_attempts[d] += t
            self.depth_accepts[d] += a


@dataclass
class GenerationStats(DepthCounts):
    """Counters and timings of one generation (times in seconds)."""

    new_tokens: int = 0
    steps: int = 0                    # target forwards after prefill (= verify passes)
    prompt_tokens: int = 0
    tree_nodes: int = 0               # total tree nodes verified (root included)
    drafter_calls: int = 0
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    accept_time: float = 0.0
    other_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target forward (accepted + 1), before EOS/limit truncation."""
        return self._emitted / self.steps if self.steps else 0.0

    _emitted: int = 0

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time + self.accept_time + self.other_time

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the decoding time, prefill left out."""
        return self.new_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def tokens_per_s_with_prefill(self) -> float:
        """New tokens over the decoding time plus the prompt's prefill."""
        total = self.decode_time + self.prefill_time
        return self.new_tokens / total if total > 0 else 0.0

    def table(self) -> str:
        """A small human-readable table."""
        rows = [
            ("new tokens", f"{self.new_tokens}"),
            ("target forwards", f"{self.steps}"),
            ("tau (tokens/forward)", f"{self.tau:.2f}"),
            ("tokens/s, prefill excluded", f"{self.tokens_per_s:.1f}"),
            ("tokens/s, prefill included", f"{self.tokens_per_s_with_prefill:.1f}"),
            ("mean tree nodes", f"{self.tree_nodes / max(self.steps, 1):.1f}"),
            ("acceptance by depth", " ".join(f"{a:.2f}" for a in self.depth_acceptance)),
            ("time draft/verify/accept/other",
             " / ".join(f"{t * 1e3:.0f} ms" for t in (self.draft_time, self.verify_time,
                                                      self.accept_time, self.other_time))),
            ("prefill", f"{self.prefill_time * 1e3:.0f} ms"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@dataclass(frozen=True)
class GenerationResult:
    """text (None without a tokenizer), token_ids: LongTensor[T] new tokens only, stats."""

    text: str | None
    token_ids: torch.Tensor
    stats: GenerationStats


class GenerationStream:
    """Iterates over token-id chunks as they are accepted; ``.result`` is set when exhausted."""

    def __init__(self, chunks: Iterator[list[int]], finish):
        self._chunks = chunks
        self._finish = finish
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._chunks
        self.result = self._finish()


def drafter_cost_kind(drafter: Drafter) -> str:
    """The cost model's name for a drafter's per-level pass ("eagle", "early_exit", "lookup"...)."""
    return capabilities(drafter).cost_kind


def target_calibration(target: Target):
    """The local calibration of ``target`` (its dtype, packed or not); a clear error without one."""
    from treespec.planning.calibration import Calibration, machine_mismatch, target_calibration_path
    from treespec.fastpath.packing import linear_kernel

    dtype_name = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    kernel = linear_kernel(target.model)
    packed = kernel != "stock"
    compiled = target.passes is not None
    path = target_calibration_path(target)
    if not path.exists():   # the command that writes this very file
        raise ValueError(f"builder='auto' needs a calibration of {target.name!r} ({dtype_name}"
                         f"{f', {kernel} linear layers' if packed else ''}{', compiled passes' if compiled else ''}) "
                         f"at {path}; run `treespec calibrate --model {target.name} --weights pretrained --dtype "
                         f"{dtype_name}{f' --kernel {kernel}' if packed else ' --no-pack'}"
                         f"{' --compile' if compiled else ''} --threads {torch.get_num_threads()}` first")
    calibration = Calibration.load(path)
    why = machine_mismatch(calibration, target.device)
    if why is not None:
        warnings.warn(f"builder='auto': the calibration at {path} may not fit this machine ({why}); "
                      f"the tree it picks can be far from the best here. Recalibrate: `treespec "
                      f"calibrate --model {target.name} --weights pretrained --dtype {dtype_name}`",
                      CalibrationMismatchWarning, stacklevel=4)
    return calibration


def auto_builder(target: Target, drafter: Drafter, calibration=None, acceptance=None,
                 max_budget: int = 65, batch: int = 1, temperature: float = 0.0) -> TreeBuilder:
    """The tree the cost model predicts fastest on this machine (``builder="auto"``).

    Uses the local calibration (``treespec calibrate``). When the calibration measured this
    very drafter (``treespec calibrate --drafter NAME``, keyed by its registered name, with the
    weights it was loaded from: ``CalibrationMismatchWarning`` and the generic plan otherwise), its
    pass times and its positional acceptance vector measured at the temperature nearest to
    ``temperature`` are used (acceptance falls as T rises); otherwise the generic
    pass of its cost kind and the kind's default β. Above T = 0 it also plans sampled drafts
    (``mode="without_replacement"``) where the calibration measured their acceptance, and
    builds whichever plan is faster. ``acceptance`` (β or a positional vector) overrides the
    acceptance (of ranked drafts). ``max_budget``: the largest tree it may pick (nodes incl. the
    root); when no tree pays, a budget-1 (root-only) tree: plain decoding, one token per
    target forward. A target with compiled passes (``target.passes``) is planned with its own
    curve (:func:`treespec.planning.target_calibration_path`) and never gets a tree past its
    largest bucket (which would run eagerly). ``batch``: the number of requests verified together (``SpeculativeServer``
    asks with its current batch size; the tree shrinks as the verify pass turns compute-bound).
    """
    from treespec.planning import DEFAULT_BETA, auto_budget

    check_int("max_budget", max_budget)   # tree nodes, the root included
    if getattr(target, "passes", None) is not None:
        max_budget = min(max_budget, target.passes.buckets[-1])
    dtype = next(target.model.parameters()).dtype
    dtype_name = str(dtype).removeprefix("torch.")
    if calibration is None:
        calibration = target_calibration(target)
    if calibration.shape.bytes_per_weight != dtype.itemsize:
        raise ValueError(f"the calibration measured {calibration.shape.bytes_per_weight:g}-byte weights but the "
                         f"target runs {dtype_name} ({dtype.itemsize} bytes); calibrate with --dtype {dtype_name}")
    caps = capabilities(drafter)
    name = caps.registry_name   # calibrate --drafter keys its entries by it
    measured_with = calibration.weights.get(name)
    if caps.weights_checksum is not None and name in calibration.acceptance and measured_with != caps.weights_checksum:
        warnings.warn(f"builder='auto': the calibration measured drafter {name!r} with "
                      f"{f'checkpoint {measured_with[:12]}' if measured_with else 'weights it did not record'}, "
                      f"this one was loaded from checkpoint {caps.weights_checksum[:12]}: its acceptance is not "
                      f"used (the tree is planned from the generic pass and default β). Recalibrate: `treespec "
                      f"calibrate --weights pretrained --drafter {name}` (the shipped checkpoint)",
                      CalibrationMismatchWarning, stacklevel=3)
        name = None   # a calibration of other weights is not a calibration of this drafter
    generic = drafter_cost_kind(drafter)
    if name in calibration.drafters:
        kind = name
    elif generic == "lookup" or generic in calibration.drafters:
        kind = generic
    else:
        kind = "early_exit" if "early_exit" in calibration.drafters else next(iter(calibration.drafters))
    if acceptance is not None:
        plans = [("deterministic", acceptance)]
    else:
        plans = [("deterministic", calibration.acceptance_for(name, temperature) or DEFAULT_BETA.get(generic, 0.6))]
        if temperature > 0:   # sampled drafts, where the calibration measured them at T > 0
            plans += [(mode, vector) for mode in ("without_replacement", "with_replacement")
                      if (vector := calibration.acceptance_for(name, temperature, mode)) is not None]
    choices = [(auto_budget(calibration, a, kind, max_drafts=max_budget - 1, batch=batch), mode)
               for mode, a in plans]
    choice, mode = max(choices, key=lambda c: c[0].tokens_per_s)   # a tie keeps the first: ranked drafts
    if choice.drafts == 0:
        return DynamicTreeBuilder(budget=1, depth=1, top_k=1)
    if choice.is_chain:
        return ChainBuilder(budget=choice.drafts + 1, mode=mode)
    width = max(choice.level_sizes)
    return DynamicTreeBuilder(budget=choice.budget, depth=choice.depth, top_k=max(2, min(8, width)), mode=mode)


class CalibrationMismatchWarning(UserWarning):
    """builder="auto" was sized with a calibration measured on another machine, torch or
    thread count (``treespec.planning.machine_mismatch``)."""


HUGE_VERIFY_BYTES = 1 << 30   # warn above this (SpeculativeGenerator)


class LargeTreeWarning(UserWarning):
    """A tree budget whose verify pass needs more than ``HUGE_VERIFY_BYTES`` (shown by default,
    unlike ResourceWarning)."""


def verify_memory_bytes(model, nodes: int, prefix: int) -> int:
    """Rough bytes of the large tensors one verify pass of a ``nodes``-node tree creates after a
    ``prefix``-token context: logits in the model dtype and three float32 [N, V] rows (their
    float copy, processed p, draft q), the [N, P + N] mask and fp32 attention scores per head."""
    cfg = model.config
    item = next(model.parameters()).element_size()
    vocab = model.get_output_embeddings().weight.shape[0]
    keys = prefix + nodes
    heads = getattr(cfg, "num_attention_heads", 1)
    return nodes * vocab * (item + 12) + nodes * keys * (item + 4 * heads)


def context_window(target: Target, drafter: object) -> tuple[int, str]:
    """(longest context a request may reach, why): the target's limit, or the drafter's where
    it is shorter (``capabilities(drafter).max_context``)."""
    own = capabilities(drafter)
    if own.max_context is not None and own.max_context < target.max_context:
        return own.max_context, own.max_context_reason
    return target.max_context, target.max_context_reason


def check_builder(builder: object) -> None:
    """A clear error for something passed as a builder that cannot build trees."""
    if not callable(getattr(builder, "build", None)) or not hasattr(builder, "budget"):
        raise TypeError(f"builder must be a TreeBuilder (e.g. DynamicTreeBuilder(budget=16, depth=5, "
                        f"top_k=4)), 'auto' or None, got {type(builder).__name__}")


def check_seed(seed: object) -> int | None:
    """``seed`` as an int (numpy ints accepted), or None; anything else is a TypeError."""
    if seed is None:
        return None
    if not isinstance(seed, bool):
        try:
            return operator.index(seed)
        except TypeError:
            pass
    raise TypeError(f"seed must be an int or None (None: a fresh random seed), got {seed!r}")


def encode_prompt(target: Target, prompt: str | Sequence[int] | torch.Tensor, chat: bool = True) -> torch.Tensor:
    """LongTensor[P] (on the host) of ``prompt``'s ids: text through ``target``'s tokenizer (its chat
    template when ``chat`` and it has one), token ids checked against its vocabulary. The one
    encoding of ``SpeculativeGenerator.encode`` and ``SpeculativeServer.add_request``."""
    if isinstance(prompt, str):
        tok = target.tokenizer
        if tok is None:
            raise ValueError("this target has no tokenizer: pass token ids instead of a string")
        if not prompt.strip():
            raise ValueError("prompt is empty; pass some text or token ids")
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                          add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)
    if isinstance(prompt, torch.Tensor):
        ids = prompt
    else:
        try:
            ids = None if isinstance(prompt, (bytes, dict, set)) else torch.as_tensor(prompt)
        except (TypeError, ValueError, RuntimeError):
            ids = None
        if ids is None or (ids.is_floating_point() and ids.numel()):
            raise TypeError(f"prompt must be text, token ids (a list of ints) or a LongTensor, got "
                            f"{type(prompt).__name__}")
    if ids.numel() == 0:
        raise ValueError("prompt is empty; pass at least one token id")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"prompt token ids must be integers, got dtype {ids.dtype}; pass a "
                        "LongTensor or a list of ints")
    ids = ids.flatten().long()
    if bool((ids < 0).any()) or bool((ids >= target.vocab_size).any()):
        raise ValueError(f"prompt token ids must lie in [0, {target.vocab_size})")
    return ids.cpu()


class SpeculativeGenerator:
    """Speculative generation with a target, a drafter and a tree builder.

    One generation at a time: the drafter and the verifier hold the running request's state, so
    a second ``generate`` / ``stream`` started while one is running (from another thread, an
    interleaved stream, or an ``on_step`` hook) raises ``RuntimeError``. Use one generator
    (with its own drafter) per concurrent request.

    Args:
        target:  a ``treespec.Target`` (``load_target`` or ``Target.from_hf``).
        drafter: a Drafter, or a registered drafter name (``registered_drafters()``).
        builder: a TreeBuilder; default ``DynamicTreeBuilder(budget=16, depth=5, top_k=4)``;
                 "auto" sizes the tree with the cost model and the local calibration
                 (``auto_builder``; kept as ``calibration``, else None). A builder of budget 1 (auto's choice where speculation
                 does not pay) decodes plainly: the drafter is not called at all.
        verify:  the acceptance rule: "token" (default, every tree), "block" (chains) or
                 "traversal" (trees); all exact (``treespec.core.accept``). The last two
                 differ from "token" only on trees with drawn children (stochastic modes).
    """

    def __init__(self, target: Target, drafter: Drafter | str,
                 builder: TreeBuilder | Literal["auto"] | None = None,
                 verify: VerifyRule = "token"):
        if not isinstance(target, Target):
            raise TypeError(f"target must be a treespec.Target (use Target.from_hf(model, tokenizer)), "
                            f"got {type(target).__name__}")
        if builder is not None and not isinstance(builder, str):
            check_builder(builder)
        if isinstance(drafter, str):
            drafter = load_drafter(drafter, target)
        elif not isinstance(drafter, Drafter):   # say which member it lacks
            check_drafter_protocol(drafter, f"drafter must be a Drafter (or a name such as 'eagle3' or "
                                            f"'package.module:factory'), got {type(drafter).__name__}; this one")
        if drafter.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab size {drafter.vocab_size} != target vocab size "
                             f"{target.vocab_size}; they must share one vocabulary")
        self._auto: dict[float, TreeBuilder] | None = None   # builder="auto": temperature -> tree
        self.calibration = None   # builder="auto": the local calibration that sizes its trees
        if builder == "auto":
            self.calibration = target_calibration(target)
            self._auto = {0.0: auto_builder(target, drafter, self.calibration)}
            builder = self._auto[0.0]
        elif isinstance(builder, str):
            raise ValueError(f"builder must be a TreeBuilder or 'auto', got {builder!r}")
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
        self.target = target
        self.drafter = drafter
        self.builder = builder if builder is not None else DynamicTreeBuilder()
        self._busy = threading.Lock()  # one generation at a time (see _exclusive)
        self.verify = verify
        nodes = getattr(self.builder, "budget", 1)
        need = verify_memory_bytes(target.model, nodes, nodes)
        if need > HUGE_VERIFY_BYTES:
            warnings.warn(f"a tree of {nodes} nodes takes about {need / 2**30:.1f} GiB per verify pass (more "
                          f"with a long prompt); lower the budget to verify in less memory and time",
                          LargeTreeWarning, stacklevel=2)

    # ------------------------------------------------------------------ inputs
    def encode(self, prompt: str | Sequence[int] | torch.Tensor, chat: bool = True) -> torch.Tensor:
        """LongTensor[P] of prompt ids; strings go through the chat template when there is one."""
        return encode_prompt(self.target, prompt, chat)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                 seed: int | None = None, chat: bool = True,
                 on_step: StepHook | None = None) -> GenerationResult:
        """Generate up to ``max_new_tokens``; see ``stream`` for the arguments."""
        stream = self.stream(prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                             min_p=min_p, seed=seed, chat=chat, on_step=on_step)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128, *,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               seed: int | None = None, chat: bool = True,
               on_step: StepHook | None = None) -> GenerationStream:
        """A GenerationStream of token-id chunks. The sampling settings and their defaults are
        ``SamplingConfig``'s (greedy); ``seed`` None draws a fresh seed, a given seed repeats.

        ``prompt``: text (through the chat template when ``chat`` and the tokenizer has one) or
        token ids. ``on_step(built, acceptance, step)`` is called after every verification.
        """
        sampling = SamplingConfig(temperature, top_k, top_p, min_p)
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be a callable (built, acceptance, step) or None, got "
                            f"{type(on_step).__name__}")
        if not isinstance(chat, bool):
            raise TypeError(f"chat must be True or False (use the chat template for text prompts), got {chat!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be an int > 0, got {max_new_tokens!r}")
        ids = self.encode(prompt, chat)
        limit, why = context_window(self.target, self.drafter)
        if ids.numel() >= limit:
            raise ValueError(f"prompt has {ids.numel()} tokens but the context window is {limit} "
                             f"({why}); shorten the prompt")
        builder = self.builder_for(sampling.temperature)
        budget = getattr(builder, "budget", 1)
        room = limit - ids.numel() - budget
        if max_new_tokens > room and max_new_tokens <= limit - ids.numel() - 1:
            raise ValueError(f"the tree budget {budget} does not fit the context window ({limit} tokens: "
                             f"{why}; prompt {ids.numel()}, max_new_tokens "
                             f"{max_new_tokens}); use a budget of at "
                             f"most {limit - ids.numel() - max_new_tokens}")
        if max_new_tokens > room:
            raise ValueError(f"max_new_tokens={max_new_tokens} does not fit the context window "
                             f"({limit} tokens: {why}; prompt {ids.numel()}, "
                             f"tree budget included); "
                             f"use at most {max(room, 0)}")
        seed = check_seed(seed)
        gen = torch.Generator(device=self.target.device)  # draws happen where p and q live
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
        out: list[int] = []
        stats = GenerationStats(prompt_tokens=ids.numel())
        chunks = self._exclusive(self._loop(ids, max_new_tokens, sampling, gen, out, stats, on_step, builder))

        def finish() -> GenerationResult:
            tok = self.target.tokenizer
            text = tok.decode(out, skip_special_tokens=True) if tok is not None else None
            return GenerationResult(text, torch.tensor(out, dtype=torch.long), stats)

        return GenerationStream(chunks, finish)

    def builder_for(self, temperature: float) -> TreeBuilder:
        """The builder a request at ``temperature`` runs: ``self.builder``; with builder="auto",
        the tree planned for this temperature's calibrated acceptance (T > 0 accepts less than
        greedy, so its best tree is smaller, and may draw its drafts), planned once per T."""
        if self._auto is None:
            return self.builder
        if temperature not in self._auto:
            self._auto[temperature] = auto_builder(self.target, self.drafter, self.calibration,
                                                   temperature=temperature)
        return self._auto[temperature]

    def _exclusive(self, chunks: Iterator[list[int]]) -> Iterator[list[int]]:
        """Run ``chunks`` holding the generator's lock: the drafter, the builder and the
        verifier keep per-request state, so a second generation while one is running (another
        thread, an interleaved stream, a call from ``on_step``) is refused, never mixed."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this SpeculativeGenerator is already generating (another thread, or a "
                               "stream not yet exhausted); finish or drop that stream first, or give "
                               "each concurrent request its own SpeculativeGenerator and drafter")
        try:
            yield from chunks
        finally:
            self._busy.release()

    def _loop(self, ids: torch.Tensor, max_new: int, sampling: SamplingConfig,
              gen: torch.Generator, out: list[int], stats: GenerationStats,
              on_step: StepHook | None, builder: TreeBuilder) -> Iterator[list[int]]:
        drafter = self.drafter
        # A builder of budget 1 (auto's "do not speculate") never drafts: the drafter is left out
        # (no target features captured, no commits) and each step is a plain decoding step.
        plain = builder.budget == 1
        layers = drafter.target_layers if drafter.needs_target_hidden and not plain else ()
        verifier = TreeVerifier(self.target.model, sampling, layers, self.target.passes)
        eos = set(self.target.eos_token_ids)
        device = self.target.device
        budget = getattr(builder, "budget", 1)
        if self.target.passes is not None:   # compile what this request's trees may need, off the clock
            self.target.passes.warm(budget, layers, ids.numel() + max_new)
        if not plain:                        # every bucket of the drafter's compiled calls, for the longest cache
            warm_drafter(drafter, ids.numel() + max_new + budget)

        def clock() -> float:  # an accelerator's queued work is booked to the phase that ran it
            synchronize(device)
            return time.perf_counter()

        t0 = clock()
        feats = verifier.prefill(ids)
        if not plain:
            drafter.begin(ids, feats)
        stats.prefill_time = clock() - t0
        root = int(ids[-1])
        while True:
            t0 = clock()
            step_root = root
            if plain:   # the root alone: one-token pass, its row's draw (accept's for a lone root)
                built = None
                t1 = clock()
                logits = verifier.step(root)
                t2 = clock()
                acc = accept_root_logits(logits, sampling, gen)
                t3 = clock()
            else:
                built = builder.build(drafter, root, sampling, gen)
                t1 = clock()
                scored = verifier.score(built.tree)
                t2 = clock()
                acc = accept(built.tree, scored.probs, gen, self.verify)
                t3 = clock()
                keep = torch.cat([torch.zeros(1, dtype=torch.long, device="cpu"), acc.path])  # host indices
                verifier.compact(keep)
                feats = scored.features.select(keep) if layers else TargetFeatures.empty()
                drafter.commit(built.source[acc.path], acc.tokens, feats)
            new = acc.tokens.tolist()
            stats.steps += 1
            stats._emitted += len(new)
            stats.tree_nodes += 1 if plain else built.tree.num_nodes
            stats.drafter_calls += 0 if plain else built.drafter_calls
            stats._add_depths(acc.depth_attempts, acc.depth_accepts)
            chunk = []
            for t in new:
                chunk.append(t)
                if t in eos or len(out) + len(chunk) >= max_new:
                    break
            out.extend(chunk)
            stats.new_tokens = len(out)
            root = new[-1]
            t4 = clock()
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1
            stats.accept_time += t3 - t2
            stats.other_time += t4 - t3
            if on_step is not None:
                if built is None:
                    built = finish(PartialTree.rooted(step_root), {}, "deterministic")   # the hook's tree
                on_step(built, acc, stats.steps - 1)
            yield chunk
            if len(chunk) < len(new) or chunk[-1] in eos or len(out) >= max_new:
                return
