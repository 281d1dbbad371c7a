"""Batch benchmark: total tokens/s against the batch size, speculation vs batched plain decoding.

For each B in --batch-sizes (default 1, 2, 4, 8, 16) and each temperature (T = 0 greedy, T = 1
seeded), disjoint groups of B MT-bench first turns (chat template; groups = max(1, prompts // B),
at most --max-groups)
are decoded to --max-new-tokens each (EOS stops a request early), by:
- HF generate (batched): the stock fp32 model, left-padded, one ``generate`` call per group;
- treespec none: the server with a root-only tree (no speculation): the batched loop's overhead;
- treespec chain k / tree N: ``SpeculativeServer`` on the packed target with the shipped eagle3
  head (batched drafting), a chain of k drafts / an EAGLE-2 tree of N nodes (fixed budgets);
- treespec auto: ``builder="auto"``: each step the cost model picks the tree for the CURRENT
  batch size (``auto_builder(..., batch=B)``) from this machine's calibration;
- treespec lookup adaptive: prompt lookup (repeated suffixes of ``--lookup-min-ngram`` tokens
  or more) drafting an adaptive chain of up to --chain-k tokens (``min_confidence``): requests
  whose text does not repeat draft nothing that step. The cost model does not predict it.
Per group, HF runs first and the treespec rows follow in an order rotated by one row per group
(an A/A probe on a shared host drew several % between two identical runs back to back).
Total tokens/s = useful new tokens of the group (up to each request's EOS) / wall seconds
(prefill included). Beside each treespec row: the measured gain over HF batched generate and
the cost model's predicted speculative gain at that B (calibrated machine, the drafter's
measured acceptance): for "auto" the chosen tree's, for a chain its own τ and step time, for a
tree of N nodes the best N-node tree's.

    python benchmarks/batch.py --prompts 16 --max-new-tokens 128 --threads 1

Writes benchmarks/results/batch.{json,md,png} after every group; ``--resume`` continues a cut
short run from its JSON; ``--render`` rewrites the Markdown and the plot from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

import treespec
from harness import RESULTS, figure, machine_info, machine_line, save_figure, write_results
from treespec.cli.main import ensure_calibration
from treespec.planning import Calibration, CalibratedCost, expected_tokens_positional, plan_curve
from treespec.planning.planner import AUTO_MIN_GAIN, auto_min_gain
from treespec.data import chat_prompt, mtbench_questions
from treespec.builders import ChainBuilder, DynamicTreeBuilder

DRAFTER = "eagle3"


def hf_batched(model, prompts: list[torch.Tensor], max_new: int, eos: list[int], temperature: float,
               seed: int) -> tuple[list[list[int]], float]:
    """Left-padded HF ``generate`` of a group: (useful new tokens per request, seconds)."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), eos[0], dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - p.numel():], mask[b, width - p.numel():] = p, 1
    sample = temperature > 0
    torch.manual_seed(seed)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=sample, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=eos[0], repetition_penalty=None,
                             temperature=temperature if sample else None, top_p=None,
                             top_k=0 if sample else None)
        dt = time.perf_counter() - t0
    news = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        news.append(row[:end])
    return news, dt


def treespec_group(target, drafter, builder, prompts, max_new, temperature, seed, calibration):
    """One server run of a group: (new tokens per request, seconds, stats dict)."""
    t0 = time.perf_counter()
    server = treespec.SpeculativeServer(target, drafter, builder, calibration=calibration)
    cfg = treespec.SamplingConfig(temperature)
    rids = [server.add_request(p, cfg, max_new, seed + b) for b, p in enumerate(prompts)]
    server.run()
    dt = time.perf_counter() - t0
    s = server.stats
    auto = {b: repr(x) for (b, _), x in server._auto.items()}
    stats = {"steps": s.steps, "request_steps": s.request_steps, "nodes": s.tree_nodes, "drafter_calls": s.drafter_calls,
             **{k: getattr(s, k) for k in ("prefill_time", "draft_time", "verify_time", "accept_time",
                                            "other_time")}, "auto": auto}
    return [list(server.finished[r].tokens) for r in rids], dt, stats


