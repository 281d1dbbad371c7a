"""Attention masks and positions for verifying a DraftTree in one forward pass.

Tree tokens attend to the whole cached prefix (P tokens) and to their own ancestors:
    mask[i, :P] = True,  mask[i, P + j] = ancestor_mask[i, j].
Each tree node sits at position ``P + depth``, where it would sit in plain decoding of its path.

Formats:
    bool          BoolTensor, True = may attend.
    HF 4-D        [1, 1, N, P + N]; bool for "sdpa"/"flex"/"flash" style backends, additive
                  float (0 / dtype-min) for "eager", where a bool mask would be *added* to the
                  scores and silently do nothing useful.
    packed        FlashInfer's ``packed_custom_mask``: per request, the [qo_len, kv_len] bool
                  mask flattened row-major, bits packed little-endian into uint8, each request
                  padded to a whole byte; ``mask_indptr[r]`` is request r's first byte.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from treespec.core.tree import DraftTree

# Attention implementations whose 4-D masks are additive floats; everything else takes bool.
_ADDITIVE_MASK_IMPLS = frozenset({"eager"})


def tree_bool_mask(tree: DraftTree, prefix_len: int, device: torch.device | None = None) -> torch.Tensor:
    """BoolTensor[N, P + N]: True where tree node i may attend (prefix ‖ ancestors)."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    n = tree.num_nodes
    anc = tree.ancestor_mask
    if device is not None:
        anc = anc.to(device)
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=anc.device)
    return torch.cat([prefix, anc], dim=1)


def hf_tree_mask(
    tree: DraftTree,
    prefix_len: int,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> torch.Tensor:
    """HF 4-D mask [1, 1, N, P + N]: bool (True = attend), or additive 0 / finfo.min for eager."""
    if attn_implementation not in _ADDITIVE_MASK_IMPLS:
        return tree_bool_mask(tree, prefix_len, device)[None, None]
    if not dtype.is_floating_point:
        raise ValueError(f"an eager (additive) mask needs a floating dtype, got {dtype}")
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    # The prefix block is all "attend" (0); only the tree block [N, N] needs dtype-min entries.
    n = tree.num_nodes
    anc = tree.ancestor_mask if device is None else tree.ancestor_mask.to(device)
    out = torch.zeros(1, 1, n, prefix_len + n, dtype=dtype, device=anc.device)
    out[0, 0, :, prefix_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return out


def attn_implementation_of(model: torch.nn.Module) -> str:
    """The attention implementation a HF model runs with (default "eager")."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl or "eager"


def position_ids(tree: DraftTree, prefix_len: int, device: torch.device | None = None) -> torch.Tensor:
    """LongTensor[1, N]: ``P + depth`` for every node."""
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    pos = tree.depth + prefix_len
    return (pos.to(device) if device is not None else pos)[None]


def tree_forward_args(tree: DraftTree, prefix_len: int, attn_implementation: str = "sdpa",
                      dtype: torch.dtype = torch.float32, device: torch.device | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(position_ids, 4-D mask) a stock HF forward takes to score ``tree`` after ``prefix_len``
    cached tokens. A root alone is a plain decode step: it sees every cached position and sits
    at position P, which the model infers from the cache, so it gets (None, None) and runs the
    model's own one-token path (bit-identical to HF's decode step; no mask to build or add)."""
    if tree.num_nodes == 1:
        return None, None
    return (position_ids(tree, prefix_len, device),
            hf_tree_mask(tree, prefix_len, attn_implementation, dtype, device))


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool[M] -> uint8[ceil(M / 8)], little bit order (bit j of byte b = bits[8b + j])."""
    if bits.device.type == "cpu":  # numpy's packbits is much faster than the torch version
        return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))
    return _pack_bits_torch(bits)


def _pack_bits_torch(bits: torch.Tensor) -> torch.Tensor:
    """``_pack_bits`` in torch ops, for tensors on an accelerator."""
    m = bits.numel()
    padded = torch.zeros((m + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[:m] = bits.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return (padded.view(-1, 8) * weights).sum(-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, m: int) -> torch.Tensor:
    """uint8[ceil(M / 8)] -> Bool[M], inverse of ``_pack_bits``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, None] >> shifts) & 1
    return bits.reshape(-1)[:m].bool()


