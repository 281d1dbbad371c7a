"""A batch of draft trees in CSR layout, and the two step functions a serving stack calls.

Glossary (see DESIGN.md; B requests, T = Σ N_i tree nodes in all, V vocab):
    req_indptr  LongTensor[B + 1]; request i owns flat nodes ``req_indptr[i] : req_indptr[i + 1]``
                (N_i = its tree size, root included, >= 1).
    local       a node index inside its own request's tree (0 = that request's root); flat
                parents are local, -1 at every root, so ``tree(i)`` is a slice, not a renumbering.
    prefix      P_i, the request's cached tokens (the committed tokens except the root).
    keep plan   the KV slots to keep after acceptance, as (source, destination) slot offsets
                relative to the request's prefix: tree node j sits at slot P_i + j during
                verification; the root and the accepted path move to P_i, P_i + 1, ... A paged
                cache adds P_i and maps slots through its own slot mapping.

Per-tree semantics are exactly ``DraftTree``'s (``TreeBatch.tree(i)`` is one, validated the same
way) and per-request acceptance is exactly ``accept``'s: a batch of one is today's tree, and a
request's output never depends on its batch-mates (each request draws from its own generator).

Step functions (pure tensor math: no model, no cache):
    prepare_verify(batch, prefix_lens) -> VerifyInputs    ragged inputs + FlashInfer packed mask
    accept_batch(batch, target_probs, generators, rule)   per-request Acceptance + keep plan
"""

from __future__ import annotations

import operator
from dataclasses import InitVar, dataclass, field
from typing import NamedTuple, Sequence

import torch

