"""The drafter contract, the partial tree builders grow, and the drafter registry.

Glossary:
    committed   tokens the engine has emitted (prompt included). The last committed token is the
                **root** of the next tree; every committed token before it is in the target's KV
                cache and has target features.
    features    ``TargetFeatures``: target hidden states for committed positions, keyed by HF
                ``hidden_states`` index (0 = embeddings, L = last layer), as a drafter asked for
                through ``target_layers``.
    frontier    the nodes of a ``PartialTree`` a builder asks the drafter to expand: for each,
                the drafter returns logits of q(.|prefix, path to node).

Lifecycle driven by the engine:
    begin(prompt_ids, features)         once per request; prompt_ids[-1] is the first root.
    expand(tree, nodes) -> logits        any number of times while a builder grows one tree;
                                         a node is expanded at most once, parents before children.
    commit(path, tokens, features)       after verification: ``path`` (accepted node indices,
                                         root excluded) and ``tokens`` (their tokens + the new
                                         token, which becomes the next root). ``features`` covers
                                         the old root and the accepted nodes.

Batched form (``treespec.drafters.batched``): the same lifecycle per request key under one
object, with ``expand_batch`` answering every request's call of a drafting round in ONE
forward. A drafter offers it through an optional ``batched()`` method (the model drafters do);
any other drafter is looped per request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import torch

from treespec.fastpath.device import synchronize
from treespec.core.tree import DraftTree


@dataclass(frozen=True)
class TargetFeatures:
    """Target hidden states for a run of committed positions.

    Attributes:
        hidden: mapping HF hidden_states index -> FloatTensor[T, H], one row per position.
    """

    hidden: dict[int, torch.Tensor]

    def __post_init__(self) -> None:
        lengths = {int(h.shape[0]) for h in self.hidden.values()}
        if len(lengths) > 1:
            raise ValueError(f"all feature layers must cover the same positions, got lengths {lengths}")

    @property
    def length(self) -> int:
        return next(iter(self.hidden.values())).shape[0] if self.hidden else 0

    def select(self, rows: torch.Tensor) -> "TargetFeatures":
        return TargetFeatures({k: v.index_select(0, rows.to(v.device)) for k, v in self.hidden.items()})

    @staticmethod
    def empty() -> "TargetFeatures":
        return TargetFeatures({})


@dataclass
class PartialTree:
    """A tree under construction; node 0 is the root. Builders append, drafters read.

    Attributes:
        tokens:  token per node.
        parents: parent per node (-1 for the root), always < the node's index.
        depth:   depth per node (root 0).
        score:   builder-defined score per node (e.g. cumulative draft log-probability).
    """

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    depth: list[int] = field(default_factory=lambda: [0])
    score: list[float] = field(default_factory=lambda: [0.0])

    @classmethod
    def rooted(cls, root_token: int) -> "PartialTree":
        return cls(tokens=[int(root_token)])

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float = 0.0) -> int:
        """Append a child of ``parent``; returns its index."""
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depth.append(self.depth[parent] + 1)
        self.score.append(float(score))
        return len(self.tokens) - 1

    def path_to(self, node: int) -> list[int]:
        path = [node]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]


def tree_slot_mask(tree: PartialTree, nodes: list[int], slots: dict[int, int], committed: int, base: int,
                   device: torch.device) -> torch.Tensor:
    """BoolTensor[F, base + F] on ``device``: which cache positions each new node attends to.

    Row r (node ``nodes[r]``, written at cache position base + r) sees the first ``committed``
    positions, the positions ``slots[a]`` of its ancestors a that have one, and itself. The
    index pairs are collected in Python and written with ONE indexed store (one upload), not
    element by element on the device.
    """
    f = len(nodes)
    pairs: list[int] = []
    for r, n in enumerate(nodes):
        a = tree.parents[n]
        while a in slots:
            pairs += (r, slots[a])
            a = tree.parents[a]
        pairs += (r, base + r)
    allowed = torch.zeros(f, base + f, dtype=torch.bool, device=device)
    allowed[:, :committed] = True
    index = torch.tensor(pairs, dtype=torch.long, device=device).view(-1, 2)
    allowed[index[:, 0], index[:, 1]] = True
    return allowed


def fused_slots(head, layers: tuple[int, ...], device: torch.device, dtype: torch.dtype, tokens: list[int],
                features: TargetFeatures) -> torch.Tensor | None:
    """A feature head's fused inputs [n, H] for committed slots (tokens[i], feature row i of
    ``features`` at target ``layers``), or None when there are none. Shared by the single and
    the batched feature drafters."""
    if features.length != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {features.length} feature rows")
    if not tokens:
        return None
    with torch.inference_mode():
        return head.fuse({l: features.hidden[l].to(device, dtype) for l in layers})


@runtime_checkable
class Drafter(Protocol):
    """Anything that proposes next-token distributions cheaply (see the module docstring).

    Capability flags:
        needs_target_hidden: the engine must collect target features for ``begin``/``commit``.
        target_layers:       which HF hidden_states indices the drafter needs (empty if none).
        vocab_size:          V of the logits ``expand`` returns (must equal the target's).
        path_independent:    q at a node depends only on its depth, not on the path
                             (Medusa-style heads); builders may share one call per depth.

    Optional capabilities: a drafter may also define any of the members below. They are read
    in one place, ``capabilities(drafter)``, never probed elsewhere.
        cost_kind:       the cost model's name of its per-level pass ("eagle", "early_exit",
                         "lookup", ...); default "eagle" if it reads target features, else
                         "early_exit".
        registry_name:   the name it was loaded under (set by ``load_drafter``); calibration
                         entries of ``treespec calibrate --drafter NAME`` are keyed by it.
        weights_checksum: the tensor checksum of the checkpoint it was loaded from (set by the
                         checkpoint loaders); a calibration records it, and ``builder="auto"``
                         does not plan with acceptance measured on other weights.
        expand_compact:  ``expand`` restricted to a reduced draft vocabulary (see ``expand``).
        batched:         ``batched() -> BatchDrafter``, its own batched form for the server
                         (default: one copy of the drafter per request, ``LoopBatchDrafter``).
        max_context, max_context_reason:
                         the longest context the drafter drafts from correctly, and why (a
                         drafter model with sliding-window attention: its window − 1); default
                         no limit. Requests that would pass it are refused up front.
    """

    needs_target_hidden: bool
    target_layers: tuple[int, ...]
    vocab_size: int
    path_independent: bool

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        """Start a request. prompt_ids: LongTensor[P]; features cover prompt_ids[:-1]."""

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        """FloatTensor[len(nodes), V]: draft logits of the next token after each node.

        Optional fast path: a drafter whose q is always zero outside a fixed set of Vd target
        ids (a reduced draft vocabulary) may also define ``expand_compact(tree, nodes) ->
        (logits [F, Vd], ids LongTensor[Vd] | None)``, the same call restricted to those ids
        (None: all V). Builders prefer it; it must agree with ``expand`` (-inf elsewhere).
        """

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        """Accept ``path`` (LongTensor[A], node ids of the accepted drafts in the last tree).
        tokens: LongTensor[A + 1], this step's new text: the A accepted draft tokens, then the
        target's own next token (the next tree's root)."""


@dataclass(frozen=True)
class Capabilities:
    """What a drafter offers beyond the required protocol (see ``Drafter``)."""

    cost_kind: str
    registry_name: str | None
    # (tree, nodes) -> (logits [F, Vd], target ids [Vd] | None)
    expand_compact: Callable[[PartialTree, list[int]], tuple[torch.Tensor, torch.Tensor | None]] | None
    batched: Callable[[], object] | None          # () -> BatchDrafter
    max_context: int | None                       # None: no limit of its own
    max_context_reason: str
    weights_checksum: str | None = None           # None: no checkpoint (lookup, a model drafter)


def capabilities(drafter: object) -> Capabilities:
    """The optional members of ``drafter`` (``Drafter``'s docstring lists them), with their
    defaults. The one place they are read."""
    kind = getattr(drafter, "cost_kind", None)
    if kind is None:
        kind = "eagle" if getattr(drafter, "needs_target_hidden", False) else "early_exit"
    compact, batched = getattr(drafter, "expand_compact", None), getattr(drafter, "batched", None)
    return Capabilities(kind, getattr(drafter, "registry_name", None), compact if callable(compact) else None,
                        batched if callable(batched) else None, getattr(drafter, "max_context", None),
                        getattr(drafter, "max_context_reason", ""), getattr(drafter, "weights_checksum", None))


# ---------------------------------------------------------------- protocol check
DRAFTER_METHODS = ("begin", "expand", "commit")
DRAFTER_FLAGS = ("needs_target_hidden", "target_layers", "vocab_size", "path_independent")


def missing_members(obj: object) -> list[str]:
    """The members of the ``Drafter`` protocol that ``obj`` lacks (a method that is not
    callable counts as missing), in the protocol's order."""
    return ([m for m in DRAFTER_METHODS if not callable(getattr(obj, m, None))]
            + [f for f in DRAFTER_FLAGS if not hasattr(obj, f)])


def check_drafter_protocol(obj: object, what: str = "drafter") -> None:
    """TypeError naming every member of the ``Drafter`` protocol that ``obj`` lacks."""
    missing = missing_members(obj)
    if missing:
        raise TypeError(f"{what} ({type(obj).__name__}) is not a treespec Drafter: it lacks "
                        f"{', '.join(missing)}. A Drafter has the methods begin(prompt_ids, features), "
                        f"expand(tree, nodes) and commit(path, tokens, features) and the attributes "
                        f"{', '.join(DRAFTER_FLAGS)} (docs/drafters.md)")


# ---------------------------------------------------------------- registry
# name -> factory(target, **options) -> Drafter. Factories receive the treespec Target.
_REGISTRY: dict[str, Callable[..., Drafter]] = {}
ENTRY_POINT_GROUP = "treespec.drafters"   # third-party packages register drafter factories here


def register_drafter(name: str, *, replace: bool = False) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    """Decorator: register a drafter factory under ``name``. A name registered already is a
    ValueError unless ``replace=True`` (re-running a notebook cell that defines the drafter)."""
    if not isinstance(name, str) or not name or any(c in name for c in _KEY_SPECIALS + ":"):
        raise ValueError(f"drafter name must be a non-empty string without any of {_KEY_SPECIALS + ':'!r}, "
                         f"got {name!r}")

    def wrap(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        if not callable(factory):
            raise TypeError(f"drafter factory for {name!r} must be callable, got {factory!r}")
        if name in _REGISTRY and not replace:
            raise ValueError(f"a drafter named {name!r} is already registered; pass "
                             f"register_drafter({name!r}, replace=True) to replace it")
        _REGISTRY[name] = factory
        return factory

    return wrap


def registered_drafters() -> tuple[str, ...]:
    """Names registered in this process (the shipped drafters and any ``register_drafter``)."""
    return tuple(sorted(_REGISTRY))


def plugin_drafters() -> tuple[str, ...]:
    """Names installed packages offer in the ``treespec.drafters`` entry-point group."""
    from importlib.metadata import entry_points

    return tuple(sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}))