def predicted(cal: Calibration, kind: str, acceptance, row: str, b: int, context: int,
              min_gain: float = AUTO_MIN_GAIN) -> dict | None:
    """The cost model's prediction for a row at batch b: its speculative gain over plain decoding,
    τ per request and the verify and draft seconds per step (so each part can be checked)."""
    cost = CalibratedCost(cal, kind)
    curve = plan_curve(cost, acceptance, b, context, max_drafts=64)
    plain = b / cost.verify_s(1, b, context)
    if row == "treespec auto":   # as auto_budget picks it: plain decoding below min_gain
        c = max(curve, key=lambda c: (c.tokens_per_s, -c.drafts))
        c = c if c.speedup >= min_gain else curve[0]
    elif row.startswith("treespec chain"):
        k = int(row.rsplit(" ", 1)[1])
        tau = expected_tokens_positional([-1] + list(range(k)), acceptance)
        verify, draft = cost.verify_s(k + 1, b, context), cost.draft_s([1] * k, b, context)
        return {"gain": b * tau / (verify + draft) / plain, "tau": tau, "verify_s": verify, "draft_s": draft}
    elif row.startswith("treespec tree"):
        n = int(row.rsplit(" ", 1)[1])
        c = next((c for c in curve if c.budget == n), None)
        if c is None:
            return None
    elif row == "treespec none":
        c = curve[0]
    else:
        return None
    return {"gain": c.speedup, "tau": c.tau, "verify_s": c.verify_s, "draft_s": c.draft_s}


def all_predictions(cal: Calibration, rows, temps, sizes, context: int, min_gain: float = AUTO_MIN_GAIN) -> dict:
    """predictions[T][row][B] for the treespec rows, acceptance measured at each T; auto's
    with the minimum gain it ran with."""
    kind = DRAFTER if DRAFTER in cal.drafters else "eagle"
    return {t: {r: {str(b): predicted(cal, kind, cal.acceptance_for(DRAFTER, float(t)) or 0.6, r, b, context,
                                      min_gain)
                    for b in sizes}
                for r in rows if r.startswith("treespec")} for t in temps}


def rows_of(args):
    rows = ["HF generate (batched)", "treespec none", f"treespec chain {args.chain_k}"]
    rows += [f"treespec tree {n}" for n in args.budgets] + ["treespec auto", "treespec lookup adaptive"]
    if args.rows:   # HF batched generate is always kept: every gain is measured against it
        wanted = {w.strip() for w in args.rows.split(",")}
        unknown = wanted - {r.removeprefix("treespec ") for r in rows}
        if unknown:
            raise SystemExit(f"--rows: unknown rows {sorted(unknown)}; choose from "
                             f"{[r.removeprefix('treespec ') for r in rows[1:]]}")
        rows = rows[:1] + [r for r in rows[1:] if r.removeprefix("treespec ") in wanted]
    return rows


def builder_of(row: str, args):
    if row == "treespec none":
        return DynamicTreeBuilder(budget=1, depth=1, top_k=1)
    if row.startswith("treespec chain"):
        return ChainBuilder(budget=args.chain_k + 1)
    if row == "treespec lookup adaptive":
        return ChainBuilder(budget=args.chain_k + 1, min_confidence=args.min_confidence)
    if row.startswith("treespec tree"):
        return DynamicTreeBuilder(budget=int(row.rsplit(" ", 1)[1]), depth=5, top_k=4)
    return "auto"


