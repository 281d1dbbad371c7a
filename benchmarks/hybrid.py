"""Hybrid drafter benchmark: lookup + eagle3 in one tree (``hybrid``) against each part alone.

The drafter grid of benchmarks/drafters.py (``harness.drafter_grid``: MT-bench first turns through the chat template,
SmolLM2-135M fp32 target, vanilla HF decoding first on every prompt, every configuration
interleaved on the same prompt, τ / acceptance by depth / tokens/s / speedup, the machine's CPU,
flags and threads), with other defaults: drafters
``lookup`` (prompt lookup alone), ``eagle3`` (the shipped head alone) and ``hybrid`` (both),
trees ``chain4`` (a 4-token chain), ``best16`` and ``best64`` (best-first, SpecExec), T = 0 and
T = 1. The full configuration is 20 prompts x 128 tokens:

    python benchmarks/hybrid.py                                          # full: 20 x 128
    python benchmarks/hybrid.py --prompts 2 --max-new-tokens 16 --out /tmp/hybrid   # smoke
    python benchmarks/hybrid.py --resume benchmarks/results/hybrid.json  # continue a cut-short run

Writes benchmarks/results/hybrid.{json,md} (or --out), the machine (CPU model, flags,
threads) recorded in both by the grid's report. Every drafters.py option works here.
"""

from __future__ import annotations

from harness import RESULTS, drafter_grid

DEFAULTS = dict(prompts=20, drafters="lookup,eagle3,hybrid", trees="chain4,best16,best64",
                out=str(RESULTS / "hybrid"))

if __name__ == "__main__":
    drafter_grid(__doc__, DEFAULTS, full_prompts=20, title="Hybrid drafter (lookup + eagle3) against its parts, SmolLM2-135M")
