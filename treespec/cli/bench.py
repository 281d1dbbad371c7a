"""``treespec bench``: drafters x trees x temperatures x prompt sets against plain decoding.

    treespec bench --drafters eagle3,hybrid --trees chain:4,dynamic:16,best-first:16,sequoia:16 \\
        --temperatures 0,1 --prompts 20 --max-new-tokens 128 --prompt-set mt-bench --out DIR

The same from Python: ``treespec.cli.bench.bench(drafters=..., trees=..., ...)`` returns a
:class:`BenchReport`. Every tree size counts nodes including the root (``chain:4`` = a chain of
3 drafts, one 4-row verify pass). Per prompt the rows run back to back: plain decoding (treespec's
loop with a one-node tree: the reference for speed and for greedy equality), HF ``generate`` on
the same model object, llama.cpp where it is built (:func:`find_llamacpp`), then every
configuration (:mod:`treespec.runtime.bench` says how rows are compared). With ``--out`` the
JSON (the runs of every row), the Markdown and the plot are rewritten after every prompt, and
``--resume`` continues a cut-short run exactly after the last prompt it saved (a run saved
without llama.cpp first gets its rows for the prompts saved, where it is now built).

``--shard K/N`` measures every N-th prompt (K-th of N), so N processes of one thread each share
a many-core machine; each writes ``<name>-shardKofN.json`` (and ``.md``) and resumes alone, and
the shard that finishes last merges them into ``<name>.json`` in prompt order and deletes them.
A prompt keeps its global index (its seed), so the merge equals one process's run prompt for
prompt, timings aside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from treespec.cli.trees import BUILDERS, check_tree_flags, make_builder
from treespec.runtime.bench import Run, RowSummary, run_generator, run_hf_generate, sequoia_acceptance, summarize

__all__ = ["BenchReport", "TreeSpec", "bench", "merge_shards", "parse_drafters", "parse_shard", "parse_temperatures",
           "parse_trees", "register", "render"]

LLAMACPP_ENV = "TREESPEC_LLAMACPP"     # a built llama.cpp binary (llama-completion) or its bin folder
PLAIN, HF, LLAMACPP = "plain (treespec loop)", "plain (HF generate)", "plain (llama.cpp)"
SAMPLED_MODES = ("deterministic", "with_replacement", "without_replacement")


@dataclass(frozen=True)
class TreeSpec:
    """A tree builder and its size in nodes incl. the root (``chain:4``)."""

    name: str
    nodes: int

    @property
    def label(self) -> str:
        return f"{self.name}:{self.nodes}"


def parse_trees(text: str) -> list[TreeSpec]:
    """``"chain:4,dynamic:16"`` -> TreeSpecs; a ValueError naming --trees otherwise."""
    specs = []
    for item in (t.strip() for t in text.split(",")):
        name, sep, size = item.partition(":")
        if not item or not sep or name not in BUILDERS:
            raise ValueError(f"--trees takes NAME:NODES items (NODES incl. the root), NAME one of {', '.join(BUILDERS)}; "
                             f"e.g. chain:4,dynamic:16; got {item!r}")
        try:
            nodes = int(size)
        except ValueError:
            raise ValueError(f"--trees: the size of {item!r} must be an integer (nodes incl. the root)") from None
        if nodes < 2:
            raise ValueError(f"--trees: {item!r} needs at least 2 nodes (the root and one draft); plain decoding "
                             "is always measured")
        specs.append(TreeSpec(name, nodes))
    if len(set(specs)) != len(specs):
        raise ValueError(f"--trees names a tree twice: {text!r}")
    return specs


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--temperatures takes comma-separated numbers >= 0 (e.g. 0,1), got {text!r}") from None
    if not temps or any(not 0 <= t < float("inf") for t in temps) or len(set(temps)) != len(temps):
        raise ValueError(f"--temperatures takes distinct comma-separated numbers >= 0 (e.g. 0,1), got {text!r}")
    return temps


def parse_drafters(text: str) -> list[str]:
    """Drafter names, each resolved before any model loads as ``treespec.load_drafter`` resolves
    it: a registered name, a ``package.module:factory`` reference or a ``treespec.drafters``
    entry point."""
    from treespec.drafters import drafter_factory, merged_options

    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise ValueError(f"--drafters takes distinct comma-separated drafter names (e.g. eagle3,hybrid), got {text!r}")
    for name in names:
        try:
            drafter_factory(merged_options(name, {})[0])
        except KeyError as e:
            raise ValueError(f"--drafters: {e.args[0]}") from None
        except (ValueError, TypeError, ImportError) as e:
            raise ValueError(f"--drafters: {e}") from None
    return names


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``"2/4"`` -> (2, 4); None or ``"1/1"`` -> None (no sharding); a ValueError naming --shard."""
    if text is None:
        return None
    k, sep, n = str(text).partition("/")
    try:
        k, n = int(k), int(n)
    except ValueError:
        k = n = 0
    if not sep or not 1 <= k <= n:
        raise ValueError(f"--shard takes K/N with 1 <= K <= N (shard K of N: every N-th prompt), e.g. 1/2; "
                         f"got {text!r}")
    return None if n == 1 else (k, n)


