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
