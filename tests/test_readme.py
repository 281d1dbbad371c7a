"""The README's Python example runs as written (on the real SmolLM2 target)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


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


def test_readme_drafter_example_runs_on_a_tiny_target(capsys):
    """The "Your own drafter" block, with a tiny random target in place of SmolLM2."""
    import treespec
    from treespec.drafters.base import _REGISTRY
    from treespec.models import tiny_target

    code = python_blocks()[1]
    assert "register_drafter" in code
    tiny = tiny_target(vocab_size=32, seed=0)
    tiny.model.generation_config.eos_token_id = None
    namespace: dict = {"treespec": treespec, "target": treespec.Target(tiny.model, _Chars(), tiny.name)}
    try:
        exec(compile(code, str(README), "exec"), namespace)
        gen = namespace["gen"]
        prompt = [5, 9, 5, 9, 5]
        out = gen.generate(prompt, max_new_tokens=12).token_ids.tolist()
    finally:
        _REGISTRY.pop("bigram", None)   # the registry is process-wide
    assert float(capsys.readouterr().out.strip()) >= 1.0
    # commit kept the drafter's text in step (the last step may commit past max_new_tokens:
    # the engine truncates what it returns, not what verification accepted)
    text = prompt + out
    assert gen.drafter.history[: len(text)] == text and len(gen.drafter.history) < len(text) + 8


def test_readme_server_example_runs_on_a_tiny_target(capsys):
    """The "Many requests at once" server block, with a tiny random target and an untrained
    EAGLE-3 head in place of SmolLM2's shipped one."""
    from treespec.drafters.eagle import random_feature_drafter
    from treespec.models import tiny_target

    code = next(b for b in python_blocks() if "SpeculativeServer(" in b)
    assert code.count('"eagle3"') == 1
    tiny = tiny_target(vocab_size=32, seed=0)
    tiny.model.generation_config.eos_token_id = None
    namespace: dict = {"target": tiny, "drafter": random_feature_drafter(tiny, "eagle3", seed=1, draft_vocab=16)}
    exec(compile(code.replace('"eagle3"', "drafter"), str(README), "exec"), namespace)
    server = namespace["server"]
    assert [len(server.finished[r].tokens) for r in (0, 1)] == [8, 6]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("length (")


def test_readme_adaptive_lookup_example_runs_on_a_tiny_target():
    """The "Adaptive drafting" block, with a tiny random target: on a prompt that repeats, the
    lookup drafts where a 3-token suffix recurs and the output is plain greedy decoding's."""
    import treespec
    from treespec.models import tiny_target

    code = next(b for b in python_blocks() if "min_confidence" in b)
    tiny = tiny_target(vocab_size=32, seed=0)
    tiny.model.generation_config.eos_token_id = None
    namespace: dict = {"treespec": treespec, "target": tiny}
    exec(compile(code, str(README), "exec"), namespace)
    prompt = [5, 9, 7, 5, 9, 7, 5, 9, 7, 5, 9]
    out = namespace["gen"].generate(prompt, max_new_tokens=12)
    plain = treespec.SpeculativeGenerator(tiny, "lookup", treespec.DynamicTreeBuilder(budget=1, depth=1, top_k=1))
    assert out.token_ids.tolist() == plain.generate(prompt, max_new_tokens=12).token_ids.tolist()
    assert out.stats.tree_nodes > out.stats.steps        # it drafted on some steps
