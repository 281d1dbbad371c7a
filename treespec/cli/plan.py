"""`treespec plan` and `treespec calibrate`.

    python -m treespec.cli.plan plan --model llama-3-8b --hardware h100,mi300x,h200,a100,local \\
        --batch 1,8,64 --context 2048
    python -m treespec.cli.plan calibrate --model smollm2-135m

The main ``treespec`` CLI calls ``register(subparsers)``; ``main()`` runs these two alone.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from treespec.planning.tau import DEFAULT_BETA, acceptance_vector
from treespec.data import MissingPackageError
from treespec.planning.calibration import CalibratedCost, Calibration, default_calibration_path
from treespec.calibrate.passes import DEFAULT_NS, calibrate
from treespec.fastpath.packing import KERNELS
from treespec.planning.hardware import get_hardware
from treespec.planning.anchors import matching_anchors
from treespec.planning.fitted import FittedCost, fitted_constants, predict_anchor
from treespec.planning.planner import RooflineCost, StepCost, TreeChoice, batch_limits, best_choice, plan_curve
from treespec.planning.roofline import DRAFTER_KINDS, DrafterSpec
from treespec.planning.shapes import MODEL_PRESETS, ModelShape, model_shape

__all__ = ["main", "register"]

# Errors a bad command line can raise; printed as one line, exit status 2.
_USER_ERRORS = (KeyError, ValueError, FileNotFoundError, MissingPackageError)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _acceptance(text: str) -> float | tuple[float, ...]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected β or comma-separated probabilities, got {text!r}") from None
    try:
        vector = acceptance_vector(values[0] if len(values) == 1 else values)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return values[0] if len(values) == 1 else vector


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` and ``calibrate`` subcommands (each sets ``func``)."""
    plan = subparsers.add_parser("plan", help="best tree budget/depth per hardware and batch (cost model)",
                                 description=_plan.__doc__)
    plan.add_argument("--model", default="smollm2-135m", help=f"target preset: {', '.join(MODEL_PRESETS)}")
    plan.add_argument("--hardware", default="h100,mi300x,h200,a100",
                      help="comma-separated presets (h100, mi300x, h200, a100, l40) and/or 'local'")
    plan.add_argument("--batch", type=_ints, default=[1], help="comma-separated batch sizes (default 1)")
    plan.add_argument("--context", type=int, default=2048, help="cached tokens per sequence (default 2048)")
    plan.add_argument("--drafter", default="eagle", choices=DRAFTER_KINDS, help="drafter kind (default eagle)")
    plan.add_argument("--draft-model", default=None, help="preset shape of a 'model' drafter (e.g. llama-68m)")
    plan.add_argument("--draft-layers", type=int, default=None,
                      help="eagle: decoder layers (1); early_exit: first k target layers (4)")
    plan.add_argument("--draft-vocab", type=int, default=None, help="drafter LM-head rows (default: full vocab)")
    plan.add_argument("--acceptance", type=_acceptance, default=None,
                      help="β, or a positional acceptance vector 'p1,p2,...' (default per drafter: "
                           + ", ".join(f"{k} {v}" for k, v in DEFAULT_BETA.items()) + ")")
    plan.add_argument("--max-budget", type=int, default=129,
                      help="largest tree searched, in nodes incl. the root (default 129)")
    plan.add_argument("--max-depth", type=int, default=16, help="deepest tree searched (default 16)")
    plan.add_argument("--calibration", type=Path, default=None,
                      help="calibration JSON for 'local' (default: the model's default calibration path)")
    plan.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of tokens/s vs budget to PATH (default: no plot)")
    plan.add_argument("--cost", choices=("fitted", "roofline"), default="fitted",
                      help="presets' step cost: fitted (default; the roofline plus fixed per-pass, per-level and "
                           "tree-attention terms fitted to published GPU runs, treespec.planning.fitted) or the "
                           "bare roofline")
    plan.add_argument("--limits", action="store_true",
                      help="also print the batch sizes where verification turns compute-bound and the "
                           "best tree shrinks to a chain / to no speculation")
    plan.set_defaults(func=_plan)

    cal = subparsers.add_parser("calibrate", help="measure this machine's verify/draft pass times, save JSON",
                                description=_calibrate.__doc__)
    cal.add_argument("--model", default="smollm2-135m", help=f"target preset: {', '.join(MODEL_PRESETS)}")
    cal.add_argument("--weights", choices=("random", "pretrained"), default="random",
                     help="random: the preset's shape with random fp32 weights (timing depends only on "
                          "shapes and dtype); pretrained: treespec.targets.loader.load_target(model)")
    cal.add_argument("--context", type=int, default=128, help="cached prefix tokens during the measurement")
    cal.add_argument("--max-n", type=int, default=128, help="largest tokens per pass measured (default 128)")
    cal.add_argument("--early-exit-layers", type=int, default=4, help="layers of the early-exit drafter")
    cal.add_argument("--warmup", type=int, default=2, help="untimed calls per point")
    cal.add_argument("--reps", type=int, default=7, help="timed calls per point (median kept)")
    cal.add_argument("--threads", type=int, default=None,
                     help="torch threads while measuring (default: torch's); use what the engine will use")
    cal.add_argument("--clock", choices=("wall", "thread"), default="wall",
                     help="wall: elapsed time (what the engine sees); thread: this thread's CPU time, "
                          "robust on a shared machine (needs --threads 1)")
    cal.add_argument("--drafter", default=None,
                     help="comma-separated registered drafters to measure for real (pass times by width and "
                          "positional acceptance on the 8 last MT-bench prompts), each with its options if it has "
                          "any, as name[key=value,...] (e.g. qwen2.5-coder-0.5b[weights=int4]); implies --weights "
                          "pretrained. builder='auto' then uses them")
    add_target_args(cal)
    add_compile_arg(cal)
    cal.add_argument("--batch-sizes", type=_ints, default=[],
                     help="also measure the batched verify pass at these batch sizes (e.g. 2,4,8,16) for "
                          "the server's builder='auto'")
    cal.add_argument("--out", type=Path, default=None, help="output JSON (default: the model's default path)")
    cal.set_defaults(func=_calibrate)