def _shard_stem(name: str, shard: tuple[int, int]) -> str:
    return f"{name}-shard{shard[0]}of{shard[1]}"


# ------------------------------------------------------------------------------ the run
@dataclass(frozen=True)
class Row:
    """One way of decoding at one temperature."""

    label: str
    temperature: float
    drafter: str | None = None
    tree: str | None = None

    @property
    def key(self) -> str:
        return f"T={self.temperature:g} {self.label}"


@dataclass
class BenchReport:
    """What a bench run measured: its settings, the prompts, the runs of every row (in prompt
    order) and where Sequoia's vectors came from. ``summary(row_key)`` compares a row with
    plain decoding at its temperature, over all prompts or one category."""

    settings: dict
    machine: dict
    speed_path: str
    prompts: list[dict]                       # {"set", "question_id", "category"} per prompt measured
    rows: list[Row]
    runs: dict[str, list[Run]]                # row key -> one Run per prompt measured
    sequoia: dict[str, str] = field(default_factory=dict)   # "drafter T=t" -> where its vector came from
    llamacpp: str = ""                        # the llama.cpp row's binary, or why it is absent
    wall_s: float = 0.0
    complete: bool = False
    command: str = ""                         # the command line that reproduces it, where known

    def plain_key(self, temperature: float) -> str:
        return Row(PLAIN, temperature).key

    def summary(self, row: Row, category: str | None = None) -> RowSummary:
        pick = [i for i, p in enumerate(self.prompts) if category is None or p["category"] == category]
        runs = self.runs[row.key]
        base = self.runs[self.plain_key(row.temperature)]
        return summarize([runs[i] for i in pick], [base[i] for i in pick])

    def categories(self) -> list[str]:
        return list(dict.fromkeys(p["category"] for p in self.prompts))

    def to_json(self) -> dict:
        summaries = {r.key: asdict(self.summary(r)) for r in self.rows if self.prompts}
        return {"settings": self.settings, "machine": self.machine, "speed_path": self.speed_path,
                "prompts": self.prompts, "rows": [asdict(r) for r in self.rows],
                "runs": {k: [r.to_json() for r in v] for k, v in self.runs.items()},
                "sequoia": self.sequoia, "llamacpp": self.llamacpp, "wall_s": self.wall_s,
                "complete": self.complete, "command": self.command, "summary": summaries}

    @classmethod
    def from_json(cls, data: dict) -> BenchReport:
        return cls(settings=data["settings"], machine=data["machine"], speed_path=data["speed_path"],
                   prompts=data["prompts"], rows=[Row(**r) for r in data["rows"]],
                   runs={k: [Run.from_json(r) for r in v] for k, v in data["runs"].items()},
                   sequoia=data["sequoia"], llamacpp=data["llamacpp"], wall_s=data["wall_s"],
                   complete=data["complete"], command=data.get("command", ""))


def select_prompts(prompt_sets: Sequence[str], prompts: int | None) -> list[tuple[str, object]]:
    """(set, question) pairs: the first ``prompts`` of each set in category round-robin order
    (so a short run holds every category), the sets alternating."""
    from treespec.data import interleave_categories, prompt_set

    if prompts is not None and (isinstance(prompts, bool) or not isinstance(prompts, int) or prompts < 1):
        raise ValueError(f"--prompts must be an integer >= 1 (per prompt set), got {prompts!r}")
    per_set = [[(name, q) for q in interleave_categories(prompt_set(name))[:prompts]] for name in prompt_sets]
    longest = max(len(s) for s in per_set)
    return [s[i] for i in range(longest) for s in per_set if i < len(s)]


def find_llamacpp(path: str | None) -> tuple[str | None, str]:
    """(binary, "") where llama.cpp is built (``path``, else $TREESPEC_LLAMACPP, else the
    ``make bench-llamacpp`` build folder: a llama-completion binary or the bin folder holding
    it), else (None, why not). ``path="off"`` leaves the row out."""
    from treespec.runtime import llamacpp

    if path == "off":
        return None, "left out (--llamacpp off)"
    path = path or os.environ.get(LLAMACPP_ENV)
    if not path:
        default = llamacpp.DEFAULT_BIN / llamacpp.PLAIN_TOOL
        if default.is_file() and os.access(default, os.X_OK):
            return str(default), ""
        return None, (f"llama.cpp is not built here: no --llamacpp BIN, no ${LLAMACPP_ENV} and no "
                      f"{llamacpp.DEFAULT_BIN}, so its row is absent ({llamacpp.BUILD_HINT})")
    binary = Path(path) / llamacpp.PLAIN_TOOL if Path(path).is_dir() else Path(path)
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise ValueError(f"--llamacpp: {str(binary)!r} is not an executable file (a built llama.cpp "
                         f"{llamacpp.PLAIN_TOOL}, or the bin folder holding it; {llamacpp.BUILD_HINT}; "
                         "--llamacpp off leaves the row out)")
    return str(binary), ""


def parse_llamacpp_timings(log: str) -> Run:
    """A Run from llama-completion's timing lines (:func:`treespec.runtime.llamacpp.parse_completion_log`):
    the prefill is ``prompt eval time``, the decode ``eval time`` (+ ``sampling time``)."""
    from treespec.runtime.llamacpp import parse_completion_log

    return parse_completion_log(log).to_run()