def summarize(data: dict) -> dict:
    """Per temperature and batch size: per row total tokens/s (all groups), gains, predictions."""
    out = {}
    for temp, by_b in data["rows"].items():
        out[temp] = {}
        for b, by_row in by_b.items():
            base = by_row.get("HF generate (batched)", [])
            if not base:
                continue
            base_rate = sum(r["tokens"] for r in base) / sum(r["time"] for r in base)
            table = {}
            for name, rs in by_row.items():
                if not rs:
                    continue
                rate = sum(r["tokens"] for r in rs) / sum(r["time"] for r in rs)
                e = {"tokens_per_s": rate, "gain": rate / base_rate, "groups": len(rs)}
                if "steps" in rs[0]:
                    steps = sum(r["steps"] for r in rs)
                    # request-steps: a request that finished early no longer counts
                    req_steps = sum(r.get("request_steps", r["steps"] * int(b)) for r in rs)
                    e["tau_per_request"] = sum(r["tokens"] for r in rs) / req_steps
                    e["nodes_per_request"] = sum(r["nodes"] for r in rs) / req_steps
                    e.update({f"{k.removesuffix('_time')}_ms": 1e3 * sum(r[k] for r in rs) / steps
                              for k in ("draft_time", "verify_time", "accept_time", "other_time")})
                    none = by_row.get("treespec none")
                    if none:
                        e["gain_vs_none"] = rate / (sum(r["tokens"] for r in none) / sum(r["time"] for r in none))
                        # paired by group: the two rows ran back to back on the same prompts
                        e["vs_none_by_group"] = [(r["tokens"] / r["time"]) / (n["tokens"] / n["time"])
                                                 for r, n in zip(rs, none)]
                    pred = data["predicted"].get(temp, {}).get(name, {}).get(b)
                    if isinstance(pred, dict):
                        e["predicted_gain"] = pred["gain"]
                        e["predicted_tau"] = pred["tau"]
                        e["predicted_step_ms"] = 1e3 * (pred["verify_s"] + pred["draft_s"])
                        e["step_ms"] = e["draft_ms"] + e["verify_ms"]
                    else:
                        e["predicted_gain"] = pred
                    if rs[0].get("auto"):
                        e["auto"] = sorted({v for r in rs for v in r["auto"].values()})
                if "same_as_hf" in rs[0]:
                    e["same_as_hf"] = sum(r["same_as_hf"] for r in rs)
                    e["requests"] = sum(r["requests"] for r in rs)
                table[name] = e
            out[temp][b] = table
    return out


def auto_threshold(data: dict) -> str:
    """What auto needed before it speculated in this run (runs before it was recorded: nothing)."""
    if "auto_min_gain" not in data:
        return ""
    noise = data.get("timing_noise")
    why = (f"the calibration's timing spread is {noise:.1%} per pass" if noise is not None
           else "no timing spread recorded")
    return f"; auto speculates where it predicts at least {data['auto_min_gain']:.2f}x ({why})"


