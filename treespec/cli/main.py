"""Command line: ``treespec generate | demo | plan | calibrate | train | export``."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Sequence

import torch

from treespec.core.sampling import SamplingConfig

# The builders by name live in treespec.cli.trees (treespec bench uses them without this module);
# treespec.cli.main.make_builder stays importable.
from treespec.cli.trees import ADAPTIVE, BUILDERS, make_builder  # noqa: E402,F401

# The calibration auto needs lives in treespec.calibrate.ensure (treespec serve uses it without
# this module); both names stay importable from here.
from treespec.calibrate.ensure import _cached_calibration, ensure_calibration  # noqa: E402,F401


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    from treespec.targets.loader import TARGET_LOADERS

    p.add_argument("--model", default="smollm2-135m", choices=sorted(TARGET_LOADERS),
                   help="target (default smollm2-135m; the Qwen2.5-Coder pair needs `make models-qwen`, "
                        "docs/qwen.md)")
    from treespec.cli.plan import add_compile_arg, add_target_args

    add_target_args(p)
    add_compile_arg(p)
    p.add_argument("--drafter", default=None,
                   help="a registered drafter (treespec.registered_drafters()), a drafter of your own as "
                        "package.module:factory, or an entry point of the treespec.drafters group "
                        "(docs/drafters.md); default: the target's fastest measured configuration on this kind "
                        "of CPU (treespec.cli.presets: smollm2-135m hybrid with --budget auto; on AVX2-only CPUs, on "
                        "--kernel x8 --compile, plain decoding for smollm2-135m and a lookup chain of 3 with "
                        "--min-confidence 0.5 for qwen2.5-coder-1.5b), else eagle3")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the drafter's factory, repeatable (e.g. lookup: min_ngram=3)")
    p.add_argument("--tree", default=None, choices=BUILDERS,
                   help="tree builder (default: the target's preset with neither --tree nor --budget, else dynamic)")
    p.add_argument("--budget", default=None,
                   help="tree nodes incl. root, or 'auto' (cost model); default: the target's preset with neither "
                        "--tree nor --budget, else 16")
    # None: left out (a tree flag given keeps the preset's tree away; treespec.cli.presets fills these)
    p.add_argument("--depth", type=int, default=None, help="max draft depth (dynamic/sequoia; default 5)")
    p.add_argument("--top-k-draft", type=int, default=None, help="children per expanded node (default 4)")
    p.add_argument("--acceptance", default=None,
                   help="sequoia: positional acceptance vector a0,a1,... (default: the drafter's vector "
                        "measured by `treespec calibrate --drafter NAME`, else Sequoia's default)")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="chain / dynamic / best-first: stop drafting where the path's draft confidence falls "
                        "below it, down to no draft at all (a plain step); 0 = off (default: the preset's where "
                        "its tree is used, else 0). With --drafter lookup and "
                        "--drafter-option min_ngram=3, --tree chain --min-confidence 0.5 drafts only where the text "
                        "repeats")
    p.add_argument("--draft-mode", default="deterministic",
                   choices=("deterministic", "with_replacement", "without_replacement"),
                   help="how trees pick children: their most likely tokens, or draws from the drafter")
    p.add_argument("--verify", default="token", choices=("token", "block", "traversal"),
                   help="acceptance rule: token-level (default), block (chains: --tree chain) or "
                        "traversal (trees); all exact. The new rules gain only with drawn children "
                        "(--draft-mode with_replacement/without_replacement); on deterministic trees "
                        "(and at T = 0) they are the token rule")
    defaults = SamplingConfig()   # the one set of sampling defaults (greedy)
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=defaults.top_p, help="nucleus mass; 1 = off")
    p.add_argument("--min-p", type=float, default=defaults.min_p, help="drop tokens below min-p x the most likely; 0 = off")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a different run each time)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; demo: 1, see its help)")


def _load_target(args):
    from treespec import load_target
    from treespec.cli.plan import target_pack

    from treespec.fastpath.device import resolve_device

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype, device=resolve_device(args.device),
                         pack=target_pack(args))
    if getattr(args, "compile", False):
        from treespec.runtime.compiled import compile_target

        target = compile_target(target)
    print(f"[target: {target.speed_path}]", file=sys.stderr, flush=True)
    return target


def auto_threshold_line(calibration, n_nodes: int) -> str:
    """Why auto chose an ``n_nodes`` tree: the predicted gain it needed on this machine."""
    from treespec.planning import auto_threshold_text

    return auto_threshold_text(calibration) + ("; no tree does: plain decoding" if n_nodes == 1 else "")


def _build_generator(args):
    from treespec import SpeculativeGenerator, load_drafter
    from treespec.cli.trees import check_tree_flags, parse_budget

    from treespec.cli.presets import apply_preset
    from treespec.runtime.compiled import compile_drafter_for

    preset = apply_preset(args)                         # the flags left out: the target's fastest measured
    options = drafter_options(args.drafter_option)     # malformed flags fail before the model loads
    budget = parse_budget(args.budget)
    check_tree_flags(args.tree, args.depth, args.top_k_draft, args.verify, numeric_budget=budget != "auto")
    key = None   # --budget auto: the name the drafter's calibration entries go under
    if args.budget == "auto":
        if args.min_confidence:
            raise ValueError("--min-confidence sets a fixed builder's stop; with --budget auto the cost model "
                             "chooses the tree (give a --budget number to use it)")
        from treespec.drafters.base import drafter_key, merged_options

        key = drafter_key(*merged_options(args.drafter, options))   # its options change its costs
        if key is None:
            raise ValueError(f"--drafter-option: {args.drafter_option} cannot name a calibration (a value with "
                             f"one of [],=); give --budget a number instead of auto")
    target = _load_target(args)
    if preset is not None:
        print(f"[no --drafter / --tree / --budget given: {preset.describe()}]", file=sys.stderr)
    drafter = compile_drafter_for(target, load_drafter(args.drafter, target, **options))   # --compile: its calls too
    if args.budget == "auto":
        ensure_calibration(target, key)   # measures the drafter once where the cached file lacks it
        gen = SpeculativeGenerator(target, drafter, "auto", verify=args.verify)
        print(f"[auto tree: {gen.builder.config}; {auto_threshold_line(gen.calibration, gen.builder.budget)}]",
              file=sys.stderr)
        return target, gen
    acceptance = _sequoia_acceptance(args, target) if args.tree == "sequoia" else None
    builder = make_builder(args.tree, budget, args.depth, args.top_k_draft, args.draft_mode, acceptance,
                           args.min_confidence)
    return target, SpeculativeGenerator(target, drafter, builder, verify=args.verify)


def drafter_options(pairs: Sequence[str]) -> dict[str, object]:
    """``["min_ngram=3", ...]`` -> ``{"min_ngram": 3}`` (ints, then floats, then true / false,
    else strings)."""
    from treespec.drafters.base import parse_option_value

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--drafter-option takes KEY=VALUE (e.g. min_ngram=3), got {pair!r}")
        out[key.strip()] = parse_option_value(raw)
    return out


def _sequoia_acceptance(args, target) -> tuple[float, ...] | None:
    """--acceptance, else the calibrated vector of --drafter measured on ``target``'s path (its
    calibration file: dtype, linear path, attention, compiled or not), else None (Sequoia's
    default)."""
    if args.acceptance:
        try:
            return tuple(float(x) for x in args.acceptance.split(","))
        except ValueError:
            raise SystemExit(f"--acceptance must be comma-separated probabilities, got {args.acceptance!r}") from None
    from treespec.runtime.bench import sequoia_acceptance

    vector, source = sequoia_acceptance(target, args.drafter, 0.0)
    if vector is not None:
        print(f"[sequoia acceptance of {args.drafter}: {list(vector)} ({source})]", file=sys.stderr)
    return vector


def cmd_generate(args) -> int:
    target, gen = _build_generator(args)
    tok = target.tokenizer
    hook = None
    if args.show_tree:
        from treespec.cli.viz import save_step_tree

        def hook(built, acceptance, step):
            save_step_tree(built, acceptance, tok, args.show_tree, step)

    stream = gen.stream(args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, min_p=args.min_p, seed=args.seed, on_step=hook)
    from treespec.runtime.streaming import IncrementalText

    text = IncrementalText(tok)  # prints complete characters only (multi-byte UTF-8 tokens)
    for chunk in stream:
        sys.stdout.write(text.push(chunk))
        sys.stdout.flush()
    sys.stdout.write(text.flush() + "\n")
    if args.stats:
        print(stream.result.stats.table())
    return 0


def plain_decode_speed(target, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                       seed: int | None = None) -> tuple[float, int]:
    """tokens/s of HF ``generate`` on the same model object (same weights, dtype and linear
    path: the honest baseline), greedy at temperature 0, sampled otherwise; and the token count."""
    from treespec.fastpath.device import synchronize

    model = target.model
    eos = list(target.eos_token_ids) or None
    sample = temperature > 0
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode():
        synchronize(target.device)
        t0 = time.perf_counter()
        out = model.generate(ids[None].to(target.device), do_sample=sample, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                             attention_mask=torch.ones_like(ids)[None].to(target.device),
                             repetition_penalty=None, temperature=temperature if sample else None,
                             top_p=None, top_k=0 if sample else None)
        synchronize(target.device)
        dt = time.perf_counter() - t0
    n = out.shape[1] - ids.numel()
    return n / dt, n


def cmd_demo(args) -> int:
    """Answer an MT-bench question with the tree the cost model picks for this machine, and
    compare with plain decoding of the same weights, in the same dtype, on the same path."""
    from treespec.data import mtbench_questions

    questions = mtbench_questions()
    if not 0 <= args.question < len(questions):
        raise ValueError(f"--question must be an index from 0 to {len(questions) - 1} (the MT-bench "
                         f"questions), got {args.question}")
    q = questions[args.question]
    target, gen = _build_generator(args)
    print(f"MT-bench #{q.question_id} ({q.category}): {q.turns[0]}\n", flush=True)
    ids = gen.encode(q.turns[0])
    gen.generate(ids, max_new_tokens=8)  # warm-up
    plain_decode_speed(target, ids, 8)
    res = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed)
    print(res.text, "\n")
    print(res.stats.table())
    base_tps, base_n = plain_decode_speed(target, ids, args.max_new_tokens, args.temperature, args.seed)
    spec_tps = res.stats.tokens_per_s_with_prefill
    mode = "greedy" if args.temperature == 0 else f"sampled at T={args.temperature:g}"
    print(f"\npath: {target.speed_path}; {torch.get_num_threads()} threads")
    print(f"plain decoding (HF generate, {mode}, same weights and path): {base_tps:.1f} tokens/s "
          f"with prefill ({base_n} tokens)")
    print(f"treespec {getattr(gen.builder, 'config', type(gen.builder).__name__)} + {args.drafter}: "
          f"{spec_tps:.1f} tokens/s with prefill -> speedup {spec_tps / base_tps:.2f}x (prefill included on "
          f"both sides)")
    stock_tps = stock_decode_speed(target, ids, args.max_new_tokens, args.temperature, args.seed)
    if stock_tps is not None:
        print(f"plain decoding with PyTorch's stock linear layers (what HF generate runs without treespec): "
              f"{stock_tps:.1f} tokens/s with prefill -> treespec {spec_tps / stock_tps:.2f}x, plain on the fast "
              f"path {base_tps / stock_tps:.2f}x")
    return 0


def stock_decode_speed(target, ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                       seed: int | None = None) -> float | None:
    """tokens/s of HF ``generate`` with the target's linear layers put back to stock ``nn.Linear``
    for the run (then packed again); None when they are stock already."""
    from treespec.fastpath.packing import linear_kernel, pack_linears, unpack_linears

    kernel = linear_kernel(target.model)
    if kernel == "stock":
        return None
    unpack_linears(target.model)
    try:
        return plain_decode_speed(target, ids, max_new_tokens, temperature, seed)[0]
    finally:
        pack_linears(target.model, kernel=kernel)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with ``(default: ...)``, options without help text too (the
    stock ArgumentDefaultsHelpFormatter skips those). Not shown: defaults already spelled out in
    the help ("(default ..."), None and empty ones (the help says what happens), and on / off flags."""

    def _shows_default(self, action: argparse.Action) -> bool:
        empty = action.default is None or (isinstance(action.default, (str, list, tuple)) and not action.default)
        return (bool(action.option_strings) and not empty and action.default is not argparse.SUPPRESS
                and action.nargs != 0 and "(default" not in (action.help or ""))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return f"{text} (default: %(default)s)".lstrip() if self._shows_default(action) else text

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"     # a blank help would not be formatted at all
        return super()._format_action(action)


