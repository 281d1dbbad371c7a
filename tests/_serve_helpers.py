"""Test helpers for the server and its HTTP front door: a tiny target that speaks text (a
byte-level tokenizer with a chat template over a tiny random Llama) and a live HTTP server on a
free loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer(eos: bool = True):
    """One token per byte (256) plus <eos> (id 256), with a chat template; no download. Without
    ``eos`` id 256 is an ordinary token (nothing ends a generation before its limit)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>" if eos else None)
    out.chat_template = CHAT_TEMPLATE
    return out


def text_target(eos: bool = False, max_positions: int = 1024, dtype=torch.float32):
    """A treespec Target: a 2-layer random Llama over the byte tokenizer's 257 ids. Without
    ``eos`` it never stops early (lengths are exactly max_tokens)."""
    from _engine_helpers import peaky_llama
    from treespec.targets.loader import Target

    tok = byte_tokenizer(eos)
    model = peaky_llama(len(tok), seed=3, hidden_size=32, num_layers=2, std=0.25,
                        max_position_embeddings=max_positions, dtype=dtype)
    model.generation_config.eos_token_id = 256 if eos else None
    return Target.from_hf(model, tok, name="tiny-bytes", pack=False)


def text_drafter(target):
    """An untrained eagle3 head over the target (batched drafting, real feature plumbing)."""
    from treespec.drafters.eagle import random_feature_drafter

    return random_feature_drafter(target, "eagle3", seed=1, draft_vocab=128)


@contextlib.contextmanager
def live_server(app, drain_timeout: float = 5.0):
    """Serve ``app`` (a Starlette app) with uvicorn on a free 127.0.0.1 port in a thread; yields
    the base URL (http://127.0.0.1:PORT/v1)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_timeout, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


class Reply:
    """A plain HTTP answer: status, headers, text, json()."""

    def __init__(self, status: int, headers, body: bytes):
        import json as _json

        self.status_code, self.headers, self.text = status, {k.lower(): v for k, v in headers.items()}, body.decode()
        self._json = _json

    def json(self):
        return self._json.loads(self.text)


def http(method: str, url: str, json=None, content: bytes | None = None) -> Reply:
    """One request with the standard library (no client of its own to keep in step)."""
    import json as _json
    import urllib.error
    import urllib.request

    data = _json.dumps(json).encode() if json is not None else content
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Reply(r.status, dict(r.headers), r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, dict(e.headers), e.read())