def run_llamacpp(binary: str, gguf: Path, prompt_text: str, max_new_tokens: int, temperature: float, seed: int,
                 threads: int, prompt_tokens: int | None = None) -> Run:
    """llama.cpp's plain decoding of ``prompt_text`` (the chat template already applied), timed by
    its own counters (model loading left out); ``prompt_tokens``: the count its prompt must hold."""
    from treespec.runtime.llamacpp import LlamaCppMode, run_llamacpp_mode

    return run_llamacpp_mode(binary, LlamaCppMode("plain"), gguf, prompt_text, prompt_tokens, max_new_tokens, threads,
                             temperature, seed).to_run()


def bench(drafters: Sequence[str] = ("eagle3",), trees: Sequence[str | TreeSpec] = ("chain:4", "dynamic:16"),
          temperatures: Sequence[float] = (0.0,), prompt_sets: Sequence[str] = ("mt-bench",),
          prompts: int | None = 20, max_new_tokens: int = 128, *, target: str | object = "smollm2-135m",
          depth: int = 5, top_k: int = 4, sampled_mode: str = "without_replacement", seed: int = 0,
          hf_plain: bool = True, llamacpp: str | None = None, out: str | Path | None = None, name: str = "bench",
          plot: bool = False, resume: bool = False, progress: bool = True, note: str = "",
          command: str = "", shard: tuple[int, int] | str | None = None) -> BenchReport:
    """Measure ``drafters`` x ``trees`` x ``temperatures`` on ``prompt_sets`` against plain decoding.

    ``trees``: ``"NAME:NODES"`` strings or TreeSpecs (nodes incl. the root). ``target``: a
    registered name (loaded on the default fast path, as ``treespec generate`` loads it) or a
    :class:`treespec.Target`. ``prompts``: the first N of each set, categories round-robin (None:
    all). At T > 0 trees draw children in ``sampled_mode``; at T = 0 they rank them. Sequoia
    uses this machine's calibrated acceptance vector for the drafter where one exists.
    ``out``: a folder for ``<name>.json`` / ``.md`` (and ``.png`` with ``plot``), rewritten
    after every prompt; ``resume`` continues the run saved there. ``command``: the command line
    written into the result as the way to reproduce it. ``shard``: ``(K, N)`` or ``"K/N"``,
    measure prompts K-1, K-1+N, ... only, into ``<name>-shardKofN.json``; the shard that
    completes last merges all N into ``<name>.json`` (:func:`merge_shards`) and returns it."""
    from treespec.data import chat_prompt

    specs = [t if isinstance(t, TreeSpec) else parse_trees(t)[0] for t in trees]
    drafters = parse_drafters(",".join(drafters))
    temperatures = parse_temperatures(",".join(f"{float(t)!r}" for t in temperatures))
    if sampled_mode not in SAMPLED_MODES:
        raise ValueError(f"--sampled-mode must be one of {SAMPLED_MODES}, got {sampled_mode!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens!r}")
    if plot and out is None:
        raise ValueError("--plot writes <out>/<name>.png: give --out DIR too")
    if isinstance(shard, str) or shard is None:
        shard = parse_shard(shard)
    else:
        shard = parse_shard(f"{shard[0]}/{shard[1]}")
    if shard is not None and out is None:
        raise ValueError("--shard writes <out>/<name>-shardKofN.json for the merge: give --out DIR too")
    items = select_prompts(prompt_sets, prompts)
    order = [i for i in range(len(items)) if shard is None or i % shard[1] == shard[0] - 1]
    binary, llamacpp_note = find_llamacpp(llamacpp)
    t_start = time.perf_counter()
    tgt = _target(target)
    target_name = getattr(tgt, "name", str(target))
    settings = dict(target=target_name, drafters=list(drafters), trees=[s.label for s in specs],
                    temperatures=temperatures, prompt_sets=list(prompt_sets), prompts_per_set=prompts,
                    max_new_tokens=max_new_tokens, depth=depth, top_k=top_k, sampled_mode=sampled_mode, seed=seed,
                    hf_plain=hf_plain, threads=torch.get_num_threads())
    if getattr(tgt, "passes", None) is not None:     # compiled passes: never resumed into an eager run
        settings["compiled"] = True
    if shard is not None:
        settings["shard"] = f"{shard[0]}/{shard[1]}"
    paths = _out_paths(out, name)
    if shard is not None:
        paths = paths.with_name(_shard_stem(name, shard))
    report = _resumed(paths, settings) if resume else None
    if binary is not None:
        gguf = _gguf_of(target_name)
        llamacpp_note = f"{binary} on {gguf} (GGUF weights; llama.cpp's own timers, model loading left out)"
    rows, gens, sequoia = _rows(tgt, drafters, specs, temperatures, hf_plain, binary, depth, top_k, sampled_mode)
    added = []
    if report is not None and [r.key for r in report.rows] != [r.key for r in rows]:
        added = [r for r in rows if r.label == LLAMACPP and r.key not in report.runs]
        if [r.key for r in rows if r not in added] != [r.key for r in report.rows]:
            raise ValueError(f"--resume: the saved run has the rows {[r.key for r in report.rows]}, these options "
                             f"give {[r.key for r in rows]}; give the same options (--llamacpp off: no llama.cpp "
                             "row)")
    if report is None:
        from treespec.fastpath.packing import machine_info

        report = BenchReport(settings=settings, machine=machine_info(), speed_path=tgt.speed_path, prompts=[],
                             rows=rows, runs={r.key: [] for r in rows}, sequoia=sequoia, llamacpp=llamacpp_note)
    if note:
        report.settings["note"] = note
    if command and not added:
        report.command = command
    if added:
        _add_llamacpp_rows(report, rows, added, items, tgt.tokenizer, binary, _gguf_of(target_name), llamacpp_note,
                           max_new_tokens, seed, command, progress)
        if paths is not None:
            save(report, paths, plot)
    _warm_up(tgt, gens, hf_plain)
    done = len(report.prompts)
    wall_before = report.wall_s
    bar = _progress(len(order) - done, len(rows), progress)
    try:
        for index in order[done:]:
            set_name, q = items[index]
            ids = torch.tensor(chat_prompt(tgt.tokenizer, q.turns[0]))
            text = _llamacpp_text(tgt.tokenizer, q.turns[0]) if binary else ""
            fresh: dict[str, Run] = {}
            plain_ids: dict[float, list[int]] = {}
            for row in rows:
                s = seed + index
                bar.set_postfix_str(row.key, refresh=False)
                if row.label == LLAMACPP:
                    run = run_llamacpp(binary, gguf, text, max_new_tokens, row.temperature, s,
                                       torch.get_num_threads(), prompt_tokens=ids.numel())
                elif row.label == HF:
                    run, new = run_hf_generate(tgt, ids, max_new_tokens, row.temperature, s)
                else:
                    run, new = run_generator(gens[row.key], ids, max_new_tokens, row.temperature, s)
                if row.label == PLAIN:
                    plain_ids[row.temperature] = new
                elif row.temperature == 0 and row.label != LLAMACPP:
                    run.same_as_plain = new == plain_ids[0.0]
                fresh[row.key] = run
                bar.update(1)
            for key, run in fresh.items():   # a prompt counts once all its rows ran
                report.runs[key].append(run)
            report.prompts.append({"set": set_name, "question_id": q.question_id, "category": q.category,
                                   "index": index})
            report.wall_s = wall_before + time.perf_counter() - t_start
            report.complete = len(report.prompts) == len(order)
            if paths is not None:
                save(report, paths, plot)
    finally:
        bar.close()
    if paths is not None and not order[done:]:
        save(report, paths, plot)
    if shard is not None and report.complete:
        merged = merge_shards(out, name, shard[1], plot)
        if merged is not None:
            return merged
    return report