from treespec.core.masks import pack_tree_masks
from treespec.core.sampling import SamplingConfig
from treespec.core.tree import SAMPLING_MODES, DraftTree, Sampling, check_long_vector
from treespec.core.acceptance import VERIFY_RULES, Acceptance, VerifyRule
from treespec.core.rejection import accept


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """B draft trees, flat and in request order; validated on construction.

    Attributes:
        req_indptr:      LongTensor[B + 1]; 0 = req_indptr[0] < req_indptr[1] < ... = T.
        tokens:          LongTensor[T]; each request's root first.
        parents:         LongTensor[T]; LOCAL parent index, -1 at each root, < the local index.
        sampling:        tuple of B sampling modes (``DraftTree.sampling``), one per request.
        configs:         tuple of B ``SamplingConfig``: how request i's logits become p (and q).
        draft_probs:     FloatTensor[T, V] or None; flat q rows. Rows of a request that has none
                         (deterministic) are zero and ``has_draft_probs[i]`` is False.
        has_draft_probs: tuple of B bools; None = every request has rows iff draft_probs is given.
        vocab_size:      V shared by every request (None when no request names one).
    """

    req_indptr: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    sampling: tuple[Sampling, ...]
    configs: tuple[SamplingConfig, ...]
    draft_probs: torch.Tensor | None = None
    has_draft_probs: tuple[bool, ...] | None = None
    vocab_size: int | None = None
    # False only when the trees were validated already (``from_trees``)
    scan_probs: InitVar[bool] = True
    _trees: tuple[DraftTree, ...] = field(init=False, repr=False)

    def __post_init__(self, scan_probs: bool) -> None:
        _validate_layout(self)
        b = self.batch_size
        has = self.has_draft_probs
        if has is None:
            has = (self.draft_probs is not None,) * b
        if not isinstance(has, tuple) or len(has) != b or not all(isinstance(h, bool) for h in has):
            raise ValueError(f"has_draft_probs must be a tuple of {b} bools (one per request), got {has!r}")
        if any(has) and self.draft_probs is None:
            raise ValueError("has_draft_probs marks requests with draft rows but draft_probs is None")
        object.__setattr__(self, "has_draft_probs", has)
        ptr = self.req_indptr.tolist()
        trees = []
        for i in range(b):
            s, e = ptr[i], ptr[i + 1]
            probs = self.draft_probs[s:e] if has[i] else None
            try:
                trees.append(DraftTree(self.tokens[s:e], self.parents[s:e], probs, self.sampling[i],
                                       self.vocab_size, scan_probs=scan_probs))
            except ValueError as err:
                raise ValueError(f"request {i}: {err}") from None
        object.__setattr__(self, "_trees", tuple(trees))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], configs: Sequence[SamplingConfig]) -> "TreeBatch":
        """Concatenate per-request trees (request order kept). All must share one vocabulary."""
        if not isinstance(trees, (list, tuple)) or not trees:
            raise ValueError("trees must be a non-empty list of DraftTree (one per request)")
        for i, t in enumerate(trees):
            if not isinstance(t, DraftTree):
                raise TypeError(f"trees[{i}] must be a DraftTree, got {type(t).__name__}")
        configs = _check_configs(configs, len(trees))
        vocabs = {t.vocab_size for t in trees if t.vocab_size is not None}
        if len(vocabs) > 1:
            raise ValueError(f"trees have mixed vocabularies {sorted(vocabs)}; one batch needs one "
                             "target vocabulary")
        vocab = vocabs.pop() if vocabs else None
        sizes = [t.num_nodes for t in trees]
        indptr = torch.zeros(len(trees) + 1, dtype=torch.long)
        indptr[1:] = torch.tensor(sizes, dtype=torch.long).cumsum(0)
        device = trees[0].tokens.device
        tokens = torch.cat([t.tokens.to(device) for t in trees])
        parents = torch.cat([t.parents.to(device) for t in trees])
        has = tuple(t.draft_probs is not None for t in trees)
        probs = None
        if any(has):
            ref = next(t.draft_probs for t in trees if t.draft_probs is not None)
            dtypes = {t.draft_probs.dtype for t in trees if t.draft_probs is not None}
            if len(dtypes) > 1:
                raise TypeError(f"draft_probs of the trees have mixed dtypes {dtypes}; cast them to one")
            # [T, V]
            probs = torch.cat([t.draft_probs.to(ref.device) if t.draft_probs is not None
                               else ref.new_zeros(t.num_nodes, vocab) for t in trees])
        return cls(indptr.to(device), tokens, parents, tuple(t.sampling for t in trees), configs,
                   probs, has, vocab, scan_probs=False)

    # ------------------------------------------------------------------ per request
    @property
    def batch_size(self) -> int:
        return int(self.req_indptr.shape[0]) - 1

    def __len__(self) -> int:
        return self.batch_size

    @property
    def num_nodes(self) -> int:
        """T, the flat node count."""
        return int(self.tokens.shape[0])

    @property
    def sizes(self) -> list[int]:
        """N_i per request."""
        return (self.req_indptr[1:] - self.req_indptr[:-1]).tolist()

    def tree(self, i: int) -> DraftTree:
        """Request i's DraftTree (views of the flat tensors)."""
        i = operator.index(i)
        if not 0 <= i < self.batch_size:
            raise IndexError(f"request index {i} out of range for a batch of {self.batch_size}")
        return self._trees[i]

    @property
    def trees(self) -> tuple[DraftTree, ...]:
        return self._trees

    def __repr__(self) -> str:
        return f"TreeBatch(B={self.batch_size}, sizes={self.sizes}, sampling={self.sampling})"


def _check_configs(configs: object, b: int) -> tuple[SamplingConfig, ...]:
    if isinstance(configs, SamplingConfig) or not isinstance(configs, (list, tuple)):
        raise TypeError(f"configs must be a list of {b} SamplingConfig (one per request), got "
                        f"{type(configs).__name__}")
    if len(configs) != b:
        raise ValueError(f"configs has {len(configs)} entries but the batch has {b} requests")
    for i, c in enumerate(configs):
        if not isinstance(c, SamplingConfig):
            raise TypeError(f"configs[{i}] must be a SamplingConfig, got {type(c).__name__}")
    return tuple(configs)


