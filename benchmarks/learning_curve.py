"""Learning curve: what more training tokens buy, per checkpoint of one (or more) training runs.

A run trained with ``--tokens N --curve K`` leaves checkpoints at K log-spaced token counts in
``<run>/curve/<kind>.tokens<T>.safetensors``, each with a card recording the tokens seen, steps,
minutes and CPU-hours (training CPU of every process + the extraction CPU of the tokens seen).
For every checkpoint this script measures

    held-out acceptance by depth   teacher-forced on held-out ShareGPT replies (the cards' metric:
                                   top1 = greedy acceptance of one draft given a correct prefix,
                                   beta_top32 = a lower bound of the T = 1 acceptance)
    tree τ                         tokens per target forward of the real SmolLM2-135M at T = 0 and
                                   T = 1 (seeded) on MT-bench first turns (never trained on), for
                                   each ``--trees`` builder

and writes ``--out``.{json,md,png} after every point; re-running skips the points already
measured with the same settings (resumable). The Markdown ends with where each curve points: a
least-squares line of depth-1 top-1 against log10(tokens) over the drafter's last decade of
points, and the tokens at which it would reach issue 28's goal (:data:`GOAL_TOP1`).
``--render`` rewrites the Markdown and the plot from the JSON, measuring nothing.

    python benchmarks/learning_curve.py --runs runs/eagle3 runs/eagle            # 20 prompts x 128
    python benchmarks/learning_curve.py --runs runs/eagle3 --checkpoints checkpoints/smollm2-135m/eagle3.safetensors
    python benchmarks/learning_curve.py --runs /tmp/run --prompts 2 --max-new-tokens 16 --out /tmp/lc
    python benchmarks/learning_curve.py --render --prompts 4 --max-new-tokens 48 --trees chain4,tree16 --heldout-sequences 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import treespec
import treespec.drafters.eagle  # noqa: F401  (registers eagle, eagle3)
import treespec.drafters.medusa  # noqa: F401
import treespec.drafters.mtp  # noqa: F401
import treespec.drafters.small  # noqa: F401
from harness import RESULTS, TREE_NAMES, Pool, figure, machine_info, machine_line, make_tree, save_figure, write_results
from treespec.data import chat_prompt, mtbench_questions

GOAL_TOP1 = 0.6   # issue 28: eagle3's held-out top-1 at depth 1


def checkpoints(runs: list[str], extra: list[str] = ()) -> list[Path]:
    """Every learning-curve checkpoint of the runs, by kind then tokens, then ``extra``
    checkpoints with cards written by ``treespec train`` (a shipped head, a run's end)."""
    found = [p for r in runs for p in sorted((Path(r) / "curve").glob("*.tokens*.safetensors"))]
    for p in map(Path, extra):
        if not (p.is_file() and p.with_suffix(".json").is_file()):
            raise SystemExit(f"--checkpoints: {p} needs the checkpoint and its card ({p.with_suffix('.json').name})")
        found.append(p)
    if not found:
        raise SystemExit(f"no learning-curve checkpoints (curve/<kind>.tokens<T>.safetensors) under {runs}; "
                         "train with --tokens N --curve K, or name checkpoints with --checkpoints")
    return found


def tau_of(target, drafter, trees: list[str], prompts, max_new: int, temperature: float = 0.0) -> dict:
    """τ, acceptance by depth and tokens/s at ``temperature`` for each tree, pooled over ``prompts``."""
    out = {}
    for t in trees:
        gen = treespec.SpeculativeGenerator(target, drafter, make_tree(t))
        gen.generate(torch.tensor(chat_prompt(target.tokenizer, "Hi")), max_new_tokens=4)    # warm-up
        pool = Pool()
        for q in prompts:
            ids = torch.tensor(chat_prompt(target.tokenizer, q.turns[0]))
            pool.add_stats(gen.generate(ids, max_new_tokens=max_new, temperature=temperature, seed=0).stats)
        out[t] = {k: v for k, v in pool.row(None).items() if k in ("tau", "acceptance_by_depth", "tokens_per_s")}
    return out


def measure(path: Path, target, args, prompts) -> dict:
    from treespec.train.loop import heldout_of_checkpoint

    card = json.loads(path.with_suffix(".json").read_text())
    kind, train = card["drafter"], card["train"]
    t0 = time.perf_counter()
    held = heldout_of_checkpoint(kind, target, path, sequences=args.heldout_sequences)
    drafter = treespec.load_drafter(kind, target, checkpoint=str(path))
    tau = {t: tau_of(target, drafter, args.trees.split(","), prompts, args.max_new_tokens, t) for t in (0.0, 1.0)}
    return {"run": path.parent.parent.name, "checkpoint": path.name, "checksum": card["checksum"], "drafter": kind,
            "tokens": train["tokens_seen"], "curve_point_tokens": train.get("curve_point_tokens"),
            "steps": train["steps_done"], "train_minutes": train["train_minutes"],
            "cpu_hours": train["cpu_hours"], "cpu_hours_by_machine": train.get("cpu_hours_by_machine", {}),
            "train_cpu_seconds": train["train_cpu_seconds"],
            "extraction_cpu_seconds": train["extraction_cpu_seconds"], "processes": train["processes"],
            "global_batch": train["global_batch"], "autocast": train["autocast"],
            "heldout": held, "tau_t0": tau[0.0], "tau_t1": tau[1.0],
            "eval_minutes": round((time.perf_counter() - t0) / 60, 2), "eval_machine": machine_line(machine_info())}


def markdown(result: dict) -> str:
    c = result["config"]
    trees = c["trees"]
    lines = [f"# Learning curve ({c['prompts']} MT-bench prompts x {c['max_new_tokens']} tokens, T = 0 and T = 1; "
             f"held-out: {c['heldout_sequences']} ShareGPT sequences)", "",
             machine_line(result["machine"]) + " (the last evaluation's machine; each point in the JSON names "
             "its own as `eval_machine`, and the CPU-hours column names the machines each run trained on; "
             "top1 and τ are properties of the fp32 target and the head, not of the machine)", "",
             "CPU-hours = training CPU of every process (online runs: the target's pass included) + the "
             "extraction CPU of the tokens seen (shard runs). top1 = held-out greedy acceptance of one draft at "
             "depth 1..4 given a correct prefix; τ = tokens per target forward on MT-bench first turns.", "",
             "| drafter | tokens | CPU-h (by machine) | steps | held-out top1 by depth | "
             + " | ".join(f"τ {t}, T = {temp}" for temp in (0, 1) for t in trees) + " |",
             "|---|---|---|---|---|" + "---|" * 2 * len(trees)]
    for p in sorted(result["points"], key=lambda p: (p["drafter"], p["tokens"])):
        top1 = " ".join(f"{x:.2f}" for x in p["heldout"]["top1_by_depth"])
        taus = " | ".join(f"{p[key][t]['tau']:.2f}" for key in ("tau_t0", "tau_t1") for t in trees)
        machines = "; ".join(f"{m}: {h:.3f}" for m, h in p.get("cpu_hours_by_machine", {}).items())
        cpu = f"{p['cpu_hours']:.3f}" + (f" ({machines})" if machines else "")
        name = p["drafter"] if p.get("curve_point_tokens") else f"{p['drafter']} ({p['run']}/{p['checkpoint']})"
        lines.append(f"| {name} | {p['tokens']:,} | {cpu} | {p['steps']} | {top1} | {taus} |")
    return "\n".join(lines + trend(result["points"])) + "\n"


def trend(points: list[dict], goal: float = GOAL_TOP1) -> list[str]:
    """Markdown lines: for each drafter with three or more points in its last decade of tokens,
    the least-squares line of depth-1 top-1 against log10(tokens) over them, and the tokens (and
    CPU-hours, at the largest run's own rate) where that line reaches ``goal``."""
    lines = ["", f"## Where the curves point (depth-1 top-1 against log10 tokens, to {goal})", "",
             "| drafter | points (tokens) | top-1 gained per 10x tokens | largest residual | tokens at "
             f"{goal} | x the largest run | CPU-h at its rate |", "|---|---|---|---|---|---|---|"]
    for kind in sorted({p["drafter"] for p in points}):
        pts = sorted((p for p in points if p["drafter"] == kind), key=lambda p: p["tokens"])
        last = pts[-1]
        pts = [p for p in pts if p["tokens"] >= last["tokens"] / 10]
        if len(pts) < 3:
            continue
        x = torch.tensor([p["tokens"] for p in pts], dtype=torch.float64).log10()
        y = torch.tensor([p["heldout"]["top1_by_depth"][0] for p in pts], dtype=torch.float64)
        slope = float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())
        worst = float((y - y.mean() - slope * (x - x.mean())).abs().max())     # the largest residual
        span = ", ".join(f"{p['tokens'] / 1e6:.1f} M" for p in pts)
        row = f"| {kind} | {span} | {slope:+.3f} | {worst:.3f} |"
        if slope <= 0:
            lines.append(f"{row} never | - | - |")
            continue
        need = 10 ** float(x.mean() + (goal - y.mean()) / slope)
        rate = last["cpu_hours"] / last["tokens"]
        lines.append(f"{row} {need / 1e6:,.0f} M | {need / last['tokens']:.1f} | {need * rate:,.0f} |")
    lines += ["", "A straight line in log tokens is what these points show, not a law: the schedule, "
              "the data's repeats (ShareGPT's ~12.5 M tokens at --max-len 256) and the head's capacity "
              "can bend it either way."]
    return lines


