"""``treespec serve``: an OpenAI-compatible HTTP server over one continuous-batching engine.

    treespec serve --model smollm2-135m --drafter eagle3 --budget auto --host 127.0.0.1 --port 8000

The app (``app.make_app``) is Starlette under uvicorn; the engine (``engine.Engine``) steps one
``SpeculativeServer`` on its own thread; ``protocol`` checks request bodies; ``metrics`` serves
Prometheus text. SIGTERM (or Ctrl-C) drains: no new requests (503), live ones finish within
``--drain-timeout`` seconds, then the process exits. docs/serving.md has the whole HTTP section.
"""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    """Add the ``serve`` subcommand to the CLI's subparsers."""
    from treespec.cli.plan import add_compile_arg, add_target_args
    from treespec.cli.trees import BUILDERS
    from treespec.targets.loader import TARGET_LOADERS

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, SSE, /metrics)")
    p.add_argument("--model", default="smollm2-135m", choices=sorted(TARGET_LOADERS), help="target")
    add_target_args(p)
    add_compile_arg(p)
    p.add_argument("--drafter", default=None,
                   help="registered drafter name, or 'none': plain decoding, speculation off; default: the "
                        "target's serving preset for this kind of CPU (treespec.cli.presets: smollm2-135m "
                        "eagle3, qwen2.5-coder-1.5b its 0.5B, on AVX2-only CPUs lookup), else eagle3")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the drafter's factory, repeatable")
    p.add_argument("--budget", default=None,
                   help="tree nodes incl. the root, or 'auto': the cost model sizes each step's tree "
                        "for the current batch size and each request's temperature, down to plain decoding. "
                        "auto measures what this machine's calibration lacks before serving (the drafter and "
                        "the batched passes up to --max-batch; a few minutes the first time, then cached). "
                        "Default: the serving preset's tree where the preset's drafter runs and no tree flag "
                        "is given, else auto")
    p.add_argument("--tree", default=None, choices=BUILDERS, help="a numeric --budget's builder (default dynamic)")
    p.add_argument("--depth", type=int, default=5, help="max draft depth of a numeric --budget's tree")
    p.add_argument("--top-k-draft", type=int, default=4, help="children per expanded node (numeric --budget)")
    p.add_argument("--min-confidence", type=float, default=None,
                   help="a numeric --budget's stop (chain / dynamic / best-first): no node where the path's "
                        "draft confidence falls below it, down to a plain step; 0 = off")
    p.add_argument("--draft-max-batch", type=int, default=None,
                   help="a numeric --budget's tree is drafted only while at most this many requests are live; "
                        "past it each step is plain (a batched pass of several trees is compute-bound on a CPU). "
                        "Default: any batch, or the serving preset's")
    p.add_argument("--verify", default="token", choices=("token", "block", "traversal"), help="acceptance rule")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting to join; past it the answer is 429 with Retry-After")
    p.add_argument("--max-tokens-default", type=int, default=256,
                   help="max_tokens of a request that sends none (clipped to the context)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds live requests get to finish after SIGTERM")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    # --kernel / --compile left out: the target's serving preset for this CPU kind (treespec.cli.presets)
    p.set_defaults(func=cmd_serve, kernel=None, compile=None)


def build_server(args: argparse.Namespace):
    """(target, ``SpeculativeServer``) as the arguments describe them."""
    import torch

    from treespec import load_target
    from treespec.cli.plan import target_pack
    from treespec.cli.trees import check_tree_flags, make_builder, parse_budget
    from treespec.cli.presets import apply_serve_preset
    from treespec.drafters import load_drafter
    from treespec.drafters.base import parse_option_value
    from treespec.fastpath.device import resolve_device
    from treespec.runtime.server import SpeculativeServer

    preset = apply_serve_preset(args)    # no --drafter / --kernel / --compile: the target's serving preset
    for name in ("max_batch", "max_queue", "max_tokens_default"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    options = {}
    for pair in args.drafter_option:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--drafter-option takes KEY=VALUE (e.g. min_ngram=3), got {pair!r}")
        options[key.strip()] = parse_option_value(raw)
    parsed = parse_budget(args.budget)
    budget = None if parsed == "auto" else parsed
    if budget is None:
        for flag in ("tree", "min_confidence", "draft_max_batch"):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} shapes a fixed tree; with --budget auto the cost model "
                                 f"chooses each step's tree for the batch size (give a --budget number to use it)")
    else:
        check_tree_flags(args.tree, args.depth, args.top_k_draft, args.verify)
        if args.draft_max_batch is not None and args.draft_max_batch < 1:
            raise ValueError(f"--draft-max-batch must be >= 1, got {args.draft_max_batch}")
        builder = make_builder(args.tree, budget, args.depth, args.top_k_draft, min_confidence=args.min_confidence)
    key = None   # --budget auto: the name the drafter's calibration entries go under
    if budget is None and args.drafter != "none":
        from treespec.drafters.base import drafter_key, merged_options

        key = drafter_key(*merged_options(args.drafter, options))   # its options change its costs
        if key is None:
            raise ValueError(f"--drafter-option: {args.drafter_option} cannot name a calibration (a value with "
                             f"one of [],=); give --budget a number instead of auto")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    target = load_target(args.model, dtype=args.dtype, device=resolve_device(args.device), pack=target_pack(args))
    if args.compile:
        from treespec.runtime.compiled import compile_target

        target = compile_target(target)
    print(f"[target: {target.speed_path}]", file=sys.stderr, flush=True)
    if preset is not None:
        print(f"[the serving preset for this CPU: {preset.describe()}]", file=sys.stderr, flush=True)
    if args.drafter == "none":
        return target, warmed(SpeculativeServer(target, None), args.max_batch)
    drafter = load_drafter(args.drafter, target, **options)    # batched calls, eager (not compiled)
    if budget is None:
        from treespec.calibrate.ensure import ensure_calibration

        # the batched curves let auto shrink the tree as the batch grows (a chain, then none)
        ensure_calibration(target, key, batches=auto_batches(args.max_batch))
        server = SpeculativeServer(target, drafter, "auto", verify=args.verify)
        plan = auto_plan(server, args.max_batch)
        for b, t, builder in plan:
            print(f"[auto at batch {b}, T = {t:g}: {describe_tree(builder)}]", file=sys.stderr, flush=True)
        if all(builder.budget == 1 for _, _, builder in plan):
            # A drafter that never drafts still costs its commit every step (its state follows
            # the text): where auto plans no tree at all, the server decodes plainly without it.
            print(f"[auto: no tree pays on this machine at any batch size up to {args.max_batch}, greedy or "
                  f"sampled: serving plain decoding, {args.drafter} not run]", file=sys.stderr, flush=True)
            return target, warmed(SpeculativeServer(target, None), args.max_batch)
        return target, warmed(server, args.max_batch, max(builder.budget for _, _, builder in plan))
    server = SpeculativeServer(target, drafter, builder, verify=args.verify, draft_max_batch=args.draft_max_batch)
    return target, warmed(server, args.max_batch, budget)


