"""Test helpers: tiny random Llamas built straight from ``LlamaConfig`` and tiny random trees.

Kept independent of ``treespec.targets.loader`` so the acceptance-core tests need nothing but the core.
"""

from __future__ import annotations

import random

import pytest
import torch

from treespec.core.tree import DraftTree

TINY_VOCAB = 96


def tiny_llama(attn_implementation: str = "sdpa", seed: int = 0, vocab_size: int = TINY_VOCAB):
    """A 2-layer fp32 Llama with random weights (GQA: 4 query heads, 2 KV heads), eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng():  # seeded weights without touching the global RNG stream
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    return model


def random_parents(rng: random.Random, n: int) -> list[int]:
    """Parent pointers of a uniformly random recursive tree on n nodes (topological)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def random_tree(
    rng: random.Random,
    n: int,
    vocab: int,
    sampling: str = "deterministic",
) -> DraftTree:
    """A random valid tree: random topology, distinct sibling tokens, random draft_probs rows.

    Every child's token has draft probability > 0 under its parent's row, so the tree is
    acceptable for every sampling mode (siblings distinct, so also without replacement).
    Needs ``vocab`` >= the largest number of siblings (at most n - 1).
    """
    parents = random_parents(rng, n)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        kids.setdefault(p, []).append(i)
    tokens = [rng.randrange(vocab)] + [0] * (n - 1)
    for p, cs in kids.items():
        for c, tok in zip(cs, rng.sample(range(vocab), len(cs))):
            tokens[c] = tok
    probs = None
    if sampling != "deterministic":
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        probs = torch.rand(n, vocab, generator=g, dtype=torch.float64) + 0.05
        probs /= probs.sum(-1, keepdim=True)
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        probs,
        sampling,
        vocab,
    )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run a module's tests on one intra-op thread, then restore the setting.

    Tiny tensors gain nothing from threads, and on a busy 2-core machine a multi-threaded op on
    a [5, 5] tensor can spin for milliseconds waiting for a worker. Import this fixture into a
    test module (``from _tiny import one_thread``) to apply it there.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def cache_kwargs(model, cache) -> dict:
    """The keyword a HF causal LM takes its KV cache by: ``cache`` in recent transformers 5.x,
    ``past_key_values`` before (and deprecated after) the rename."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}