def write(data: dict, out: Path) -> str:
    data["summary"] = summarize(data)
    a = data["args"]
    lines = [
        f"# Batch benchmark: MT-bench first turns x {a['max_new_tokens']} new tokens, B = {a['batch_sizes']}",
        "",
        machine_line(data["machine"]) + f" Wall time {data['wall_s'] / 60:.1f} min; load average "
        f"{min(data['load'], default=0):.1f}-{max(data['load'], default=0):.1f}. {data.get('note', '')}",
        "",
        f"Target: {data['paths']['packed']} (treespec rows), {data['paths']['stock']} (HF rows); drafter "
        f"{DRAFTER} (batched: one head forward per drafting round for all requests). Calibration: "
        f"{data['paths']['calibration']}" + auto_threshold(data) + ".",
        "",
        "tokens/s = useful new tokens of all requests / wall seconds (prefill included), summed over the "
        "groups of B prompts. *gain* = over HF batched `generate` at the same B; *vs none* = over the "
        "treespec server without speculation (the loop's own overhead cancels); *vs none by group* = "
        "the same ratio per group of B prompts, the two rows having run back to back on them: median "
        "(lowest-highest), the run's noise in one view; *predicted* = the cost "
        "model's speculative gain at that B (over plain decoding; compare with *vs none*; batched "
        "verify passes from the calibration's measured batch curves, acceptance measured at the row's "
        "temperature); *pred / meas* = predicted / vs none. τ/request = tokens per request per step "
        "the request was live; nodes = tree nodes per request per step; ms = per step (all requests). "
        "The prediction by parts: *τ pred* against τ/request, *step ms pred* (verify + draft) against "
        "the measured draft + verify ms.",
    ]
    for temp, by_b in data["summary"].items():
        lines += ["", f"## T = {temp}", "",
                  "| B | row | tokens/s | gain | vs none | vs none by group | predicted | pred / meas | τ/request | "
                  "τ pred | nodes | draft / verify / other ms | step ms pred | = HF |",
                  "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
        for b, table in by_b.items():
            for name, e in table.items():
                pred = e.get("predicted_gain")
                split = (f"{e['draft_ms']:.1f} / {e['verify_ms']:.1f} / {e['accept_ms'] + e['other_ms']:.1f}"
                         if "draft_ms" in e else "-")
                same = f"{e['same_as_hf']}/{e['requests']}" if "same_as_hf" in e else "-"
                vs_none = f"{e['gain_vs_none']:.2f}x" if "gain_vs_none" in e else "-"
                groups = e.get("vs_none_by_group") if name != "treespec none" else None
                by_group = (f"{statistics.median(groups):.2f} ({min(groups):.2f}-{max(groups):.2f})"
                            if groups else "-")
                ratio = f"{pred / e['gain_vs_none']:.2f}" if pred and e.get("gain_vs_none") else "-"
                tau_pred = f"{e['predicted_tau']:.2f}" if "predicted_tau" in e else "-"
                tau = (f"{e['tau_per_request']:.2f} | {tau_pred} | {e['nodes_per_request']:.1f}"
                       if "tau_per_request" in e else "- | - | -")
                step_pred = f"{e['predicted_step_ms']:.0f}" if "predicted_step_ms" in e else "-"
                lines.append(f"| {b} | {name} | {e['tokens_per_s']:.1f} | {e['gain']:.2f}x | {vs_none} | {by_group} | "
                             f"{f'{pred:.2f}x' if pred else '-'} | {ratio} | {tau} | {split} | {step_pred} | {same} |")
        autos = {b: t["treespec auto"].get("auto") for b, t in by_b.items() if "treespec auto" in t}
        if autos:
            lines += ["", "auto's trees: " + "; ".join(f"B = {b}: {', '.join(v or [])}" for b, v in autos.items())]
    md = "\n".join(lines) + "\n"
    write_results(out, data, md)
    plot(data, out.with_suffix(".png"))
    return md


def plot(data: dict, path: Path) -> None:
    temps = list(data["summary"])
    if not temps:
        return
    fig, axes = figure(2, len(temps), size=(5.5 * len(temps), 8))
    for j, temp in enumerate(temps):
        by_b = data["summary"][temp]
        bs = sorted(by_b, key=int)
        names = sorted({n for t in by_b.values() for n in t})
        for name in names:
            xs = [int(b) for b in bs if name in by_b[b]]
            axes[0][j].plot(xs, [by_b[str(b)][name]["tokens_per_s"] for b in xs], "o-", label=name)
            if name.startswith("treespec") and name != "treespec none":
                line, = axes[1][j].plot(xs, [by_b[str(b)][name]["gain"] for b in xs], "o-", label=f"{name} measured")
                pred = [(b, by_b[str(b)][name].get("predicted_gain")) for b in xs]
                pred = [(b, p) for b, p in pred if p]
                if pred:
                    axes[1][j].plot(*zip(*pred), "x--", color=line.get_color(), label=f"{name} predicted")
        for ax, ylabel in ((axes[0][j], "total tokens/s"), (axes[1][j], "gain over HF batched generate")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size B")
            ax.set_ylabel(ylabel)
            ax.set_title(f"T = {temp}")
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        axes[1][j].axhline(1.0, color="k", lw=0.8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--chain-k", type=int, default=3)
    ap.add_argument("--budgets", default="8,16", help="fixed tree budgets (nodes incl. the root)")
    ap.add_argument("--lookup-min-ngram", type=int, default=3,
                    help="lookup adaptive: the shortest repeated suffix that may propose a draft")
    ap.add_argument("--min-confidence", type=float, default=0.5,
                    help="lookup adaptive: the chain stops where its draft confidence falls below this")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="", help="only these treespec rows, e.g. 'none,auto' (default: all)")
    ap.add_argument("--max-groups", type=int, default=0,
                    help="at most this many groups per B (0: all); B = 1 then times fewer prompts than B = 16")
    ap.add_argument("--note", default="")
    ap.add_argument("--resume", action="store_true", help="continue the run saved at --out")
    ap.add_argument("--out", default=str(RESULTS / "batch"))
    ap.add_argument("--render", action="store_true", help="only rewrite the Markdown and plot from the JSON")
    ap.add_argument("--repredict", action="store_true",
                    help="with --render: recompute the predictions from the run's calibration file")
    args = ap.parse_args()
    out = Path(args.out)
    if args.render:
        data = json.loads(out.with_suffix(".json").read_text())
        if args.repredict:   # the calibration file may have been measured after the run started
            cal = Calibration.load(data["paths"]["calibration"])
            temps, sizes = list(data["rows"]), [int(b) for b in next(iter(data["rows"].values()))]
            rows = list(next(iter(next(iter(data["rows"].values())).values())))
            if "context" not in data:   # runs before it was recorded: the same prompts' mean length
                tok = treespec.load_target("smollm2-135m").tokenizer
                qs = mtbench_questions()[: data["args"]["prompts"]]
                data["context"] = (int(statistics.mean(len(chat_prompt(tok, q.turns[0])) for q in qs))
                                   + data["args"]["max_new_tokens"] // 2)
            data["predicted"] = all_predictions(cal, rows, temps, sizes, data["context"],
                                                data.get("auto_min_gain", AUTO_MIN_GAIN))
        print(write(data, out))
        return
    args.budgets = [int(x) for x in args.budgets.split(",")]
    torch.set_num_threads(args.threads)
    temps = [t.strip() for t in args.temperatures.split(",")]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    stock = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=False)
    packed = treespec.load_target("smollm2-135m", dtype=torch.float32, pack=True)
    cal_path = ensure_calibration(packed, DRAFTER, batches=[b for b in sizes if b > 1])
    cal = Calibration.load(cal_path)
    drafter = treespec.load_drafter(DRAFTER, packed)
    lookup = treespec.load_drafter("lookup", packed, max_ngram=max(3, args.lookup_min_ngram),
                                   min_ngram=args.lookup_min_ngram)
    rows = rows_of(args)

    def drafter_of(row: str):
        return lookup if row == "treespec lookup adaptive" else drafter
    tok = stock.tokenizer
    questions = mtbench_questions()[: args.prompts]
    prompts = [torch.tensor(chat_prompt(tok, q.turns[0])) for q in questions]
    context = int(statistics.mean(p.numel() for p in prompts)) + args.max_new_tokens // 2
    if args.resume and out.with_suffix(".json").exists():
        data = json.loads(out.with_suffix(".json").read_text())
    else:
        data = {"machine": machine_info(), "args": vars(args), "wall_s": 0.0, "load": [], "note": args.note,
                "paths": {"stock": stock.speed_path, "packed": packed.speed_path, "calibration": str(cal_path)},
                "rows": {t: {str(b): {r: [] for r in rows} for b in sizes} for t in temps}, "predicted": {}}
    data["context"], data["auto_min_gain"], data["timing_noise"] = context, auto_min_gain(cal), cal.timing_noise
    data["predicted"] = all_predictions(cal, rows, temps, sizes, context, data["auto_min_gain"])
    eos = list(stock.eos_token_ids)
    warm = [torch.tensor(chat_prompt(tok, "Hello!"))] * 2
    hf_batched(stock.model, warm, 4, eos, 0.0, 0)
    for r in rows[1:]:
        treespec_group(packed, drafter_of(r), builder_of(r, args), warm, 4, 0.0, 0, cal)
    for b in sizes:
        n_groups = max(1, len(prompts) // b)
        if args.max_groups:
            n_groups = min(n_groups, args.max_groups)
        groups = [prompts[g * b:(g + 1) * b] for g in range(n_groups)]
        groups = [g if len(g) == b else (g * b)[:b] for g in groups]      # fewer prompts than B: repeat
        for temp in temps:
            cells = data["rows"][temp][str(b)]
            for gi in range(min(len(v) for v in cells.values()), len(groups)):
                t_start, seed = time.time(), 1000 + gi
                group = groups[gi]
                hf_out, dt = hf_batched(stock.model, group, args.max_new_tokens, eos, float(temp), seed)
                cells[rows[0]].append({"tokens": sum(map(len, hf_out)), "time": dt})
                spec = rows[1:]   # rotated per group: no row always runs right after another
                for r in spec[gi % len(spec):] + spec[:gi % len(spec)]:
                    news, dt, stats = treespec_group(packed, drafter_of(r), builder_of(r, args), group,
                                                     args.max_new_tokens, float(temp), seed, cal)
                    rec = {"tokens": sum(map(len, news)), "time": dt, **stats}
                    if temp == "0":
                        rec["same_as_hf"] = sum(x == y for x, y in zip(news, hf_out))
                        rec["requests"] = len(news)
                    cells[r].append(rec)
                data["wall_s"] += time.time() - t_start
                data["load"].append(os.getloadavg()[0])
                write(data, out)
                print(f"T={temp} B={b} group {gi + 1}/{len(groups)} ({time.time() - t_start:.0f} s)", flush=True)
    print(write(data, out))


if __name__ == "__main__":
    main()
