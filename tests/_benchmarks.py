"""Import a script of benchmarks/ as a module for a test, with benchmarks/ on sys.path while it is
in use (the scripts import their ``harness``)."""

import importlib.util
import sys
from contextlib import contextmanager
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks"


@contextmanager
def benchmark_module(script: str):
    """``benchmarks/<script>.py`` loaded as a module (not registered in sys.modules)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"{script}_bench", BENCH / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