def drafter_factory(name: str) -> Callable[..., Drafter]:
    """The factory ``name`` stands for, tried in this order: a registered name; a
    ``package.module:factory`` reference (imported); an entry point of the ``treespec.drafters``
    group. Anything else is a KeyError listing what exists."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        return _import_factory(name)
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if found:
        try:
            factory = found[0].load()
        except Exception as e:   # a broken plugin package: say which one, and why
            raise ImportError(f"drafter {name!r}: the entry point {found[0].value!r} of group "
                              f"{ENTRY_POINT_GROUP!r} failed to load ({type(e).__name__}: {e}); reinstall or fix "
                              f"that package") from e
        return _callable_factory(name, factory)
    plugins = plugin_drafters()
    raise KeyError(f"unknown drafter {name!r}; registered: {', '.join(registered_drafters())}"
                   + (f"; installed plugins: {', '.join(plugins)}" if plugins else "")
                   + ". A drafter of your own: 'package.module:factory' (factory(target) -> Drafter), or an "
                   f"entry point in group {ENTRY_POINT_GROUP!r} (docs/drafters.md)") from None


def _import_factory(reference: str) -> Callable[..., Drafter]:
    """``"package.module:factory"`` (the attribute may be dotted: ``module:Class.create``)."""
    import importlib

    module_name, _, attr = reference.partition(":")
    if not module_name or not attr:
        raise ValueError(f"drafter {reference!r}: write a drafter of your own as 'package.module:factory'")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"drafter {reference!r}: cannot import module {module_name!r} ({e}); install its package "
                         f"or put its folder on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise ValueError(f"drafter {reference!r}: {module_name} has no attribute {attr!r}; it defines "
                             f"{', '.join(names[:20]) or 'nothing public'}")
        obj = getattr(obj, part)
    return _callable_factory(reference, obj)


def _callable_factory(name: str, factory: object) -> Callable[..., Drafter]:
    if not callable(factory):
        raise TypeError(f"drafter {name!r} names {type(factory).__name__} object, not a factory; it must be a "
                        f"callable factory(target, **options) -> Drafter")
    return factory   # type: ignore[return-value]


# A drafter loaded with options is calibrated under a key that names them, because options
# such as ``weights="int4"`` or a draft vocabulary change its pass times and acceptance: a
# calibration of the plain drafter is not one of that drafter. The key is a name too:
# ``load_drafter(key, target)`` builds the same drafter again, which is how calibration
# rebuilds what it measures.
_KEY_SPECIALS = "[],="


def parse_option_value(raw: str) -> object:
    """A drafter option's text as its value: an int, else a float, else ``true`` / ``false``
    as a bool, else the text itself."""
    raw = raw.strip()
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            continue
    return {"true": True, "false": False}.get(raw.lower(), raw)


def _option_text(value: object) -> str | None:
    """``value`` as key text that ``parse_option_value`` reads back equal; None if none does."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str) and value and not any(c in value for c in _KEY_SPECIALS) \
            and parse_option_value(value) == value:
        return value
    return None