def _add_llamacpp_rows(report: BenchReport, rows: list[Row], added: list[Row], items, tokenizer, binary: str,
                       gguf: Path, note: str, max_new_tokens: int, seed: int, command: str, progress: bool) -> None:
    """A run saved without llama.cpp, resumed where it is built: its rows are measured for the
    prompts already saved, one prompt after another (all of them before any is saved: a cut
    leaves the run as it was), and the result says they ran after the other rows, not
    interleaved with them."""
    from treespec.data import chat_prompt

    bar = _progress(len(report.prompts), len(added), progress)
    runs: dict[str, list[Run]] = {r.key: [] for r in added}
    try:
        for p in report.prompts:
            q = items[p["index"]][1]
            ids = chat_prompt(tokenizer, q.turns[0])
            text = _llamacpp_text(tokenizer, q.turns[0])
            for row in added:
                bar.set_postfix_str(row.key, refresh=False)
                runs[row.key].append(run_llamacpp(binary, gguf, text, max_new_tokens, row.temperature,
                                                  seed + p["index"], torch.get_num_threads(),
                                                  prompt_tokens=len(ids)))
                bar.update(1)
    finally:
        bar.close()
    report.rows = rows
    report.runs.update(runs)
    report.llamacpp = (f"{note}; its rows were added to the saved run afterwards (`{command}`), each prompt's "
                       f"llama.cpp runs after all of treespec's rows, not interleaved with them")


def _llamacpp_text(tokenizer, turn: str) -> str:
    """The text llama.cpp reads for ``turn``: the same one-message chat as ``chat_prompt``'s ids."""
    return tokenizer.apply_chat_template([{"role": "user", "content": turn}], add_generation_prompt=True,
                                         tokenize=False)


def _target(target):
    if not isinstance(target, str):
        return target
    from treespec.targets import load_target

    t = load_target(target)   # the default fast path, as `treespec generate` loads it
    print(f"[target: {t.speed_path}]", file=sys.stderr, flush=True)
    return t


def _gguf_of(target_name: str) -> Path:
    from treespec.runtime.llamacpp import gguf_path

    try:
        return gguf_path(target_name)
    except ValueError as e:
        raise ValueError(f"--llamacpp: {e}; leave --llamacpp out") from None


