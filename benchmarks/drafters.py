"""Trained-drafter benchmark: each drafter x {chain k=4, dynamic tree budget 16/32/64} x T in {0, 1}.

MT-bench first turns through the chat template, SmolLM2-135M as the target, the shipped
checkpoints under checkpoints/smollm2-135m/. For every prompt, vanilla decoding (HF ``generate``,
greedy at T = 0, sampling at T = 1) runs first, then every drafter x tree configuration on the same
prompt (interleaved, so machine noise hits all methods alike).

    python benchmarks/drafters.py                                  # full: 80 prompts x 128 tokens
    python benchmarks/drafters.py --prompts 5 --max-new-tokens 64  # reduced (labelled as such)
    python benchmarks/drafters.py --resume benchmarks/results/drafters.json   # continue a cut-short run
    python benchmarks/hybrid.py                                    # lookup, eagle3 and the hybrid (20 x 128)

The grid itself (trees, pooled counters, report) is ``harness.drafter_grid``, shared with
benchmarks/hybrid.py. Results are written after every prompt, so a run stopped early keeps its prompts, and
``--resume`` continues it (the full run takes many hours on a 2-core CPU).

Reported per (drafter, tree, T): τ (tokens per target forward), acceptance by depth (accepted /
attempted drafts at each depth, pooled over prompts), tokens/s (new tokens / (prefill + decode)
time, pooled), and speedup = tokens/s over vanilla tokens/s at the same T in the same run.
Writes benchmarks/results/drafters.{json,md}.
"""

from __future__ import annotations

from harness import RESULTS, drafter_grid

DRAFTERS = ("eagle", "eagle3", "medusa", "mtp", "small", "lookup", "hybrid")
DEFAULT_TREES = ("chain4", "tree16", "tree32", "tree64")  # others on request (--trees)
FULL_PROMPTS = 80  # this script's full configuration: 80 prompts x 128 tokens
DEFAULTS = dict(prompts=FULL_PROMPTS, drafters=",".join(DRAFTERS), trees=",".join(DEFAULT_TREES),
                out=str(RESULTS / "drafters"))

if __name__ == "__main__":
    drafter_grid(__doc__, DEFAULTS, full_prompts=FULL_PROMPTS, title="Trained drafters on SmolLM2-135M")
