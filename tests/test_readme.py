"""The Python examples of README.md and docs/*.md run as written: the README's on the real
SmolLM2 target, the others on a tiny random target in its place."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def python_blocks(path: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def doc_block(marker: str) -> tuple[str, str]:
    """The one ```python block of README.md or docs/*.md containing ``marker``, and its file."""
    found = [(block, str(path)) for path in [README, *DOCS] for block in python_blocks(path) if marker in block]
    assert len(found) == 1, f"expected one python block with {marker!r}, found {len(found)}"
    return found[0]


def test_every_doc_python_block_is_run_by_a_test():
    """Each ```python block of the docs is one a test executes, found by its marker: the tests
    below, test_docs_drafters.py for the drafter tutorial ("register_drafter"), test_batch.py for the serving step functions ("prepare_verify(") and test_qwen_real.py
    for the Qwen pair (slow, where its parts are installed), test_bench.py for ``treespec bench``, test_serve.py for the HTTP client ("import openai")."""
    markers = ("register_drafter", "SpeculativeServer(", "min_confidence", "prepare_verify(",
               'load_drafter("qwen2.5-coder-0.5b"', "regenerate_batch(target",
               "from treespec.cli.bench import bench", "import openai")
    blocks = [b for path in DOCS for b in python_blocks(path)]
    assert DOCS and blocks
    untested = [b.splitlines()[0] for b in blocks if not any(m in b for m in markers)]
    assert not untested, f"python blocks in docs/ that no test runs: {untested}"
    for marker in markers:
        doc_block(marker)


def test_readme_has_a_short_python_example():
    blocks = python_blocks()
    assert blocks, "README.md must contain a ```python example"
    assert len(blocks[0].strip().splitlines()) <= 14


@pytest.mark.slow
def test_readme_example_runs(capsys):
    code = python_blocks()[0]
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    result = namespace["result"]
    assert result.stats.new_tokens > 0
    assert result.text.strip()
    assert "tau" in capsys.readouterr().out


class _Chars:
    """A character tokenizer for a 32-token tiny target (no chat template, no EOS)."""

    eos_token_id = None

    def __call__(self, text: str, **kw) -> dict:
        return {"input_ids": [ord(c) % 32 for c in text]}

    def decode(self, ids, **kw) -> str:
        return "".join(chr(64 + int(i)) for i in ids)


def test_readme_server_example_runs_on_a_tiny_target(capsys):
    """The SpeculativeServer block (docs/serving.md), with a tiny random target and an untrained
    EAGLE-3 head in place of SmolLM2's shipped one."""
    from treespec.drafters.eagle import random_feature_drafter
    from treespec.targets.loader import tiny_target

    code, where = doc_block("SpeculativeServer(")
    assert code.count('"eagle3"') == 1
    tiny = tiny_target(vocab_size=32, seed=0)
    tiny.model.generation_config.eos_token_id = None
    namespace: dict = {"target": tiny, "drafter": random_feature_drafter(tiny, "eagle3", seed=1, draft_vocab=16)}
    exec(compile(code.replace('"eagle3"', "drafter"), where, "exec"), namespace)
    server = namespace["server"]
    assert [len(server.finished[r].tokens) for r in (0, 1)] == [8, 6]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("length (")


def test_readme_adaptive_lookup_example_runs_on_a_tiny_target():
    """The "Adaptive drafting" block (docs/drafters.md), with a tiny random target: on a prompt that repeats, the
    lookup drafts where a 3-token suffix recurs and the output is plain greedy decoding's."""
    import treespec
    from treespec.targets.loader import tiny_target

    code, where = doc_block("min_confidence")
    tiny = tiny_target(vocab_size=32, seed=0)
    tiny.model.generation_config.eos_token_id = None
    namespace: dict = {"treespec": treespec, "target": tiny}
    exec(compile(code, where, "exec"), namespace)
    prompt = [5, 9, 7, 5, 9, 7, 5, 9, 7, 5, 9]
    out = namespace["gen"].generate(prompt, max_new_tokens=12)
    plain = treespec.SpeculativeGenerator(tiny, "lookup", treespec.DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    assert out.token_ids.tolist() == plain.generate(prompt, max_new_tokens=12).token_ids.tolist()
    assert out.stats.tree_nodes > out.stats.steps        # it drafted on some steps



def test_training_data_example_writes_the_targets_replies(tmp_path, monkeypatch):
    """The "Data of your own" block (docs/training.md), with a tiny random target: the file it
    writes holds the target's greedy replies to the prompts, as --data reads them."""
    from treespec.targets.loader import tiny_target
    from treespec.train.online import read_examples
    from treespec.train.shards import Example, regenerate

    code, where = doc_block("regenerate_batch(target")
    tiny = tiny_target(vocab_size=32, seed=0)
    rows = [Example(r, [3 + (r * 7 + i) % 29 for i in range(20)], 4 + r % 3) for r in range(20)]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"target": tiny, "rows": rows})
    assert read_examples(tmp_path / "regen.jsonl") == [regenerate(tiny, ex, 0.0) for ex in rows[:16]]