def _rows(target, drafters, specs, temperatures, hf_plain, binary, depth, top_k, sampled_mode):
    """The rows in their order on every prompt, a generator per treespec row, and Sequoia's
    vector sources."""
    from treespec.builders import DynamicTreeBuilder
    from treespec.drafters import load_drafter
    from treespec.runtime import SpeculativeGenerator
    from treespec.runtime.compiled import compile_drafter_for

    loaded = {}
    for name in drafters:
        try:
            loaded[name] = compile_drafter_for(target, load_drafter(name, target))   # --compile: its calls too
        except KeyError as e:
            raise ValueError(f"--drafters: {e.args[0]}") from None
    first = loaded[drafters[0]]
    rows, gens, sequoia = [], {}, {}
    for t in temperatures:
        plain = Row(PLAIN, t)
        rows.append(plain)
        gens[plain.key] = SpeculativeGenerator(target, first, DynamicTreeBuilder(budget=1, depth=1, top_k=1))
        if hf_plain:
            rows.append(Row(HF, t))
        if binary:
            rows.append(Row(LLAMACPP, t))
        mode = "deterministic" if t == 0 else sampled_mode
        for name in drafters:
            for spec in specs:
                acceptance = None
                if spec.name == "sequoia":
                    key = getattr(loaded[name], "registry_name", name)
                    acceptance, sequoia[f"{name} T={t:g}"] = sequoia_acceptance(target, key, t, mode)
                builder = make_builder(spec.name, spec.nodes, depth, top_k, mode, acceptance)
                row = Row(f"{name} {spec.label}", t, drafter=name, tree=spec.label)
                rows.append(row)
                gens[row.key] = SpeculativeGenerator(target, loaded[name], builder)
    return rows, gens, sequoia


def _warm_up(target, gens, hf_plain: bool) -> None:
    """One short generation per treespec row, and one HF generate where it has a row (kernels,
    allocator, shapes)."""
    from treespec.data import chat_prompt

    ids = torch.tensor(chat_prompt(target.tokenizer, "Hello!"))
    for gen in gens.values():
        gen.generate(ids, max_new_tokens=8)
    if hf_plain:
        run_hf_generate(target, ids, 8, 0.0, 0)


def _progress(prompts: int, rows: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=prompts * rows, desc="bench", unit="run", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


# ------------------------------------------------------------------------------ output
def _out_paths(out, name: str) -> Path | None:
    if out is None:
        return None
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"--name must be a plain file stem (e.g. bench), got {name!r}")
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out must be a folder (it gets {name}.json, .md and .png), got the file {folder}")
    return folder / name


def _resumed(paths: Path | None, settings: dict) -> BenchReport | None:
    """The run saved at ``paths``.json if it was measured with ``settings`` (a longer prompt
    list may continue a shorter one), else None when none is saved; a clear error on a mismatch."""
    if paths is None:
        raise ValueError("--resume continues the run saved in --out DIR: give --out")
    path = paths.with_suffix(".json")
    if not path.exists():
        return None
    try:
        report = BenchReport.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--resume: {path} is not a bench result ({e}); delete it or give another --out") from None
    saved = {k: v for k, v in report.settings.items() if k not in ("prompts_per_set", "note", "shards")}
    now = {k: v for k, v in settings.items() if k != "prompts_per_set"}
    if saved != now:
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        raise ValueError(f"--resume: {path} was measured with other settings ({', '.join(differ)}): "
                         f"saved {[saved.get(k) for k in differ]}, now {[now.get(k) for k in differ]}; "
                         "give the same options or another --out")
    report.settings["prompts_per_set"] = settings["prompts_per_set"]
    return report


def save(report: BenchReport, paths: Path, plot: bool) -> None:
    paths.parent.mkdir(parents=True, exist_ok=True)
    tmp = paths.with_suffix(".json.tmp")      # never a half-written JSON to resume from
    tmp.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    tmp.replace(paths.with_suffix(".json"))
    paths.with_suffix(".md").write_text(markdown(report))
    if plot:
        plot_report(report, paths.with_suffix(".png"))


def render(out: str | Path, name: str = "bench", plot: bool = False) -> BenchReport:
    """Rewrite ``<out>/<name>.md`` (and the plot) from the saved JSON, measuring nothing."""
    paths = _out_paths(out, name)
    path = paths.with_suffix(".json")
    if not path.exists():
        raise ValueError(f"--render: no saved run at {path}")
    report = BenchReport.from_json(json.loads(path.read_text()))
    paths.with_suffix(".md").write_text(markdown(report))
    if plot:
        plot_report(report, paths.with_suffix(".png"))
    return report


