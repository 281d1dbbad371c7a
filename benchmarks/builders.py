"""Builder benchmark: τ and tokens/s of every tree builder at budgets 4..64, T = 0 and T = 1.

Same target (SmolLM2-135M), same drafter, same MT-bench first turns (chat template) for every
builder; the only thing that changes is the builder and its budget (nodes incl. the root).

    python benchmarks/builders.py --prompts 3 --max-new-tokens 64      # quick check
    python benchmarks/builders.py                                       # 20 prompts x 128 tokens

On two cores, one process per temperature, then merge:

    python benchmarks/builders.py --temperatures 0 --out benchmarks/results/builders_t0 &
    python benchmarks/builders.py --temperatures 1 --out benchmarks/results/builders_t1 &
    wait; python benchmarks/builders.py --merge benchmarks/results/builders_t{0,1}.json

``--verify block|traversal`` runs every configuration with that acceptance rule instead of the
token rule (block verifies chains only: use ``--builders chain``).

A run cut short keeps every configuration on the same first prompts; continue it later with
``--resume benchmarks/results/builders_t0.json`` (same drafter, settings and Sequoia vectors).

Drafter: the best registered one: among the trained drafters whose checkpoint loads (eagle3,
eagle, mtp, medusa, small) the one with the highest τ on a held-out prompt (EAGLE-2 default
tree, T = 0), else "early-exit"; ``--drafter`` overrides. At T = 1 the stochastic builders
draw children without replacement (``--t1-mode``); the static tree fills ranks
deterministically (Medusa style). Sequoia's acceptance vector is measured first on 3 other
MT-bench prompts at each temperature (``measure_acceptance_vector``, width 8).

Builder overhead = time inside ``builder.build`` minus time inside ``drafter.expand`` (measured
with a timing proxy around the drafter), as a share of the drafter time. Target: <= 15 %.

Writes benchmarks/results/builders.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import RESULTS, figure, machine_info, machine_line, pick_drafter, save_figure, write_results
from treespec import SpeculativeGenerator, load_target
from treespec.data import chat_prompt, mtbench_questions
from treespec.drafters.base import TimedDrafter
from treespec.calibrate.drafters import measure_acceptance_vector
from treespec.builders import BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SequoiaBuilder, StaticTreeBuilder
from treespec.core import VERIFY_RULES

BUILDERS = ("chain", "static", "dynamic", "best-first", "sequoia")


def make(name: str, budget: int, mode: str, acceptance) -> object:
    """The builder ``name`` at ``budget`` nodes (root included); settings in the module doc."""
    depth = min(6, budget - 1)
    wide = 4 if budget <= 16 else 8
    if name == "chain":
        return ChainBuilder(budget=budget, mode=mode)
    if name == "static":
        return StaticTreeBuilder.default(budget)
    if name == "dynamic":
        return DynamicTreeBuilder(budget, depth=depth, top_k=wide, mode=mode)
    if name == "best-first":
        return BestFirstBuilder(budget, max_width=wide, max_rounds=depth + 1, mode=mode)
    if name == "sequoia":
        return SequoiaBuilder(budget, depth=depth, acceptance=acceptance, mode=mode)
    raise ValueError(f"unknown builder {name!r}; choose from {BUILDERS}")


class Tally:
    """Running totals of one configuration over the prompts measured so far (all additive, so
    a cut-short run can be resumed from its saved rows)."""

    def __init__(self):
        self.prompts = self.tokens = self.steps = self.emitted = self.nodes = self.calls = 0
        self.decode = self.build = self.expand = 0.0
        self.per_prompt_tps: list[float] = []

    def add(self, stats, expand_time: float) -> None:
        self.prompts += 1
        self.tokens += stats.new_tokens
        self.steps += stats.steps
        self.emitted += stats._emitted
        self.nodes += stats.tree_nodes
        self.calls += stats.drafter_calls
        self.decode += stats.decode_time
        self.build += stats.draft_time
        self.expand += expand_time
        self.per_prompt_tps.append(stats.tokens_per_s)

    @classmethod
    def from_row(cls, row: dict) -> "Tally":
        """The totals behind a saved row (``--resume``)."""
        t = cls()
        t.prompts, t.tokens, t.steps = row["prompts"], row["new_tokens"], row["steps"]
        t.emitted = round(row["tau"] * row["steps"])
        t.nodes = round(row["mean_nodes"] * row["steps"])
        t.calls = round(row["calls_per_step"] * row["steps"])
        t.decode, t.expand = row["decode_time_s"], row["draft_time_s"]
        t.build = row["draft_time_s"] + row["builder_time_s"]
        # rows saved before per-prompt speeds were kept: the median covers later prompts only
        t.per_prompt_tps = list(row.get("per_prompt_tokens_per_s", []))
        return t

    def row(self) -> dict:
        over = self.build - self.expand
        return dict(tau=self.emitted / self.steps, tokens_per_s=self.tokens / self.decode,
                    median_prompt_tokens_per_s=(statistics.median(self.per_prompt_tps)
                                                if self.per_prompt_tps else None),
                    per_prompt_tokens_per_s=self.per_prompt_tps,
                    prompts=self.prompts, new_tokens=self.tokens, steps=self.steps,
                    mean_nodes=self.nodes / self.steps, calls_per_step=self.calls / self.steps,
                    draft_time_s=self.expand, builder_time_s=over,
                    builder_overhead=over / self.expand if self.expand > 0 else 0.0,
                    builder_share_of_drafting=over / self.build if self.build > 0 else 0.0,
                    decode_time_s=self.decode)


def run_one(gen, drafter: TimedDrafter, ids, max_new: int, temperature: float, seed: int, tally: Tally):
    drafter.reset()
    r = gen.generate(ids, max_new_tokens=max_new, temperature=temperature, seed=seed)
    tally.add(r.stats, drafter.expand_time)


def write_table(results: list[dict], meta: dict) -> str:
    lines = [f"# Tree builders: τ and tokens/s by budget\n",
             f"Target {meta['target']}, drafter **{meta['drafter']}**, "
             f"{meta.get('prompts_done', meta['prompts'])} MT-bench "
             f"prompts x {meta['max_new_tokens']} new tokens, {meta['threads']} CPU thread(s) "
             f"({meta['machine']}); T = 1 drafting mode: {meta['t1_mode']} (static: ranked); "
             f"acceptance rule: {meta.get('verify', 'token')}. "
             f"Wall time {meta['wall_s'] / 60:.1f} min.\n",
             *([machine_line({**meta["cpu"], "torch_threads": meta["threads"]}) + "\n"] if "cpu" in meta else []),
             "Builder overhead = builder time outside drafter.expand / drafter.expand time "
             "(JSON `builder_overhead`; `builder_share_of_drafting` divides by the whole drafting "
             "phase instead).\n"]
    if meta.get("note"):
        lines.append(f"Conditions: {meta['note']}\n")
    if not meta.get("complete"):
        lines.append(f"**Partial run**: {meta.get('prompts_done', '?')} of {meta['prompts']} prompts measured "
                     "(every configuration on the same prompts).\n")
    for temp in meta["temperatures"]:
        lines.append(f"\n## T = {temp:g}\n")
        base = [r for r in results if r["builder"] == "none" and r["temperature"] == temp]
        if base:
            lines.append(f"No drafting (budget 1): {base[0]['tokens_per_s']:.2f} tokens/s.\n")
        lines.append("| builder | " + " | ".join(f"B={b} τ / tok/s" for b in meta["budgets"]) +
                     " | max overhead |")
        lines.append("|---|" + "---|" * (len(meta["budgets"]) + 1))
        for name in meta["builders"]:
            rows = {r["budget"]: r for r in results if r["builder"] == name and r["temperature"] == temp}
            if not rows:
                continue
            cells = [f"{rows[b]['tau']:.2f} / {rows[b]['tokens_per_s']:.1f}" if b in rows else "—"
                     for b in meta["budgets"]]
            over = max(r["builder_overhead"] for r in rows.values())
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {100 * over:.1f} % |")
    if meta.get("sequoia_acceptance"):
        lines.append("\nSequoia acceptance vectors (measured, width 8): " + "; ".join(
            f"T={t}: " + ", ".join(f"{x:.3f}" for x in a) for t, a in meta["sequoia_acceptance"].items()))
    return "\n".join(lines) + "\n"


def plot(results: list[dict], meta: dict, path: Path) -> None:
    temps = meta["temperatures"]
    fig, axes = figure(1, len(temps), size=(6 * len(temps), 4.2))
    for ax, temp in zip(axes[0], temps):
        for name in meta["builders"]:
            rows = sorted((r for r in results if r["builder"] == name and r["temperature"] == temp),
                          key=lambda r: r["budget"])
            if rows:
                ax.plot([r["budget"] for r in rows], [r["tau"] for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(meta["budgets"], [str(b) for b in meta["budgets"]])
        ax.set_xlabel("budget (tree nodes incl. root)")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.set_title(f"T = {temp:g}, drafter {meta['drafter']}")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    save_figure(fig, path, dpi=120)


def save(out: Path, meta: dict, results: list[dict]) -> None:
    write_results(out, dict(meta=meta, results=results), write_table(results, meta))
    plot(results, meta, out.with_suffix(".png"))


def merge(paths: list[str], out: Path, note: str | None = None) -> None:
    """One table from runs split by temperature (e.g. two processes, one per CPU core)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    meta = dict(runs[0]["meta"])
    if note:
        meta["note"] = note
    meta["temperatures"] = [t for r in runs for t in r["meta"]["temperatures"]]
    meta["sequoia_acceptance"] = {k: v for r in runs for k, v in r["meta"]["sequoia_acceptance"].items()}
    meta["wall_s"] = max(r["meta"]["wall_s"] for r in runs)
    meta["complete"] = all(r["meta"]["complete"] for r in runs)
    meta["prompts_done"] = min(r["meta"].get("prompts_done", r["meta"]["prompts"]) for r in runs)
    meta["merged_from"] = paths
    results = [row for r in runs for row in r["results"]]
    save(out, meta, results)
    print(f"merged {len(paths)} runs into {out}.{{json,md,png}}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="4,8,16,32,64")
    ap.add_argument("--builders", default=",".join(BUILDERS))
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--t1-mode", default="without_replacement",
                    choices=("deterministic", "with_replacement", "without_replacement"))
    ap.add_argument("--drafter", default=None, help="registered drafter (default: best available)")
    ap.add_argument("--verify", default="token", choices=VERIFY_RULES,
                    help="acceptance rule for every configuration (block: chains only)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "builders"))
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge earlier runs' JSON into --out")
    ap.add_argument("--resume", metavar="JSON",
                    help="continue a cut-short run from its JSON (same drafter, settings and Sequoia "
                         "vectors; --prompts may raise the total); writes back to it")
    ap.add_argument("--note", default=None,
                    help="how the machine was used during the run (written into the table)")
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, Path(args.out), args.note)
        return
    earlier = None
    if args.resume:
        earlier = json.loads(Path(args.resume).read_text())
        m = earlier["meta"]
        args.out = str(Path(args.resume).with_suffix(""))
        args.drafter, args.max_new_tokens, args.t1_mode, args.seed = (
            m["drafter"], m["max_new_tokens"], m["t1_mode"], m["seed"])
        args.verify = m.get("verify", "token")
        args.budgets = ",".join(map(str, m["budgets"]))
        args.builders = ",".join(m["builders"])
        args.temperatures = ",".join(f"{t:g}" for t in m["temperatures"])
        args.prompts = max(args.prompts, m["prompts"]) if "--prompts" in sys.argv else m["prompts"]
    torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    builders = args.builders.split(",")
    if args.verify == "block" and set(builders) - {"chain"}:
        raise SystemExit(f"--verify block verifies chains only; use --builders chain (got {args.builders})")
    temps = [float(t) for t in args.temperatures.split(",")]
    start = time.perf_counter()

    target = load_target("smollm2-135m")
    questions = mtbench_questions()
    name, inner = pick_drafter(target, args.drafter, questions[-4].turns[0])
    drafter = TimedDrafter(inner)
    prompts = [torch.tensor(chat_prompt(target.tokenizer, q.turns[0])) for q in questions[: args.prompts]]
    held_out = [q.turns[0] for q in questions[-3:]]  # Sequoia's vector: not the benchmark prompts
    print(f"drafter {name}; {len(prompts)} prompts x {args.max_new_tokens} tokens", flush=True)
    SpeculativeGenerator(target, drafter, ChainBuilder(budget=3)).generate(prompts[0], max_new_tokens=4)  # warm-up

    acceptance = {}
    if earlier is not None:
        acceptance = {float(t): tuple(v) for t, v in earlier["meta"]["sequoia_acceptance"].items()}
    elif "sequoia" in builders:
        for temp in temps:
            mode = "deterministic" if temp == 0 else args.t1_mode
            acceptance[temp] = measure_acceptance_vector(inner, target, held_out, width=8,
                                                         max_new_tokens=32, temperature=temp, mode=mode)
            print(f"sequoia acceptance T={temp:g}: {[round(a, 3) for a in acceptance[temp]]}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(target="smollm2-135m", drafter=name, prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, budgets=budgets, builders=builders,
                temperatures=temps, t1_mode=args.t1_mode, threads=args.threads, seed=args.seed,
                verify=args.verify,
                machine=f"{platform.machine()} {platform.processor() or ''}".strip(), cpu=machine_info(),
                torch=torch.__version__, wall_s=0.0, complete=False,
                sequoia_acceptance={str(k): list(v) for k, v in acceptance.items()})
    done = 0
    if args.note:
        meta["note"] = args.note
    if earlier is not None:
        done = earlier["meta"]["prompts_done"]
        if "note" in earlier["meta"] and not args.note:
            meta["note"] = earlier["meta"]["note"]
        # the earlier wall_s already includes every run before it
        meta["wall_s_before_resume"] = earlier["meta"]["wall_s"]
    # Every configuration runs on prompt i before any runs on prompt i + 1 (interleaved), so a
    # shared machine's load drifts hit all configurations alike, and a cut-short run still
    # holds every configuration on the same prompts. Budget 1 = plain decoding in the engine.
    configs = []  # (builder name, budget, temperature, builder)
    for temp in temps:
        mode = "deterministic" if temp == 0 else args.t1_mode
        configs.append(("none", 1, temp, DynamicTreeBuilder(budget=1)))
        configs += [(b, budget, temp, make(b, budget, mode, acceptance.get(temp)))
                    for budget in budgets for b in builders]
    gens = [SpeculativeGenerator(target, drafter, c[3], verify=args.verify) for c in configs]
    tallies = [Tally() for _ in configs]
    if earlier is not None:
        saved = {(r["builder"], r["budget"], r["temperature"]): r for r in earlier["results"]}
        tallies = [Tally.from_row(saved[c[:3]]) for c in configs]

    def rows() -> list[dict]:
        out = []
        for (b, budget, temp, builder), tally in zip(configs, tallies):
            row = tally.row()
            row.update(builder=b, budget=budget, temperature=temp,
                       repr="no drafting" if b == "none" else repr(builder))
            out.append(row)
        return out

    for i, ids in enumerate(prompts):
        if i < done:
            continue
        t0 = time.perf_counter()
        for (b, budget, temp, builder), gen, tally in zip(configs, gens, tallies):
            run_one(gen, drafter, ids, args.max_new_tokens, temp, args.seed + i, tally)
        meta.update(wall_s=time.perf_counter() - start + meta.get("wall_s_before_resume", 0.0),
                    prompts_done=i + 1)
        save(out, meta, rows())  # after every prompt: partial results survive
        print(f"prompt {i + 1}/{len(prompts)} in {time.perf_counter() - t0:.0f} s", flush=True)
    results = rows()
    for row in results:
        print(f"T={row['temperature']:g} B={row['budget']:>2} {row['builder']:<10} tau {row['tau']:.2f}  "
              f"{row['tokens_per_s']:6.1f} tok/s  nodes {row['mean_nodes']:.1f}  "
              f"overhead {100 * row['builder_overhead']:.1f} %")
    meta.update(complete=True, prompts_done=len(prompts))
    save(out, meta, results)
    print(f"wrote {out}.{{json,md,png}} in {meta['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
