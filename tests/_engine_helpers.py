"""Shared helpers of the engine / verifier / drafter tests.

- ``one_thread``: autouse-able fixture, one intra-op thread (tiny tensors gain nothing from
  threads, and on a busy 2-core machine a threaded op on a [5, 5] tensor can spin for ms).
- ``peaky_llama``: a tiny random Llama whose weights are re-drawn with a large std, so its
  next-token law is far from uniform and depends on the context (HF's init, std 0.02, gives
  near-uniform logits: weak statistical tests and argmax near-ties).
- ``NGramDrafter``: a cheap non-HF drafter (a fixed random trigram table), exact to reason about
  and ~100x cheaper than a model forward; for the long sampling tests.
- ``small_generator``: a SpeculativeGenerator over ``peaky_target(8)`` and an ``NGramDrafter``
  (a small dynamic tree unless told otherwise): the cheapest whole engine to call.
- ``fresh_cache``: the DynamicCache of a plain causal forward over some tokens (the reference
  for KV-cache equality checks).
- ``word_tokenizer``: a tiny whitespace WordLevel tokenizer with a chat template, no download.
- ``hf_greedy``: the reference for greedy equivalence, HF ``generate`` with every logits
  processor neutral (and checked to be).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.targets.loader import Target, tiny_llama


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def peaky_llama(
    vocab_size: int = 8,
    seed: int = 0,
    hidden_size: int = 16,
    num_layers: int = 1,
    std: float = 0.5,
    attn_implementation: str = "sdpa",
    max_position_embeddings: int = 256,
    dtype: torch.dtype = torch.float32,
):
    """A tiny Llama (GQA 2 query / 1 KV head) with weights ~ N(0, std), no EOS.

    ``generation_config.eos_token_id`` is cleared so EOS never interferes unless a test sets it.
    """
    model = tiny_llama(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=max_position_embeddings,
        seed=seed,
        attn_implementation=attn_implementation,
    )
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.generation_config.eos_token_id = None
    return model.to(dtype)


def peaky_target(vocab_size: int = 8, seed: int = 0, **kw) -> Target:
    return Target.from_hf(peaky_llama(vocab_size, seed, **kw), None, name=f"peaky-v{vocab_size}-s{seed}", pack=False)


def small_generator(drafter=None, builder=None):
    """A SpeculativeGenerator over ``peaky_target(8)``: ``drafter`` (default ``NGramDrafter(8)``)
    and ``builder`` (default ``DynamicTreeBuilder(6, 3, 2)``)."""
    from treespec import DynamicTreeBuilder, SpeculativeGenerator

    return SpeculativeGenerator(peaky_target(8), drafter or NGramDrafter(8), builder or DynamicTreeBuilder(6, 3, 2))


def fresh_cache(model, tokens: list[int]) -> DynamicCache:
    """The cache of a plain causal forward over ``tokens`` (positions 0..len - 1)."""
    cache = DynamicCache(config=model.config)
    if tokens:
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True)
    return cache


def assert_cache_equal(cache: DynamicCache, ref: DynamicCache, length: int, atol: float = 1e-5) -> None:
    """Every layer of ``cache`` holds exactly ``length`` positions equal to ``ref``'s."""
    assert len(cache.layers) == len(ref.layers)
    for i, (a, b) in enumerate(zip(cache.layers, ref.layers)):
        if length == 0:
            assert not a.is_initialized or a.keys.shape[-2] == 0, f"layer {i} not empty"
            continue
        assert a.keys.shape[-2] == length, f"layer {i}: {a.keys.shape[-2]} cached, want {length}"
        assert a.values.shape[-2] == length
        torch.testing.assert_close(a.keys, b.keys, atol=atol, rtol=0, msg=lambda m: f"layer {i} keys: {m}")
        torch.testing.assert_close(a.values, b.values, atol=atol, rtol=0,
                                   msg=lambda m: f"layer {i} values: {m}")