def warmed(server, max_batch: int, nodes: int = 1):
    """``server``, its compiled graphs (where the target's passes are compiled) built now, before
    it listens: every batch bucket up to ``max_batch`` requests for trees of up to ``nodes``
    nodes (one node past the server's ``draft_max_batch``), with no hidden states (plain
    steps), and with the drafter's feature layers for one request (other shapes compile when
    first met, announced)."""
    if server.target.passes is None:
        return server
    from treespec.runtime.batch_compiled import batch_passes

    passes = batch_passes(server.target)
    passes.warm(max_batch, nodes, draft_max_batch=server.draft_max_batch)
    if server.layers and nodes > 1:
        passes.single.warm(nodes, server.layers)
    return server


def auto_batches(max_batch: int) -> tuple[int, ...]:
    """Batch sizes above 1 whose verify pass auto's calibration measures for a server of
    ``max_batch``: the powers of two below it and itself (others are interpolated)."""
    return tuple(sorted({b for b in (2, 4, 8, 16, 32, 64) if b < max_batch} | ({max_batch} - {1})))


def auto_plan(server, max_batch: int, temperatures: tuple[float, ...] = (0.0, 1.0)) -> list[tuple[int, float, object]]:
    """(batch size, temperature, the tree auto gives a request at that temperature when that
    many are decoded together) for batch 1, the measured sizes and ``max_batch``."""
    from treespec.runtime.generator import auto_builder
    from treespec.runtime.server import auto_max_budget

    return [(b, t, auto_builder(server.target, server.drafter, server.calibration,
                                max_budget=auto_max_budget(server.target, b), batch=b, temperature=t))
            for t in temperatures for b in sorted({1, *auto_batches(max_batch)})]


def describe_tree(builder) -> str:
    """"plain decoding", "a chain of k drafts" or "a tree of n nodes, depth d"."""
    from treespec.builders import ChainBuilder

    if builder.budget == 1:
        return "plain decoding (no draft)"
    if isinstance(builder, ChainBuilder):
        drafts = builder.budget - 1
        return f"a chain of {drafts} draft{'s' if drafts > 1 else ''}"
    return f"a tree of {builder.budget} nodes, depth {builder.config.depth}"


def serve_app(app, host: str, port: int, drain_timeout: float, sock=None, log_level: str = "info") -> None:
    """Run ``app`` (``make_app``) under uvicorn until SIGTERM / SIGINT, then drain: new requests
    get 503 at once, live ones up to ``drain_timeout`` s to finish. ``sock``: a bound socket to
    serve on instead of ``host``:``port``."""
    import uvicorn

    front = app.state.front

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            front.engine.draining = True
            super().handle_exit(sig, frame)
            # uvicorn raises a captured signal again once it has shut down, which ends the
            # process with -SIGTERM; the drain is this server's clean exit: status 0.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=drain_timeout, lifespan="on")
    DrainingServer(config).run(sockets=[sock] if sock is not None else None)


def cmd_serve(args: argparse.Namespace) -> int:
    from treespec.cli.serve.app import make_app

    target, server = build_server(args)
    app = make_app(server, target.name, max_queue=args.max_queue, max_batch=args.max_batch,
                   default_max_tokens=args.max_tokens_default, drain_timeout=args.drain_timeout)
    print(f"[treespec serve: {target.name} on http://{args.host}:{args.port}/v1; drafter {args.drafter}, "
          f"budget {args.budget}; max batch {args.max_batch}, queue {args.max_queue}]", file=sys.stderr, flush=True)
    serve_app(app, args.host, args.port, args.drain_timeout)
    return 0
