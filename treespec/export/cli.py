"""``treespec export {eagle3,medusa} --out DIR``: a shipped or given drafter checkpoint, written in
the format vLLM loads (see ``treespec.export``)."""

from __future__ import annotations

import argparse
import sys

KINDS = ("eagle3", "medusa")


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a drafter as a vLLM EAGLE-3 / Medusa draft checkpoint")
    p.add_argument("kind", choices=KINDS, help="which drafter")
    p.add_argument("--out", required=True, help="output directory (new or empty; --force replaces an export)")
    p.add_argument("--model", default="smollm2-135m", help="target name (default smollm2-135m)")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint (default: the shipped one)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype of the exported weights")
    p.add_argument("--stack", default="vllm", choices=("vllm", "sglang"),
                   help="serving stack (sglang is refused for eagle3 with the reason)")
    p.add_argument("--force", action="store_true", help="replace a previous treespec export in --out")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from treespec import load_target
    from treespec.drafters import load_drafter
    from treespec.export import export_eagle3, export_medusa

    from treespec.export import SGLANG_MISMATCH

    if args.stack == "sglang":    # refused before loading anything
        raise ValueError(SGLANG_MISMATCH if args.kind == "eagle3" else
                         "--stack sglang: SGLang has no Medusa draft format; use --stack vllm")
    target = load_target(args.model, pack=False)
    drafter = load_drafter(args.kind, target, checkpoint=args.checkpoint)
    source = args.checkpoint or f"shipped {args.kind} checkpoint for {args.model}"
    if args.kind == "eagle3":
        out = export_eagle3(target, drafter, args.out, dtype=args.dtype, force=args.force, stack=args.stack,
                            source=source)
    else:
        out = export_medusa(target, drafter, args.out, dtype=args.dtype, force=args.force, source=source)
    print(f"wrote {args.kind} draft for vLLM to {out}", file=sys.stderr)
    return 0
