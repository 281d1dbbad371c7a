"""The shipped heads stored as 8-bit blocks: what it costs in held-out acceptance, and the bytes.

For each shipped checkpoint of SmolLM2-135M (``--kinds``), the float16 file (``--source``: a git
revision that still has it, or ``disk`` for the file as it is) against the same tensors stored
as GGUF Q8_0 blocks (``save_checkpoint(..., storage="blocks8")``: int8 per weight, one fp16
scale per 32). Held-out acceptance is teacher-forced on the card's held-out ShareGPT split
(``treespec.train.loop.heldout_metrics``, ``--sequences`` rows): top-1 agreement and beta (sum
of min(p, q) over the target's top 32) by draft depth.

``--write`` stores the 8-bit file over the shipped one and updates its card: ``heldout`` (the
card's 8 sequences, measured on the stored file), ``checkpoint_bytes``, ``checksum`` and a
``storage`` record with both measurements. Run once per format change:

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_storage.py --source HEAD --write

Writes ``--out``.{json,md} with the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import torch

import treespec
from harness import RESULTS, machine_info, machine_line, md_table, write_results
from treespec.drafters.checkpoint import card_path, load_checkpoint, read_header, save_checkpoint
from treespec.drafters.feature import shipped_checkpoint
from treespec.train.data import build_cache
from treespec.train.loop import (HELDOUT, HELDOUT_CARD_SEQS, RecipeConfig, heldout_chunks, heldout_metrics,
                                 heldout_of_checkpoint, make_recipe, rebuild)

KINDS = ("eagle", "eagle3", "medusa", "mtp")
REPO = Path(__file__).resolve().parents[1]


def source_file(shipped: Path, source: str, scratch: Path) -> Path:
    """The float16 checkpoint to convert: the shipped file, or its copy at git revision ``source``
    (with its card beside it)."""
    if source == "disk":
        return shipped
    rel = shipped.relative_to(REPO)
    out = scratch / shipped.name
    for path, dest in ((rel, out), (card_path(rel), card_path(out))):
        blob = subprocess.run(["git", "show", f"{source}:{path.as_posix()}"], cwd=REPO, capture_output=True,
                              check=True).stdout
        dest.write_bytes(blob)
    return out


def heldout(target, kind: str, path: Path, sequences: int) -> dict:
    """Held-out acceptance of the checkpoint at ``path`` on ``sequences`` held-out rows."""
    state, header = load_checkpoint(path, target, kind)
    card = json.loads(card_path(path).read_text())
    recipe = make_recipe(kind, target, RecipeConfig(**card.get("recipe", {})),
                         torch.zeros(target.vocab_size, dtype=torch.long))
    chunks = heldout_chunks(target, recipe.layers, sequences)
    metrics = heldout_metrics(recipe, rebuild(recipe, kind, state, header, target), chunks, sequences)
    return {k: metrics[k] for k in ("top1_by_depth", "beta_top32_by_depth", "positions", "sequences")}


def convert(target, kind: str, source: Path, dest: Path) -> Path:
    """``source`` (float16) stored as 8-bit blocks at ``dest``, with its card."""
    header = read_header(source, kind)
    if header.get("blocks8"):
        raise ValueError(f"{source} is already stored as 8-bit blocks; pass --source with a revision that has "
                         f"the float16 file")
    state, _ = load_checkpoint(source, target, kind)
    card = json.loads(card_path(source).read_text())
    return save_checkpoint(dest, state, kind, header["arch"], target, card=card, storage="blocks8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--source", default="disk", help="git revision holding the float16 files, or 'disk'")
    ap.add_argument("--sequences", type=int, default=64, help="held-out sequences (the card reports 8)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="store the 8-bit files and cards over the shipped ones")
    ap.add_argument("--out", default=str(RESULTS / "checkpoint_storage"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = treespec.load_target("smollm2-135m", dtype=torch.float32)
    build_cache(target, HELDOUT)   # the held-out split's features, once (every measurement below reads them)
    rows, data = [], {"machine": machine_info(), "sequences": args.sequences, "kinds": {}}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for kind in args.kinds.split(","):
            shipped = shipped_checkpoint(target, kind)
            (scratch / "src").mkdir(exist_ok=True)
            src = source_file(shipped, args.source, scratch / "src")
            blocks = convert(target, kind, src, scratch / "blocks8" / shipped.name)
            before, after = heldout(target, kind, src, args.sequences), heldout(target, kind, blocks, args.sequences)
            entry = {"bytes_float16": src.stat().st_size, "bytes_blocks8": blocks.stat().st_size,
                     "blocks8_tensors": read_header(blocks)["blocks8"], "float16": before, "blocks8": after}
            data["kinds"][kind] = entry
            for name, e in (("float16", before), ("blocks8", after)):
                rows.append([kind, name, f"{entry['bytes_' + name] / 2 ** 20:.2f}",
                             " / ".join(f"{v:.4f}" for v in e["top1_by_depth"]),
                             " / ".join(f"{v:.4f}" for v in e["beta_top32_by_depth"])])
            if args.write:
                card = json.loads(card_path(blocks).read_text())
                card["heldout"] = heldout_of_checkpoint(kind, target, blocks, sequences=HELDOUT_CARD_SEQS)
                card["heldout_note"] = card.get("heldout_note", "").replace("exported fp16 checkpoint",
                                                                              "stored checkpoint (8-bit blocks)")
                card["checkpoint_bytes"] = blocks.stat().st_size
                card["storage"] = {
                    "format": "blocks8",
                    "what": "every 2-D weight as GGUF Q8_0 blocks (int8 values, one fp16 scale per 32), the "
                            "rest float16; read back as the exact float32 q*d the block kernel's int8 "
                            "rounding gives",
                    "bytes_float16": entry["bytes_float16"], "bytes_blocks8": entry["bytes_blocks8"],
                    f"heldout_{args.sequences}_float16": before, f"heldout_{args.sequences}_blocks8": after,
                    "measured_by": "benchmarks/checkpoint_storage.py"}
                card_path(blocks).write_text(json.dumps(card, indent=1) + "\n")
                shipped.write_bytes(blocks.read_bytes())
                card_path(shipped).write_text(card_path(blocks).read_text())
    total = {n: sum(e[f"bytes_{n}"] for e in data["kinds"].values()) for n in ("float16", "blocks8")}
    lines = ["# The shipped heads as 8-bit blocks: bytes and held-out acceptance", "",
             f"{machine_line(data['machine'])} SmolLM2-135M fp32 target; held-out ShareGPT, "
             f"{args.sequences} sequences, teacher-forced (top-1 = greedy acceptance given a correct prefix, "
             "beta = sum of min(p, q) over the target's top 32), depths 1 / 2 / 3 / 4.", "",
             *md_table(["head", "stored as", "MiB", "top-1 by depth", "beta by depth"], rows, "llrll"), "",
             f"All four: {total['float16'] / 2 ** 20:.1f} MiB as float16, {total['blocks8'] / 2 ** 20:.1f} MiB as "
             "8-bit blocks.", "",
             f"Reproduce: `OMP_NUM_THREADS={args.threads} python benchmarks/checkpoint_storage.py --source "
             f"{args.source if args.source == 'disk' else 'REV'} --sequences {args.sequences}` (REV: a revision "
             "with the float16 files)"]
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.out, {**data, "command": "benchmarks/checkpoint_storage.py"}, md)


if __name__ == "__main__":
    main()
