"""What 4-bit weights buy a drafter: Qwen2.5-Coder-0.5B passes in bf16 (packed) against int4.

Two copies of the 0.5B in the CPU's bf16 path: one with its linear layers packed
(``pack_linears``, what ``load_drafter`` does), one with them in 4 bits
(``quantize_linears``: :class:`treespec.fastpath.quant.Int4Linear`). Measured, interleaved:

- a draft pass over ``n`` new rows after a 300-token context (decoder + full LM head), for the
  row counts a chain (1) and a tree level (2-16) feed; median ms of ``--reps`` passes each; the
  int4 copy both ways, every pass on the int4 kernel and every pass on the dense copy of the
  4-bit weights, which places ``INT4_MAX_ROWS`` (where ``Int4Linear`` switches);
- one 4864 x 896 layer (the MLP's up projection) for 1 row in fp32: dense ``F.linear`` against the
  int4 kernel with fp32 inputs, the reason ``Int4Linear`` refuses fp32 models;
- how often the two copies agree on the next token (teacher-forced argmax over every position of
  ``--prompts`` MT-bench prompts): what 4 bits cost in draft quality, before acceptance.

    python benchmarks/quant_drafter.py            # writes benchmarks/results/quant_drafter.{json,md}

Records the CPU model, flags and threads (1).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from harness import RESULTS, machine_info, machine_line, md_table, median_ms, time_calls, write_results
from treespec.data import chat_prompt, mtbench_questions
from treespec.fastpath.packing import pack_linears
from treespec.fastpath.quant import GROUP, INT4_MAX_ROWS, Int4Linear, quantize_linears, quantize_weight
from treespec.targets.loader import load_qwen_coder_0_5b


def pass_ms(model, context: torch.Tensor, rows: int, reps: int) -> float:
    """Median ms of one pass over ``rows`` new tokens after ``context`` (cache cropped back)."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=context[None], cache=cache, use_cache=True, logits_to_keep=1)
        new = context[:rows][None]
        pos = torch.arange(len(context), len(context) + rows)[None]

        def step():
            model(input_ids=new, position_ids=pos, cache=cache, use_cache=True)
            cache.crop(-rows)   # back to the context (transformers 5 takes the count to drop)
        return median_ms(time_calls(step, reps, warmup=2))


def agreement(a, b, prompts: list[torch.Tensor]) -> tuple[int, int]:
    """(positions where both models' argmax agree, positions) over ``prompts``, teacher-forced.
    Each prompt is one pass of many rows, so the int4 copy runs its dense copy of the 4-bit
    weights here: the same weights its kernel multiplies by on draft passes."""
    same = total = 0
    with torch.inference_mode():
        for ids in prompts:
            x, y = a(input_ids=ids[None]).logits[0].argmax(-1), b(input_ids=ids[None]).logits[0].argmax(-1)
            same, total = same + int((x == y).sum()), total + len(ids)
    return same, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,10,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--out", default=str(RESULTS / "quant_drafter"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dense = load_qwen_coder_0_5b(dtype=torch.bfloat16)
    tok = dense.tokenizer
    pack_report = pack_linears(dense.model)
    small = load_qwen_coder_0_5b(dtype=torch.bfloat16).model.eval()
    quant_report = quantize_linears(small)
    texts = [q.turns[0] for q in mtbench_questions()][: args.prompts]
    prompts = [torch.tensor(chat_prompt(tok, t)) for t in texts]
    context = torch.cat(prompts)[:300]
    if len(context) < 300:
        raise SystemExit(f"--prompts {args.prompts} hold {len(context)} tokens; 300 are needed for the context")

    layers = [m for m in small.modules() if isinstance(m, Int4Linear)]

    def forced(rows: int, max_rows: int) -> float:
        for m in layers:
            m.max_rows = max_rows
        try:
            return pass_ms(small, context, rows, args.reps)
        finally:
            for m in layers:
                m.max_rows = INT4_MAX_ROWS

    passes = []
    for n in (int(r) for r in args.rows.split(",")):
        bf16_ms, int4_ms = pass_ms(dense.model, context, n, args.reps), pass_ms(small, context, n, args.reps)
        passes.append({"rows": n, "bf16_packed_ms": bf16_ms, "int4_ms": int4_ms, "ratio": bf16_ms / int4_ms,
                       "int4_kernel_ms": forced(n, n), "int4_dense_copy_ms": forced(n, 0)})

    w = torch.randn(4864, 896) * 0.02
    q, scales_and_zeros = quantize_weight(w)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    x = torch.randn(1, 896)
    fp32 = {"dense_us": median_ms(time_calls(lambda: F.linear(x, w), args.reps, warmup=3)) * 1e3,
            "int4_us": median_ms(time_calls(lambda: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP,
                                                                                      scales_and_zeros),
                                            args.reps, warmup=3)) * 1e3}
    same, total = agreement(dense.model, small, prompts)
    machine = machine_info()
    data = {"machine": machine, "pack": str(pack_report), "quantize": str(quant_report), "context": len(context),
            "passes": passes, "fp32_layer_4864x896": fp32,
            "argmax_agreement": {"same": same, "positions": total, "prompts": len(prompts)}}
    lines = ["# Qwen2.5-Coder-0.5B as a drafter: packed bf16 against 4-bit weights", "",
             machine_line(machine), "",
             f"bf16: {pack_report}. int4: {quant_report}.", "",
             f"## One draft pass after a {len(context)}-token context (decoder + LM head, median of {args.reps})", ""]
    lines += md_table(["rows", "bf16 packed ms", "int4 ms", "bf16 / int4", "int4: kernel only ms",
                       "int4: dense copy only ms"],
                      [[p["rows"], f"{p['bf16_packed_ms']:.1f}", f"{p['int4_ms']:.1f}", f"{p['ratio']:.2f}x",
                        f"{p['int4_kernel_ms']:.1f}", f"{p['int4_dense_copy_ms']:.1f}"] for p in passes], "rrrrrr")
    lines += ["", f"`Int4Linear` runs passes of up to {INT4_MAX_ROWS} rows on the int4 kernel and longer ones on "
              "its dense copy of the same 4-bit weights (PyTorch's bf16 GEMM, not packed): the last two columns "
              "force one or the other.", "",
              "## One 4864 x 896 layer, 1 row, fp32 inputs", "",
              f"dense `F.linear` {fp32['dense_us']:.0f} us, int4 kernel {fp32['int4_us']:.0f} us "
              f"({fp32['int4_us'] / fp32['dense_us']:.1f}x the dense time): why `Int4Linear` takes bf16 or fp16 "
              "models only.", "",
              "## Draft quality", "",
              f"Next-token argmax of the int4 copy equals the bf16 copy's at {same} of {total} positions "
              f"({same / total:.1%}) over {len(prompts)} MT-bench first turns, teacher-forced. What this costs in "
              "acceptance against the 1.5B is measured in `qwen_int4.md` (τ of the same builders).", ""]
    write_results(args.out, data, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
