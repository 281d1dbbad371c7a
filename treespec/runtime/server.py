"""SpeculativeServer: continuous batching of tree-speculative requests on one target.

Requests join and leave between steps; every step serves all live requests with ONE batched
drafter forward per drafting round and ONE target forward:

    admit      queued requests: one prefill forward (``BatchVerifier.add``), ``drafter.begin``
    build      build_batch(drafter, jobs)      per request its own builder (budget), root,
                                               sampling config and generator
    verify     verifier.score(TreeBatch)       ONE target forward, p per request's config
    accept     accept_batch(..., generators)   per request, its own generator
    compact    verifier.compact(keep plans); drafter.commit(key, ...)
    leave      EOS / max_new_tokens / cancel: verifier.retain(live rows), drafter.drop(key)

Each request draws only from its own generator, in the order ``SpeculativeGenerator`` does
(its tree's draws, then its acceptance), and sees only its own cache rows: its output is its
output alone whatever joins or leaves around it (exact law always; identical tokens greedy,
and at T > 0 whenever the batched forwards round like the single ones, see
``treespec.drafters.batched``). Memory: the target and drafter caches hold live requests only.

``budget="auto"`` (``builder="auto"``): each step the cost model picks each request's tree for
the CURRENT batch size and its temperature (``auto_builder(..., batch=B, temperature=T)``:
verification turns compute-bound as B grows, so the tree shrinks to a chain, then to none; a
sampled request accepts less than a greedy one, so its tree is smaller). The calibration's
batched curves (``calibrate_batches``) give the batched pass's cost where measured.

A request auto would not draft for is kept away from the drafter, which otherwise costs it
without paying: the target's hidden states over its prompt, its features queued every step
(``begin`` and commits are lazy), a row in the drafter's KV that the head's pass spans whenever
any request drafts and, at its own next draft, a head pass over that backlog. So an auto request that joins a batch for which auto plans no tree even
with one request fewer never begins on the drafter, and one for which auto plans no tree
``AUTO_DETACH_STEPS`` steps in a row leaves it (``drafter.drop``); either decodes plainly to its
end, and a step where no live request drafts asks the target for no hidden states. The margin
of one request and the run of steps keep a brief spell of company (a burst of two, a request
joining or a cancelled one leaving) from costing a request its drafting.

``generate_batch`` is the front door for a fixed set of requests: all join at the first step,
each leaves at its EOS or limit. With one drafter for all, drafting is batched too; with a
list of per-request drafters, each request is drafted by its own (``LoopBatchDrafter``).

Both take what ``SpeculativeGenerator.generate`` takes: text (through the chat template) or
token ids, a registered drafter name, one ``max_new_tokens`` for all. ``drafter=None`` is the
plain server: no drafter, one token per request per target forward (the baseline that
speculation is measured against under the same load).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

from treespec.core.tree_batch import TreeBatch, accept_batch
from treespec.fastpath.device import synchronize
from treespec.drafters import load_drafter
from treespec.drafters.base import Drafter, TargetFeatures
from treespec.drafters.batched import BatchDrafter, LoopBatchDrafter, as_batch_drafter
from treespec.runtime.generator import (
    DepthCounts, auto_builder, check_builder, check_seed, context_window, encode_prompt, target_calibration,
)
from treespec.targets.loader import Target
from treespec.core.sampling import SamplingConfig
from treespec.builders.base import TreeBuilder
from treespec.builders.batch import BuildJob, build_batch
from treespec.builders.dynamic import DynamicTreeBuilder
from treespec.core.acceptance import VERIFY_RULES, VerifyRule
from treespec.runtime.batch_compiled import BATCH_NODE_BUCKETS, CompiledBatchVerifier, batch_passes
from treespec.runtime.batch_verifier import BatchVerifier

AUTO_MAX_BUDGET = 65          # the largest tree (nodes, root incl.) budget="auto" may pick; context is reserved for it
AUTO_DETACH_STEPS = 8         # plain steps in a row after which an auto request leaves the drafter


def auto_max_budget(target: Target, batch: int) -> int:
    """The largest tree auto plans for a request among ``batch``: :data:`AUTO_MAX_BUDGET`, and
    on compiled passes with others beside it the largest node bucket of the batched graphs
    (``BATCH_NODE_BUCKETS``; the calibration measured nothing larger)."""
    if target.passes is not None and batch > 1:
        return min(AUTO_MAX_BUDGET, BATCH_NODE_BUCKETS[-1])
    return AUTO_MAX_BUDGET


@dataclass(frozen=True)
class RequestResult:
    """A finished request: its new tokens (EOS included when hit) and why it stopped."""

    tokens: tuple[int, ...]
    reason: Literal["eos", "length", "cancelled"]


@dataclass
class ServerStats(DepthCounts):
    """Counters and timings since the server started (seconds).

    Per-position acceptance: ``depth_attempts[d]`` counts the steps whose acceptance walk stood
    at draft depth d with a child to try, ``depth_accepts[d]`` those that accepted a child there
    (``Acceptance.depth_attempts`` summed over requests); their ratio is the acceptance rate of
    draft position d + 1."""

    steps: int = 0                 # target verify forwards
    request_steps: int = 0         # Σ over steps of the live requests (tokens / this = τ per request)
    new_tokens: int = 0
    emitted: int = 0               # accepted + 1 per request step, before EOS / limit truncation
    tree_nodes: int = 0            # verified nodes, roots included
    drafter_calls: int = 0         # batched drafter forwards
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    accept_time: float = 0.0
    other_time: float = 0.0
    depth_attempts: list[int] = field(default_factory=list)
    depth_accepts: list[int] = field(default_factory=list)

    @property
    def decode_time(self) -> float:
        return self.draft_time + self.verify_time + self.accept_time + self.other_time

    @property
    def tau(self) -> float:
        """Mean tokens a request emits per target forward (accepted + 1)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0


