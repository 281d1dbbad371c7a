"""Compiled graphs called without Dynamo once compiled (:class:`DirectGraphs`): the dispatch that
treespec's compiled passes (``treespec.runtime.compiled``) and a feature head's compiled calls
(``treespec.drafters.feature_compiled``) share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

__all__ = ["DirectGraphs", "serial_kernels"]


def serial_kernels() -> dict:
    """Inductor's config for graphs whose rows must not depend on the pass they sit in: its own
    C++ kernels single-threaded where torch runs several threads (treespec's operators inside keep
    every thread: they split the work by output column or row, never one sum).

    Inductor parallelizes a kernel by the threads it has and the loop sizes of that graph: a 1-row
    pass has no row loop to split, so with 2 threads it splits the RMSNorm's sum over the 1536
    hidden values of Qwen2.5-1.5B between the threads, where a 4-row pass gives each row to one
    thread whole. The two sum in another order, a row's bits differ between the one-token step and
    the tree pass, and greedy speculation can leave plain decoding's tokens. The kernels it writes
    (norms, rotary embedding, the MLP's gate, residual adds) are a small part of a pass. One
    thread: the options as they were (those graphs' cache keys unchanged)."""
    return {"cpp.threads": 1} if torch.get_num_threads() > 1 else {}


class DirectGraphs:
    """Compiled graphs called without Dynamo once compiled: no guards, no gathering of inputs.

    Before each call of a compiled graph, Dynamo checks its guards (shapes, globals: ~0.3 ms a
    SmolLM2 pass on AVX2) and gathers the graph's inputs from the model's modules and the cache
    (~370 tensors: the weights, the cache's: ~0.45 ms). Both come out the same at every pass of
    one key (rows, feature layers, cache size). As the ``torch.compile`` backend, this class runs
    Inductor's ``compile_fx`` (what the default backend runs) and keeps each compiled function
    with the inputs it was compiled on; a later pass of the key calls it with those inputs, its
    own tensor arguments (``args``, by name) put in their places: the call Dynamo makes, without
    what precedes it.

    Sound under its owner's contract (``CompiledPasses``, ``CompiledHeadCalls``): the model and
    its modules fixed for its life, the cache replaced only when it grows (then :meth:`forget`
    drops the kept graphs), and every tensor a call changes passed as an argument. And
    :meth:`adopt` keeps a graph only after a direct call gave the bits of the Dynamo call before it."""

    def __init__(self, options: dict, args: Sequence[str]):
        self.options = dict(options)            # Inductor's config for these graphs (cpp_wrapper)
        self.args = tuple(args)
        self._direct: dict[tuple, _DirectCall] = {}
        self._capture: list | None = None       # graphs compiled inside :meth:`capturing`
        self._pending: list = []                # those of the last capturing call, for adopt

    def backend(self, gm: torch.fx.GraphModule, example_inputs: list):
        from torch._inductor.compile_fx import compile_fx

        inputs = list(example_inputs)             # the real tensors (compile_fx may empty the list)
        compiled = compile_fx(gm, example_inputs, config_patches={**self.options, **serial_kernels()})
        if self._capture is not None:
            placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
            sources = [getattr(node.meta.get("grapharg"), "source", None) for node in placeholders]
            names = [src.local_name if type(src).__name__ == "LocalSource" else None for src in sources]
            (output,) = [node for node in gm.graph.nodes if node.op == "output"]
            outs = output.args[0]
            flat = isinstance(outs, (tuple, list)) and len(set(outs)) == len(outs)   # no output twice
            self._capture.append((compiled, inputs, names, len(outs) if flat else None))
        return compiled

    @contextlib.contextmanager
    def capturing(self):
        """The graphs compiled inside are kept for :meth:`adopt`."""
        self._capture = []
        try:
            yield
        finally:
            self._pending, self._capture = self._capture, None

    def adopt(self, key: tuple, padded: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
        """Call the one graph compiled inside the last :meth:`capturing` on ``padded`` (the state
        it reads set back as it was before that call); where its outputs equal ``expected`` (that
        call's, flat) bit for bit, keep it for ``key``. Returns whether it was kept."""
        pending, self._pending = self._pending, []
        if len(pending) != 1 or pending[0][3] != len(expected):
            return False
        compiled, inputs, names, _ = pending[0]
        if any(name is not None and name not in self.args for name in names):
            return False                           # an argument a direct call would not pass along
        direct = _DirectCall(compiled, inputs, [(i, self.args.index(name)) for i, name in enumerate(names)
                                                if name is not None])
        outs = direct.flat(padded)
        if not all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True)):
            return False
        self._direct[key] = direct
        return True

    def get(self, key: tuple) -> "_DirectCall | None":
        return self._direct.get(key)

    def forget(self) -> None:
        """Drop every kept graph (their inputs hold tensors about to be replaced)."""
        self._direct.clear()


class _DirectCall:
    """One compiled graph and its inputs, its tensor arguments replaced at each call."""

    def __init__(self, compiled, inputs: list, slots: list[tuple[int, int]]):
        self.compiled, self.inputs, self.slots = compiled, inputs, slots

    def flat(self, padded: Sequence[torch.Tensor]) -> list:
        args = list(self.inputs)
        for i, j in self.slots:
            args[i] = padded[j]
        return list(self.compiled(*args))     # as Dynamo's bytecode calls it

    def __call__(self, padded: Sequence[torch.Tensor]):
        out, *hidden = self.flat(padded)
        return out, tuple(hidden)
