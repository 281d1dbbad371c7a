"""``check_drafter``: does a drafter keep the contract the engine relies on?

Checks, in order (a failed protocol check stops there; the others all run, then every failure
is raised together):
    protocol   the members of ``treespec.Drafter``; ``expand`` returns FloatTensor[F, V] of
               logits with no NaN or +inf and a finite entry per row (-inf is allowed);
               ``expand_compact`` (if any) agrees with ``expand``; a drafter that says
               ``path_independent`` gives one q per depth.
    batched    ``expand`` of a whole level at once equals expanding its nodes one by one.
    greedy     T = 0 output equals plain greedy decoding of the target, under a chain and a
               dynamic tree.
    law        T = 1: the first two tokens of seeded engine runs (a tree of drawn children, and
               a chain) against the target's law of those tokens, enumerated exactly over V²
               outcomes of an 8-token target (Pearson chi-square, p > ``alpha``).

A drafter can be slow or useless and pass; it fails when the engine could not rely on it.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from treespec.builders import BestFirstBuilder, ChainBuilder, DynamicTreeBuilder
from treespec.drafters import load_drafter
from treespec.drafters.base import Drafter, PartialTree, TargetFeatures, capabilities, missing_members
from treespec.runtime.generator import SpeculativeGenerator
from treespec.targets.loader import Target, tiny_target
from treespec.testing.laws import chisquare_pvalue, first_tokens_law, plain_greedy

DrafterFactory = Callable[[Target], Drafter]
PROMPTS = ([5, 7, 3, 6, 1, 4], [4])          # token ids < 8, so every target's vocabulary has them
LAW_VOCAB = 8                                # V of the law check's target: V² outcomes enumerated


@dataclass(frozen=True)
class CheckResult:
    """One check: ``passed`` None means skipped (``detail`` says why)."""

    name: str
    passed: bool | None
    seconds: float
    detail: str


@dataclass
class ConformanceReport:
    """Every check's result, in order."""

    drafter: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.passed is not False for r in self.results)

    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.passed is False]

    def __str__(self) -> str:
        word = {True: "pass", False: "FAIL", None: "skip"}
        lines = [f"check_drafter({self.drafter}):"]
        lines += [f"  {word[r.passed]:4}  {r.name:9} {r.seconds:6.1f} s  {r.detail}" for r in self.results]
        return "\n".join(lines)


class DrafterConformanceError(AssertionError):
    """A drafter failed ``check_drafter``; ``report`` holds every check's result."""

    def __init__(self, report: ConformanceReport):
        self.report = report
        super().__init__(f"the drafter fails {', '.join(r.name for r in report.failures())}:\n{report}")


class _Failed(Exception):
    """A check's own failure, with what is wrong and how to fix it."""


def conformance_targets() -> tuple[Target, Target]:
    """The default targets: a 32-token and an 8-token tiny random Llama, with no EOS (every run
    reaches its length)."""
    out = []
    for vocab, seed in ((32, 0), (LAW_VOCAB, 3)):
        target = tiny_target(vocab_size=vocab, seed=seed)
        target.model.generation_config.eos_token_id = None
        out.append(target)
    return out[0], out[1]


