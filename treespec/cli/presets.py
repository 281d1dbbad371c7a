"""The configuration ``treespec generate`` / ``demo`` / ``serve`` run when the user names no drafter or
tree: per target, the fastest treespec configuration measured on this kind of CPU, with the
result file that measured it. A flag the user gives always wins; only the missing ones come from
here.

``serve`` takes only the drafter from here (``SERVE_PRESETS``): its tree is always ``--budget
auto`` unless given, the one tree choice that follows a batch size changing from step to step
(a fixed tree that pays at batch 1 loses at batch 8).

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

    def describe(self) -> str:
        tree = "builder='auto'" if self.budget == "auto" else f"{self.tree}:{self.budget}"
        return f"--drafter {self.drafter}, {tree} (the fastest measured: {self.source})"


_SMOLLM2 = Preset("hybrid", "dynamic", "auto",
                  "hybrid with builder='auto' is treespec's fastest row on every CPU kind measured: "
                  "engine_amx.md 1.52x, llamacpp_avx512bf16.md 1.39x, llamacpp_avx2.md 1.16-1.20x its plain decoding")
_QWEN = Preset("qwen2.5-coder-0.5b", "chain", "5",
               "the 0.5B drafting a chain of 4: 1.61x plain decoding in qwen_avx512bf16.md, its fastest row at T = 0 "
               "that a flag can name")



def _on_every_kind(preset: Preset) -> dict[str, Preset]:
    """One preset for every CPU kind (``CpuInfo.kind``) measured so far."""
    return {kind: preset for kind in ("amx", "avx512bf16", "avx2")}


PRESETS: dict[str, dict[str, Preset]] = {
    "smollm2-135m": _on_every_kind(_SMOLLM2),
    "qwen2.5-coder-1.5b": _on_every_kind(_QWEN),
}

_SERVE_SMOLLM2 = Preset("eagle3", "dynamic", "auto",
                        "eagle3 with --budget auto is the serving configuration load-tested in serve_load_avx2.md "
                        "(1.07x the plain server at c = 1, plain decoding from batch 2 on)")
_SERVE_QWEN = Preset("qwen2.5-coder-0.5b", "dynamic", "auto",
                     "the 0.5B is the drafter of the target's fastest nameable row (qwen_avx512bf16.md); --budget "
                     "auto sizes its tree for each batch size from this machine's calibration")

SERVE_PRESETS: dict[str, dict[str, Preset]] = {
    "smollm2-135m": _on_every_kind(_SERVE_SMOLLM2),
    "qwen2.5-coder-1.5b": _on_every_kind(_SERVE_QWEN),
}


def best_preset(model: str, cpu: CpuInfo | None = None) -> Preset | None:
    """The fastest measured configuration of ``model`` on this CPU kind, or None where none was
    measured (the command's own defaults apply)."""
    return PRESETS.get(model, {}).get((cpu if cpu is not None else cpu_info()).kind)


FALLBACK = {"drafter": "eagle3", "tree": "dynamic", "budget": "16"}   # a target without a preset


def apply_preset(args, cpu: CpuInfo | None = None) -> Preset | None:
    """Fill the --drafter / --tree / --budget the user left out (None) from the target's preset:
    no tree flag and no budget: the preset's tree and budget; a tree without a budget: budget 16,
    as before presets. Returns the preset where it supplied something."""
    preset = best_preset(args.model, cpu)
    used = False
    if args.drafter is None:
        args.drafter, used = (preset.drafter, True) if preset else (FALLBACK["drafter"], used)
    if args.budget is None:
        if args.tree is None and preset is not None:
            args.tree, args.budget, used = preset.tree, preset.budget, True
        else:
            args.budget = FALLBACK["budget"]
    if args.tree is None:
        args.tree = FALLBACK["tree"]
    return preset if used else None


def apply_serve_preset(args, cpu: CpuInfo | None = None) -> Preset | None:
    """``treespec serve``: fill the --drafter the user left out (None) from the target's serving
    preset for this CPU kind (else eagle3); --budget keeps its own default, auto. Returns the
    preset where it supplied the drafter."""
    if args.drafter is not None:
        return None
    preset = SERVE_PRESETS.get(args.model, {}).get((cpu if cpu is not None else cpu_info()).kind)
    args.drafter = preset.drafter if preset is not None else FALLBACK["drafter"]
    return preset
