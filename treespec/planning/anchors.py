"""Published GPU speculative-decoding measurements: the rows the cost model is checked against.

Every row is a figure someone else measured and published; the source names the page (URL) or
the paper table. ``derived`` says which fields are not printed there as such and how they were
obtained (a ratio of two published figures, a τ taken from a sibling measurement of the same
drafter head on the same data). No figure here is estimated by us.

Glossary (DESIGN.md): τ (tau) is the published mean acceptance length, tokens per target
forward (accepted + 1). ``speedup`` is speculative over plain decoding on the same engine and
GPU(s): tokens/s over tokens/s, or plain time over speculative time.

Tree settings (``DraftShape``) use SGLang's words: ``levels`` drafting passes (SGLang
``speculative_num_steps``, vLLM ``num_speculative_tokens`` for a chain), ``topk`` nodes expanded
per level after the first (``speculative_eagle_topk``; 1 is a chain), ``verify_tokens`` tokens
per sequence in the verify pass, the root included (``speculative_num_draft_tokens``; a chain of
k drafts verifies k + 1).

``context`` is not published by any of these sources: it is our assumption of the mean cached
length during decoding (MT-bench: ~100-token prompts and answers of a few hundred tokens, so
512), recorded per row so that the model's input is visible.

A row the model cannot hold within ``ANCHOR_TOLERANCE`` names why in ``not_held``; the test
(tests/test_anchors.py) checks every other row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ANCHORS", "ANCHOR_TOLERANCE", "Anchor", "DraftShape", "EngineKind", "matching_anchors"]

# A prediction is held when it is within 25 % of the published speedup.
ANCHOR_TOLERANCE = 0.25

EngineKind = Literal["graph", "eager"]   # CUDA/HIP-graph serving engine, or eager PyTorch (HF loops)


@dataclass(frozen=True)
class DraftShape:
    """A draft tree or chain as the engine was configured (see the module docstring).

    Attributes:
        levels:        drafting passes per step (the tree's depth below the root).
        topk:          nodes each level after the first expands (1: a chain).
        verify_tokens: tokens per sequence in one verify pass, the root included.
    """

    levels: int
    topk: int
    verify_tokens: int

    def __post_init__(self) -> None:
        for name in ("levels", "topk", "verify_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DraftShape.{name} must be a positive int, got {value!r}")
        capacity = 1 + self.topk + (self.levels - 1) * self.topk * self.topk  # candidates drafted
        if self.verify_tokens > capacity:
            raise ValueError(f"DraftShape: {self.verify_tokens} verify tokens cannot come from "
                             f"{self.levels} levels of top-{self.topk} (at most {capacity})")

    @property
    def widths(self) -> tuple[int, ...]:
        """Nodes each drafting pass expands: the root, then ``topk`` per level."""
        return (1,) + (self.topk,) * (self.levels - 1)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


@dataclass(frozen=True)
class Anchor:
    """One published measurement.

    Attributes:
        key:          short unique name.
        model:        the target as published.
        shape:        ``shapes.MODEL_PRESETS`` name with the same layer sizes.
        bytes_per_weight: weight (and KV) bytes the run used (bf16/fp16: 2, fp8: 1).
        gpu:          ``hardware.HARDWARE_PRESETS`` name.
        gpus:         GPUs the target ran on (tensor parallel); None: not stated.
        engine:       engine and version as published.
        engine_kind:  "graph" (CUDA/HIP graphs: SGLang, vLLM) or "eager" (HF-style PyTorch loop).
        batch:        sequences decoded together.
        drafter:      the published drafter ("EAGLE-3 head", "Llama 3.2-1B draft model", ...).
        drafter_kind: ``roofline.DRAFTER_KINDS`` entry that models it.
        draft_shape:  preset shape of a "model" drafter (None otherwise).
        draft_vocab:  the drafter's LM-head rows (EAGLE-3 heads: 32000); None: the target's.
        tree:         the draft tree or chain.
        tau:          published mean acceptance length; None: not published.
        plain_tok_s:  plain decoding tokens/s (per sequence at batch 1); None: not published.
        spec_tok_s:   speculative tokens/s; None: not published.
        speedup:      speculative over plain, as published or as the ratio of the two above.
        dataset:      prompts.
        context:      assumed mean cached tokens per sequence (not published; see above).
        source:       URL or paper + table.
        derived:      which figures are derived, and how ("" when all are printed as is).
        not_held:     why the cost model cannot hold this row within the tolerance (None: held).
    """

    key: str
    model: str
    shape: str
    gpu: str
    gpus: int | None
    engine: str
    engine_kind: EngineKind
    batch: int
    drafter: str
    drafter_kind: str
    tree: DraftShape
    tau: float | None
    plain_tok_s: float | None
    spec_tok_s: float | None
    speedup: float
    dataset: str
    context: int
    source: str
    derived: str = ""
    not_held: str | None = None
    bytes_per_weight: float = 2.0
    draft_shape: str | None = None
    draft_vocab: int | None = None


_SGLANG_DOCS = "https://docs.sglang.io/advanced_features/speculative_decoding.html (Performance Highlights)"
_EAGLE3_PAPER = "Li et al. 2025, EAGLE-3 (arXiv:2503.01840v3)"
_SGLANG_PR = "https://github.com/sgl-project/sglang/pull/4247 (comment by chromecast56, 2025-03-10, with CUDA graphs)"
_VLLM_ISSUE = "https://github.com/vllm-project/vllm/issues/20780 (AL and TPOT tables)"
_ROCM_BLOG = ("https://rocm.blogs.amd.com/software-tools-optimization/speculative-decoding---deep-dive/README.html "
              "(Table 1)")
_H100_PR = ("GPU: the PR's author states ~380 tokens/s on a single H100 for this run "
            "(https://github.com/hemingkx/Spec-Bench/issues/22)")
_PLAIN_SGLANG = "plain 158.34 tokens/s is the SGLang docs' baseline for the same model, data and GPU"
_VLLM_GPU = ("GPU: the issue names none; its author's benchmarks of the same script in "
             "https://github.com/vllm-project/vllm/pull/16937 are 'Output tokens/s on H100 BS1'")
_CHAIN3_TAU = ("tau: Table 3 publishes none; 2.79 (EAGLE-3) / 2.29 (EAGLE) is the mean acceptance "
               "length of the same heads with a 3-token chain on MT-bench in vLLM "
               "(https://github.com/vllm-project/vllm/issues/20780)")
_NO_TAU = "τ is not published, and the prediction needs it"

ANCHORS: tuple[Anchor, ...] = (
    # --- SGLang, H100, batch 1, EAGLE trees -------------------------------------------------
    Anchor("sglang-eagle3-h100-b1-docs", "Llama-3.1-8B-Instruct", "llama-3-8b", "h100", 1,
           "SGLang (EAGLE-3 paper: v0.4.4)", "graph", 1, "EAGLE-3 head", "eagle",
           DraftShape(levels=5, topk=8, verify_tokens=32), tau=4.68,
           plain_tok_s=158.34, spec_tok_s=373.25, speedup=373.25 / 158.34, dataset="MT-bench",
           context=512, draft_vocab=32000,
           source=f"{_SGLANG_DOCS}; {_EAGLE3_PAPER} Table 4",
           derived=("speedup = 373.25 / 158.34; tau 4.68 and the tree are the SGLang EAGLE-3 run with "
                    f"speculative_num_steps 5 in {_SGLANG_PR}; topk 8 and 32 draft tokens are the docs' "
                    "EAGLE-3 launch example (the table does not state its settings)")),
    Anchor("sglang-eagle3-h100-b1-steps8", "Llama-3.1-8B-Instruct", "llama-3-8b", "h100", 1,
           "SGLang (PR #4247)", "graph", 1, "EAGLE-3 head", "eagle",
           DraftShape(levels=8, topk=8, verify_tokens=32), tau=5.39,
           plain_tok_s=158.34, spec_tok_s=378.57, speedup=378.57 / 158.34, dataset="MT-bench",
           context=512, draft_vocab=32000, source=_SGLANG_PR,
           derived=(f"speedup = 378.57 / 158.34; {_PLAIN_SGLANG}; {_H100_PR}; topk 8 and 32 draft tokens "
                    "are assumed from the docs' example (the comment states num_steps only)")),
    Anchor("sglang-eagle3-h100-b1-steps5", "Llama-3.1-8B-Instruct", "llama-3-8b", "h100", 1,
           "SGLang (PR #4247)", "graph", 1, "EAGLE-3 head", "eagle",
           DraftShape(levels=5, topk=8, verify_tokens=32), tau=4.68,
           plain_tok_s=158.34, spec_tok_s=361.70, speedup=361.70 / 158.34, dataset="MT-bench",
           context=512, draft_vocab=32000, source=_SGLANG_PR,
           derived=(f"speedup = 361.70 / 158.34; {_PLAIN_SGLANG}; {_H100_PR}; topk 8 and 32 draft tokens "
                    "assumed as above")),
    Anchor("sglang-eagle2-h100-b1-steps8", "Llama-3.1-8B-Instruct", "llama-3-8b", "h100", 1,
           "SGLang (PR #4247)", "graph", 1, "EAGLE-2 head (EAGLE-LLaMA3.1-Instruct-8B)", "eagle",
           DraftShape(levels=8, topk=8, verify_tokens=32), tau=3.76,
           plain_tok_s=158.34, spec_tok_s=230.08, speedup=230.08 / 158.34, dataset="MT-bench",
           context=512, source=_SGLANG_PR,
           derived=(f"speedup = 230.08 / 158.34; {_PLAIN_SGLANG}; {_H100_PR}; topk 8 and 32 draft tokens "
                    "assumed as above")),
    # --- SGLang, H100, batch 2-64, chain of 3 (EAGLE-3 paper Table 3) --------------------------
    *(Anchor(f"sglang-{name}-h100-b{batch}-chain3", "Llama-3.1-8B-Instruct", "llama-3-8b", "h100", 1,
             "SGLang v0.4.4", "graph", batch, head, "eagle", DraftShape(levels=3, topk=1, verify_tokens=4),
             tau=tau, plain_tok_s=None, spec_tok_s=None, speedup=speedup, dataset="MT-bench",
             context=512, draft_vocab=vocab, source=f"{_EAGLE3_PAPER} Table 3 (chain length 3, no tree)",
             derived=_CHAIN3_TAU)
      for name, head, tau, vocab, table in (
          ("eagle3", "EAGLE-3 head", 2.79, 32000, ((8, 1.62), (32, 1.32), (64, 1.38))),
          ("eagle", "EAGLE head", 2.29, None, ((8, 1.23), (32, 0.94), (64, 0.99))))
      for batch, speedup in table),
    # --- vLLM V1, H100 (see derived), batch 1, chains --------------------------------------------
    *(Anchor(f"vllm-{name}-h100-b1-chain{k}", "Llama-3.1-8B-Instruct", "llama-3-8b", "h100", 1,
             "vLLM V1", "graph", 1, head, "eagle", DraftShape(levels=k, topk=1, verify_tokens=k + 1),
             tau=tau, plain_tok_s=1000 / 7.07, spec_tok_s=1000 / tpot, speedup=7.07 / tpot,
             dataset="MT-bench", context=512, draft_vocab=vocab, source=_VLLM_ISSUE,
             derived=f"tokens/s = 1000 / TPOT ms (7.07 plain, {tpot} speculative); speedup = 7.07 / {tpot}; "
                     + _VLLM_GPU)
      for name, head, vocab, k, tau, tpot in (
          ("eagle3", "EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)", 32000, 3, 2.79, 4.09),
          ("eagle3", "EAGLE-3 head (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)", 32000, 7, 3.54, 4.29),
          ("eagle", "EAGLE head (yuhuili/EAGLE-LLaMA3.1-Instruct-8B)", None, 3, 2.29, 4.29))),
    # --- EAGLE's own PyTorch loop, A100, batch 1, 70B trees (EAGLE-3 paper Table 1) -------------
    *(Anchor(f"eagle-{name}-a100-b1-70b", "Llama-3.3-70B-Instruct", "llama-3-70b", "a100", None,
             "EAGLE reference code (HF transformers, eager PyTorch)", "eager", 1, head, "eagle",
             DraftShape(levels=6, topk=10, verify_tokens=60), tau=tau, plain_tok_s=None, spec_tok_s=None,
             speedup=speedup, dataset="MT-bench, T = 0", context=512, draft_vocab=vocab,
             source=f"{_EAGLE3_PAPER} Table 1 (MT-bench, temperature 0; 70B models tested on A100)",
             derived=("tree: total_token 60, depth 5 (6 drafting passes), top_k 10, the defaults of "
                      "eagle/evaluation/gen_ea_answer_llama3chat.py in github.com/SafeAILab/EAGLE (the paper "
                      "does not restate them); GPU count not stated (a bf16 70B needs two 80 GB A100s or more): "
                      "modelled as one (memory-bound passes scale alike; no communication cost). Not fitted: "
                      "the model predicts these rows with constants carried from the H100 fit"))
      for name, head, vocab, tau, speedup in (
          ("eagle3", "EAGLE-3 head", 32000, 5.63, 4.11),
          ("eagle2", "EAGLE-2 head", None, 3.67, 2.83))),
    # --- vLLM, MI300X, draft-model chains (ROCm blog) ---------------------------------------------
    *(Anchor(f"vllm-draft-{size}-mi300x-70b", "Llama 3.1-70B (FP8, amd/Llama-3.1-70B-Instruct-FP8-KV)",
             "llama-3-70b", "mi300x", 1, "vLLM v0.6.7, ROCm 6.3.1", "graph", 1,
             f"{draft} draft model", "model", DraftShape(levels=5, topk=1, verify_tokens=6), tau=None,
             plain_tok_s=None, spec_tok_s=None, speedup=speedup, dataset="random 8192-token prompts, 256 out",
             context=8192 + 128, bytes_per_weight=1.0, draft_shape=shape, source=_ROCM_BLOG,
             derived=("speedup = E2E latency 2736.95 ms / the speculative one, as the table prints it; the chain "
                      "length 5 is the blog's num_speculative_tokens for its 405B command (not restated for "
                      "70B); batch: an online server at a low request rate, taken as 1"),
             not_held=f"{_NO_TAU}; the latency includes an 8192-token prefill the speedup does not separate")
      for size, draft, shape, speedup in (
          ("1b", "Llama 3.2-1B", "llama-3.2-1b", 2.31),
          ("8b", "Llama 3.1-8B", "llama-3-8b", 2.04))),
)


def matching_anchors(shape: str, gpu: str, batch: int) -> tuple[Anchor, ...]:
    """Rows published for this model preset, hardware preset and batch."""
    return tuple(a for a in ANCHORS if a.shape == shape and a.gpu == gpu.strip().lower() and a.batch == batch)


def _check_unique() -> None:
    keys = [a.key for a in ANCHORS]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"duplicate anchor keys: {duplicates}")


_check_unique()