def check_drafter(factory: DrafterFactory | str, target: Target | None = None, *, law_target: Target | None = None,
                  law_runs: int = 600, alpha: float = 1e-3, raise_on_failure: bool = True) -> ConformanceReport:
    """Check the drafter that ``factory(target)`` builds (see the module docstring).

    Args:
        factory:    a factory(target) -> Drafter, or a name ``load_drafter`` resolves
                    ("package.module:factory", a registered or entry-point name).
        target:     the target of the protocol, batching and greedy checks; default a tiny random
                    Llama with 32 tokens (``conformance_targets``).
        law_target: the target of the T = 1 law check: at most 16 tokens, since the law is
                    enumerated over V² outcomes. Default: ``target`` when it is that small, else
                    an 8-token tiny Llama when ``target`` was not given; otherwise the check is
                    skipped (the report says so).
        law_runs:   seeded engine runs per builder in the law check.
        alpha:      the law check fails below this p-value (the chance a correct drafter fails).
        raise_on_failure: raise ``DrafterConformanceError`` on a failed check (default), else
                    only return the report.
    """
    if law_runs < 100:
        raise ValueError(f"law_runs must be >= 100 for a chi-square over the first two tokens, got {law_runs}")
    if isinstance(factory, str):
        name = factory
        factory = lambda t: load_drafter(name, t)   # noqa: E731
    elif callable(factory):
        name = getattr(factory, "__qualname__", repr(factory))
    else:
        raise TypeError(f"factory must be a callable factory(target) -> Drafter or a drafter name, got "
                        f"{type(factory).__name__}")
    if target is None:
        target, default_law = conformance_targets()
    else:
        default_law = target if target.vocab_size <= 16 else None
    law_target = law_target if law_target is not None else default_law
    report = ConformanceReport(name)
    checks = [("protocol", lambda: _protocol(factory, target)), ("batched", lambda: _batched(factory, target)),
              ("greedy", lambda: _greedy(factory, target)),
              ("law", lambda: _law(factory, law_target, law_runs, alpha))]
    for check, run in checks:
        start = time.perf_counter()
        try:
            passed, detail = run()
        except _Failed as e:
            passed, detail = False, str(e)
        except Exception as e:   # a crash inside the drafter is a failure of that check, reported as one
            passed, detail = False, f"raised {type(e).__name__}: {e}"
        report.results.append(CheckResult(check, passed, time.perf_counter() - start, detail))
        if check == "protocol" and passed is False:
            break
    if raise_on_failure and not report.ok:
        raise DrafterConformanceError(report)
    return report


# ---------------------------------------------------------------- the checks
def _begun(factory: DrafterFactory, target: Target, prompt: list[int]) -> Drafter:
    """A fresh drafter that has begun a request on ``prompt``."""
    drafter = factory(target)
    ids = torch.tensor(prompt)
    drafter.begin(ids, _features(target, drafter, ids[:-1]))
    return drafter


@torch.inference_mode()
def _features(target: Target, drafter: Drafter, ids: torch.Tensor) -> TargetFeatures:
    """The target features of ``ids`` at the layers ``drafter`` asked for."""
    if not drafter.needs_target_hidden or ids.numel() == 0:
        return TargetFeatures({l: torch.zeros(0, target.model.config.hidden_size, dtype=target.dtype)
                               for l in drafter.target_layers} if drafter.needs_target_hidden else {})
    hidden = target.model(ids[None].to(target.device), output_hidden_states=True).hidden_states
    return TargetFeatures({l: hidden[l][0] for l in drafter.target_layers})


def _logits(drafter: Drafter, tree: PartialTree, nodes: list[int], vocab: int) -> torch.Tensor:
    out = drafter.expand(tree, nodes)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point():
        raise _Failed(f"expand must return a float tensor of logits [len(nodes), V], got {type(out).__name__}"
                      + (f" of {out.dtype}" if isinstance(out, torch.Tensor) else ""))
    if tuple(out.shape) != (len(nodes), vocab):
        raise _Failed(f"expand(tree, {len(nodes)} nodes) returned shape {tuple(out.shape)}, not "
                      f"({len(nodes)}, {vocab}): one row of V logits per node, V = the target's vocabulary")
    out = out.detach().float().cpu()
    if torch.isnan(out).any() or (out == float("inf")).any():
        raise _Failed("expand returned NaN or +inf logits; return finite logits, with -inf where q is 0")
    if (~torch.isfinite(out)).all(-1).any():
        raise _Failed("expand returned a row of only -inf: q must give some token a positive probability")
    return out