class NGramDrafter:
    """Drafter with q(.|context) = softmax(A[last] + B[second last]): a fixed random trigram.

    Keeps the committed tokens itself (begin / commit), so it exercises the commit contract;
    no KV cache, no forward pass.
    """

    needs_target_hidden = False
    target_layers: tuple[int, ...] = ()
    path_independent = False

    def __init__(self, vocab_size: int, seed: int = 0, scale: float = 2.0):
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.a = torch.randn(vocab_size, vocab_size, generator=gen) * scale
        self.b = torch.randn(vocab_size + 1, vocab_size, generator=gen) * scale  # row V: no token
        self.committed: list[int] = []
        self.calls = 0

    def begin(self, prompt_ids: torch.Tensor, features: TargetFeatures) -> None:
        self.committed = [int(t) for t in prompt_ids.tolist()]

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        self.calls += 1
        if tree.tokens[0] != self.committed[-1]:
            raise ValueError("root is not the last committed token")
        rows = []
        for n in nodes:
            ctx = self.committed[:-1] + [tree.tokens[i] for i in tree.path_to(n)]
            prev = ctx[-2] if len(ctx) >= 2 else self.vocab_size
            rows.append(self.a[ctx[-1]] + self.b[prev])
        return torch.stack(rows)

    def commit(self, path: torch.Tensor, tokens: torch.Tensor, features: TargetFeatures) -> None:
        self.committed += [int(t) for t in tokens.tolist()]


class NoisyTargetDrafter(NGramDrafter):
    """Drafter with q(.|context) = softmax(target logits(context) + fixed noise(context)).

    A different model from the target (its top choices are often wrong for noise ~1), but close
    enough that wide trees are mostly accepted. Logits are memoised per context, so a long
    sampling test with a fixed prompt pays a target forward only the first time it meets a
    context.
    """

    def __init__(self, model, noise: float = 1.0, seed: int = 0):
        self.model = model
        self.vocab_size = int(model.config.vocab_size)
        self.noise, self.seed = noise, seed
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}
        self.committed = []
        self.calls = 0

    def _logits(self, ctx: tuple[int, ...]) -> torch.Tensor:
        if ctx not in self.memo:
            with torch.inference_mode():
                logits = self.model(input_ids=torch.tensor([ctx])).logits[0, -1].float()
            gen = torch.Generator().manual_seed(hash((self.seed,) + ctx) & 0x7FFFFFFF)
            self.memo[ctx] = logits + self.noise * torch.randn(logits.shape, generator=gen)
        return self.memo[ctx]

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        self.calls += 1
        if tree.tokens[0] != self.committed[-1]:
            raise ValueError("root is not the last committed token")
        head = tuple(self.committed[:-1])
        return torch.stack([self._logits(head + tuple(tree.tokens[i] for i in tree.path_to(n)))
                            for n in nodes])


def word_tokenizer(words: list[str], eos: str = "<eos>"):
    """A whitespace WordLevel fast tokenizer over ``words`` (+ ``<unk>``, ``eos``), with a chat
    template; ids follow the list order."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(list(words) + ["<unk>", eos])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos)
    fast.chat_template = "{% for m in messages %}user {{ m['content'] }} {% endfor %}bot"
    return fast


def random_partial_tree(rng: random.Random, root_token: int, n: int, vocab: int) -> PartialTree:
    """A random PartialTree on n nodes (distinct sibling tokens where the vocab allows)."""
    tree = PartialTree.rooted(root_token)
    used: dict[int, set[int]] = {}
    for _ in range(1, n):
        parent = rng.randrange(len(tree))
        free = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
        if not free:
            continue
        tok = rng.choice(free)
        used[parent].add(tok)
        tree.add(parent, tok)
    return tree


def hf_greedy(model, ids: torch.Tensor, eos: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """``model.generate`` greedy continuation of ``ids`` (new tokens only) with every processor
    neutral; asserts that none changed the logits. Stops at EOS and includes it, as the engine does."""
    config = GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, min_new_tokens=None,
        temperature=None, top_p=None, top_k=None, min_p=None, repetition_penalty=1.0,
        no_repeat_ngram_size=None, bad_words_ids=None, suppress_tokens=None,
        begin_suppress_tokens=None, forced_bos_token_id=None, forced_eos_token_id=None,
        eos_token_id=list(eos), pad_token_id=eos[0], bos_token_id=None,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                             generation_config=config)
    for step, (score, logit) in enumerate(zip(out.scores, out.logits)):
        assert torch.equal(score, logit), f"a logits processor changed step {step}"
    return out.sequences[0, ids.numel():].tolist()
