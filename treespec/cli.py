"""Command line: ``treespec generate | demo | plan | calibrate | train``."""

from __future__ import annotations

import argparse
import sys
import time

import torch

BUILDERS = ("dynamic", "chain", "static", "best-first", "sequoia")


def make_builder(name: str, budget: int, depth: int, top_k: int, mode: str = "deterministic",
                 acceptance=None):
    """A tree builder from CLI-style arguments (budget counts nodes incl. the root).
    ``acceptance``: Sequoia's positional acceptance vector (None: its default)."""
    from treespec import trees

    if name == "chain":
        return trees.ChainBuilder(max(budget - 1, 1), mode=mode)
    if name == "dynamic":
        return trees.DynamicTreeBuilder(budget=budget, depth=depth, top_k=top_k, mode=mode)
    if name == "best-first":
        return trees.BestFirstBuilder(budget=budget, max_width=top_k, mode=mode, max_depth=depth)
    if name == "sequoia":
        return trees.SequoiaBuilder(budget=budget, depth=depth, mode=mode, acceptance=acceptance)
    if name == "static":
        return trees.StaticTreeBuilder.default(budget, mode=mode)
    raise ValueError(f"unknown tree builder {name!r}; choose from {BUILDERS}")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="target name (default smollm2-135m)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="target weights (bfloat16: faster trees on CPUs with bf16 GEMMs; greedy output may "
                        "differ from fp32 at near-ties)")
    p.add_argument("--drafter", default="eagle3", help="registered drafter name (see treespec.registered_drafters())")
    p.add_argument("--tree", default="dynamic", choices=BUILDERS, help="tree builder")
    p.add_argument("--budget", default="16", help="tree nodes incl. root, or 'auto' (cost model)")
    p.add_argument("--depth", type=int, default=5, help="max draft depth (dynamic/sequoia)")
    p.add_argument("--top-k-draft", type=int, default=4, help="children per expanded node")
    p.add_argument("--acceptance", default=None,
                   help="sequoia: positional acceptance vector a0,a1,... (default: the drafter's vector "
                        "measured by `treespec calibrate --drafter NAME`, else Sequoia's default)")
    p.add_argument("--draft-mode", default="deterministic",
                   choices=("deterministic", "with_replacement", "without_replacement"))
    p.add_argument("--verify", default="token", choices=("token", "block", "traversal"),
                   help="acceptance rule: token-level (default), block (chains: --tree chain) or "
                        "traversal (trees); all exact. The new rules gain only with drawn children "
                        "(--draft-mode with_replacement/without_replacement); on deterministic trees "
                        "(and at T = 0) they are the token rule")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=None)


def _build_generator(args):
    from treespec import SpeculativeGenerator, load_drafter, load_target

    target = load_target(args.model, dtype=getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, target)
    if args.budget == "auto":
        gen = SpeculativeGenerator(target, drafter, "auto", verify=args.verify)
        print(f"[auto tree: {gen.builder.config}]", file=sys.stderr)
        return target, gen
    try:
        budget = int(args.budget)
    except ValueError:
        raise SystemExit(f"--budget must be an integer or 'auto', got {args.budget!r}") from None
    acceptance = _sequoia_acceptance(args) if args.tree == "sequoia" else None
    builder = make_builder(args.tree, budget, args.depth, args.top_k_draft, args.draft_mode, acceptance)
    return target, SpeculativeGenerator(target, drafter, builder, verify=args.verify)


def _sequoia_acceptance(args) -> tuple[float, ...] | None:
    """--acceptance, else the calibrated vector of --drafter, else None (Sequoia's default)."""
    if args.acceptance:
        try:
            return tuple(float(x) for x in args.acceptance.split(","))
        except ValueError:
            raise SystemExit(f"--acceptance must be comma-separated probabilities, got {args.acceptance!r}") from None
    from treespec.cost import Calibration, default_calibration_path

    path = default_calibration_path(args.model, getattr(args, "dtype", "float32"))
    vector = Calibration.load(path).acceptance.get(args.drafter) if path.exists() else None
    if vector is not None:
        print(f"[sequoia acceptance of {args.drafter} from {path}: {list(vector)}]", file=sys.stderr)
    return vector


def cmd_generate(args) -> int:
    target, gen = _build_generator(args)
    tok = target.tokenizer
    hook = None
    if args.show_tree:
        from treespec.viz import save_step_tree

        def hook(built, acceptance, step):
            save_step_tree(built, acceptance, tok, args.show_tree, step)

    stream = gen.stream(args.prompt, args.max_new_tokens, args.temperature, args.top_p,
                        args.top_k, seed=args.seed, on_step=hook)
    emitted: list[int] = []
    shown = ""
    for chunk in stream:
        emitted.extend(chunk)
        text = tok.decode(emitted, skip_special_tokens=True)
        sys.stdout.write(text[len(shown):])
        sys.stdout.flush()
        shown = text
    sys.stdout.write("\n")
    if args.stats:
        print(stream.result.stats.table())
    return 0


def plain_decode_speed(target, ids: torch.Tensor, max_new_tokens: int) -> tuple[float, int]:
    """tokens/s of HF greedy ``generate`` (the vanilla baseline) and the token count."""
    model = target.model
    eos = list(target.eos_token_ids) or None
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids[None].to(target.device), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0] if eos else 0,
                             repetition_penalty=None, temperature=None, top_p=None, top_k=None)
        dt = time.perf_counter() - t0
    n = out.shape[1] - ids.numel()
    return n / dt, n


def cmd_demo(args) -> int:
    """Generate an answer to an MT-bench question; compare with plain decoding of the target."""
    from treespec.data import mtbench_questions

    q = mtbench_questions()[args.question]
    args.prompt = q.turns[0]
    target, gen = _build_generator(args)
    print(f"MT-bench #{q.question_id} ({q.category}): {q.turns[0]}\n", flush=True)
    ids = gen.encode(q.turns[0])
    gen.generate(ids, max_new_tokens=8)  # warm-up
    res = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed)
    print(res.text, "\n")
    print(res.stats.table())
    base_tps, base_n = plain_decode_speed(target, ids, args.max_new_tokens)
    spec_tps = res.stats.new_tokens / (res.stats.decode_time + res.stats.prefill_time)
    print(f"\nplain decoding (HF generate, greedy): {base_tps:.1f} tokens/s ({base_n} tokens)")
    print(f"treespec {args.tree} + {args.drafter}:  {spec_tps:.1f} tokens/s "
          f"-> speedup {spec_tps / base_tps:.2f}x (prefill included on both sides)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a speculative generation")
    g.add_argument("--prompt", required=True)
    _add_generation_args(g)
    g.add_argument("--stats", action="store_true", help="print the stats table")
    g.add_argument("--show-tree", default=None, metavar="DIR", help="save a PNG of every step's tree")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="MT-bench question, speed against plain decoding")
    _add_generation_args(d)
    d.add_argument("--question", type=int, default=0, help="index into the 80 MT-bench questions")
    d.set_defaults(func=cmd_demo)

    try:
        from treespec.cost.cli import register as register_cost
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. Bad input (a wrong name, value or missing file or wheel) prints
    ``error: ...`` and returns 2 instead of a traceback."""
    from treespec.cost.cli import run_command

    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
