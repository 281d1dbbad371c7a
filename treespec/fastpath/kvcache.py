"""A KV cache that grows in place: HF's ``DynamicCache`` with each full-attention layer's keys
and values kept in spare capacity instead of concatenated anew on every forward.

Why: ``transformers``' ``DynamicLayer.update`` runs ``torch.cat([cached, new])`` for the keys and
the values of every layer on every forward, a copy of the whole cache each time (60 copies a
pass for SmolLM2-135M), although only the new rows change.

:class:`GrowingLayer` writes the new rows into a buffer with room to spare (doubled when full)
and hands attention a view of the filled part; ``crop`` only shortens that view. The values in
the cache and the view's shape are the ones ``DynamicLayer`` holds, so attention reads the same
numbers (tests compare logits and greedy tokens with HF's own cache). :func:`growing_cache` builds
a ``DynamicCache`` for a model and swaps its plain ``DynamicLayer`` layers (not sliding-window or
other kinds) for growing ones; it goes through ``forward`` as any HF cache does (no modeling code
touched). ``TreeVerifier`` uses it for the target, and a feature drafter (``treespec.drafters.feature``) one ``GrowingLayer`` for its head. What it saves grows with the context: on one
AMX core a target forward plus its crop took 0.96 (plain step) and 0.97 (3-node tree) of the
time with HF's cache after 150 cached tokens, 0.91 and 0.93 after 400
(``benchmarks/results/kv_cache_amx.md``, ``benchmarks/kv_cache.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "growing_cache", "keep_rows"]

_MIN_CAPACITY = 64   # positions allocated at first; then doubled when full


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` over a buffer ``[B, H, capacity, d]``: ``keys`` / ``values`` are views of
    its first ``length`` positions. Writes through the views (the verifier's in-place
    compaction) land in the buffer. Anything that replaces ``keys`` / ``values`` with other
    tensors (the base class's beam and batch helpers) is adopted at the next ``update``."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_buf = self._value_buf = self._view = None

    def _capacity(self) -> int:
        return 0 if self._key_buf is None else self._key_buf.shape[-2]

    def _reserve(self, length: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        """Room for ``length`` positions, the filled part kept (its values copied once)."""
        filled = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        # doubled only to grow: adopting replaced tensors (a batch verifier's rows joining or
        # leaving, every few steps) keeps the capacity, else it would double at each adoption
        have = self._capacity()
        capacity = max(length, 2 * have if length > have else have, _MIN_CAPACITY)
        keys = like_keys.new_empty((*like_keys.shape[:-2], capacity, like_keys.shape[-1]))
        values = like_values.new_empty((*like_values.shape[:-2], capacity, like_values.shape[-1]))
        if filled:
            keys[..., :filled, :].copy_(self.keys)
            values[..., :filled, :].copy_(self.values)
        self._key_buf, self._value_buf = keys, values
        self._set_length(filled)

    def _set_length(self, length: int) -> None:
        self.keys = self._key_buf[..., :length, :]
        self.values = self._value_buf[..., :length, :]
        self._view = self.keys

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        end = filled + key_states.shape[-2]
        if self.keys is not self._view or end > self._capacity():   # first rows, growth, or adopted tensors
            self._reserve(end, key_states, value_states)
        self._key_buf[..., filled:end, :].copy_(key_states)
        self._value_buf[..., filled:end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        adopted = self.is_initialized and self.keys is self._view
        if adopted and type(tokens_to_remove) is int and tokens_to_remove < 0:   # the verifier's and drafters' crop:
            self._set_length(max(self.keys.shape[-2] + tokens_to_remove, 0))      # shorter views, no checks to pay
            return
        super().crop(tokens_to_remove)   # checks the argument; slices the views
        if adopted:
            self._view = self.keys       # still views of the buffer, shorter


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for a model of ``config`` whose plain ``DynamicLayer`` layers grow in
    place (:class:`GrowingLayer`); other layer kinds (sliding windows) are left as HF builds them."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def keep_rows(cache: DynamicCache, start: int, rows: Sequence[int]) -> None:
    """Keep cache positions ``rows`` of every layer as positions ``start``, ``start + 1``, ... and
    crop the rest: an accepted path compacted after a tree pass (the verifier's target cache, a
    model drafter's). ``rows`` must increase from ``start`` or later; then each kept row moves
    down or stays, no move overwrites a row a later one reads, and only the rows out of place are
    copied (usually none or one), not a gather of all of them."""
    if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and rows[0] < start):
        raise ValueError(f"rows must increase from position {start} or later, got {list(rows)}")
    moves = [(start + i, row) for i, row in enumerate(rows) if row != start + i]
    end = start + len(rows)
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for dst, src in moves:
            layer.keys[..., dst, :] = layer.keys[..., src, :]
            layer.values[..., dst, :] = layer.values[..., src, :]
        if (extra := layer.keys.shape[-2] - end) > 0:
            layer.crop(-extra)