def add_target_args(p: argparse.ArgumentParser) -> None:
    """--dtype, --no-pack and --device, the same for every command that loads a target (so
    `calibrate` measures by default exactly what `generate` and `demo` run; each dtype and
    linear path has its own calibration file)."""
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="target weights; auto (default): bfloat16 where the CPU/GPU has native bf16 matrix "
                        "units, else float32. bfloat16 is its own target (greedy output may differ from "
                        "fp32 at near-ties); float32 is the exact reference (float16 is API-only)")
    p.add_argument("--no-pack", action="store_true",
                   help="keep HF's stock linear layers (default: weights packed once for the CPU's GEMM)")
    p.add_argument("--kernel", default="auto", choices=("auto",) + KERNELS,
                   help="the packed linear layers' kernel; auto (default; generate: the target's preset for "
                        "this CPU kind, treespec.cli.presets): picked from the CPU. amx: exact "
                        "integer blocks on the AMX tile unit with each linear input rounded to bf16 (its own "
                        "target, like bfloat16; CPUs with AMX-BF16). x8: exact integer blocks times each linear "
                        "input rounded to 8-bit integers per block of 32, as llama.cpp multiplies (its own "
                        "target; CPUs with AVX2)")
    p.add_argument("--device", default="cpu", help="where the target (and drafter) run: cpu, cuda, cuda:N")


def add_compile_arg(p: argparse.ArgumentParser) -> None:
    """--compile: the target's verify passes as compiled graphs (``Target.compiled``)."""
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="run the target's passes as torch.compile'd fixed-shape graphs over a preallocated cache "
                        "(node counts padded to 1, 2, 4, ..., 64; serve: the batch too, 1, 2, 4, 8 requests), and "
                        "the drafter's calls likewise in generate / bench (a model's 1, 2, 4 rows, a feature head's "
                        "1, 2, 4, 8); "
                        "each graph compiles once, about three minutes with "
                        "Inductor's C++ wrapper on a CPU, then comes from Inductor's disk cache)")


def target_pack(args: argparse.Namespace) -> bool | str:
    """``load_target``'s ``pack`` from --no-pack and --kernel."""
    if args.kernel is None:   # generate: filled from the target's preset (treespec.cli.presets) before loading
        raise ValueError("--kernel was left for the preset to fill: call apply_preset(args) first")
    if args.no_pack and args.kernel != "auto":
        raise ValueError(f"--no-pack keeps the stock linear layers; it cannot run --kernel {args.kernel}")
    return False if args.no_pack else (True if args.kernel == "auto" else args.kernel)


def _drafter(args: argparse.Namespace) -> DrafterSpec:
    if args.drafter == "model":
        if args.draft_model is None:
            raise ValueError("--drafter model needs --draft-model <preset> (e.g. llama-68m)")
        return DrafterSpec("model", shape=model_shape(args.draft_model), draft_vocab=args.draft_vocab)
    default_layers = 4 if args.drafter == "early_exit" else 1
    return DrafterSpec(args.drafter, layers=args.draft_layers or default_layers, draft_vocab=args.draft_vocab)


