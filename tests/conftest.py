"""Suite-wide settings.

One torch thread per test process: `make test` runs two xdist workers on two cores, and a
2-thread forward whose second core is busy can be 10x slower than a 1-thread one.

llama.cpp is found only where a test points at it: a clone where `make bench-llamacpp` built
it (``.cache/llama.cpp/build/bin``) runs the suite as one where it did not.
"""

from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _llamacpp_only_where_a_test_puts_it(monkeypatch):
    import treespec.runtime.llamacpp as llamacpp

    monkeypatch.setattr(llamacpp, "DEFAULT_BIN", Path("/nonexistent/llama.cpp/build/bin"))
    monkeypatch.delenv(llamacpp.ENV, raising=False)