def plot(result: dict, path: Path) -> None:
    fig, ((a, b),) = figure(1, 2, size=(10, 4))
    kinds = sorted({p["drafter"] for p in result["points"]})
    for kind in kinds:
        pts = sorted((p for p in result["points"] if p["drafter"] == kind), key=lambda p: p["tokens"])
        x = [p["tokens"] for p in pts]
        for d in range(min(len(pts[0]["heldout"]["top1_by_depth"]), 4)):
            a.plot(x, [p["heldout"]["top1_by_depth"][d] for p in pts], marker="o", label=f"{kind} depth {d + 1}")
        for t in result["config"]["trees"]:
            for key, style in (("tau_t0", "-"), ("tau_t1", "--")):
                b.plot(x, [p[key][t]["tau"] for p in pts], style, marker="o", label=f"{kind} {t} T = {key[-1]}")
    for ax, title in ((a, "held-out top-1 acceptance"), (b, "τ on MT-bench")):
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="*", default=[], help="training --out directories (with curve/)")
    ap.add_argument("--checkpoints", nargs="*", default=[],
                    help="more checkpoints with their cards, e.g. checkpoints/smollm2-135m/eagle3.safetensors")
    ap.add_argument("--prompts", type=int, default=20, help="MT-bench first turns for τ")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trees", default="chain4,tree64", help=f"of {', '.join(TREE_NAMES)}")
    ap.add_argument("--heldout-sequences", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "learning_curve"), help="path without suffix")
    ap.add_argument("--render", action="store_true",
                    help="rewrite --out's .md and .png from its .json (same settings), measuring nothing")
    args = ap.parse_args()
    unknown = [t for t in args.trees.split(",") if t not in TREE_NAMES]
    if unknown:
        raise SystemExit(f"--trees: unknown {unknown}; choose from {', '.join(TREE_NAMES)}")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "trees": args.trees.split(","),
              "heldout_sequences": args.heldout_sequences, "threads": args.threads, "temperatures": [0.0, 1.0]}
    earlier = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else None
    points = earlier["points"] if earlier and earlier["config"] == config else []
    if args.render:
        if not points:
            raise SystemExit(f"--render: {out}.json holds no points measured with {config}; pass the settings "
                             "it was measured with (--prompts, --max-new-tokens, --trees, --heldout-sequences)")
        write_results(out, earlier, markdown(earlier))
        plot(earlier, out.with_suffix(".png"))
        return
    done = {(p["run"], p["checkpoint"], p["checksum"]) for p in points}
    target = treespec.load_target("smollm2-135m")
    prompts = mtbench_questions()[: args.prompts]
    for path in checkpoints(args.runs, args.checkpoints):
        checksum = json.loads(path.with_suffix(".json").read_text())["checksum"]
        if (path.parent.parent.name, path.name, checksum) in done:
            continue
        points.append(measure(path, target, args, prompts))
        result = {"config": config, "machine": machine_info(), "points": points}
        write_results(out, result, markdown(result))
        plot(result, out.with_suffix(".png"))
        print(f"{path.name}: tokens {points[-1]['tokens']}, top1 {points[-1]['heldout']['top1_by_depth']}, "
              f"tau T=0 {[v['tau'] for v in points[-1]['tau_t0'].values()]}, "
              f"T=1 {[v['tau'] for v in points[-1]['tau_t1'].values()]}", flush=True)
    if points:
        print(markdown({"config": config, "machine": machine_info(), "points": points}))


if __name__ == "__main__":
    main()
