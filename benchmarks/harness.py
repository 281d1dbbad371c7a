"""The benchmark harness: what every script in ``benchmarks/`` shares.

A script imports what it needs with ``from harness import ...`` (Python puts a script's own
folder on ``sys.path``; nothing here edits it). The harness holds:

- the machine: ``machine_info`` (CPU model, relevant flags, threads, torch version, load) and
  ``machine_line``, recorded in every result file so runs on different machines are never
  compared blindly;
- timing: ``time_calls`` (one case), ``interleaved`` (many cases in a shuffled order per
  repetition, so machine noise hits every case alike), ``median_ms``, ``summarise``;
- writers: ``write_results`` (``<out>.json`` and ``<out>.md`` side by side), ``write_json``,
  ``md_table``;
- plots: ``figure`` and ``save_figure`` (matplotlib without a display);
- workloads used by more than one script: HF baselines (``hf_generate``, ``log_likelihood``),
  synthetic acceptance cases (``make_case``), the drafter picked for builder benchmarks
  (``pick_drafter``) and the MT-bench drafter grid (``drafter_grid``: drafters.py, hybrid.py;
  its trees and counters are also learning_curve.py's).

Nothing here imports torch or treespec at import time: ``vllm_check.py`` runs one phase in a
separate environment without treespec.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


# ---------------------------------------------------------------- the machine
def machine_info() -> dict:
    """CPU model, relevant flags, thread count, torch version and load average of this machine."""
    from treespec.fastpath.packing import machine_info as info

    return info()


def machine_line(info: dict | None = None) -> str:
    """One Markdown line naming the CPU, its relevant flags and the thread count."""
    from treespec.fastpath.packing import machine_line as line

    return line(info if info is not None else machine_info())


# ---------------------------------------------------------------- timing
def time_calls(fn: Callable[[], object], reps: int, warmup: int = 3,
               clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Milliseconds of ``reps`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e3)
    return out


def interleaved(cases: dict[Hashable, Callable[[], object]], reps: int, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter, self_timed: bool = False,
                on_rep: Callable[[int], None] | None = None) -> dict[Hashable, list[float]]:
    """Milliseconds of ``reps`` calls of every case, the cases in a new shuffled order at each
    repetition (seeded by the repetition), so drifts in the machine's speed hit all alike.

    ``self_timed``: each case returns its own seconds (to leave out work it must do after the
    timed part, such as undoing a cache append). ``on_rep(rep)`` runs after each repetition."""
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict[Hashable, list[float]] = {key: [] for key in cases}
    for rep in range(reps):
        order = list(cases)
        random.Random(rep).shuffle(order)
        for key in order:
            t0 = clock()
            seconds = cases[key]()
            samples[key].append((seconds if self_timed else clock() - t0) * 1e3)
        if on_rep is not None:
            on_rep(rep)
    return samples


def median_ms(ms: Iterable[float]) -> float:
    return statistics.median(list(ms))


def measure_bandwidth(reps: int = 5) -> float:
    """Bytes/s of one streaming read of a 1 GiB buffer (median of reps)."""
    import torch

    buf = torch.ones(1 << 28)
    return buf.numel() * 4 / (median_ms(time_calls(buf.sum, reps, warmup=0)) / 1e3)


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes the packed linear layers read per pass (integer blocks or fp32 panels)."""
    from treespec.fastpath.packing import PackedLinear

    return sum(m.packed_nbytes for m in model.modules() if isinstance(m, PackedLinear))


