"""The real pair: Qwen2.5-Coder-1.5B as target, every way of speeding it up side by side.

Needs the parts (``make models-qwen``). Prompts: the MT-bench coding and reasoning first turns
plus 10 code-editing prompts that restate the code to change (where prompt lookup should
shine), through the chat template. Per prompt and temperature, interleaved (machine noise hits
all methods alike):

- ``hf``           HF ``generate`` on the stock layers (the plain-decoding baseline);
- ``hf-packed``    HF ``generate`` on treespec's packed layers (``pack_linears``: the same target);
- ``hf-assisted``  HF assisted generation with the 0.5B as assistant model;
- ``hf-lookup``    HF prompt lookup decoding (``prompt_lookup_num_tokens``);
- treespec on the packed path: the 0.5B on a chain and on a dynamic tree, ``lookup`` (chain),
  ``hybrid`` (lookup + the 0.5B, best-first tree) and ``builder="auto"`` with the 0.5B where
  the machine has a calibration of this target (else the row says why it is missing).

Reported per (method, T): tokens/s (new tokens / (prefill + decode) seconds, pooled), τ, the
draft / verify time split, speedup over ``hf`` at the same T, and at T = 0 whether every
output equals plain greedy decoding token for token. The machine (CPU model, flags, threads) is
recorded from ``treespec.fastpath.packing.machine_info()``.

    python benchmarks/qwen.py                                           # full: all prompts x 128 tokens
    python benchmarks/qwen.py --prompts 1 --max-new-tokens 8 --out /tmp/qwen   # smoke (REDUCED)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import treespec
from treespec.data import mtbench_questions
from treespec.drafters import HybridDrafter, ModelDrafter
from treespec.fastpath.packing import PackedLinear, machine_info, machine_line

sys.path.insert(0, str(Path(__file__).parent))
from drafters import Pool, vanilla  # noqa: E402  (the harness's pooled counters and HF baseline)

RESULTS = Path(__file__).parent / "results"
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"

_EDIT_CODE = [
    ("Rename the function `calc` to `total_price` everywhere",
     "def calc(items, tax):\n    s = 0\n    for it in items:\n        s += it.price * it.qty\n"
     "    return s * (1 + tax)\n\n\ndef report(items):\n    print('total', calc(items, 0.2))\n"),
    ("Add type hints to every function",
     "def mean(xs):\n    return sum(xs) / len(xs)\n\n\ndef var(xs):\n    m = mean(xs)\n"
     "    return sum((x - m) ** 2 for x in xs) / len(xs)\n"),
    ("Replace the for loop with a list comprehension",
     "def squares(n):\n    out = []\n    for i in range(n):\n        if i % 2 == 0:\n"
     "            out.append(i * i)\n    return out\n"),
    ("Make the function raise ValueError on an empty list instead of returning None",
     "def first(xs):\n    if not xs:\n        return None\n    return xs[0]\n\n\ndef last(xs):\n"
     "    if not xs:\n        return None\n    return xs[-1]\n"),
    ("Convert this class to a dataclass",
     "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
     "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"),
    ("Add a docstring to each function",
     "def load(path):\n    with open(path) as f:\n        return f.read().splitlines()\n\n\n"
     "def save(path, lines):\n    with open(path, 'w') as f:\n        f.write('\\n'.join(lines))\n"),
    ("Use pathlib instead of os.path",
     "import os\n\n\ndef find(root, ext):\n    out = []\n    for d, _, files in os.walk(root):\n"
     "        for f in files:\n            if os.path.splitext(f)[1] == ext:\n"
     "                out.append(os.path.join(d, f))\n    return out\n"),
    ("Change the default timeout from 10 to 30 seconds",
     "import requests\n\n\ndef fetch(url, timeout=10):\n    r = requests.get(url, timeout=timeout)\n"
     "    r.raise_for_status()\n    return r.json()\n\n\ndef fetch_all(urls, timeout=10):\n"
     "    return [fetch(u, timeout) for u in urls]\n"),
    ("Log with the logging module instead of print",
     "def process(rows):\n    print('start', len(rows))\n    done = 0\n    for r in rows:\n"
     "        if r is None:\n            print('skip empty row')\n            continue\n        done += 1\n"
     "    print('done', done)\n    return done\n"),
    ("Make `retry` take the number of attempts as an argument (default 3)",
     "import time\n\n\ndef retry(fn):\n    for attempt in range(3):\n        try:\n            return fn()\n"
     "        except OSError:\n            time.sleep(2 ** attempt)\n    raise RuntimeError('gave up')\n"),
]
EDIT_PROMPTS = [f"{task}. Reply with the whole changed code.\n\n```python\n{code}```" for task, code in _EDIT_CODE]


def prompts(limit: int | None) -> list[tuple[str, str]]:
    """(kind, text): MT-bench coding and reasoning first turns, then the code-editing prompts."""
    mt = [(q.category, q.turns[0]) for q in mtbench_questions() if q.category in ("coding", "reasoning")]
    out = mt + [("code-edit", p) for p in EDIT_PROMPTS]
    return out[:limit] if limit else out


class StockLayers:
    """Context manager: the packed model's ``PackedLinear`` modules swapped for their plain
    ``nn.Linear`` (same parameters) and back, without re-packing."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.swapped: list[tuple[torch.nn.Module, str, PackedLinear]] = []

    def __enter__(self):
        for parent in list(self.model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, PackedLinear):
                    self.swapped.append((parent, name, child))
                    setattr(parent, name, child.unpacked())
        return self

    def __exit__(self, *exc):
        for parent, name, packed in self.swapped:
            setattr(parent, name, packed)
        self.swapped.clear()


