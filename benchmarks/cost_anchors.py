"""Fit the cost model's GPU terms to published measurements (treespec.planning.anchors).

For each (GPU, engine kind) with held rows (a published τ and no ``not_held`` reason) of which
one publishes plain tokens/s at batch 1 (the other groups check constants carried from a fit):
    1. η (achievable bandwidth fraction): from the rows' plain tokens/s at batch 1, the η at which
       the roofline's 1-token pass takes 1 / (plain tokens/s); the geometric mean over distinct
       published plain figures.
    2. level_s, verify_s, κ: a grid least-squares on log(predicted / published speedup) over the
       held rows (κ 0…1 by 0.1, level_s 0…1.5 ms by 25 µs, verify_s 0…3 ms by 50 µs).
Then every row's prediction under ``treespec.planning.fitted.FITTED`` (the constants copied from
this fit) against its published speedup, and the roofline's own prediction (no fitted terms).

Nothing here runs a model or needs a GPU; it runs in a second. The machine line is recorded as
every result's is, though the numbers do not depend on it.

Usage:  python benchmarks/cost_anchors.py          # -> results/cost_anchors.{md,json}
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from harness import RESULTS, machine_line, md_table, publish
from treespec.planning.anchors import ANCHOR_TOLERANCE, ANCHORS, Anchor
from treespec.planning.fitted import FITTED, EngineConstants, anchor_cost, fitted_constants, predict_anchor
from treespec.planning.roofline import t_target

KAPPAS = np.round(np.arange(0.0, 1.0001, 0.1), 2)
LEVEL_S = np.round(np.arange(0.0, 1.5e-3 + 1e-9, 25e-6), 7)
VERIFY_S = np.round(np.arange(0.0, 3.0e-3 + 1e-9, 50e-6), 7)


def held(anchor: Anchor) -> bool:
    return anchor.tau is not None and anchor.not_held is None


def fit_efficiency(rows: list[Anchor]) -> float:
    """η at which the roofline's 1-token pass matches each distinct published plain tokens/s."""
    etas = {}
    for a in rows:
        if a.plain_tok_s is None or a.batch != 1:
            continue
        cost = anchor_cost(a, EngineConstants(1.0, 0.0, 0.0, 0.0, "probe"))
        hw = cost.effective_hardware
        memory_s = t_target(cost.target, hw, 1, 1, a.context) - hw.overhead_s   # at η = 1
        etas[round(a.plain_tok_s, 2)] = memory_s / (1.0 / a.plain_tok_s - hw.overhead_s)
    if not etas:
        raise ValueError("no held row publishes plain tokens/s at batch 1: η cannot be fitted")
    return float(math.exp(sum(math.log(e) for e in etas.values()) / len(etas)))


def fit_group(rows: list[Anchor], eta: float) -> tuple[EngineConstants, float]:
    """Grid least squares of (κ, level_s, verify_s); returns the constants and the RMS log error."""
    probe = EngineConstants(eta, 0.0, 0.0, 0.0, "probe")
    # speedup = τ · plain / (base + κ · tree + verify_s + levels · level_s): every term but the
    # three unknowns is fixed per row, so the grid is one broadcast.
    tau, plain, base, tree, levels, published = [], [], [], [], [], []
    for a in rows:
        cost = anchor_cost(a, probe)
        hw = cost.effective_hardware
        n = a.tree.verify_tokens
        tau.append(a.tau)
        plain.append(cost.verify_s(1, a.batch, a.context))
        base.append(cost.verify_s(n, a.batch, a.context) + cost.draft_s(a.tree.widths, a.batch, a.context))
        tree.append(a.batch * a.context * cost.target.kv_bytes_per_token * (n - 1) / hw.effective_bandwidth)
        levels.append(len(a.tree.widths))
        published.append(a.speedup)
    k, lv, vf = np.meshgrid(KAPPAS, LEVEL_S, VERIFY_S, indexing="ij")
    residual = np.zeros(k.shape)
    for i in range(len(rows)):
        step = base[i] + k * tree[i] + vf + levels[i] * lv
        residual += np.log(tau[i] * plain[i] / step / published[i]) ** 2
    best = np.unravel_index(int(np.argmin(residual)), residual.shape)
    rms = float(math.sqrt(residual[best] / len(rows)))
    constants = EngineConstants(round(eta, 4), float(LEVEL_S[best[1]]), float(VERIFY_S[best[2]]),
                                float(KAPPAS[best[0]]), f"fitted to {len(rows)} held rows")
    return constants, rms


