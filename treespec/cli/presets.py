"""The configuration ``treespec generate`` / ``demo`` / ``serve`` run when the user names no drafter or
tree: per target, the fastest treespec configuration measured on this kind of CPU, with the
result file that measured it. A flag the user gives always wins; only the missing ones come from
here.

``generate`` also takes the preset's linear kernel and whether the target's passes run compiled,
where the user gave no --kernel / --compile / --no-compile (nor --no-pack, a --dtype or a device
that the path cannot take): on an AVX2-only CPU the fastest path is the x8 target (each linear
input rounded to 8-bit integers per block of 32, as llama.cpp multiplies) with compiled passes;
there SmolLM2's preset is plain decoding (no drafter pays over all prompts) and Qwen's a lookup
chain of 3 that drafts only where the votes agree (a plain 1-row pass elsewhere).
``demo`` keeps the CPU's default path: it compares with HF ``generate`` on the same path, which
runs eagerly.

``serve`` takes the drafter, the linear kernel and whether the passes run compiled from here
(``SERVE_PRESETS``; the kernel and compilation as ``generate`` takes them), and its tree where
the user gave no tree flag and runs the preset's drafter: ``--budget auto`` (the cost model
sizes each step's tree for the batch size) or a fixed tree drafted only up to the preset's
``draft_max_batch`` live requests (a fixed tree that pays at batch 1 loses at batch 8).

Only configurations a user can name on the command line are listed (a registered drafter, a
builder, a budget). The fastest Qwen row on AMX (``switch best12 head8 int4 vocab32k ctx`` in
``qwen_amx.md``) builds its drafter from parts the registry does not expose yet, so Qwen's
default is its fastest nameable row.
"""

from __future__ import annotations

from dataclasses import dataclass

from treespec.fastpath.cpu import CpuInfo, cpu_info

__all__ = ["PRESETS", "SERVE_PRESETS", "Preset", "apply_preset", "apply_serve_preset", "best_preset"]


@dataclass(frozen=True)
class Preset:
    """A drafter, a tree builder and its budget (``"auto"``: the cost model sizes the tree from
    this machine's calibration), and the measurement that chose them."""

    drafter: str
    tree: str
    budget: str
    source: str
    kernel: str = "auto"        # the target's linear kernel (--kernel); auto: the CPU's choice
    compile: bool = False       # the target's passes compiled (--compile)
    min_confidence: float = 0.0  # the tree's stop (--min-confidence): a path under it is not drafted
    draft_max_batch: int | None = None   # serve: a fixed tree drafted up to this many live requests

    @property
    def plain(self) -> bool:
        """Plain decoding: every tree the root alone (no drafter pays on this CPU)."""
        return self.budget == "1"

    def describe(self) -> str:
        tree = "builder='auto'" if self.budget == "auto" else f"{self.tree}:{self.budget}"
        tree += f", --min-confidence {self.min_confidence:g}" if self.min_confidence else ""
        what = "plain decoding (budget 1)" if self.plain else f"--drafter {self.drafter}, {tree}"
        what += f", --draft-max-batch {self.draft_max_batch}" if self.draft_max_batch and not self.plain else ""
        path = [f"--kernel {self.kernel}"] if self.kernel != "auto" else []
        path += ["--compile"] if self.compile else []
        return f"{what}{''.join(', ' + p for p in path)} (the fastest measured: {self.source})"


_SMOLLM2 = Preset("hybrid", "dynamic", "auto",
                  "hybrid with builder='auto' is treespec's fastest row on every CPU kind measured: "
                  "engine_amx.md 1.52x, llamacpp_avx512bf16.md 1.39x, llamacpp_avx2.md 1.16-1.20x its plain decoding")
_QWEN = Preset("qwen2.5-coder-0.5b", "chain", "5",
               "the 0.5B drafting a chain of 4: 1.61x plain decoding in qwen_avx512bf16.md, its fastest row at T = 0 "
               "that a flag can name")