def _validate_layout(batch: TreeBatch) -> None:
    """The CSR layout itself; per-tree rules are DraftTree's (checked per request after this)."""
    for name in ("req_indptr", "tokens", "parents"):
        check_long_vector(name, getattr(batch, name))
    ptr, n = batch.req_indptr, batch.tokens.shape[0]
    if ptr.numel() < 2:
        raise ValueError("req_indptr must have B + 1 >= 2 entries (a batch needs a request)")
    if int(ptr[0]) != 0 or int(ptr[-1]) != n:
        raise ValueError(f"req_indptr must start at 0 and end at T={n} (the number of tokens), got "
                         f"{ptr.tolist()}")
    if bool((ptr[1:] <= ptr[:-1]).any()):
        raise ValueError(f"req_indptr must be strictly increasing (every request has its root), got "
                         f"{ptr.tolist()}")
    if batch.parents.shape[0] != n:
        raise ValueError(f"parents has {batch.parents.shape[0]} entries but tokens has {n}; they must match")
    b = ptr.numel() - 1
    if isinstance(batch.sampling, list):
        object.__setattr__(batch, "sampling", tuple(batch.sampling))
    if isinstance(batch.has_draft_probs, list):
        object.__setattr__(batch, "has_draft_probs", tuple(batch.has_draft_probs))
    if not isinstance(batch.sampling, tuple) or len(batch.sampling) != b:
        raise ValueError(f"sampling must be a tuple of {b} modes from {SAMPLING_MODES}, got {batch.sampling!r}")
    object.__setattr__(batch, "configs", _check_configs(batch.configs, b))
    probs = batch.draft_probs
    if probs is not None:
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise TypeError("draft_probs must be a floating-point tensor [T, V]")
        if probs.dim() != 2 or probs.shape[0] != n:
            raise ValueError(f"draft_probs must have shape [T={n}, V], got {tuple(probs.shape)}")
        if batch.vocab_size is not None and batch.vocab_size != probs.shape[1]:
            raise ValueError(f"vocab_size={batch.vocab_size} disagrees with draft_probs' V={probs.shape[1]}")
        object.__setattr__(batch, "vocab_size", int(probs.shape[1]))