def roofline_speedup(a: Anchor) -> float | None:
    """The plain roofline's prediction (datasheet η 0.85, no fixed terms) at the row's τ."""
    if a.tau is None:
        return None
    return predict_anchor(a, EngineConstants(0.85, 0.0, 0.0, 0.0, "roofline"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "cost_anchors")
    args = parser.parse_args()
    groups: dict[tuple[str, str], list[Anchor]] = {}
    for a in ANCHORS:
        if held(a):
            groups.setdefault((a.gpu, a.engine_kind), []).append(a)
    fits = {}
    for (gpu, kind), rows in sorted(groups.items()):
        if not any(a.plain_tok_s is not None and a.batch == 1 for a in rows):
            continue   # nothing fixes η here: these rows check constants carried from another fit
        constants, rms = fit_group(rows, fit_efficiency(rows))
        fits[f"{gpu}/{kind}"] = {"rows": len(rows), "bandwidth_efficiency": constants.bandwidth_efficiency,
                                 "level_s": constants.level_s, "verify_s": constants.verify_s,
                                 "tree_kv_reads": constants.tree_kv_reads, "rms_log_error": rms}
    table, data_rows = [], []
    for a in ANCHORS:
        constants = FITTED.get((a.gpu, a.engine_kind)) or fitted_constants(a.gpu, "graph")
        predicted = predict_anchor(a, constants) if a.tau is not None else None
        roof = roofline_speedup(a)
        error = None if predicted is None else predicted / a.speedup - 1
        status = "held" if a.not_held is None and error is not None and abs(error) <= ANCHOR_TOLERANCE \
            else ("not held: " + a.not_held if a.not_held else "OUTSIDE TOLERANCE")
        data_rows.append({"key": a.key, "gpu": a.gpu, "engine": a.engine, "batch": a.batch, "tau": a.tau,
                          "tree": [a.tree.levels, a.tree.topk, a.tree.verify_tokens], "published": a.speedup,
                          "predicted": predicted, "roofline": roof, "error": error, "status": status})
        table.append((a.key, a.gpu, a.batch, "-" if a.tau is None else f"{a.tau:.2f}",
                      f"{a.tree.levels}/{a.tree.topk}/{a.tree.verify_tokens}", f"{a.speedup:.2f}x",
                      "-" if roof is None else f"{roof:.2f}x", "-" if predicted is None else f"{predicted:.2f}x",
                      "-" if error is None else f"{error:+.0%}",
                      "held" if status == "held" else status.split(":")[0]))
    fit_lines = md_table(("GPU / engine", "rows", "η", "level_s µs", "verify_s µs", "κ", "RMS log error"),
                         [(g, f["rows"], f"{f['bandwidth_efficiency']:.4f}", f"{f['level_s'] * 1e6:.0f}",
                           f"{f['verify_s'] * 1e6:.0f}", f"{f['tree_kv_reads']:.1f}", f"{f['rms_log_error']:.3f}")
                          for g, f in fits.items()], "lrrrrrr")
    held_rows = [r for r in data_rows if r["status"] == "held"]
    worst = max(abs(r["error"]) for r in held_rows)
    lines = [
        "# Cost model against published GPU measurements",
        "",
        machine_line() + " (the fit runs no model; the machine does not matter)",
        "",
        "The rows are `treespec.planning.anchors.ANCHORS` (sources and derivations there). Each prediction "
        "takes the row's published τ and its tree (levels / top-k / verify tokens) and predicts the speedup "
        "over plain decoding on the same engine. 'roofline' is the old model (datasheet η 0.85, no fixed "
        "costs, no tree attention); 'fitted' adds the terms of `treespec.planning.fitted` with these constants:",
        "",
        *fit_lines,
        "",
        *md_table(("row", "GPU", "batch", "τ", "tree", "published", "roofline", "fitted", "error", "status"),
                  table, "llrrlrrrrl"),
        "",
        f"**{len(held_rows)} of {len(data_rows)} rows held within {ANCHOR_TOLERANCE:.0%}** "
        f"(worst {worst:.0%}); the others say why in their `not_held` field.",
    ]
    publish(args.out, lines, "python benchmarks/cost_anchors.py",
            {"fits": fits, "rows": data_rows, "tolerance": ANCHOR_TOLERANCE})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