@dataclass
class _Request:
    rid: int
    prompt: torch.Tensor            # LongTensor[P]
    sampling: SamplingConfig
    max_new_tokens: int
    generator: torch.Generator
    builder: TreeBuilder | None     # None: budget="auto"
    root: int
    out: list[int] = field(default_factory=list)
    drafting: bool = True           # False: decodes plainly, without the drafter (see the module docstring)
    plain_steps: int = 0            # auto's root-only plans in a row


class SpeculativeServer:
    """Continuous batching (see the module docstring).

    Args:
        target:  a ``treespec.Target``.
        drafter: a registered name, a Drafter (its batched form is used, ``as_batch_drafter``),
                 a BatchDrafter, or None: plain decoding (no drafter; every tree is the root).
        builder: the default tree of a request: a TreeBuilder, "auto" (cost model at the current
                 batch size; needs ``treespec calibrate``) or None (DynamicTreeBuilder()).
        verify:  the acceptance rule ("token", "block", "traversal").
        calibration: for "auto": a ``treespec.planning.Calibration`` (default: the local one).
        draft_max_batch: the largest live batch at which a request with a fixed tree (a
                 TreeBuilder, not "auto") drafts; at a larger one its step is the root alone (a
                 plain step: the same law, one row). None: any batch. Where a pass of several
                 requests is compute-bound (the CPU's integer kernels past ~4 rows), a fixed
                 tree that pays alone costs more rows than it saves beside others; "auto" sizes
                 its trees per batch from the calibration instead.
    """

    def __init__(self, target: Target, drafter: "str | Drafter | BatchDrafter | None",
                 builder: TreeBuilder | Literal["auto"] | None = None, verify: VerifyRule = "token",
                 calibration=None, draft_max_batch: int | None = None):
        if not isinstance(target, Target):
            raise TypeError(f"target must be a treespec.Target, got {type(target).__name__}")
        if drafter is None:
            if builder is not None:
                raise ValueError("drafter=None is plain decoding: it takes no builder (pass builder=None)")
            drafter, builder = PlainDrafter(target.vocab_size), PLAIN
        elif isinstance(drafter, str):
            drafter = load_drafter(drafter, target)
        self.drafter = as_batch_drafter(drafter)
        if self.drafter.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab size {self.drafter.vocab_size} != target vocab size "
                             f"{target.vocab_size}; they must share one vocabulary")
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
        if draft_max_batch is not None and (isinstance(draft_max_batch, bool) or not isinstance(draft_max_batch, int)
                                            or draft_max_batch < 1):
            raise ValueError(f"draft_max_batch must be an int >= 1 or None (any batch), got {draft_max_batch!r}")
        self.target, self.verify = target, verify
        self.calibration = calibration
        self.draft_max_batch = draft_max_batch
        self.builder = self._check_builder(builder) if builder is not None else DynamicTreeBuilder()
        self.layers = tuple(self.drafter.target_layers) if self.drafter.needs_target_hidden else ()
        self.verifier = self._new_verifier()
        self.eos = set(target.eos_token_ids)
        self.stats = ServerStats()
        self.finished: dict[int, RequestResult] = {}
        self._queued: list[_Request] = []
        self._live: list[_Request] = []           # row b of the caches = _live[b]
        self._ids = itertools.count()
        self._auto: dict[tuple[int, float], TreeBuilder] = {}   # (batch size, T) -> the cost model's tree

    # ------------------------------------------------------------------ requests
    @property
    def live(self) -> tuple[int, ...]:
        """Ids of the requests being decoded (queued ones join at the next step)."""
        return tuple(r.rid for r in self._live)

    @property
    def queued(self) -> tuple[int, ...]:
        return tuple(r.rid for r in self._queued)

    def add_request(self, prompt: "str | torch.Tensor | Sequence[int]", sampling: SamplingConfig | None = None,
                    max_new_tokens: int = 128, seed: int | None = None,
                    builder: TreeBuilder | Literal["auto"] | None = None, *,
                    temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                    min_p: float | None = None, chat: bool = True) -> int:
        """Queue a request (it joins at the next ``step``); returns its id.

        ``prompt``: text (through the chat template when ``chat`` and the tokenizer has one) or
        token ids, encoded as ``SpeculativeGenerator.generate`` encodes them. The sampling
        settings: a ``SamplingConfig`` or ``generate``'s keywords (``temperature``, ``top_k``,
        ``top_p``, ``min_p``; unset ones take ``SamplingConfig``'s defaults, greedy), not both.
        ``seed`` seeds its own generator (None: fresh random); ``builder`` overrides the
        server's tree for this request (its own budget, or "auto").
        """
        if not isinstance(chat, bool):
            raise TypeError(f"chat must be True or False (use the chat template for text prompts), got {chat!r}")
        ids = encode_prompt(self.target, prompt, chat)
        keywords = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                                      ("min_p", min_p)) if v is not None}
        if sampling is not None and keywords:
            raise ValueError(f"pass the sampling settings either as sampling= or as keywords "
                             f"({', '.join(keywords)}), not both")
        sampling = SamplingConfig(**keywords) if sampling is None else sampling
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be an int > 0, got {max_new_tokens!r}")
        seed = check_seed(seed)
        if builder is not None and self.builder is PLAIN:
            raise ValueError("this server decodes plainly (drafter=None): a request cannot have a builder")
        chosen = self.builder if builder is None else self._check_builder(builder)
        self.check_fits(ids.numel(), max_new_tokens, chosen)
        gen = torch.Generator(device=self.target.device)
        gen.manual_seed(seed) if seed is not None else gen.seed()
        rid = next(self._ids)
        self._queued.append(_Request(rid, ids, sampling, max_new_tokens, gen,
                                     None if chosen == "auto" else chosen, int(ids[-1])))
        return rid

    def room(self, builder: "TreeBuilder | Literal['auto'] | None" = None) -> tuple[int, int, str]:
        """(context window, tree budget a request reserves in it, why the window is that long)
        for a request with ``builder`` (None: the server's)."""
        chosen = self.builder if builder is None else builder
        limit, why = context_window(self.target, self.drafter)
        return limit, AUTO_MAX_BUDGET if chosen == "auto" else chosen.budget, why

    def check_fits(self, prompt_tokens: int, max_new_tokens: int,
                   builder: "TreeBuilder | Literal['auto'] | None" = None) -> None:
        """ValueError, with the numbers, when a request of ``prompt_tokens`` and
        ``max_new_tokens`` cannot fit the context window beside its tree."""
        limit, budget, why = self.room(builder)
        if prompt_tokens + max_new_tokens + budget > limit:
            raise ValueError(f"the request does not fit the context window ({limit}: "
                             f"{why}; prompt {prompt_tokens}, "
                             f"max_new_tokens {max_new_tokens}, tree budget {budget}); shorten it")

    def cancel(self, rid: int) -> None:
        """Stop request ``rid`` now (queued or live); its tokens so far go to ``finished``."""
        for pool in (self._queued, self._live):
            for i, r in enumerate(pool):
                if r.rid == rid:
                    if pool is self._live:
                        self._leave([i])
                    else:
                        pool.pop(i)
                    self.finished[rid] = RequestResult(tuple(r.out), "cancelled")
                    return
        if rid in self.finished:
            raise ValueError(f"request {rid!r} already finished ({self.finished[rid].reason}); nothing to cancel")
        raise ValueError(f"unknown request id {rid!r}")

    # ------------------------------------------------------------------ one step
    def step(self) -> dict[int, list[int]]:
        """Admit queued requests, then one speculative step for every live request; returns
        each live request's new tokens (never past its limit; finished ones move to
        ``finished``). Empty when nothing is live or queued."""
        self._admit()
        if not self._live:
            return {}
        stats, device = self.stats, self.target.device

        def clock() -> float:
            synchronize(device)
            return time.perf_counter()

        t0 = clock()
        calls = getattr(self.drafter, "calls", 0)
        # A step that fails before its commits (a drafter error, an interrupt) leaves every
        # request as it was: the drafter, the target cache and the random generators.
        drafted = self.drafter.checkpoint()
        rng = [r.generator.get_state() for r in self._live]
        scored = None
        try:
            plans = [self._builder_of(r) for r in self._live]
            jobs = [BuildJob(r.rid, b, r.root, r.sampling, r.generator) for r, b in zip(self._live, plans)]
            built = build_batch(self.drafter, jobs)
            t1 = clock()
            batch = TreeBatch.from_trees([x.tree for x in built], [r.sampling for r in self._live])
            scored = self.verifier.score(batch, features=any(r.drafting for r in self._live))
            t2 = clock()
            results = accept_batch(batch, scored.probs, [r.generator for r in self._live], self.verify)
            t3 = clock()
        except BaseException:
            if scored is not None:
                self.verifier.discard()
            self.drafter.restore(drafted)
            for r, state in zip(self._live, rng):
                r.generator.set_state(state)
            raise
        self.verifier.compact([x.keep_src for x in results])
        out, done = {}, []
        for row, (r, x, acc, plan) in enumerate(zip(self._live, built, results, plans)):
            if r.drafting:
                r.plain_steps = r.plain_steps + 1 if r.builder is None and plan.budget == 1 else 0
                if r.plain_steps >= AUTO_DETACH_STEPS:
                    self.drafter.drop(r.rid)
                    r.drafting = False
                else:
                    feats = scored.features[row].select(acc.keep_src) if self.layers else TargetFeatures.empty()
                    self.drafter.commit(r.rid, x.source[acc.path], acc.tokens, feats)
            new = acc.tokens.tolist()
            chunk = []
            for t in new:
                chunk.append(t)
                if t in self.eos or len(r.out) + len(chunk) >= r.max_new_tokens:
                    break
            r.out += chunk
            r.root = new[-1]
            out[r.rid] = chunk
            stats.new_tokens += len(chunk)
            stats.emitted += len(new)
            stats.tree_nodes += x.tree.num_nodes
            stats._add_depths(acc.acceptance.depth_attempts, acc.acceptance.depth_accepts)
            if chunk[-1] in self.eos or len(r.out) >= r.max_new_tokens:
                reason = "eos" if chunk[-1] in self.eos else "length"
                self.finished[r.rid] = RequestResult(tuple(r.out), reason)
                done.append(row)
        self._leave(done)
        stats.steps += 1
        stats.request_steps += len(out)
        stats.drafter_calls += getattr(self.drafter, "calls", calls) - calls
        t4 = clock()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.accept_time += t3 - t2
        stats.other_time += t4 - t3
        return out

    def run(self) -> dict[int, RequestResult]:
        """Step until nothing is live or queued; returns ``finished``."""
        while self._live or self._queued:
            self.step()
        return self.finished

    # ------------------------------------------------------------------ internals
    def _check_builder(self, builder) -> "TreeBuilder | Literal['auto']":
        if builder == "auto":
            if self.calibration is None:
                self.calibration = target_calibration(self.target)
            return "auto"
        if isinstance(builder, str):
            raise ValueError(f"builder must be a TreeBuilder or 'auto', got {builder!r}")
        check_builder(builder)
        return builder

    def _builder_of(self, r: _Request) -> TreeBuilder:
        """This step's tree of request ``r``: its own (the root alone in a batch past
        ``draft_max_batch``), auto's for the batch size, or the root alone once it left the
        drafter."""
        if not r.drafting:
            return PLAIN
        if r.builder is None:
            return self._auto_builder(r.sampling.temperature)
        crowded = self.draft_max_batch is not None and len(self._live) > self.draft_max_batch
        return PLAIN if crowded else r.builder

    def _auto_builder(self, temperature: float, batch: int | None = None) -> TreeBuilder:
        """auto's tree at ``batch`` requests (None: the live batch) and ``temperature``."""
        key = (len(self._live) if batch is None else batch, temperature)
        if key not in self._auto:
            self._auto[key] = auto_builder(self.target, self.drafter, self.calibration,
                                           max_budget=auto_max_budget(self.target, key[0]), batch=key[0],
                                           temperature=temperature)
        return self._auto[key]

    def _admit(self) -> None:
        """Prefill the queued requests and start their drafting. If that fails (a prefill, or
        one ``drafter.begin``), nothing joins: the rows and drafter states made so far are
        dropped and the requests stay queued, so the caller can cancel or retry them."""
        if not self._queued:
            return
        joining = self._queued
        t0 = time.perf_counter()
        # An auto request joins plainly where auto plans no tree even with one request fewer
        # than the batch it joins (see the module docstring).
        batch = len(self._live) + len(joining)
        for r in joining:
            r.drafting = r.builder is not None or self._auto_builder(r.sampling.temperature, max(1, batch - 1)).budget > 1
        drafting = any(r.drafting for r in joining)
        feats = self.verifier.add([r.prompt for r in joining], features=drafting)   # raises before any row joins
        begun: list[_Request] = []
        try:
            for r, f in zip(joining, feats):
                if not r.drafting:
                    continue
                self.drafter.begin(r.rid, r.prompt, f if self.layers else TargetFeatures.empty())
                begun.append(r)
        except BaseException:
            for r in begun:
                self.drafter.drop(r.rid)
            self._keep_rows(list(range(len(self._live))))
            raise
        self._queued = []
        self._live += joining
        synchronize(self.target.device)
        self.stats.prefill_time += time.perf_counter() - t0

    def _leave(self, rows: list[int]) -> None:
        """Drop cache rows ``rows`` (finished or cancelled requests)."""
        if not rows:
            return
        for i in rows:
            if self._live[i].drafting:
                self.drafter.drop(self._live[i].rid)
        keep = [i for i in range(len(self._live)) if i not in rows]
        self._keep_rows(keep)
        self._live = [self._live[i] for i in keep]

    def _keep_rows(self, keep: list[int]) -> None:
        """The target cache keeps rows ``keep`` only (none: a fresh, empty cache)."""
        if keep:
            self.verifier.retain(keep)
        else:
            self.verifier = self._new_verifier()

    def _new_verifier(self) -> BatchVerifier:
        """An empty batched verifier: on the target's compiled passes where it has them."""
        if self.target.passes is not None:
            return CompiledBatchVerifier(batch_passes(self.target), self.layers)
        return BatchVerifier(self.target.model, self.layers)


