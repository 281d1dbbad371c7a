"""``python tests/_serve_tiny_main.py PORT``: the tiny byte-level model served as ``treespec serve``
serves (``serve_app``: SIGTERM drains), each step slowed by 20 ms so a request lasts a while."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from _serve_helpers import text_drafter, text_target  # noqa: E402
from treespec import DynamicTreeBuilder, SpeculativeServer  # noqa: E402
from treespec.cli.serve import serve_app  # noqa: E402
from treespec.cli.serve.app import make_app  # noqa: E402

torch.set_num_threads(1)
target = text_target()
server = SpeculativeServer(target, text_drafter(target), DynamicTreeBuilder(budget=4, depth=2, top_k=2))
real = server.step


def slow_step():
    time.sleep(0.02)
    return real()


server.step = slow_step
serve_app(make_app(server, "tiny-bytes", drain_timeout=20), "127.0.0.1", int(sys.argv[1]), 20, log_level="warning")