def merge_shards(out: str | Path, name: str, shards: int, plot: bool = False) -> BenchReport | None:
    """Merge the complete ``<name>-shardKofN.json`` (K = 1..N) under ``out`` into
    ``<name>.json`` / ``.md`` (and the plot), prompts in their global order, then delete the shard
    files. None while a shard is missing or unfinished; a ValueError where the shards were measured
    with other settings, rows or CPUs. The wall time is the longest shard's (they run in parallel)."""
    paths = _out_paths(out, name)
    files = [paths.with_name(_shard_stem(name, (k, shards)) + ".json") for k in range(1, shards + 1)]
    if not all(f.exists() for f in files):
        return None
    parts = []
    for f in files:
        try:
            parts.append(BenchReport.from_json(json.loads(f.read_text())))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"--shard: {f} is not a bench result ({e}); delete it and measure that shard again") from None
    if not all(p.complete for p in parts):
        return None
    first = parts[0]

    def common(report: BenchReport) -> tuple:
        settings = {k: v for k, v in report.settings.items() if k not in ("shard", "note")}
        return (settings, [r.key for r in report.rows], report.machine.get("cpu_model"),
                report.machine.get("cpu_flags"), report.sequoia, report.speed_path)

    for f, part in zip(files[1:], parts[1:]):
        if common(part) != common(first):
            raise ValueError(f"--shard: {f} was measured with other settings, rows, CPU or Sequoia vectors than "
                             f"{files[0]}; measure every shard with the same options on one machine")
    entries = sorted((p["index"], k, j) for k, part in enumerate(parts) for j, p in enumerate(part.prompts))
    if [e[0] for e in entries] != list(range(len(entries))):
        raise ValueError(f"--shard: the shards of {name} do not hold each prompt once (indices "
                         f"{[e[0] for e in entries]}); measure them again with the same --shard K/{shards}")
    settings = {k: v for k, v in first.settings.items() if k != "shard"}
    settings["shards"] = shards
    notes = list(dict.fromkeys(p.settings.get("note", "") for p in parts if p.settings.get("note")))
    if notes:
        settings["note"] = "; ".join(notes)
    command = first.command.replace(f"--shard 1/{shards}", f"--shard K/{shards}")
    merged = BenchReport(settings=settings, machine=first.machine, speed_path=first.speed_path,
                         prompts=[parts[k].prompts[j] for _, k, j in entries], rows=first.rows,
                         runs={r.key: [parts[k].runs[r.key][j] for _, k, j in entries] for r in first.rows},
                         sequoia=first.sequoia, llamacpp=first.llamacpp, wall_s=max(p.wall_s for p in parts),
                         complete=True, command=command)
    save(merged, paths, plot)
    for f in files:
        for leftover in (f, f.with_suffix(".md"), f.with_suffix(".png")):
            leftover.unlink(missing_ok=True)
    return merged


def _x(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}x"


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


HEADER = ("row", "tok/s (prefill incl.)", "tok/s (decode only)", "speedup paired", "speedup pooled",
          "decode speedup pooled", "τ", "nodes", "acceptance by depth", "draft / verify / other ms per step",
          "= plain")


def table_rows(report: BenchReport, temperature: float) -> list[list[str]]:
    out = []
    for row in (r for r in report.rows if r.temperature == temperature):
        s = report.summary(row)
        same = "-" if s.same_as_plain is None else f"{s.same_as_plain}/{s.compared}"
        split = ("-" if s.draft_ms is None else f"{s.draft_ms:.1f} / {s.verify_ms:.1f} / {s.other_ms:.1f}")
        out.append([row.label, _f(s.tokens_per_s), _f(s.decode_tokens_per_s), _x(s.speedup_paired),
                    _x(s.speedup_pooled), _x(s.decode_speedup_pooled), _f(s.tau, 2), _f(s.mean_nodes),
                    " ".join(f"{a:.2f}" for a in s.acceptance_by_depth) or "-", split, same])
    return out


def text_table(report: BenchReport) -> str:
    """The stdout table: one block per temperature."""
    lines = []
    for t in report.settings["temperatures"]:
        rows = [list(HEADER)] + table_rows(report, t)
        widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
        lines.append(f"T = {t:g} ({len(report.prompts)} prompts)")
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.append("")
    if report.llamacpp and not any(r.label == LLAMACPP for r in report.rows):
        lines.append(f"[{report.llamacpp}]")
    return "\n".join(lines)