def _protocol(factory: DrafterFactory, target: Target) -> tuple[bool, str]:
    drafter = factory(target)
    if missing := missing_members(drafter):
        raise _Failed(f"{type(drafter).__name__} lacks {', '.join(missing)} (the treespec.Drafter protocol: "
                      f"begin, expand, commit, needs_target_hidden, target_layers, vocab_size, path_independent)")
    if drafter.vocab_size != target.vocab_size:
        raise _Failed(f"vocab_size is {drafter.vocab_size!r} but the target has {target.vocab_size} tokens: the "
                      f"factory gets the target, read target.vocab_size")
    for flag in ("needs_target_hidden", "path_independent"):
        if not isinstance(getattr(drafter, flag), bool):
            raise _Failed(f"{flag} must be a bool, got {getattr(drafter, flag)!r}")
    layers, top = drafter.target_layers, target.model.config.num_hidden_layers
    if not isinstance(layers, tuple) or not all(isinstance(l, int) and 0 <= l <= top for l in layers):
        raise _Failed(f"target_layers must be a tuple of hidden_states indices 0..{top}, got {layers!r}")
    if drafter.needs_target_hidden and not layers:
        raise _Failed("needs_target_hidden is True but target_layers is empty: name the layers you read")
    drafter = _begun(factory, target, PROMPTS[0])
    tree = PartialTree.rooted(PROMPTS[0][-1])
    root = _logits(drafter, tree, [0], target.vocab_size)
    a, b = tree.add(0, 1), tree.add(0, 2)
    rows = _logits(drafter, tree, [a, b], target.vocab_size)
    notes = []
    compact = capabilities(drafter).expand_compact
    if compact is not None:
        fresh = _begun(factory, target, PROMPTS[0])
        logits, ids = compact(PartialTree.rooted(PROMPTS[0][-1]), [0])
        full = torch.full((1, target.vocab_size), float("-inf"))
        full[:, ids.cpu() if ids is not None else slice(None)] = logits.detach().float().cpu()
        if not torch.allclose(full.softmax(-1), root.softmax(-1), atol=1e-5):
            raise _Failed("expand_compact disagrees with expand: its logits at its ids must equal expand's, "
                          "and expand must give -inf outside those ids")
        notes.append("expand_compact agrees")
    if drafter.path_independent and not torch.allclose(rows[0], rows[1], atol=1e-5):
        raise _Failed("path_independent is True but two nodes of one depth got different q: set it False")
    return True, f"members, flags, expand -> [F, {target.vocab_size}] logits" + "".join(f"; {n}" for n in notes)


def _level_tree(root: int, vocab: int, seed: int) -> list[list[tuple[int, int]]]:
    """A random tree as levels of (parent, token) pairs: 3 levels, up to 3 children a node."""
    rng = random.Random(seed)
    levels, frontier, count = [], [0], 1
    for _ in range(3):
        level = []
        for parent in frontier:
            for token in rng.sample(range(vocab), rng.randint(1, 3) if parent == 0 else rng.randint(0, 2)):
                level.append((parent, token))
        if not level:
            break
        frontier = list(range(count, count + len(level)))
        count += len(level)
        levels.append(level)
    return levels


def _batched(factory: DrafterFactory, target: Target) -> tuple[bool, str]:
    v = target.vocab_size
    worst, nodes = 0.0, 0
    for seed in range(3):
        prompt = PROMPTS[0]
        levels = _level_tree(prompt[-1], min(v, 8), seed)
        together, alone = _begun(factory, target, prompt), _begun(factory, target, prompt)
        t1, t2 = PartialTree.rooted(prompt[-1]), PartialTree.rooted(prompt[-1])
        batch = [_logits(together, t1, [0], v)]
        single = [_logits(alone, t2, [0], v)]
        for level in levels:
            new = [t1.add(p, tok) for p, tok in level]
            for p, tok in level:
                t2.add(p, tok)
            batch.append(_logits(together, t1, new, v))
            single += [_logits(alone, t2, [n], v) for n in new]
        a, b = torch.cat(batch), torch.cat(single)
        if not torch.equal(torch.isinf(a), torch.isinf(b)):
            raise _Failed("expand of a level at once and of its nodes one by one put -inf in different places")
        pa, pb = a.softmax(-1), b.softmax(-1)
        worst, nodes = max(worst, float((pa - pb).abs().max())), nodes + a.shape[0]
        if worst > 1e-4:
            row = int((pa - pb).abs().amax(-1).argmax())
            raise _Failed(f"expand of a level at once differs from its nodes one by one (node {row} of tree {seed}: "
                          f"max |q diff| {worst:.2g}): row i of expand(tree, nodes) must be q after nodes[i]'s path "
                          f"(tree.path_to(nodes[i])), whatever else is in the call")
    return True, f"{nodes} nodes in 3 trees: level at once = one by one (max |q diff| {worst:.1g})"