class PlainDrafter:
    """The batched drafter of a plain server (``SpeculativeServer(target, None)``): it holds no
    state and is never asked for a draft, since every tree it meets is the root alone
    (``PLAIN``). A BatchDrafter (``treespec.drafters.batched``)."""

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = True
    registry_name = "plain"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.calls = 0

    def begin(self, key, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        pass

    def expand_batch(self, calls):
        raise RuntimeError("the plain server drafts nothing: its trees are the root alone (budget 1)")

    def commit(self, key, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        pass

    def drop(self, key) -> None:
        pass

    def checkpoint(self) -> None:
        return None

    def restore(self, state: None) -> None:
        pass


# The plain server's tree: the root alone, one token per target forward.
PLAIN = DynamicTreeBuilder(budget=1, depth=1, top_k=1)


def _check_requests(target: Target, drafters, prompts, max_new_tokens, configs, seeds,
                    per_request: bool = True) -> None:
    for name, value in (("drafters", drafters), ("prompts", prompts), ("max_new_tokens", max_new_tokens),
                        ("configs", configs), ("seeds", seeds)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list with one entry per request, got {type(value).__name__}")
        if len(value) != len(prompts):
            raise ValueError(f"{name} has {len(value)} entries but there are {len(prompts)} prompts")
    if not prompts:
        raise ValueError("prompts must hold at least one request")
    if per_request and len({id(d) for d in drafters}) != len(drafters):
        raise ValueError("each request needs its own drafter object (a drafter holds one request's state)")
    for b, (d, p, m, c) in enumerate(zip(drafters, prompts, max_new_tokens, configs)):
        if not isinstance(d, (Drafter, BatchDrafter)) or (per_request and not isinstance(d, Drafter)):
            raise TypeError(f"drafters[{b}] must be a Drafter, got {type(d).__name__}")
        if d.vocab_size != target.vocab_size:
            raise ValueError(f"drafters[{b}] has vocab size {d.vocab_size} but the target has "
                             f"{target.vocab_size}; they must share one vocabulary")
        if not isinstance(p, torch.Tensor) or p.dtype != torch.long or p.dim() != 1 or p.numel() < 1:
            raise TypeError(f"prompts[{b}] must be a 1-D LongTensor with at least one token id")
        if bool((p < 0).any()) or bool((p >= target.vocab_size).any()):
            raise ValueError(f"prompts[{b}] has token ids outside [0, {target.vocab_size})")
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise ValueError(f"max_new_tokens[{b}] must be an int > 0, got {m!r}")
        if not isinstance(c, SamplingConfig):
            raise TypeError(f"configs[{b}] must be a SamplingConfig, got {type(c).__name__}")


def generate_batch(
    target: Target,
    drafters: "Sequence[Drafter] | Drafter | BatchDrafter | str",
    builder: TreeBuilder,
    # B prompts: text, or token ids (LongTensor[P_b] or a list of ints) each
    prompts: "Sequence[str | torch.Tensor | Sequence[int]]",
    max_new_tokens: "int | Sequence[int]",
    configs: Sequence[SamplingConfig] | None = None,
    seeds: Sequence[int | None] | None = None,
    verify: VerifyRule = "token",
    chat: bool = True,
) -> list[list[int]]:
    """New token ids per request (EOS included when hit; never more than its limit).

    ``drafters``: one Drafter, BatchDrafter or registered drafter name for every request (its
    batched form: one drafter forward per round for all of them), or a list with request b's
    own single-request drafter at b (each driven alone, ``LoopBatchDrafter``). ``prompts``: text
    (through the chat template when ``chat``) or token ids, as ``SpeculativeGenerator.generate``
    takes them. ``max_new_tokens``: one limit for all, or one per request. ``configs`` default to
    ``SamplingConfig()``; ``seeds[b]`` seeds request b's generator (None: a fresh random seed).
    Runs a ``SpeculativeServer`` with every request joining at the first step.
    """

    if not isinstance(target, Target):
        raise TypeError(f"target must be a treespec.Target, got {type(target).__name__}")
    if isinstance(drafters, str):
        drafters = load_drafter(drafters, target)
    if isinstance(prompts, (list, tuple)):
        prompts = [p if isinstance(p, torch.Tensor) else _encoded(target, p, chat, b) for b, p in enumerate(prompts)]
    b_ = len(prompts) if isinstance(prompts, (list, tuple)) else 0
    if isinstance(max_new_tokens, int) and not isinstance(max_new_tokens, bool):
        max_new_tokens = [max_new_tokens] * b_
    configs = [SamplingConfig()] * b_ if configs is None else configs
    seeds = [None] * b_ if seeds is None else seeds
    check_builder(builder)
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
    per_request = isinstance(drafters, (list, tuple))
    _check_requests(target, drafters if per_request else [drafters] * b_, prompts, max_new_tokens,
                    configs, seeds, per_request)
    budget = getattr(builder, "budget", 1)
    for b, (p, m) in enumerate(zip(prompts, max_new_tokens)):
        limit, why = context_window(target, drafters[b] if per_request else drafters)
        if p.numel() + m + budget > limit:
            raise ValueError(f"request {b} does not fit the context window ({limit}: "
                             f"{why}; prompt "
                             f"{p.numel()}, max_new_tokens {m}, tree budget {budget}); shorten it")
    if per_request:
        layers = tuple(sorted({i for d in drafters if d.needs_target_hidden for i in d.target_layers}))
        drafter = LoopBatchDrafter(lambda key: drafters[key], target.vocab_size, bool(layers), layers)
    else:
        drafter = as_batch_drafter(drafters)
    server = SpeculativeServer(target, drafter, builder, verify)
    rids = [server.add_request(p, c, m, s) for p, c, m, s in zip(prompts, configs, max_new_tokens, seeds)]
    assert rids == list(range(b_))          # LoopBatchDrafter keys are request indices
    server.run()
    return [list(server.finished[r].tokens) for r in rids]


def _encoded(target: Target, prompt, chat: bool, b: int) -> torch.Tensor:
    """prompts[b] (text or a list of ids) as LongTensor[P]; its errors name the request."""
    try:
        return encode_prompt(target, prompt, chat)
    except (TypeError, ValueError) as e:
        raise type(e)(f"prompts[{b}]: {e}") from None