def _cost(name: str, target: ModelShape, spec: DrafterSpec, args: argparse.Namespace) -> StepCost:
    if name.strip().lower() == "local":
        path = args.calibration or default_calibration_path(args.model)
        return CalibratedCost.for_model(Calibration.load(path), spec.kind, target)
    if args.cost == "roofline":
        return RooflineCost(target, spec, get_hardware(name))
    return FittedCost(target, spec, get_hardware(name), fitted_constants(name))


def _print_anchors(model: str, names: Sequence[str], batches: Sequence[int]) -> None:
    """Published measurements of this model on these presets and batches, each beside the fitted
    model's prediction at the row's own τ and tree (treespec.planning.anchors)."""
    rows = [(a, predict_anchor(a) if a.tau is not None else None)
            for name in names for batch in batches for a in matching_anchors(model, name, batch)]
    if not rows:
        return
    print("\npublished (treespec.planning.anchors) beside the fitted model at the row's own τ and tree:")
    for a, predicted in rows:
        tree = "chain" if a.tree.is_chain else "tree"
        tau = "τ -" if a.tau is None else f"τ {a.tau:.2f}"
        guess = "no τ published" if predicted is None else f"predicted {predicted:.2f}x"
        print(f"  {a.key:<32} {a.gpu:<7} b{a.batch:<3} {a.engine}, {a.drafter}, {tree} "
              f"{a.tree.levels}/{a.tree.topk}/{a.tree.verify_tokens}, {tau}: published {a.speedup:.2f}x, {guess}")
        print(f"  {'':<32} source: {a.source}")


def _fmt_batch(value: int | None) -> str:
    return "-" if value is None else str(value)