def _greedy(factory: DrafterFactory, target: Target) -> tuple[bool, str]:
    builders = {"chain 5": ChainBuilder(budget=5), "dynamic 16": DynamicTreeBuilder(budget=16, depth=4, top_k=3)}
    n, taus = 24, []
    for label, builder in builders.items():
        gen = SpeculativeGenerator(target, factory(target), builder)
        for prompt in PROMPTS:
            ids = torch.tensor(prompt)
            out = gen.generate(ids, max_new_tokens=n, temperature=0.0)
            want = plain_greedy(target, ids, n)
            got = out.token_ids.tolist()
            if got != want:
                first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
                raise _Failed(f"{label}: greedy output differs from plain decoding at token {first} (prompt {prompt}): "
                              f"a drafter must not change the target, the tree it is given, or the tensors passed "
                              f"to begin / commit")
            taus.append(out.stats.tau)
    return True, f"chain 5 and dynamic 16 = plain decoding ({len(taus)} runs of {n} tokens, tau {min(taus):.2f}-{max(taus):.2f})"


def _law(factory: DrafterFactory, target: Target | None, runs: int, alpha: float) -> tuple[bool | None, str]:
    if target is None:
        return None, ("skipped: the law is enumerated over V² outcomes; pass law_target=a target of at most 16 "
                      "tokens (treespec.targets.loader.tiny_target(vocab_size=8))")
    if target.vocab_size > 16:
        raise ValueError(f"law_target has {target.vocab_size} tokens; the law check enumerates V² outcomes: give at "
                         f"most 16 (tiny_target(vocab_size=8))")
    v, ids = target.vocab_size, torch.tensor(PROMPTS[0][-4:]) % target.vocab_size
    law = first_tokens_law(target, ids, 2)
    builders = {"best-first 8 drawn without replacement":
                BestFirstBuilder(budget=8, max_width=2, max_rounds=3, mode="without_replacement"),
                "chain 4 drawn with replacement": ChainBuilder(budget=4, mode="with_replacement")}
    notes = []
    for label, builder in builders.items():
        gen = SpeculativeGenerator(target, factory(target), builder)
        counts = torch.zeros(v * v, dtype=torch.float64)
        for seed in range(runs):
            x = gen.generate(ids, max_new_tokens=2, temperature=1.0, seed=seed).token_ids.tolist()
            x = x + [x[-1]] * (2 - len(x))   # stopped at EOS: the law puts it at (eos, eos)
            counts[x[0] * v + x[1]] += 1
        p, dof = chisquare_pvalue(counts, law)
        if p <= alpha:
            raise _Failed(f"{label}: the first two tokens of {runs} seeded runs at T = 1 do not follow the target's "
                          f"law (chi-square p = {p:.2g}, {dof} dof): the output is biased. Usual causes: expand "
                          f"returns q that changes between calls for one node, or the drafter changes the target, "
                          f"the tree it is given (tokens, parents) or the tensors passed to begin / commit")
        notes.append(f"p = {p:.2f}")
    return True, f"T = 1, {runs} runs x 2 builders vs the exact law over {v}² outcomes ({', '.join(notes)})"