def hf_timed(model, ids: torch.Tensor, eos: list[int], max_new: int, temperature: float, seed: int,
             **extra) -> tuple[list[int], float]:
    """(new tokens, seconds) of HF ``generate`` with ``extra`` (assistant_model=, prompt_lookup_num_tokens=)."""
    torch.manual_seed(seed)
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
              repetition_penalty=None, top_p=None, top_k=None, temperature=temperature if temperature > 0 else None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], **kw, **extra)
        dt = time.perf_counter() - t0
    return out[0, ids.numel():].tolist(), dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=None, help="first N prompts (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "qwen"))
    ap.add_argument("--note", default="shared 2-core CPU", help="the machine's state, for the table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"[{machine_line(machine_info())}]", file=sys.stderr, flush=True)
    temps = [float(t) for t in args.temperatures.split(",")]
    items = prompts(args.prompts)
    reduced = args.prompts is not None or args.max_new_tokens < 128

    target = treespec.load_target(TARGET, dtype=torch.float32)       # packed where the CPU gains
    small = treespec.load_drafter(DRAFT, target)                      # ModelDrafter, packed like the target
    eos = list(target.eos_token_ids)
    methods: dict[str, object] = {
        "0.5b chain4": treespec.SpeculativeGenerator(target, small, treespec.ChainBuilder(4)),
        "0.5b tree16": treespec.SpeculativeGenerator(
            target, ModelDrafter(small.model, target.vocab_size), treespec.DynamicTreeBuilder(16, 5, 4)),
        "lookup chain8": treespec.SpeculativeGenerator(target, "lookup", treespec.ChainBuilder(8)),
        "hybrid best16": treespec.SpeculativeGenerator(
            target, HybridDrafter(ModelDrafter(small.model, target.vocab_size)),
            treespec.BestFirstBuilder(budget=16, max_width=4, max_rounds=7)),
    }
    missing: dict[str, str] = {}
    try:
        methods["0.5b auto"] = treespec.SpeculativeGenerator(target, ModelDrafter(small.model, target.vocab_size),
                                                              "auto")
    except (ValueError, FileNotFoundError) as e:
        missing["0.5b auto"] = str(e)

    pools: dict[tuple[str, float], Pool] = {}
    greedy_equal: dict[str, list[bool]] = {}
    start = time.time()
    for i, (kind, text) in enumerate(items):
        ids = methods["lookup chain8"].encode(text)
        for temp in temps:
            seed = args.seed * 1000 + i
            with StockLayers(target.model):
                ref, dt = hf_timed(target.model, ids, eos, args.max_new_tokens, temp, seed)
            base = pools.setdefault(("hf", temp), Pool())
            base.tokens, base.seconds = base.tokens + len(ref), base.seconds + dt
            for name, extra in (("hf-packed", {}), ("hf-assisted", {"assistant_model": small.model}),
                                ("hf-lookup", {"prompt_lookup_num_tokens": 10})):
                out, dt = hf_timed(target.model, ids, eos, args.max_new_tokens, temp, seed, **extra)
                pool = pools.setdefault((name, temp), Pool())
                pool.tokens, pool.seconds = pool.tokens + len(out), pool.seconds + dt
                if temp == 0:
                    greedy_equal.setdefault(name, []).append(out == ref)
            for name, gen in methods.items():
                res = gen.generate(ids, args.max_new_tokens, temperature=temp, seed=seed)
                pools.setdefault((name, temp), Pool()).add_stats(res.stats)
                if temp == 0:
                    greedy_equal.setdefault(name, []).append(res.token_ids.tolist() == ref)
        print(f"[{i + 1}/{len(items)} {kind}] {time.time() - start:.0f} s", file=sys.stderr, flush=True)
        save(Path(args.out), report(args, temps, items[: i + 1], reduced, pools, greedy_equal, missing,
                                    target.speed_path, time.time() - start))


def report(args, temps, items, reduced, pools, greedy_equal, missing, speed_path, seconds) -> dict:
    rows = []
    for temp in temps:
        base = pools[("hf", temp)]
        base_tps = base.tokens / base.seconds if base.seconds else None
        for (name, t), pool in pools.items():
            if t == temp:
                equal = greedy_equal.get(name) if temp == 0 else None
                rows.append({"method": name, "temperature": temp, **pool.row(None if name == "hf" else base_tps),
                             "greedy_equal": None if equal is None else f"{sum(equal)}/{len(equal)}"})
    kinds = sorted({k for k, _ in items})
    return {
        "config": {"target": TARGET, "drafter": DRAFT, "prompts": len(items),
                   "prompt_kinds": {k: sum(1 for kk, _ in items if kk == k) for k in kinds},
                   "max_new_tokens": args.max_new_tokens, "temperatures": temps, "threads": args.threads,
                   "seed": args.seed, "reduced": reduced, "speed_path": speed_path},
        "machine": {"note": args.note, **machine_info(), "torch_threads": args.threads},
        "wall_minutes": round(seconds / 60, 1),
        "missing": missing,
        "rows": rows,
    }


def save(out: Path, result: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    c = result["config"]
    lines = [f"# Qwen2.5-Coder-1.5B with its 0.5B sibling ({'REDUCED' if c['reduced'] else 'full'} configuration)",
             "",
             f"{c['prompts']} prompts ({', '.join(f'{n} {k}' for k, n in c['prompt_kinds'].items())}) x "
             f"{c['max_new_tokens']} new tokens, T in {c['temperatures']}, fp32, {result['machine']['note']}; "
             f"wall {result['wall_minutes']} min. Target path: {c['speed_path']}.",
             machine_line(result["machine"]),
             "speedup is tokens/s over `hf` (stock HF generate) at the same T; greedy = outputs equal to "
             "`hf` token for token at T = 0.",
             "",
             "| T | method | τ | draft / verify ms per step | tokens/s | speedup | greedy |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cost = f"{r['draft_ms_per_step']:.0f} / {r['verify_ms_per_step']:.0f}" if "steps" in r else "-"
        lines.append(f"| {r['temperature']:g} | {r['method']} | {r.get('tau', 1.0):.2f} | {cost} | "
                     f"{r['tokens_per_s']:.2f} | {r.get('speedup', 1.0):.2f} | {r['greedy_equal'] or '-'} |")
    for name, why in result["missing"].items():
        lines.append(f"\n{name}: not run: {why}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
