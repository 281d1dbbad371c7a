"""Incremental detokenisation for streamed output.

A token may end in the middle of a multi-byte UTF-8 character (byte-level BPE splits CJK
characters and emoji into 2-4 byte tokens); decoding such a prefix gives U+FFFD replacement
characters that the next token would have turned into the right character. ``IncrementalText``
re-decodes everything emitted so far and releases only text that can no longer change: it holds
back a trailing run of U+FFFD (an incomplete character) and anything that does not extend what
was already released (a tokenizer that rewrites earlier text once more tokens arrive).
``flush`` releases the rest at the end, so the concatenated pieces equal ``tokenizer.decode``
of all ids whenever the released text was a prefix of it (always, for byte-level tokenizers).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["IncrementalText"]

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Turn a stream of token-id chunks into a stream of complete text pieces."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.shown = ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Iterable[int]) -> str:
        """Add token ids; returns the newly complete text (possibly "")."""
        self.ids.extend(int(i) for i in ids)
        stable = self._text().rstrip(REPLACEMENT)
        if len(stable) <= len(self.shown) or not stable.startswith(self.shown):
            return ""
        piece, self.shown = stable[len(self.shown):], stable
        return piece

    def flush(self) -> str:
        """The rest of the text at the end of the stream (a real trailing U+FFFD included)."""
        text = self._text()
        piece = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown += piece
        return piece
