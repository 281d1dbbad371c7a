"""docs/drafters.md's tutorial runs as written: the drafter passes check_drafter, generates on a
tiny target in SmolLM2's place (fast), and runs through ``treespec bench --drafters
module:factory`` on the real SmolLM2 (slow)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

DOC = Path(__file__).resolve().parents[1] / "docs" / "drafters.md"


def tutorial() -> str:
    """The one ```python block of docs/drafters.md that calls check_drafter."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S) if "check_drafter(" in b]
    assert len(blocks) == 1
    return blocks[0]


def test_the_tutorial_is_complete_and_about_forty_lines():
    code = tutorial()
    assert "import torch" in code and "import treespec" in code and "target = " in code
    cls = code[code.index("class BigramDrafter"):code.index("def make")]
    assert len(cls.strip().splitlines()) <= 45
    assert "chat=False" in code and "replace=True" in code
    assert "treespec bench --drafters" in DOC.read_text() and "package.module:factory" in DOC.read_text()


def test_the_tutorial_runs_on_a_tiny_target(capsys, monkeypatch):
    import treespec
    from treespec.drafters.base import _REGISTRY
    from treespec.targets.loader import Target, tiny_target

    from _engine_helpers import word_tokenizer

    tiny = tiny_target(vocab_size=32, seed=0)
    tiny.model.generation_config.eos_token_id = None
    target = Target.from_hf(tiny.model, word_tokenizer([str(i) for i in range(30)]), name="tiny-digits")
    monkeypatch.setattr(treespec, "load_target", lambda name, **kw: target)
    namespace: dict = {"__name__": "drafters_tutorial"}
    try:
        exec(compile(tutorial(), str(DOC), "exec"), namespace)
        exec(compile(tutorial(), str(DOC), "exec"), namespace)   # the cell run twice: replace=True
    finally:
        _REGISTRY.pop("bigram", None)   # the registry is process-wide
    result = namespace["result"]
    assert result.stats.new_tokens == 16 and result.stats.tau >= 1.0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 2 and float(printed[-1].split()[-1]) == result.stats.tau
    drafter = namespace["gen"].drafter
    assert drafter.follows
    seen = drafter.follows[next(iter(drafter.follows))]
    q = drafter.expand(treespec.drafters.PartialTree.rooted(next(iter(drafter.follows))), [0])
    assert torch.allclose(q.softmax(-1), seen / seen.sum())   # logits are log q, -inf where unseen


@pytest.mark.slow
def test_the_tutorial_drafter_runs_through_bench_by_module_factory(tmp_path, monkeypatch):
    """``treespec bench --drafters tutorial_bigram:make`` with the tutorial's drafter in a module
    of a temporary folder on sys.path, on SmolLM2: 1 prompt x 8 tokens, greedy equal."""
    code = tutorial()
    module = code[:code.index("\ncheck_drafter(make)")]
    module = module.replace('target = treespec.load_target("smollm2-135m")', "")
    (tmp_path / "tutorial_bigram.py").write_text(module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("TREESPEC_LLAMACPP", raising=False)
    from treespec.cli import main as cli

    out = tmp_path / "out"
    assert cli.main(["bench", "--drafters", "tutorial_bigram:make", "--trees", "chain:3", "--temperatures", "0",
                     "--prompts", "1", "--max-new-tokens", "8", "--no-hf", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert any("tutorial_bigram:make" in key for key in data["runs"])
    sys.modules.pop("tutorial_bigram", None)