def _plan(args: argparse.Namespace) -> int:
    """Predict the best draft tree (budget, depth), τ, tokens/s and speedup for a target on
    each hardware and batch size, from the fitted GPU cost model or the roofline (presets, --cost)
    or this machine's calibration ('local'), beside published GPU measurements of the same model, hardware and batch; plot
    tokens/s against the tree budget when --plot names a file."""
    target = model_shape(args.model)
    spec = _drafter(args)
    acceptance = args.acceptance if args.acceptance is not None else DEFAULT_BETA[spec.kind]
    if args.max_budget < 1:
        raise SystemExit(f"--max-budget counts tree nodes incl. the root and must be >= 1, got {args.max_budget}")
    names = [h.strip() for h in args.hardware.split(",") if h.strip()]
    costs = {name: _cost(name, target, spec, args) for name in names}
    print(f"target {target.name} ({target.total_params / 1e9:.3g} B params, {target.bytes_per_weight:g} B/weight), "
          f"drafter {spec.kind}, acceptance {acceptance}, context {args.context}")
    print("tokens/s: predicted decoding rate of the whole batch, prefill excluded")
    header = f"{'hardware':<9} {'batch':>5} {'budget':>6} {'depth':>5} {'tau':>6} {'tokens/s':>10} " \
             f"{'speedup':>7} {'verify ms':>9} {'draft ms':>8} {'loop ms':>7}"
    print(header)
    print("-" * len(header))
    curves: dict[int, dict[str, list[TreeChoice]]] = {}
    for name, cost in costs.items():
        for batch in args.batch:
            curve = plan_curve(cost, acceptance, batch, args.context, args.max_budget - 1, args.max_depth)
            curves.setdefault(batch, {})[name] = curve
            c = best_choice(curve)
            print(f"{name:<9} {batch:>5} {c.budget:>6} {c.depth:>5} {c.tau:>6.2f} {c.tokens_per_s:>10.1f} "
                  f"{c.speedup:>7.2f} {c.verify_s * 1e3:>9.3f} {c.draft_s * 1e3:>8.3f} {c.loop_s * 1e3:>7.3f}")
    if args.limits:
        print("\nbatch where: decode compute-bound | verify of the batch-1 tree compute-bound | "
              "best is a chain | best is no speculation")
        for name in names:
            hardware = Calibration.load(args.calibration or default_calibration_path(args.model)) \
                if name.lower() == "local" else get_hardware(name)
            lim = batch_limits(target, spec, hardware, args.context, acceptance,
                               max_drafts=args.max_budget - 1, max_depth=args.max_depth)
            print(f"{name:<9} {_fmt_batch(lim.decode_compute_bound):>6} | {_fmt_batch(lim.verify_compute_bound):>6} | "
                  f"{_fmt_batch(lim.chain):>6} | {_fmt_batch(lim.no_speculation):>6}")
    if args.cost == "fitted":
        _print_anchors(args.model, [n for n in names if n.lower() != "local"], args.batch)
    plot = args.plot
    if plot is not None and plot.lower() != "none":
        from treespec.planning.plot import plot_curves

        path = plot_curves(curves, plot, f"{target.name}, {spec.kind} drafter, context {args.context}")
        print(f"\nplot: {path}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """Measure this machine's target verify pass (n = 1 … max-n tokens) and two drafters'
    passes (early-exit and EAGLE-like one layer), fit monotone piecewise-linear curves and save
    them as JSON for `plan --hardware local` and the engine's budget="auto"."""
    import torch

    from treespec.fastpath.device import resolve_device

    device = resolve_device(args.device)
    from treespec.drafters.base import drafter_names

    drafters = drafter_names(args.drafter or "")
    target = None
    if drafters or args.weights == "pretrained":
        from treespec.targets.loader import load_target

        target = load_target(args.model, dtype=args.dtype, device=device, pack=target_pack(args))
        print(f"[target: {target.speed_path}]", flush=True)
        model = target.model
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        if args.model not in MODEL_PRESETS:
            raise KeyError(f"unknown model {args.model!r}; known models: {sorted(MODEL_PRESETS)}")
        from treespec.fastpath.packing import pack_linears, resolve_dtype

        dtype, _ = resolve_dtype(args.dtype, device)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**MODEL_PRESETS[args.model]), dtype=dtype)
        model.to(device).eval().requires_grad_(False)
        pack = target_pack(args)
        pack_linears(model, enabled=pack is not False, kernel=pack if isinstance(pack, str) else None)
    if args.clock == "thread" and args.threads != 1:
        raise ValueError("--clock thread counts one thread's CPU time: use it with --threads 1")
    ns = tuple(n for n in DEFAULT_NS if n <= args.max_n)
    if not ns:
        raise ValueError(f"--max-n must be >= 1, got {args.max_n}")
    passes = None
    if args.compile:   # the target curve times the compiled graphs (its own file: ...-compiled.json)
        from treespec.runtime.compiled import CompiledPasses, compile_target

        if target is not None:
            target = compile_target(target)
            passes = target.passes
        else:
            passes = CompiledPasses(model)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    result = calibrate(model, args.model, ns=ns, context=args.context, early_exit_layers=args.early_exit_layers,
                       n_warmup=args.warmup, n_rep=args.reps, threads=args.threads, clock=clock,
                       progress=lambda m: print(m, flush=True), passes=passes)
    if args.batch_sizes:
        from treespec.calibrate.passes import calibrate_batches

        previous = torch.get_num_threads()
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        try:
            result = calibrate_batches(result, model, args.batch_sizes, n_rep=max(1, args.reps - 2),
                                       n_warmup=min(1, args.warmup), clock=clock,
                                       progress=lambda m: print(m, flush=True))
        finally:
            torch.set_num_threads(previous)
    if drafters:
        from treespec.calibrate.drafters import (  # run the engine
            calibrate_drafter, calibrate_drafter_batches, calibration_prompts,
        )

        held_out = calibration_prompts()  # benchmarks use the first questions, these are the last
        previous = torch.get_num_threads()
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        try:
            for name in drafters:
                result = calibrate_drafter(result, name, target, held_out, clock=clock,
                                           progress=lambda m: print(m, flush=True))
                if args.batch_sizes:   # its batched drafting call too
                    result = calibrate_drafter_batches(result, name, target, args.batch_sizes, clock=clock,
                                                       progress=lambda m: print(m, flush=True))
        finally:
            torch.set_num_threads(previous)
    from treespec.planning.calibration import model_calibration_path

    path = result.save(args.out or model_calibration_path(args.model, model, compiled=args.compile,
                                                          threads=result.threads or None))
    print(f"saved {path}")
    from treespec.planning.planner import auto_threshold_text

    print(f"builder='auto' {auto_threshold_text(result)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treespec", description="treespec cost model")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    return run_command(parser.parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """``args.func(args)``; a user error (``_USER_ERRORS``) prints one ``error: ...`` line and
    returns 2 instead of a traceback. Shared by every treespec subcommand."""
    try:
        return int(args.func(args) or 0)
    except _USER_ERRORS as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