def markdown(report: BenchReport) -> str:
    from treespec.fastpath.packing import machine_line

    st = report.settings
    sets = ", ".join(st["prompt_sets"])
    lines = [f"# treespec bench: {', '.join(st['drafters'])} x {', '.join(st['trees'])}", "",
             f"Target {st['target']} ({report.speed_path}); {len(report.prompts)} prompts from {sets} "
             f"(categories round-robin) x up to {st['max_new_tokens']} new tokens; T = "
             f"{', '.join(f'{t:g}' for t in st['temperatures'])} (at T > 0 trees draw children "
             f"{st['sampled_mode']}; greedy trees rank them); depth {st['depth']}, top-k {st['top_k']}; seed "
             f"{st['seed']} + prompt index. Wall time {report.wall_s / 60:.1f} min"
             + (f" (the longest of {st['shards']} shards measured in parallel, one process each)" if st.get("shards")
                else f" (shard {st['shard']}: every {st['shard'].split('/')[1]}-th prompt)" if st.get("shard")
                else "") + ".", "",
             machine_line(report.machine) + f" Load average at the start {report.machine.get('load_avg_1m')}.", ""]
    if st.get("note"):
        lines += [f"Conditions: {st['note']}", ""]
    if not report.complete:
        lines += [f"**Partial run**: {len(report.prompts)} prompts measured (every row on the same prompts; "
                  "`--resume` continues it).", ""]
    lines += ["Rows of one prompt run back to back. *tok/s* pools all tokens over all seconds, with the prefill "
              "(the wall time of each generation) and decode-only (the prefill left out). *speedup paired* = median "
              f"over prompts of the per-prompt ratio against **{PLAIN}** (one-node trees: the same target, "
              "path and loop, no drafter); *pooled* = all tokens / all seconds against the same; *decode speedup "
              "pooled* leaves both prefills out. τ = tokens per target forward; acceptance by depth = accepted / "
              "attempted draft nodes at depth 1, 2, ...; = plain (T = 0): prompts whose output equals the plain "
              "row's token for token.", ""]
    if report.command:
        lines += [f"Reproduce: `{report.command}`", ""]
    if report.llamacpp:
        present = any(r.label == LLAMACPP for r in report.rows)
        lines += [f"llama.cpp: {report.llamacpp}." if present else f"llama.cpp: {report.llamacpp}.", ""]
    if report.sequoia:
        lines += ["Sequoia's acceptance vectors: " + "; ".join(f"{k}: {v}" for k, v in report.sequoia.items()), ""]
    for t in st["temperatures"]:
        lines += [f"## T = {t:g}", "", "| " + " | ".join(HEADER) + " |",
                  "| --- |" + " ---: |" * (len(HEADER) - 4) + " --- | --- | ---: |"]
        lines += ["| " + " | ".join(r) + " |" for r in table_rows(report, t)]
        cats = report.categories()
        if len(cats) > 1:
            lines += ["", f"Per category at T = {t:g}: speedup paired / τ (prompts per category: "
                      + ", ".join(f"{c} {sum(p['category'] == c for p in report.prompts)}" for c in cats) + ")", "",
                      "| row | " + " | ".join(cats) + " |", "| --- |" + " ---: |" * len(cats)]
            for row in (r for r in report.rows if r.temperature == t and r.label != PLAIN):
                cells = []
                for c in cats:
                    s = report.summary(row, c)
                    cells.append(_x(s.speedup_paired) + ("" if s.tau is None else f" / {s.tau:.2f}"))
                lines.append(f"| {row.label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot_report(report: BenchReport, path: Path) -> Path:
    """Speedup (paired, prefill included) and τ of every configuration, a panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = report.settings["temperatures"]
    fig, axes = plt.subplots(2, len(temps), figsize=(max(6.0, 1.0 + 0.55 * len(report.rows) / len(temps)) * len(temps),
                                                      7.5), squeeze=False)
    drafters = report.settings["drafters"]
    colors = {d: f"C{i}" for i, d in enumerate(drafters)}
    for col, t in enumerate(temps):
        rows = [r for r in report.rows if r.temperature == t and r.drafter is not None]
        sums = [report.summary(r) for r in rows]
        xs = range(len(rows))
        ax_s, ax_t = axes[0][col], axes[1][col]
        ax_s.bar(xs, [s.speedup_paired or 0.0 for s in sums], color=[colors[r.drafter] for r in rows])
        ax_s.axhline(1.0, color="k", lw=1)
        for other in (r for r in report.rows if r.temperature == t and r.drafter is None and r.label != PLAIN):
            value = report.summary(other).speedup_paired
            if value:
                ax_s.axhline(value, ls="--", lw=1, color="grey")
                ax_s.text(len(rows) - 0.5, value, other.label, ha="right", va="bottom", fontsize=7, color="grey")
        ax_s.set_ylabel("speedup over plain decoding\n(paired by prompt, prefill incl.)")
        ax_s.set_title(f"T = {t:g}: {len(report.prompts)} prompts x {report.settings['max_new_tokens']} tokens")
        ax_t.bar(xs, [s.tau or 0.0 for s in sums], color=[colors[r.drafter] for r in rows])
        ax_t.set_ylabel("τ (tokens per target forward)")
        for ax in (ax_s, ax_t):
            ax.set_xticks(list(xs), [r.tree for r in rows], rotation=45, ha="right", fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[d]) for d in drafters]
        ax_s.legend(handles, drafters, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ the command
def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand."""
    b = sub.add_parser("bench", help="compare drafters x trees x temperatures against plain decoding",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from treespec.cli.plan import add_compile_arg, add_target_args
    from treespec.targets.loader import TARGET_LOADERS

    b.add_argument("--model", default="smollm2-135m", choices=sorted(TARGET_LOADERS), help="target (default %(default)s)")
    add_target_args(b)
    add_compile_arg(b)
    b.add_argument("--drafters", default="eagle3", help="comma-separated drafter names (default %(default)s)")
    b.add_argument("--trees", default="chain:4,dynamic:16",
                   help=f"comma-separated NAME:NODES, NODES incl. the root, NAME in {', '.join(BUILDERS)} "
                        "(default %(default)s)")
    b.add_argument("--temperatures", default="0", help="comma-separated, 0 = greedy (default %(default)s)")
    b.add_argument("--prompt-set", default="mt-bench",
                   help="comma-separated: mt-bench, code-edit, or a Spec-Bench JSON-lines file (question_id, "
                        "category, turns) (default %(default)s)")
    b.add_argument("--prompts", default="20", help="first N prompts of each set, categories round-robin; 'all' "
                                                   "(default %(default)s)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="(default %(default)s)")
    b.add_argument("--depth", type=int, default=5, help="max draft depth of dynamic / best-first / sequoia "
                                                        "(default %(default)s)")
    b.add_argument("--top-k-draft", type=int, default=4, help="children per expanded node (default %(default)s)")
    b.add_argument("--sampled-mode", default="without_replacement", choices=SAMPLED_MODES,
                   help="how trees pick children at T > 0 (default %(default)s; T = 0 ranks them)")
    b.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i (default %(default)s)")
    b.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")
    b.add_argument("--no-hf", action="store_true", help="leave out the HF generate plain row")
    b.add_argument("--llamacpp", default=None, metavar="BIN",
                   help=f"a built llama.cpp llama-completion, or its bin folder, for its plain-decoding row "
                        f"(default ${LLAMACPP_ENV}, else `make bench-llamacpp`'s .cache/llama.cpp/build/bin; "
                        "off, or not built: no row, and the output says so)")
    b.add_argument("--out", default=None, metavar="DIR", help="write DIR/<name>.json and .md after every prompt")
    b.add_argument("--name", default="bench", help="file stem under --out (default %(default)s)")
    b.add_argument("--plot", action="store_true", help="also write DIR/<name>.png (needs matplotlib: the bench extra)")
    b.add_argument("--resume", action="store_true", help="continue the run saved under --out with the same options")
    b.add_argument("--render", action="store_true",
                   help="only rewrite the Markdown (and with --plot the plot) from the JSON saved under --out")
    b.add_argument("--note", default="", help="how the machine was used during the run (written into the result)")
    b.add_argument("--shard", default=None, metavar="K/N",
                   help="measure every N-th prompt (shard K of N) into <name>-shardKofN.json, e.g. one process per "
                        "core; the shard that completes last merges all N into <name>.json (default: all prompts)")
    b.set_defaults(func=cmd_bench)


def command_line(args: argparse.Namespace) -> str:
    """The ``treespec bench`` command that reproduces ``args`` (every option spelled out)."""
    import shlex

    words = ["treespec", "bench", "--model", args.model, "--drafters", args.drafters, "--trees", args.trees,
             "--temperatures", args.temperatures, "--prompt-set", args.prompt_set, "--prompts", str(args.prompts),
             "--max-new-tokens", str(args.max_new_tokens), "--depth", str(args.depth), "--top-k-draft",
             str(args.top_k_draft), "--sampled-mode", args.sampled_mode, "--seed", str(args.seed), "--threads",
             str(args.threads)]
    words += [w for flag, on in (("--no-hf", args.no_hf), ("--no-pack", args.no_pack), ("--compile", args.compile),
                                 ("--plot", args.plot)) if on
              for w in (flag,)]
    words += [w for flag, value in (("--dtype", args.dtype), ("--kernel", args.kernel), ("--device", args.device))
              if value not in ("auto", "cpu") for w in (flag, value)]
    if args.llamacpp:
        words += ["--llamacpp", args.llamacpp]
    if args.out:
        words += ["--out", args.out, "--name", args.name, "--resume"]
    if args.shard and parse_shard(args.shard):
        words += ["--shard", args.shard]
    return shlex.join(words)


def cmd_bench(args: argparse.Namespace) -> int:
    from treespec.targets import load_target
    from treespec.cli.plan import target_pack
    from treespec.fastpath.device import resolve_device

    if args.render:
        if not args.out:
            raise ValueError("--render rewrites the Markdown saved under --out DIR: give --out")
        print(text_table(render(args.out, args.name, args.plot)))
        return 0
    drafters = parse_drafters(args.drafters)
    trees = parse_trees(args.trees)
    for spec in trees:                                # --top-k-draft / --depth in the flags' words
        check_tree_flags(spec.name, args.depth, args.top_k_draft)
    temperatures = parse_temperatures(args.temperatures)
    shard = parse_shard(args.shard)
    if shard is not None and not args.out:
        raise ValueError("--shard writes <out>/<name>-shardKofN.json for the merge: give --out DIR too")
    if args.prompts == "all":
        prompts = None
    else:
        try:
            prompts = int(args.prompts)
        except ValueError:
            raise ValueError(f"--prompts takes an integer >= 1 or 'all', got {args.prompts!r}") from None
    sets = [s.strip() for s in args.prompt_set.split(",") if s.strip()]
    if not sets:
        raise ValueError(f"--prompt-set takes mt-bench, code-edit or a JSON-lines path, got {args.prompt_set!r}")
    select_prompts(sets, prompts)                     # bad sets and files fail before the model loads
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    find_llamacpp(args.llamacpp)
    target = load_target(args.model, dtype=args.dtype, device=resolve_device(args.device), pack=target_pack(args))
    if args.compile:
        from treespec.runtime.compiled import compile_target

        target = compile_target(target)
    print(f"[target: {target.speed_path}]", file=sys.stderr, flush=True)
    report = bench(drafters, trees, temperatures, sets, prompts, args.max_new_tokens, target=target, depth=args.depth,
                   top_k=args.top_k_draft, sampled_mode=args.sampled_mode, seed=args.seed, hf_plain=not args.no_hf,
                   llamacpp=args.llamacpp, out=args.out, name=args.name, plot=args.plot, resume=args.resume,
                   note=args.note, command=command_line(args), shard=shard)
    print(text_table(report))
    if args.out:
        written = ", ".join(f"{args.name}{s}" for s in (".json", ".md") + ((".png",) if args.plot else ()))
        print(f"wrote {written} in {args.out}")
    return 0