class HelpParser(argparse.ArgumentParser):
    """An ArgumentParser whose ``--help`` shows every option's default; its subcommands'
    parsers (``add_subparsers`` makes them of the parser's own class) do too, with the
    formatter a subcommand asks for (e.g. raw descriptions) kept under the defaults."""

    def __init__(self, *args, formatter_class: type = DefaultsHelpFormatter, **kwargs):
        if not issubclass(formatter_class, DefaultsHelpFormatter):
            formatter_class = type(f"Defaults{formatter_class.__name__}", (DefaultsHelpFormatter, formatter_class), {})
        super().__init__(*args, formatter_class=formatter_class, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from treespec import __version__

    parser = HelpParser(prog="treespec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"treespec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a speculative generation")
    g.add_argument("--prompt", required=True, help="the user message (through the chat template)")
    _add_generation_args(g)
    g.add_argument("--stats", action="store_true",
                   help="print the stats table (tau, acceptance by depth, time split, tokens/s with and "
                        "without the prefill)")
    g.add_argument("--show-tree", default=None, metavar="DIR", help="save a PNG of every step's tree")
    # --kernel / --compile left out: the target's preset for this CPU kind (treespec.cli.presets)
    g.set_defaults(func=cmd_generate, kernel=None, compile=None)

    d = sub.add_parser("demo", help="MT-bench question, speed against plain decoding")
    _add_generation_args(d)
    d.add_argument("--question", type=int, default=0, help="index into the 80 MT-bench questions")
    # One thread by default: on a small shared machine a 2-thread forward of this model slows
    # down several-fold whenever the other core is busy (OpenMP workers wait for each other).
    # The hybrid drafter (prompt lookup mixed into eagle3's q): with auto's tree it reached a
    # higher tau at T = 0 than eagle3 alone for a little more drafting, on the exact fp32 target
    # and the amx path alike (benchmarks/results/engine_fp32_hybrid.md, engine_amx_hybrid.md).
    # Its path is the CPU's default, eager: the demo compares with HF generate on that same path.
    d.set_defaults(func=cmd_demo, budget="auto", threads=1, drafter="hybrid")

    try:
        from treespec.cli.plan import register as register_cost
    except ImportError:  # pragma: no cover - cost model not installed in this checkout
        register_cost = None
    if register_cost is not None:
        register_cost(sub)
    try:
        from treespec.train.cli import register as register_train
    except ImportError:
        register_train = None
    if register_train is not None:
        register_train(sub)
    from treespec.export.cli import register as register_export

    register_export(sub)
    from treespec.cli.bench import register as register_bench

    register_bench(sub)
    from treespec.cli.serve import register as register_serve

    register_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. Bad input (a wrong name, value or missing file or wheel) prints
    ``error: ...`` and returns 2 instead of a traceback."""
    from treespec.cli.plan import run_command

    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