# AVX2 only (no native bf16): the x8 target with compiled passes decodes faster than llama.cpp
# plainly; for SmolLM2 a drafted row and the eagle3 head's call cost more than they save there
_SMOLLM2_AVX2 = Preset("lookup", "chain", "1",
                       "llamacpp_avx2.md: plain decoding on the x8 target with compiled passes, 1.62x llama.cpp's "
                       "plain decoding at T = 0 and 1.68x at T = 1; hybrid auto on the same path plans plain "
                       "decoding", kernel="x8", compile=True)
# Qwen: with K-quant records a 1-node pass reads 1.02 GB and a 4-node one costs ~1.45 of it, so a
# chain pays only where its guesses are good: the lookup chain of 3 stops where the votes along it
# fall under 0.5, a step without a recurring suffix is a 1-row pass; the 0.5B's calls cost more
# than the rows they save
_QWEN_AVX2 = Preset("lookup", "chain", "4",
                    "qwen_avx2.md: a lookup chain of 3 cut at confidence 0.5 on the x8 target (K-quant records) "
                    "with compiled passes, 1.66x llama.cpp's plain decoding over all prompts (plain decoding "
                    "1.47x) and 2.02x on code edits, its fastest row on every prompt kind", kernel="x8", compile=True,
                    min_confidence=0.5)


def _on_every_kind(preset: Preset, **kinds: Preset) -> dict[str, Preset]:
    """One preset for every CPU kind (``CpuInfo.kind``) measured so far, ``kinds`` excepted."""
    return {kind: kinds.get(kind, preset) for kind in ("amx", "avx512bf16", "avx2")}


PRESETS: dict[str, dict[str, Preset]] = {
    "smollm2-135m": _on_every_kind(_SMOLLM2, avx2=_SMOLLM2_AVX2),
    "qwen2.5-coder-1.5b": _on_every_kind(_QWEN, avx2=_QWEN_AVX2),
}

_SERVE_SMOLLM2 = Preset("eagle3", "dynamic", "auto",
                        "eagle3 with --budget auto is the serving configuration load-tested in serve_load_avx2.md "
                        "(1.07x the plain server at c = 1, plain decoding from batch 2 on)")
_SERVE_QWEN = Preset("qwen2.5-coder-0.5b", "dynamic", "auto",
                     "the 0.5B is the drafter of the target's fastest nameable row (qwen_avx512bf16.md); --budget "
                     "auto sizes its tree for each batch size from this machine's calibration")

# AVX2 only: the x8 target with compiled passes, as generate runs it (the batch verified through
# compiled graphs of 1, 2, 4, 8 requests); eagle3 stays the drafter auto weighs at each batch size
_SERVE_SMOLLM2_AVX2 = Preset("eagle3", "dynamic", "auto",
                             "serve_load_avx2.md: the x8 target with compiled batch graphs, 26.3 tokens/s at c = 1 "
                             "against llama-server's 14.6 (auto plans plain decoding there)", kernel="x8", compile=True)
# Qwen: generate's lookup chain cut at 0.5 while a request is alone; beside others the batched
# pass is already compute-bound (4 rows cost ~1.4 of one), so every step is plain there
_SERVE_QWEN_AVX2 = Preset("lookup", "chain", "4",
                          "qwen_avx2.md: a lookup chain of 3 cut at confidence 0.5 on the x8 target with compiled "
                          "passes is the fastest Qwen row on AVX2 (1.66x llama.cpp's plain decoding); drafted while "
                          "a request is alone, plain steps beside others (serve_load_avx2.md: 5.1 tokens/s at c = 1 "
                          "against llama-server's 3.0)", kernel="x8", compile=True,
                          min_confidence=0.5, draft_max_batch=1)

SERVE_PRESETS: dict[str, dict[str, Preset]] = {
    "smollm2-135m": _on_every_kind(_SERVE_SMOLLM2, avx2=_SERVE_SMOLLM2_AVX2),
    "qwen2.5-coder-1.5b": _on_every_kind(_SERVE_QWEN, avx2=_SERVE_QWEN_AVX2),
}