def summarise(ms: Sequence[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile of timings in ms."""
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    return {"median_ms": statistics.median(ms), "p10_ms": deciles[0], "p90_ms": deciles[-1]}


# ---------------------------------------------------------------- writers
def write_json(path: Path | str, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def write_results(out: Path | str, data: dict, markdown: str) -> tuple[Path, Path]:
    """``<out>.json`` (``data``) and ``<out>.md`` (``markdown``); ``out`` has no suffix (or its
    suffix is replaced). Creates the folder. Returns both paths."""
    out = Path(out)
    js = write_json(out.with_suffix(".json"), data)
    md = out.with_suffix(".md")
    md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
    return js, md


def publish(out: Path | str, lines: Sequence[str], command: str, data: dict) -> str:
    """The Markdown ``lines`` and the ``command`` that reproduces them, printed and written with
    ``data`` (this machine and the command added) as ``out``.{json,md}; returns the Markdown."""
    md = "\n".join([*lines, "", f"Reproduce: `{command}`"]) + "\n"
    print(md)
    write_results(out, {"machine": machine_info(), **data, "command": command}, md)
    return md


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | None = None) -> list[str]:
    """Markdown table lines; ``align`` has one letter per column, "l" or "r" (default: all left)."""
    align = align or "l" * len(header)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


# ---------------------------------------------------------------- plots
def figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (7.0, 4.5)):
    """(fig, axes[nrows][ncols]) on matplotlib's file backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=size, squeeze=False)


def save_figure(fig, path: Path | str, dpi: int = 110) -> Path:
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- HF baselines
def hf_generate(model, ids, max_new: int, eos: list[int], temperature: float, seed: int,
                assistant=None, lookup: int = 0):
    """HF ``generate`` of ``ids`` [P]: (new tokens [n], seconds). Greedy at T = 0, else sampled
    at ``temperature`` with ``seed`` and no top-k / top-p; ``assistant`` (a draft model) or
    ``lookup`` (prompt-lookup tokens) turn on HF's own speculative decoding."""
    import torch

    sample = temperature > 0
    kwargs = dict(do_sample=sample, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
                  attention_mask=torch.ones_like(ids)[None], repetition_penalty=None,
                  temperature=temperature if sample else None, top_p=None, top_k=0 if sample else None)
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    torch.manual_seed(seed)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids[None], **kwargs)
        dt = time.perf_counter() - t0
    return out[0, ids.numel():], dt


def log_likelihood(model, ids, new) -> tuple[float, int]:
    """Sum of log p(new token | prefix) under ``model``, and the token count."""
    import torch

    if new.numel() == 0:
        return 0.0, 0
    seq = torch.cat([ids, new])[None]
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[0, ids.numel() - 1:-1].float()
    return float(torch.log_softmax(logits, -1).gather(1, new[:, None]).sum()), int(new.numel())


# ---------------------------------------------------------------- synthetic acceptance cases
# accept.py and accept_rules.py: EAGLE-like trees at serving sizes.
N_NODES = 64
VOCAB = 49_152
LEVELS = (8, 16, 16, 12, 7, 4)  # nodes per depth; 1 + sum = 64
FANOUT = (8, 4, 2, 2, 1, 1)     # children of each expanded node of the previous level, per depth
SCENARIOS = ("accept-few", "reject-all", "worst-walk")


def eagle_parents(expanded_last: bool = False) -> list[int]:
    """Parent pointers of the fixed EAGLE-like tree: level d's nodes hang, FANOUT[d] each, under
    the first nodes of level d - 1 (the last ones if ``expanded_last``)."""
    parents, prev = [-1], [0]
    for size, fan in zip(LEVELS, FANOUT):
        level = []
        hosts = prev[: -(-size // fan)] if not expanded_last else prev[len(prev) - -(-size // fan):]
        for j in range(size):
            parents.append(hosts[j // fan])
            level.append(len(parents) - 1)
        prev = level
    assert len(parents) == N_NODES
    return parents


def make_case(mode: str, scenario: str, seed: int = 0):
    """(DraftTree, target_probs float32 [N, V]) for one sampling mode and target scenario
    (``SCENARIOS``; what each means: accept.py's docstring)."""
    import torch

    from treespec.core.tree import DraftTree

    g = torch.Generator().manual_seed(seed)
    parents = eagle_parents(expanded_last=scenario == "worst-walk")
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    # Drafter: peaked distributions (a few tokens hold most mass), float32 like a softmax.
    logits_q = torch.randn(n, VOCAB, generator=g) * 2.0
    logits_q[:, :16] += 16.0 * torch.rand(n, 16, generator=g)
    q = logits_q.softmax(-1)
    tokens = torch.zeros(n, dtype=torch.long)
    tokens[0] = 1
    for u in range(n):
        if not kids[u]:
            continue
        m = len(kids[u])
        if mode == "with_replacement" and scenario != "worst-walk":  # i.i.d. (repeats allowed)
            xs = torch.multinomial(q[u], m, replacement=True, generator=g)
        elif mode != "deterministic":  # Gumbel-top-k = sequential draws w/o replacement (also
            # a possible, if unlikely, i.i.d. outcome: worst-walk wants distinct siblings)
            gumbel = -torch.log(-torch.log(torch.rand(VOCAB, generator=g)))
            xs = torch.topk(q[u].log() + gumbel, m).indices
        else:  # deterministic: the drafter's top-m
            xs = torch.topk(q[u], m).indices
        tokens[kids[u]] = xs
    noise = (torch.randn(n, VOCAB, generator=g) * 2.0).softmax(-1)
    if scenario == "accept-few":
        p = 0.7 * q + 0.3 * noise
    elif scenario == "reject-all":
        p = noise.clone()
        p[0, tokens[kids[0]]] = 0.0
        p[0] /= p[0].sum()
    elif scenario == "worst-walk":
        p = noise * 1e-3
        for u in range(n):
            if kids[u]:
                expanded = [c for c in kids[u] if kids[c]] or kids[u]
                others = [c for c in kids[u] if c != expanded[-1]]
                p[u, tokens[others]] = 0.0
                p[u, tokens[expanded[-1]]] = 1.0
        p /= p.sum(-1, keepdim=True)
    else:
        raise KeyError(f"unknown scenario {scenario!r}; known: {SCENARIOS}")
    draft = None if mode == "deterministic" else q
    tree = DraftTree(tokens, torch.tensor(parents), draft, mode, VOCAB)
    return tree, p.float().contiguous()


# ---------------------------------------------------------------- drafter for builder benchmarks
TRAINED = ("eagle3", "eagle", "mtp", "medusa", "small")  # trained drafters, used when they load


def pick_drafter(target, name: str | None, probe_prompt: str):
    """(name, drafter): ``name``, else the trained drafter with the highest τ on a held-out
    prompt (EAGLE-2 default tree, T = 0), else "early-exit"."""
    from treespec import DynamicTreeBuilder, SpeculativeGenerator, load_drafter, registered_drafters

    if name:
        return name, load_drafter(name, target)
    found = {}
    for kind in TRAINED:
        if kind in registered_drafters():
            try:
                found[kind] = load_drafter(kind, target)
            except (FileNotFoundError, ValueError) as e:
                print(f"[skip {kind}: {e}]", flush=True)
    if not found:
        return "early-exit", load_drafter("early-exit", target)
    tau = {k: SpeculativeGenerator(target, d, DynamicTreeBuilder()).generate(
        probe_prompt, max_new_tokens=48).stats.tau for k, d in found.items()}
    print(f"[tau of the trained drafters on a held-out prompt: "
          f"{ {k: round(v, 2) for k, v in tau.items()} }]", flush=True)
    best = max(tau, key=tau.get)
    return best, found[best]


# ---------------------------------------------------------------- the MT-bench drafter grid
# drafters.py and hybrid.py: every drafter x tree x temperature on the same prompts, vanilla HF
# decoding first on each prompt. Dynamic trees follow EAGLE-2's depth / top-k growth with the
# budget; best-first trees builders.py's settings (the best τ there at budget 64).
def _trees() -> dict[str, Callable[[], object]]:
    import treespec

    return {
        "chain4": lambda: treespec.ChainBuilder(budget=5),
        "chain8": lambda: treespec.ChainBuilder(budget=9),
        "tree4": lambda: treespec.DynamicTreeBuilder(budget=4, depth=3, top_k=2),
        "tree8": lambda: treespec.DynamicTreeBuilder(budget=8, depth=4, top_k=4),
        "tree16": lambda: treespec.DynamicTreeBuilder(budget=16, depth=5, top_k=4),
        "tree32": lambda: treespec.DynamicTreeBuilder(budget=32, depth=6, top_k=6),
        "tree64": lambda: treespec.DynamicTreeBuilder(budget=64, depth=6, top_k=8),
        "best16": lambda: treespec.BestFirstBuilder(budget=16, max_width=4, max_rounds=7),
        "best32": lambda: treespec.BestFirstBuilder(budget=32, max_width=4),   # issue 28's τ goal tree
        "best64": lambda: treespec.BestFirstBuilder(budget=64, max_width=8, max_rounds=7),
    }


TREE_NAMES = ("chain4", "chain8", "tree4", "tree8", "tree16", "tree32", "tree64", "best16", "best32", "best64")


def make_tree(name: str):
    """A fresh builder for the grid's tree ``name`` (one of ``TREE_NAMES``)."""
    trees = _trees()
    if name not in trees:
        raise KeyError(f"unknown tree {name!r}; known: {', '.join(TREE_NAMES)}")
    return trees[name]()


def vanilla(target, ids, max_new: int, temperature: float, seed: int) -> tuple[int, float]:
    """(new tokens, seconds) of HF generate: greedy at T = 0, sampling at T > 0 (the model's
    generation config otherwise, as the grid has always measured it)."""
    import torch

    eos = list(target.eos_token_ids)
    torch.manual_seed(seed)
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0],
              repetition_penalty=None, top_p=None, top_k=None,
              temperature=temperature if temperature > 0 else None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = target.model.generate(ids[None], **kw)
        dt = time.perf_counter() - t0
    return out.shape[1] - ids.numel(), dt


class Pool:
    """Pooled counters of one (method, T) over prompts."""

    def __init__(self):
        self.tokens = self.steps = self.emitted = 0
        self.seconds = self.draft = self.verify = 0.0
        # the prompts' passes, of ``seconds``: None once a run could not split them off (HF generate)
        self.prefill: float | None = 0.0
        self.prompt_tokens = 0
        self.attempts: list[int] = []
        self.accepts: list[int] = []

    def add_run(self, tokens: int, seconds: float, prefill: float | None = None, prompt_tokens: int = 0) -> None:
        """One generation timed from outside: ``tokens`` new tokens in ``seconds``, of which
        ``prefill`` (None: not known) the prompt's pass over ``prompt_tokens`` tokens."""
        self.tokens += tokens
        self.seconds += seconds
        self.prefill = None if prefill is None or self.prefill is None else self.prefill + prefill
        self.prompt_tokens += prompt_tokens

    def add_stats(self, st) -> None:
        self.tokens += st.new_tokens
        self.steps += st.steps
        self.emitted += round(st.tau * st.steps)
        self.seconds += st.decode_time + st.prefill_time
        self.draft += st.draft_time
        self.verify += st.verify_time
        self.prefill = None if self.prefill is None else self.prefill + st.prefill_time
        self.prompt_tokens += st.prompt_tokens
        for d, (t, a) in enumerate(zip(st.depth_attempts, st.depth_accepts)):
            if d >= len(self.attempts):
                self.attempts.append(0)
                self.accepts.append(0)
            self.attempts[d] += t
            self.accepts[d] += a

    def state(self) -> dict:
        """Raw counters, saved with the results so a cut-short run can resume."""
        return dict(vars(self))

    def merged(self, other: "Pool") -> "Pool":
        """The counters of both pools (e.g. two shards of one run), summed; depths aligned."""
        out = Pool.from_state(self.state())
        for name in ("tokens", "steps", "emitted", "seconds", "draft", "verify", "prompt_tokens"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.prefill = None if self.prefill is None or other.prefill is None else self.prefill + other.prefill
        depth = max(len(self.attempts), len(other.attempts))
        pad = lambda xs: list(xs) + [0] * (depth - len(xs))  # noqa: E731
        out.attempts = [a + b for a, b in zip(pad(self.attempts), pad(other.attempts))]
        out.accepts = [a + b for a, b in zip(pad(self.accepts), pad(other.accepts))]
        return out

    @classmethod
    def from_state(cls, state: dict) -> "Pool":
        pool = cls()
        pool.prefill = None                 # a state saved before prefills were counted
        vars(pool).update(state)
        return pool

    def row(self, base_tps: float | None) -> dict:
        tps = self.tokens / self.seconds if self.seconds else 0.0
        out = {"tokens": self.tokens, "seconds": round(self.seconds, 2), "tokens_per_s": round(tps, 2)}
        if self.steps:
            out["tau"] = round(self.emitted / self.steps, 3)
            out["steps"] = self.steps
            out["acceptance_by_depth"] = [round(a / t, 3) if t else None
                                          for a, t in zip(self.accepts, self.attempts)]
            out["draft_ms_per_step"] = round(self.draft / self.steps * 1e3, 1)
            out["verify_ms_per_step"] = round(self.verify / self.steps * 1e3, 1)
        elif self.tokens:
            out["ms_per_token"] = round(self.seconds / self.tokens * 1e3, 1)
        if self.prefill is not None and self.tokens and self.seconds > self.prefill:
            out["prefill_s"] = round(self.prefill, 2)
            out["decode_tokens_per_s"] = round(self.tokens / (self.seconds - self.prefill), 2)
            if self.prompt_tokens:
                out["prefill_ms_per_prompt_token"] = round(self.prefill / self.prompt_tokens * 1e3, 2)
        if base_tps:
            out["speedup"] = round(tps / base_tps, 3)
        return out


def drafter_grid(doc: str, defaults: dict, full_prompts: int, title: str) -> None:
    """Run the grid from the command line; ``defaults`` sets the argument defaults of the calling
    script, and ``full_prompts`` x 128 tokens is the configuration not labelled REDUCED."""
    import torch

    import treespec
    import treespec.drafters.eagle  # noqa: F401  (registers eagle, eagle3)
    import treespec.drafters.hybrid  # noqa: F401  (registers hybrid = lookup + eagle3)
    import treespec.drafters.medusa  # noqa: F401
    import treespec.drafters.mtp  # noqa: F401
    import treespec.drafters.small  # noqa: F401
    from treespec.data import chat_prompt, mtbench_questions

    print(f"[{machine_line(machine_info())}]", file=sys.stderr, flush=True)  # also in the results
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, help="MT-bench first turns (of 80)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--drafters")
    ap.add_argument("--trees", help=f"of {', '.join(TREE_NAMES)}")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="target (and drafter) weights; vanilla runs in the same dtype")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--note", default="shared 2-core CPU", help="the machine's state, for the table")
    ap.add_argument("--resume", metavar="JSON",
                    help="continue a cut-short run from its JSON (same settings; writes back to it)")
    ap.set_defaults(**defaults)
    args = ap.parse_args()
    earlier = json.loads(Path(args.resume).read_text()) if args.resume else None
    if earlier is not None:
        c = earlier["config"]
        args.out = str(Path(args.resume).with_suffix(""))
        args.max_new_tokens, args.seed = c["max_new_tokens"], c["seed"]
        args.dtype = c.get("dtype", "float32")
        args.prompts = max(args.prompts, c["prompts"]) if "--prompts" in sys.argv else c["prompts"]
        args.drafters, args.trees = ",".join(c["drafters"]), ",".join(c["trees"])
        args.temperatures = ",".join(f"{t:g}" for t in c["temperatures"])
    torch.set_num_threads(args.threads)
    drafters = [d for d in args.drafters.split(",") if d]
    trees = [t for t in args.trees.split(",") if t]
    temps = [float(t) for t in args.temperatures.split(",")]
    reduced = args.prompts < full_prompts or args.max_new_tokens < 128
    target = treespec.load_target("smollm2-135m", dtype=getattr(torch, args.dtype))
    gens = {(d, t): treespec.SpeculativeGenerator(target, treespec.load_drafter(d, target), make_tree(t))
            for d in drafters for t in trees}
    questions = mtbench_questions()[: args.prompts]
    pools: dict[tuple[str, str, float], Pool] = {}
    done, minutes_before = 0, 0.0
    if earlier is not None:
        done, minutes_before = earlier["prompts_done"], earlier["wall_minutes"]
        pools = {(d, t, float(temp)): Pool.from_state(state) for d, t, temp, state in earlier["pools"]}
    # warm-up (allocations, first-call paths) on a short prompt
    warm = torch.tensor(chat_prompt(target.tokenizer, "Hi"))
    for gen in gens.values():
        gen.generate(warm, max_new_tokens=4)
    start = time.time()
    out = Path(args.out)

    def report(done_now: int) -> dict:
        minutes = minutes_before + (time.time() - start) / 60
        return _grid_report(args, drafters, trees, temps, reduced, pools, done_now, len(questions), minutes,
                            full_prompts, title)

    for i, q in enumerate(questions):
        if i < done:
            continue
        ids = torch.tensor(chat_prompt(target.tokenizer, q.turns[0]))
        for temp in temps:
            seed = args.seed * 1000 + i
            n, dt = vanilla(target, ids, args.max_new_tokens, temp, seed)
            pools.setdefault(("vanilla", "-", temp), Pool()).add_run(n, dt)
            for (d, t), gen in gens.items():
                res = gen.generate(ids, max_new_tokens=args.max_new_tokens, temperature=temp, seed=seed)
                pools.setdefault((d, t, temp), Pool()).add_stats(res.stats)
        result = report(i + 1)
        write_results(out, result, grid_markdown(result))   # after every prompt: a stopped run resumes
        print(f"[{i + 1}/{len(questions)}] {time.time() - start:.0f} s", flush=True)
    result = report(len(questions))
    write_results(out, result, grid_markdown(result))
    print(grid_markdown(result))


def _grid_report(args, drafters, trees, temps, reduced, pools, done: int, total: int, minutes: float,
                 full_prompts: int, title: str) -> dict:
    """Rows (vanilla first per temperature) plus everything needed to resume."""
    import torch

    rows = []
    for temp in temps:
        base = pools[("vanilla", "-", temp)]
        base_tps = base.tokens / base.seconds
        rows.append({"drafter": "vanilla", "tree": "-", "temperature": temp, **base.row(None)})
        for d in drafters:
            for t in trees:
                rows.append({"drafter": d, "tree": t, "temperature": temp, **pools[(d, t, temp)].row(base_tps)})
    return {
        "config": {"prompts": total, "max_new_tokens": args.max_new_tokens, "drafters": drafters,
                   "trees": {t: repr(make_tree(t).config) for t in trees}, "temperatures": temps,
                   "threads": args.threads, "seed": args.seed, "reduced": reduced,
                   "dtype": args.dtype, "full_prompts": full_prompts, "title": title},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch": torch.__version__, "note": args.note, **machine_info(), "torch_threads": args.threads},
        "prompts_done": done,
        "wall_minutes": round(minutes, 1),
        # time the full configuration (full_prompts x 128 tokens) would take at this run's pace
        "estimated_full_hours": round(minutes / 60 * (full_prompts / done) * (128 / args.max_new_tokens), 1),
        "rows": rows,
        "pools": [[d, t, temp, pool.state()] for (d, t, temp), pool in pools.items()],
    }


def grid_markdown(result: dict) -> str:
    """The grid's Markdown report: one row per (T, drafter, tree)."""
    c = result["config"]
    title = "REDUCED configuration" if c["reduced"] else "full configuration"
    done = result.get("prompts_done", c["prompts"])
    if done < c["prompts"]:
        title += f", PARTIAL: {done} of {c['prompts']} prompts measured"
    lines = [
        f"# {c.get('title', 'Trained drafters on SmolLM2-135M')} ({title})",
        "",
        f"{done} MT-bench first turns x {c['max_new_tokens']} new tokens, T in {c['temperatures']}, "
        f"{c['threads']} torch thread(s), {c.get('dtype', 'float32')} weights, {result['machine']['note']}; wall {result['wall_minutes']} min "
        f"(the full {c.get('full_prompts', 80)} x 128 configuration would take ~{result['estimated_full_hours']} h "
        f"at this pace).",
        "τ = tokens per target forward; acceptance by depth = accepted / attempted drafts at each depth; "
        "tokens/s includes prefill; speedup is against vanilla HF decoding at the same T in the same run.",
        *([machine_line(result["machine"])] if "cpu_model" in result["machine"] else []),
        *(["", "bfloat16: every method runs the same bf16 weights, and the acceptance rule is exact for the "
            "probabilities the target computes. Greedy outputs are NOT token-identical to HF `generate`: a "
            "different kernel path (tree mask, batch of N tokens) rounds bf16 logits differently and flips "
            "argmax at near-ties (measured: 2 of 3 MT-bench prompts diverge within 64 tokens even with no drafting). The fp32 runs are token-identical."]
          if c.get("dtype", "float32") != "float32" else []),
        "",
        "| T | drafter | tree | τ | acceptance by depth | draft / verify ms per step | tokens/s | speedup |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in r.get("acceptance_by_depth", []))
        cost = (f"{r['draft_ms_per_step']:.0f} / {r['verify_ms_per_step']:.0f}" if "steps" in r
                else f"{r.get('ms_per_token', 0):.0f} ms per token")
        lines.append(f"| {r['temperature']:g} | {r['drafter']} | {r['tree']} | {r.get('tau', 1.0):.2f} | "
                     f"{acc} | {cost} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f} |")
    below = sorted({f"{r['drafter']} {r['tree']}" for r in result["rows"]
                    if r["drafter"] != "vanilla" and r.get("tau", 1.0) < 1.5})
    if below:
        lines += ["", f"Below τ = 1.5: {', '.join(below)}."]
    return "\n".join(lines) + "\n"
