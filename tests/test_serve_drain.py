"""SIGTERM drains `treespec serve`: a live stream runs to its end, new requests are refused, then
the process exits cleanly (a subprocess, as a user runs it)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _serve_helpers import http

openai = pytest.importorskip("openai")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_lets_live_requests_finish_then_exits() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "_serve_tiny_main.py"), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if http("GET", f"{base}/health").status_code == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny-bytes", prompt="drain me", max_tokens=80, temperature=0,
                                           stream=True)
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGTERM)
        rest = list(chunks)                                   # the live request runs to its end
        final = rest[-1]
        assert final.choices[0].finish_reason == "length" and final.usage.completion_tokens == 80
        assert first.choices[0].text is not None
        refused = threading.Event()
        try:                                                  # a new request: refused (503) or no listener
            r = http("POST", f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2})
            refused.set() if r.status_code == 503 else None
        except OSError:
            refused.set()
        assert refused.is_set()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