def drafter_key(name: str, options: dict[str, object]) -> str | None:
    """The name ``load_drafter(name, target, **options)`` is calibrated under: ``name`` alone
    without options, else ``name[key=value,...]``, keys sorted (``qwen2.5-coder-0.5b[weights=int4]``).

    ``checkpoint`` stays out: a calibration records the checkpoint's tensor checksum, and
    ``builder="auto"`` already refuses acceptance measured on other weights. None when an
    option has no text that reads back as itself (a head passed as a Drafter object): no name
    rebuilds that drafter, so no calibration can be keyed by one."""
    parts = []
    for key in sorted(options):
        if key == "checkpoint":
            continue
        text = _option_text(options[key])
        if text is None:
            return None
        parts.append(f"{key}={text}")
    return f"{name}[{','.join(parts)}]" if parts else name


def split_drafter_key(key: str) -> tuple[str, dict[str, object]]:
    """``drafter_key``'s inverse: ``"name[a=1,b=x]"`` -> ``("name", {"a": 1, "b": "x"})``; a
    plain name -> ``(name, {})``."""
    name, bracket, rest = key.partition("[")
    if not bracket:
        return key, {}
    if not rest.endswith("]") or "[" in rest or not name:
        raise ValueError(f"drafter {key!r}: write options as name[key=value,...], e.g. "
                         "'qwen2.5-coder-0.5b[weights=int4]'")
    options: dict[str, object] = {}
    for pair in rest[:-1].split(","):
        option, sep, raw = pair.partition("=")
        if not sep or not option.strip() or option.strip() in options:
            raise ValueError(f"drafter {key!r}: each option is key=value, once (e.g. weights=int4); got {pair!r}")
        options[option.strip()] = parse_option_value(raw)
    return name, options


