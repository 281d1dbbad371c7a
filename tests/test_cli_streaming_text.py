"""Streamed text: the CLI prints what the API decodes, one token at a time, and a multi-byte
character split across tokens is held back until it is complete."""

from __future__ import annotations

import argparse

import pytest

from _serve_helpers import byte_tokenizer   # one token per byte: a CJK character or an emoji spans 3-4 tokens

TEXTS = ["日本語: こんにちは, 中文: 你好", "emoji 😀👍🏽 ok", "e\u0301 🇯🇵!"]


@pytest.mark.parametrize("text", TEXTS)
def test_cli_stream_prints_the_text_of_the_api_one_token_at_a_time(text, monkeypatch, capsys):
    from treespec.cli import main as cli

    tok = byte_tokenizer()
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and len(ids) > len(text)        # multi-byte characters

    class FakeStream:
        result = None

        def __iter__(self):
            for i in ids:                                             # one token per chunk
                yield [i]

    class FakeGen:
        def stream(self, *a, **kw):
            return FakeStream()

    target = argparse.Namespace(tokenizer=tok)
    monkeypatch.setattr(cli, "_build_generator", lambda args: (target, FakeGen()))
    assert cli.main(["generate", "--prompt", "hi"]) == 0
    out = capsys.readouterr().out
    assert "\ufffd" not in out
    assert out == text + "\n"


def test_incremental_text_holds_back_an_incomplete_tail_only():
    from treespec.runtime.streaming import IncrementalText

    tok = byte_tokenizer()
    ids = tok("a你b")["input_ids"]                                   # a, 3 bytes, b
    inc = IncrementalText(tok)
    assert [inc.push([i]) for i in ids] == ["a", "", "", "你", "b"]
    assert inc.flush() == ""
    inc = IncrementalText(tok)                                        # text that ends mid-character
    assert inc.push(ids[:2]) == "a" and inc.flush() == "\ufffd"     # flushed as the API decodes it
