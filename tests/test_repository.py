"""The repository is a product: its tracked files fit the budget a GPU call can carry, and
``benchmarks/results/`` holds one indexed, current file per benchmark and machine kind."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TRACKED_BUDGET = 32 * 2 ** 20     # bytes: a GPU call carries the tree and what it needs, 64 MiB in all
RESULT_FILES_BUDGET = 40          # files under benchmarks/results/, RESULTS.md included
# run history that belongs in git, not in the product's text
HISTORY = re.compile(r"\bstop \d+|\bsessions?\b", re.IGNORECASE)


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / p for p in out.decode().split("\0") if p and (ROOT / p).is_file()]


def test_tracked_files_fit_the_budget():
    sizes = sorted(((f.stat().st_size, f) for f in tracked_files()), reverse=True)
    total = sum(s for s, _ in sizes)
    largest = ", ".join(f"{f.relative_to(ROOT)} ({s / 2 ** 20:.1f} MiB)" for s, f in sizes[:8])
    assert total <= TRACKED_BUDGET, (f"tracked files total {total / 2 ** 20:.1f} MiB, over the "
                                     f"{TRACKED_BUDGET / 2 ** 20:.0f} MiB budget; the largest: {largest}")


def test_no_training_state_is_tracked():
    states = [f.relative_to(ROOT) for f in tracked_files() if f.relative_to(ROOT).parts[0] == "runs"
              or f.name.endswith((".resume.safetensors", ".train.safetensors"))]
    assert not states, f"training states belong outside main's tree (docs/training.md): {states}"


def indexed_results() -> set[str]:
    """File names RESULTS.md's table names: `name.md` / `.json` / `.png` expands to each suffix."""
    names = set()
    for line in (RESULTS / "RESULTS.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        stem = None
        for token in re.findall(r"`([^`]+)`", first):
            if token.startswith("."):
                if stem is None:
                    raise AssertionError(f"RESULTS.md: a suffix without a file before it: {line[:80]}")
                names.add(stem + token)
            else:
                names.add(token)
                stem = token.rsplit(".", 1)[0]
    return names


def test_every_result_file_is_indexed_and_every_index_row_exists():
    files = {p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "RESULTS.md"}
    indexed = indexed_results()
    assert not files - indexed, f"result files missing from RESULTS.md: {sorted(files - indexed)}"
    assert not indexed - files, f"RESULTS.md names files that do not exist: {sorted(indexed - files)}"
    assert len(files) + 1 <= RESULT_FILES_BUDGET, (
        f"benchmarks/results/ holds {len(files) + 1} files (budget {RESULT_FILES_BUDGET}): keep the current "
        "result per benchmark and machine kind; git keeps the rest")


def test_results_name_their_machine_and_carry_no_run_history():
    for md in sorted(RESULTS.glob("*.md")):
        text = md.read_text()
        assert not HISTORY.search(text), f"{md.name}: run history ({HISTORY.search(text).group(0)!r}) belongs in git"
        if md.name != "RESULTS.md":
            assert re.search(r"xeon|epyc|cpu model|model name|CPU:", text, re.IGNORECASE), \
                f"{md.name} does not say which CPU it ran on"


@pytest.mark.parametrize("name", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md"))])
def test_docs_carry_no_run_history_and_name_only_kept_results(name):
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    text = path.read_text()
    hit = HISTORY.search(text)
    assert hit is None, f"{name}: run history ({hit.group(0)!r} near {text[max(0, hit.start() - 60):hit.end() + 20]!r})"
    stems = {p.name.rsplit(".", 1)[0] for p in RESULTS.iterdir()}
    scripts = tuple(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    for ref in re.findall(r"`(?:benchmarks/results/)?([a-z0-9_]+)\.(?:md|json|png)`", text):
        if ref.startswith(scripts) and ref not in stems:   # a result file's name (its script's name first)
            raise AssertionError(f"{name} names `{ref}.*`, which is not in benchmarks/results/")
