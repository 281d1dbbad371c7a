"""Side-by-side timing of two versions of the block kernel (``treespec/fastpath/csrc/panel_gemm.cpp``):
two git revisions, or (``--isas``) its AVX2 and AVX-512 code.

Compiles the kernel source at a git revision (``--base``, default HEAD) and the working tree's,
under two module names in one process, then times one forward's worth of linear layers of
SmolLM2-135M's shapes (30 layers of q, k, v, o, gate, up, down as 4-bit blocks, the LM head as
8-bit blocks: 112 MB, so weights stream from DRAM as in a real pass) for n rows, both versions
interleaved rep by rep on the same weights and inputs. Each version's blobs come from its own
revision's ``pack_blocks`` (a revision may lay the blocks out differently). Before timing, each
version's outputs are compared with float64 on the first layer's seven weights and the LM head
(the table's header gives the largest error) and with each other's (the same bits or not: a
revision may add in another order). ``--isa avx512`` runs both on their AVX-512 code (default:
AVX2, the code every revision has).

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py --base HEAD --reps 15

With a clean working tree both builds are the same source: an A/A run, which measures the noise
floor a kernel change must clear on this machine (``results/kernel_aa_avx2.md``: within 4 % at
41 reps, but identical tiles have differed by up to 13 % between runs on a busy host).

``--kernel x8`` times the 8-bit-input kernel (``x8_linear_blocks``) instead, on each revision's
``x8_records`` of the same blocks (its outputs carry x's 8-bit rounding, so its error against
float64 is that rounding's, ~1e-2):

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py --kernel x8 --base HEAD~1 --reps 21

``--attention`` times the row attention kernel (``row_attention``: each query row over the keys
its mask allows, with the operations it would get alone; the amx path's attention) of the two revisions instead: one forward's
worth of it (30 layers, each its own cache of ``--prefix`` keys: SmolLM2's 9 query heads over 3
key/value heads of 64) for an n-node tree (a random one, the same for both) after the prefix:

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py --base HEAD~1 --attention --reps 15 --out benchmarks/results/kernel_ab_row_attention

``--isas`` compares instead the working tree's kernel built once and run with its AVX2 and its
AVX-512 code (the latter only on a CPU with AVX-512 F), the same bits by construction:

    OMP_NUM_THREADS=1 python benchmarks/kernel_ab.py --isas --reps 15 --out benchmarks/results/kernel_isa_amx

Writes benchmarks/results/kernel_ab.{json,md}: median ms per n for each version, their ratio, the
GFLOP/s they reach, their errors, and the CPU model, flags and threads.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from harness import RESULTS, interleaved, machine_info, median_ms, write_results
from treespec.fastpath.kernels import ISAS, SOURCE, _isa_index, compile_kernel, kernel_isa, pack_blocks
# SmolLM2-135M: hidden 576, 9 query heads and 3 key-value heads of 64, MLP 1536, vocab 49152
LAYER = (("q", 576, 576), ("k", 192, 576), ("v", 192, 576), ("o", 576, 576),
         ("gate", 1536, 576), ("up", 1536, 576), ("down", 576, 1536))
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
# --shapes qwen: a slice of Qwen2.5-Coder-1.5B Q4_K_M (hidden 1536, MLP 8960, 2 key-value heads
# of 128): 4 of its 28 layers, v and down as 6-bit blocks in every other one (Q4_K_M gives 14 of
# each Q6_K), and 1/8 of its 6-bit LM head: the same mix of 4- and 6-bit work, in 1/7 of the bytes
QWEN = {"layer": (("q", 1536, 1536, 4), ("k", 256, 1536, 4), ("v", 256, 1536, 4), ("o", 1536, 1536, 4),
                  ("gate", 8960, 1536, 4), ("up", 8960, 1536, 4), ("down", 1536, 8960, 4)),
        "layers": 4, "head": (151936 // 8 // 16 * 16, 1536, 6)}
# --shapes qwen-6bit: its 6-bit work alone, the whole LM head and 7 of the 14 6-bit down projections
QWEN_6BIT = [(1536, 8960, 6)] * 7 + [(151936 // 16 * 16, 1536, 6)]


def weight_shapes(shapes: str) -> list[tuple[int, int, int]]:
    """(n, k, bits) of every weight of one timed pass: SmolLM2-135M's (the LM head as 8-bit
    blocks), the Qwen slice above or its 6-bit matrices."""
    if shapes == "smollm2":
        return [(n, k, 4) for _ in range(LAYERS) for _, n, k in LAYER] + [(VOCAB, HIDDEN, 8)]
    if shapes == "qwen-6bit":
        return list(QWEN_6BIT)
    out = []
    for i in range(QWEN["layers"]):
        for name, n, k, bits in QWEN["layer"]:
            out.append((n, k, 6 if name in ("v", "down") and i % 2 else bits))
    return out + [QWEN["head"]]


def exact_blocks(n: int, k: int, bits: int, gen: torch.Generator, k_quant: bool = False) -> torch.Tensor:
    """A random [n, k] fp32 weight that is exactly GGUF Q4_1 (bits 4), Q6_K's form (bits 6: q in
    -32..31, an fp32 scale a 16 values) or Q8_0 (bits 8). ``k_quant`` (bits 4 and 6): the scales
    in GGUF Q4_K's and Q6_K's own form, an fp16 number per 256 values times a 6-bit (Q6_K: 8-bit)
    integer per block, as Qwen2.5-Coder's file has them."""
    if bits == 6:
        q = torch.randint(-32, 32, (n, k // 16, 16), generator=gen).float()
        q[..., 0], q[..., 1] = -32, 31
        if k_quant:
            sc = torch.randint(-128, 128, (n, k // 256, 16, 1), generator=gen).float()
            big = (torch.rand(n, k // 256, 1, 1, generator=gen) * 1e-5 + 1e-6).half().float()
            d = (big * sc).reshape(n, k // 16, 1)
        else:
            d = (torch.rand(n, k // 16, 1, generator=gen) * 1e-3 + 1e-4).half().float()   # q d exact in fp32
        return (q * d).reshape(n, k)
    if bits == 4:
        q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
        q[..., 0], q[..., 1] = 0, 15                         # the block's min and max on the grid
        if k_quant:
            sc, mc = torch.randint(1, 64, (2, n, k // 256, 8, 1), generator=gen).float()
            big_d, big_m = (torch.rand(2, n, k // 256, 1, 1, generator=gen) * 1e-3 + 1e-4).half().float()
            d, m = (big_d * sc).reshape(n, k // 32, 1), (-(big_m * mc)).reshape(n, k // 32, 1)
        else:
            d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
            m = (-torch.rand(n, k // 32, 1, generator=gen) * 0.05).half().float()
    else:
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
        q[..., 0] = 127
        d = (torch.rand(n, k // 32, 1, generator=gen) * 1e-3 + 1e-4).half().float()
        m = torch.zeros(n, k // 32, 1)
    return (q * d + m).reshape(n, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision of the kernel to compare against")
    ap.add_argument("--ns", default="1,2,3,4,5,6,7,8,12,16")
    ap.add_argument("--isas", action="store_true",
                    help="compare the working tree's AVX2 and AVX-512 kernels instead of two revisions")
    ap.add_argument("--isa", choices=ISAS, default="avx2",
                    help="the code both revisions run (avx512: only on a CPU with AVX-512 F, and only for "
                         "revisions whose kernel has it)")
    ap.add_argument("--kernel", choices=("blocks", "x8"), default="blocks",
                    help="blocks: the fp32 block kernel (panel_linear_blocks); x8: the 8-bit-input kernel "
                         "(x8_linear_blocks, AVX2 code only) on x8_records of the same blocks")
    ap.add_argument("--attention", action="store_true",
                    help="time the row attention kernel of the two revisions instead of the block kernel")
    ap.add_argument("--prefix", type=int, default=300, help="cached keys before the tree (--attention)")
    ap.add_argument("--shapes", choices=("smollm2", "qwen", "qwen-6bit"), default="smollm2",
                    help="whose linear layers one point times (qwen: a slice of Qwen2.5-Coder-1.5B Q4_K_M; "
                         "qwen-6bit: its 6-bit matrices)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "kernel_ab"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ns = [int(v) for v in args.ns.split(",")]
    if args.kernel == "x8" and (args.isas or args.attention or args.isa != "avx2"):
        raise SystemExit("--kernel x8 times the x8 kernel's AVX2 code: drop --isas, --attention and --isa")
    if args.isas:
        if kernel_isa() != "avx512":
            raise SystemExit("--isas needs a CPU with AVX-512 F (this one runs the AVX2 kernels only)")
        module = compile_kernel(SOURCE, "treespec_panel_gemm_ab_work")
        versions = {"AVX2": (module, 0, pack_blocks), "AVX-512": (module, 1, pack_blocks)}   # the module's isa numbers
    else:
        if args.isa == "avx512" and kernel_isa() != "avx512":
            raise SystemExit("--isa avx512 needs a CPU with AVX-512 F")
        versions = revisions(args.base, None if args.isa == "avx2" else ISAS.index(args.isa))
    (bench_attention if args.attention else bench)(versions, ns, args)


def revisions(base: str, isa: int | None) -> dict:
    """The kernel at git revision ``base`` and the working tree's, each with its own revision's
    ``pack_blocks``, on the code numbered ``isa`` (None: the module's default, AVX2)."""
    root = Path(__file__).resolve().parent.parent
    rev = subprocess.run(["git", "rev-parse", "--short", base], cwd=root, capture_output=True, text=True,
                         check=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp())

    def old_file(path: Path, name: str) -> Path:
        text = subprocess.run(["git", "show", f"{rev}:{path.relative_to(root)}"], cwd=root, capture_output=True,
                              text=True, check=True).stdout
        (tmp / name).write_text(text)
        return tmp / name

    kernels_py = Path(__file__).resolve().parent.parent / "treespec" / "fastpath" / "kernels.py"
    spec = importlib.util.spec_from_file_location(f"kernels_{rev}", old_file(kernels_py, f"kernels_{rev}.py"))
    old_kernels = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old_kernels     # its dataclasses look their module up
    spec.loader.exec_module(old_kernels)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", str(SOURCE), str(kernels_py)],
                           cwd=root).returncode != 0
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()
    return {f"base {rev}": (compile_kernel(old_file(SOURCE, f"panel_gemm_{rev}.cpp"), f"treespec_panel_gemm_ab_{rev}"),
                            isa, old_kernels.pack_blocks),
            "working tree" if dirty else f"HEAD {head}": (compile_kernel(SOURCE, "treespec_panel_gemm_ab_work"), isa,
                                                          pack_blocks)}


def measure(versions: dict, ns: list[int], reps: int, one_pass, error_of) -> tuple[list, bool, dict, dict]:
    """One pass of each version per n to warm up and check it (``error_of(n, outputs)``: its error
    against float64; whether the versions give the same bits), then ``one_pass(version, n)`` timed
    for every version and n, interleaved. Returns (names, same bits, largest error by name,
    median ms by name and n)."""
    names = list(versions)
    same_bits, error = True, {v: 0.0 for v in names}
    for n in ns:
        outs = [one_pass(versions[v], n) for v in names]
        same_bits &= all(torch.equal(a, b) for a, b in zip(*outs))
        for v, out in zip(names, outs):
            error[v] = max(error[v], error_of(n, out))
    samples = interleaved({(v, n): (lambda v=v, n=n: one_pass(versions[v], n)) for v in names for n in ns},
                          reps, warmup=0)
    return names, same_bits, error, {v: {n: median_ms(samples[(v, n)]) for n in ns} for v in names}


def bench(versions: dict, ns: list[int], args) -> None:
    """Times and writes ``versions`` (name -> (module, isa number or None for the default, pack_blocks))."""
    gen = torch.Generator().manual_seed(0)
    shapes = weight_shapes(args.shapes)
    qwen = args.shapes.startswith("qwen")
    weights = [exact_blocks(n, k, bits, gen, k_quant=qwen) for n, k, bits in shapes]
    first = len(QWEN["layer"]) if qwen else len(LAYER)
    packers = {version[2] for version in versions.values()}
    def layout(packer):   # x8: each revision's pack_blocks, then its x8 records (pack_blocks' own module)
        if args.kernel != "x8":
            return packer
        return lambda w: sys.modules[packer.__module__].x8_records(packer(w))
    blobs = {packer: [layout(packer)(w) for w in weights] for packer in packers}   # one set per layout
    checked = list(range(first)) + [len(weights) - 1]   # the first layer's seven weights and the LM head
    exact = {i: weights[i] for i in checked}                     # kept for the float64 reference
    del weights
    macs = sum(-(-n // 16) * 16 * k for n, k, _ in shapes)
    xs = {n: {k: torch.randn(n, k, generator=gen) for k in {k for _, k, _ in shapes}} for n in ns}

    def one_pass(version: tuple, n: int) -> list[torch.Tensor]:
        mod, isa, packer = version
        if args.kernel == "x8":
            # x8k records (K-quants' scales; revisions before them never make any): 256 k a record
            return [mod.x8_linear_blocks(xs[n][b.blob.shape[1] * 256], b.blob, b.bits, False, True)
                    if getattr(b, "layout", "") == "x8k" else
                    mod.x8_linear_blocks(xs[n][b.blob.shape[1] * 32], b.blob, b.bits, b.half_scales)
                    for b in blobs[packer]]

        def extra(b) -> tuple:   # an older revision's module takes no isa, nor fp16 scales
            if getattr(b, "half_scales", False):
                return (0 if isa is None else isa, True)
            return () if isa is None else (isa,)
        return [mod.panel_linear_blocks(xs[n][b.blob.shape[1] * 32], b.blob, b.bits, *extra(b)) for b in blobs[packer]]

    def error_of(n: int, out: list[torch.Tensor]) -> float:   # on the checked layers, relative to the largest output
        refs = {i: xs[n][exact[i].shape[1]].double() @ exact[i].double().T for i in checked}
        return max(float(((out[i].double() - ref).abs() / ref.abs().max()).max()) for i, ref in refs.items())

    names, same_bits, error, ms = measure(versions, ns, args.reps, one_pass, error_of)
    write_ab(args, "x8 block kernel A/B" if args.kernel == "x8" else "Block kernel A/B", names, same_bits, ms, ns,
             f"{args.isa if not args.isas else 'each ISA'}'s code. One point = "
             + {"smollm2": "every linear layer of one SmolLM2-135M forward",
                "qwen": "4 layers and 1/8 of the LM head of Qwen2.5-Coder-1.5B Q4_K_M (4- and 6-bit blocks)",
                "qwen-6bit": "the LM head and 7 down projections of Qwen2.5-Coder-1.5B Q4_K_M (its Q6_K matrices, "
                             "6-bit blocks)"}[args.shapes]
             + f" ({macs / 1e6:.1f} M weights as blocks) over n rows",
             ("relative_error", "largest error against float64 on the first layer's seven weights and the LM head, "
                                "relative to the output's largest magnitude" + (" (x rounded to 8 bits a block: ~1e-2 "
                                "is that rounding, not an error of the kernel)" if args.kernel == "x8" else ""), error),
             ("GFLOP/s", lambda v, n: f"{2 * macs * n / ms[v][n] / 1e6:.0f}"), {"weights": macs})


def write_ab(args, title: str, names: list, same_bits: bool, ms: dict, ns: list[int], setup: str, error: tuple,
             extra: tuple, data: dict | None = None) -> None:
    """Prints and writes an A/B of ``names`` (``measure``'s results): ``setup`` says what one
    point is; ``error`` = (JSON key, what the error is, error by name); ``extra`` = (a column's
    name, cell(name, n)) shown for each version."""
    a, b = names
    key, what, err = error
    column, cell = extra
    m = machine_info()
    lines = [f"# {title}: {a} vs {b}", "",
             f"CPU: {m['cpu_model']}; flags: {', '.join(m['cpu_flags'])}; torch {m['torch']}, "
             f"{m['torch_threads']} thread(s), {setup}; medians of {args.reps} interleaved reps.", "",
             f"Outputs: {'the same bits in both versions' if same_bits else 'the versions differ in the last bits'}; "
             f"{what}: {a} {err[a]:.1e}, {b} {err[b]:.1e}.", "",
             f"| n | {a} ms | {b} ms | {b} / {a} | {a} {column} | {b} {column} |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n in ns:
        lines.append(f"| {n} | {ms[a][n]:.2f} | {ms[b][n]:.2f} | {ms[b][n] / ms[a][n]:.2f} | {cell(a, n)} | {cell(b, n)} |")
    md = "\n".join(lines) + "\n"
    print(md)
    write_results(args.out, {"machine": m, "args": vars(args), "versions": names, "same_bits": same_bits, key: err,
                             "t_ms": {v: {str(n): t for n, t in row.items()} for v, row in ms.items()}, **(data or {})}, md)


def bench_attention(versions: dict, ns: list[int], args) -> None:
    """Times and writes the row attention of ``versions`` (as for :func:`bench`) for n-node trees."""
    from treespec.core.masks import hf_tree_mask
    from treespec.core.tree import DraftTree

    heads, kv_heads, d, p = 9, 3, 64, args.prefix
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for n in ns:
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        tree = DraftTree(torch.arange(n), torch.tensor(parents), sampling="deterministic")
        mask = hf_tree_mask(tree, p, "sdpa", torch.float32, None)
        q = torch.randn(LAYERS, 1, n, heads, d, generator=gen).transpose(2, 3)   # HF's layout: a transposed view
        kv = torch.randn(LAYERS, 2, 1, kv_heads, p + n, d, generator=gen)
        cases[n] = (q, kv, mask)

    def one_pass(version: tuple, n: int) -> list[torch.Tensor]:
        q, kv, mask = cases[n]
        isa = _isa_index(None) if version[1] is None else version[1]   # the module's default is AVX-512's code
        return [version[0].row_attention(q[i], kv[i, 0], kv[i, 1], mask, d ** -0.5, isa) for i in range(LAYERS)]

    def error_of(n: int, out: list[torch.Tensor]) -> float:   # the first layer's, absolute
        q, kv, mask = cases[n]
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[0].double(), kv[0, 0].double(), kv[0, 1].double(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
        return float((out[0].double() - ref).abs().max())

    names, same_bits, error, ms = measure(versions, ns, args.reps, one_pass, error_of)
    write_ab(args, "Row attention A/B", names, same_bits, ms, ns,
             f"one point = the row attention of one SmolLM2-135M forward ({LAYERS} layers, {heads} query heads over "
             f"{kv_heads} key/value heads of {d}, each layer its own cache of {p} keys) for a random n-node tree after them",
             ("absolute_error", "largest absolute error against float64 SDPA on the first layer", error),
             ("ms a row", lambda v, n: f"{ms[v][n] / n:.3f}"))


if __name__ == "__main__":
    main()