def merged_options(name: str, options: dict[str, object]) -> tuple[str, dict[str, object]]:
    """(the registered name, every option) of ``load_drafter(name, target, **options)``, where
    ``name`` may carry options too (``"lookup[min_ngram=3]"``); an option given both ways is a
    ValueError."""
    name, named = split_drafter_key(name)
    if twice := sorted(set(named) & set(options)):
        raise ValueError(f"drafter option {', '.join(map(repr, twice))} given both in the name and as an "
                         "argument; give it once")
    return name, {**named, **options}


def drafter_names(text: str) -> list[str]:
    """A comma-separated list of drafter keys, whose own options are comma-separated inside
    brackets: ``"eagle3,qwen2.5-coder-0.5b[weights=int4,x=1]"`` -> the two keys."""
    names = re.findall(r"[^,\[]+(?:\[[^\]]*\])?", text)
    if ",".join(names) != text:
        raise ValueError(f"drafters {text!r}: give names separated by single commas, each with its options in "
                         "closed brackets (e.g. eagle3,qwen2.5-coder-0.5b[weights=int4])")
    return names


def as_draft_tree(partial: PartialTree, draft_probs: torch.Tensor | None, sampling: str) -> DraftTree:
    """Freeze a PartialTree into a validated DraftTree."""
    return DraftTree(
        torch.tensor(partial.tokens, dtype=torch.long),
        torch.tensor(partial.parents, dtype=torch.long),
        draft_probs,
        sampling,  # type: ignore[arg-type]
    )


class TimedDrafter:
    """Drafter proxy that times every ``expand`` / ``expand_compact`` call (benchmarks and
    drafter calibration); everything else is forwarded to ``inner``.

    Attributes:
        expand_time: seconds inside the drafter's expand calls since the last reset.
        calls:       (nodes expanded, seconds) of every call since the last reset.
    """

    def __init__(self, inner: Drafter, clock=None):
        import time

        self.inner = inner
        self.clock = clock or time.perf_counter
        self.expand_time = 0.0
        self.calls: list[tuple[int, float]] = []

    def reset(self) -> None:
        self.expand_time, self.calls = 0.0, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)  # AttributeError when the inner drafter lacks it
        return self._timed(attr) if name == "expand_compact" else attr

    def _timed(self, fn):
        def timed(tree, nodes):
            synchronize(getattr(self.inner, "device", None))   # earlier queued work is not ours
            start = self.clock()
            out = fn(tree, nodes)
            synchronize((out[0] if isinstance(out, tuple) else out).device)
            seconds = self.clock() - start
            self.expand_time += seconds
            self.calls.append((len(nodes), seconds))
            return out
        return timed

    def begin(self, prompt_ids, features) -> None:
        self.inner.begin(prompt_ids, features)

    def expand(self, tree, nodes):
        return self._timed(self.inner.expand)(tree, nodes)

    def commit(self, path, tokens, features) -> None:
        self.inner.commit(path, tokens, features)