def pack_masks(masks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a ragged batch of bool masks [qo_len_r, kv_len_r] FlashInfer style.

    Returns:
        packed:      uint8[total_bytes]
        mask_indptr: int32[R + 1]; request r occupies bytes [indptr[r], indptr[r + 1]).
    """
    chunks, indptr = [], [0]
    for r, m in enumerate(masks):
        if m.dtype != torch.bool or m.dim() != 2:
            raise ValueError(f"masks[{r}] must be a 2-D bool tensor [qo_len, kv_len], got "
                             f"{m.dtype} {tuple(m.shape)}")
        chunk = _pack_bits(m.reshape(-1))
        chunks.append(chunk)
        indptr.append(indptr[-1] + chunk.numel())
    device = masks[0].device if masks else None
    packed = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return packed, torch.tensor(indptr, dtype=torch.int32, device=device)


def pack_tree_masks(
    trees: Sequence[DraftTree], prefix_lens: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed masks for a ragged batch of trees: request r has qo_len = N_r, kv_len = P_r + N_r."""
    if len(trees) != len(prefix_lens):
        raise ValueError(f"got {len(trees)} trees but {len(prefix_lens)} prefix lengths")
    return pack_masks([tree_bool_mask(t, p) for t, p in zip(trees, prefix_lens)])


def unpack_masks(
    packed: torch.Tensor,
    mask_indptr: torch.Tensor,
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
) -> list[torch.Tensor]:
    """Inverse of ``pack_masks``: a list of BoolTensor[qo_len_r, kv_len_r]."""
    n_req = mask_indptr.numel() - 1
    if len(qo_lens) != n_req or len(kv_lens) != n_req:
        raise ValueError(f"mask_indptr describes {n_req} requests; got {len(qo_lens)} qo_lens "
                         f"and {len(kv_lens)} kv_lens")
    out = []
    ptr = mask_indptr.tolist()
    for r in range(n_req):
        q, k = int(qo_lens[r]), int(kv_lens[r])
        nbytes = ptr[r + 1] - ptr[r]
        if nbytes != (q * k + 7) // 8:
            raise ValueError(f"request {r}: {nbytes} bytes cannot hold a [{q}, {k}] mask")
        out.append(_unpack_bits(packed[ptr[r]:ptr[r + 1]], q * k).view(q, k))
    return out


def padded_tree_masks(
    trees: Sequence[DraftTree],
    prefix_lens: Sequence[int],
    cache_len: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """BoolTensor[B, M, S + M] for a right-padded batch of trees over a shared cache of S slots.

    Request b's KV row holds its prefix in slots [0, P_b) (the rest of its first S slots is
    padding); the trees' rows are appended at S .. S + M - 1, M = max N_b. Real node i of tree b
    may attend to slots [0, P_b) and to S + j for its ancestors j. A padding row (i >= N_b)
    attends to its own slot only, so every row has a finite softmax and nothing reads it.
    """
    if len(trees) != len(prefix_lens):
        raise ValueError(f"got {len(trees)} trees but {len(prefix_lens)} prefix lengths")
    if any(p < 0 or p > cache_len for p in prefix_lens):
        raise ValueError(f"prefix lengths {list(prefix_lens)} must lie in [0, cache_len={cache_len}]")
    m = max(t.num_nodes for t in trees)
    mask = torch.zeros(len(trees), m, cache_len + m, dtype=torch.bool)
    pad_diag = torch.arange(m)
    mask[:, pad_diag, cache_len + pad_diag] = True
    for b, (tree, p) in enumerate(zip(trees, prefix_lens)):
        n = tree.num_nodes
        mask[b, :n, :p] = True
        mask[b, :n, cache_len:cache_len + n] = tree.ancestor_mask
    return mask if device is None else mask.to(device)


def to_hf_mask(
    mask: torch.Tensor,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A bool mask [B, Q, K] as a HF 4-D mask [B, 1, Q, K]: bool, or additive 0 / dtype-min for
    eager (see ``hf_tree_mask``)."""
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise ValueError(f"mask must be a bool tensor [B, Q, K], got {mask.dtype} {tuple(mask.shape)}")
    if attn_implementation not in _ADDITIVE_MASK_IMPLS:
        return mask[:, None]
    if not dtype.is_floating_point:
        raise ValueError(f"an eager (additive) mask needs a floating dtype, got {dtype}")
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)[:, None]