# ---------------------------------------------------------------- step functions
class VerifyInputs(NamedTuple):
    """Ragged inputs of one verify pass, FlashInfer style (unpacks as a 5-tuple).

    Attributes:
        input_ids:   LongTensor[T]; the flat tree tokens.
        positions:   LongTensor[T]; P_i + depth of each node.
        qo_indptr:   int32[B + 1]; request i's query rows (= ``req_indptr``).
        packed_mask: uint8[Σ ceil(N_i (P_i + N_i) / 8)]; per request the bool mask
                     [N_i, P_i + N_i] = prefix ‖ ancestor mask, row-major, bits little-endian,
                     each request padded to a whole byte (``packed_custom_mask``).
        mask_indptr: int32[B + 1]; request i's first byte in ``packed_mask``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    qo_indptr: torch.Tensor
    packed_mask: torch.Tensor
    mask_indptr: torch.Tensor


def _check_prefix_lens(prefix_lens: object, b: int) -> list[int]:
    if isinstance(prefix_lens, torch.Tensor):
        if prefix_lens.dtype.is_floating_point or prefix_lens.dtype == torch.bool or prefix_lens.dim() != 1:
            raise TypeError(f"prefix_lens must be a 1-D integer tensor [B] or a list of ints, got "
                            f"{prefix_lens.dtype} {tuple(prefix_lens.shape)}")
        lens = prefix_lens.tolist()
    elif isinstance(prefix_lens, (list, tuple)):
        lens = list(prefix_lens)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in lens):
            raise TypeError(f"prefix_lens must hold ints (cached tokens per request), got {lens!r}")
    else:
        raise TypeError(f"prefix_lens must be a list of ints or a LongTensor [B], got {type(prefix_lens).__name__}")
    if len(lens) != b:
        raise ValueError(f"prefix_lens has {len(lens)} entries but the batch has {b} requests")
    if any(p < 0 for p in lens):
        raise ValueError(f"prefix_lens must be >= 0, got {lens}")
    return lens


def prepare_verify(
    batch: TreeBatch,
    # [B]
    prefix_lens: Sequence[int] | torch.Tensor,
) -> VerifyInputs:
    """Everything an attention kernel with a custom mask needs to score ``batch`` in one pass.

    ``prefix_lens``: [B] cached tokens of each request (its KV pages hold P_i slots; the tree's
    N_i rows are appended after them). Pure tensor math, on ``batch.tokens``' device.
    """
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"batch must be a TreeBatch (TreeBatch.from_trees), got {type(batch).__name__}")
    lens = _check_prefix_lens(prefix_lens, batch.batch_size)
    device = batch.tokens.device
    # [T]
    depth = torch.cat([t.depth for t in batch.trees]).to(device)
    prefix = torch.tensor(lens, dtype=torch.long, device=device)
    positions = depth + prefix.repeat_interleave(torch.tensor(batch.sizes, device=device))
    packed, mask_indptr = pack_tree_masks(batch.trees, lens)
    return VerifyInputs(batch.tokens, positions, batch.req_indptr.to(torch.int32),
                        packed.to(device), mask_indptr.to(device))


@dataclass(frozen=True)
class RequestAcceptance:
    """Acceptance of one request of a batch, with its KV keep plan.

    Attributes:
        acceptance: the ``Acceptance`` that ``accept`` gives for this request's tree alone.
        keep_src:   LongTensor[A + 1]; slots to keep, relative to the request's prefix: the root
                    (0) then the accepted path's node indices.
        keep_dst:   LongTensor[A + 1]; where they go, relative to the prefix: 0, 1, ..., A.
                    Entries with src == dst need no copy.
    """

    acceptance: Acceptance
    keep_src: torch.Tensor
    keep_dst: torch.Tensor

    @property
    def path(self) -> torch.Tensor:
        return self.acceptance.path

    @property
    def tokens(self) -> torch.Tensor:
        return self.acceptance.tokens


def accept_batch(
    batch: TreeBatch,
    # [T, V]
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    rule: VerifyRule = "token",
) -> tuple[RequestAcceptance, ...]:
    """``accept`` per request on its rows of ``target_probs``, each with its own generator.

    ``target_probs[req_indptr[i] + j]`` is request i's processed p(.|path to node j) under
    ``batch.configs[i]``. ``generators[i]`` is request i's alone (None: torch's global RNG, not
    reproducible), so a request's result never depends on its batch-mates.
    """
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"batch must be a TreeBatch (TreeBatch.from_trees), got {type(batch).__name__}")
    if rule not in VERIFY_RULES:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose from {VERIFY_RULES}")
    if not isinstance(target_probs, torch.Tensor) or not target_probs.is_floating_point():
        raise TypeError("target_probs must be a floating-point tensor [T, V]")
    if target_probs.dim() != 2 or target_probs.shape[0] != batch.num_nodes:
        raise ValueError(f"target_probs must have shape [T={batch.num_nodes}, V], got "
                         f"{tuple(target_probs.shape)}")
    if isinstance(generators, torch.Generator) or not isinstance(generators, (list, tuple)):
        raise TypeError("generators must be a list with one torch.Generator (or None) per request, "
                        f"got {type(generators).__name__}")
    if len(generators) != batch.batch_size:
        raise ValueError(f"generators has {len(generators)} entries but the batch has "
                         f"{batch.batch_size} requests; pass one generator per request")
    for i, g in enumerate(generators):
        if g is not None and not isinstance(g, torch.Generator):
            raise TypeError(f"generators[{i}] must be a torch.Generator or None, got {type(g).__name__}")
    ptr = batch.req_indptr.tolist()
    out = []
    for i, tree in enumerate(batch.trees):
        acc = accept(tree, target_probs[ptr[i]:ptr[i + 1]], generators[i], rule)
        src = torch.cat([torch.zeros(1, dtype=torch.long), acc.path])
        out.append(RequestAcceptance(acc, src, torch.arange(src.numel())))
    return tuple(out)