def best_preset(model: str, cpu: CpuInfo | None = None) -> Preset | None:
    """The fastest measured configuration of ``model`` on this CPU kind, or None where none was
    measured (the command's own defaults apply)."""
    return PRESETS.get(model, {}).get((cpu if cpu is not None else cpu_info()).kind)


FALLBACK = {"drafter": "eagle3", "tree": "dynamic", "budget": "16"}   # a target without a preset
TREE_FLAGS = {"depth": 5, "top_k_draft": 4}    # --depth / --top-k-draft where the user gave none


def apply_preset(args, cpu: CpuInfo | None = None) -> Preset | None:
    """Fill the --drafter / --tree / --budget the user left out (None) from the target's preset:
    no tree flag (--tree, --depth, --top-k-draft) and no budget: the preset's tree and budget;
    a tree without a budget: dynamic (where no --tree) with budget 16,
    as before presets. The --kernel and --compile left out (None) come from the preset too,
    where the path can take them (see the module docstring). Returns the preset where it supplied
    something."""
    preset = best_preset(args.model, cpu)
    used = _apply_path(args, preset)
    # a tree flag given asks for a tree of the user's shape: the preset's tree is not applied
    shaped = any(getattr(args, name, None) is not None for name in TREE_FLAGS)
    for name, default in TREE_FLAGS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if args.drafter is None:
        args.drafter, used = (preset.drafter, True) if preset else (FALLBACK["drafter"], used)
    preset_tree = args.budget is None and args.tree is None and not shaped and preset is not None
    if preset_tree:
        args.tree, args.budget, used = preset.tree, preset.budget, True
    elif args.budget is None:
        args.budget = FALLBACK["budget"]
    if getattr(args, "min_confidence", 0.0) is None:   # --min-confidence left out: the preset's tree's stop
        args.min_confidence = preset.min_confidence if preset_tree else 0.0
    if args.tree is None:
        args.tree = FALLBACK["tree"]
    return preset if used else None


def _apply_path(args, preset: Preset | None) -> bool:
    """Fill --kernel / --compile left out (None): the preset's where the user gave neither and
    their --no-pack, --dtype and --device leave the path free (the packed CPU kernels run fp32
    on the CPU), else the command's own defaults. Whether the preset supplied them."""
    free = (args.kernel is None and args.compile is None and preset is not None and not args.no_pack
            and args.dtype in ("auto", "float32") and str(args.device) == "cpu")
    if args.kernel is None:
        args.kernel = preset.kernel if free else "auto"
    if args.compile is None:
        args.compile = preset.compile if free else False
    return free and (preset.kernel != "auto" or preset.compile)


def apply_serve_preset(args, cpu: CpuInfo | None = None) -> Preset | None:
    """``treespec serve``: fill the --drafter, --kernel and --compile the user left out (None)
    from the target's serving preset for this CPU kind (else eagle3 on the CPU's own path;
    --kernel / --compile as for ``generate``), and the tree (--budget, --tree, --min-confidence,
    --draft-max-batch) where the user gave none of them nor another drafter: the preset's,
    else --budget auto. Returns the preset where it supplied something."""
    preset = SERVE_PRESETS.get(args.model, {}).get((cpu if cpu is not None else cpu_info()).kind)
    used = _apply_path(args, preset)
    if args.drafter is None:
        args.drafter, used = (preset.drafter, True) if preset is not None else (FALLBACK["drafter"], used)
    shaped = any(getattr(args, name) is not None for name in ("budget", "tree", "min_confidence", "draft_max_batch"))
    if not shaped and preset is not None and args.drafter == preset.drafter:
        args.budget, used = preset.budget, True
        if preset.budget != "auto":
            args.tree, args.min_confidence, args.draft_max_batch = (preset.tree, preset.min_confidence,
                                                                    preset.draft_max_batch)
    if args.budget is None:
        args.budget = "auto"
    if args.budget != "auto":
        args.tree = args.tree or FALLBACK["tree"]
        args.min_confidence = args.min_confidence or 0.0
    return preset if used else None
