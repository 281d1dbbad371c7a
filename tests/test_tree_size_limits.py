"""Tree budgets that cannot fit: a budget beyond the context is blamed on the budget, and a huge
tree warns with the memory its verify pass takes."""

from __future__ import annotations

import pytest

from _engine_helpers import small_generator


def test_a_budget_beyond_the_context_is_blamed_on_the_budget():
    from treespec import DynamicTreeBuilder
    from treespec.runtime.generator import LargeTreeWarning

    with pytest.warns(LargeTreeWarning):
        gen = small_generator(builder=DynamicTreeBuilder(budget=100000, depth=3, top_k=2))
    limit = gen.target.max_context
    with pytest.raises(ValueError, match=rf"tree budget 100000 .* use a budget of at most {limit - 3 - 8}\b"):
        gen.generate([1, 2, 3], max_new_tokens=8)
    with pytest.raises(ValueError, match=rf"max_new_tokens={limit} does not fit .* use at most {limit - 3 - 6}\b"):
        small_generator().generate([1, 2, 3], max_new_tokens=limit)   # the default budget fits


def test_a_huge_tree_warns_with_the_memory_its_verify_takes():
    from treespec import SpeculativeGenerator, StaticTreeBuilder
    from treespec.runtime.generator import verify_memory_bytes
    from treespec.drafters import LookupDrafter
    from treespec.targets.loader import Target, tiny_llama

    model = tiny_llama(vocab_size=49152, max_position_embeddings=8192)
    target = Target.from_hf(model, None, "wide-vocab", pack=False)
    need = verify_memory_bytes(model, 4000, 4000)
    assert need > 4000 * 49152 * 12                                  # logits, p and q rows at least
    from treespec.runtime.generator import LargeTreeWarning

    with pytest.warns(LargeTreeWarning, match=rf"4000 nodes .* about {need / 2**30:.1f} GiB"):
        SpeculativeGenerator(target, LookupDrafter(49152), _static(4000))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpeculativeGenerator(target, LookupDrafter(49152), _static(64))


def _static(n):
    from treespec import StaticTreeBuilder

    return StaticTreeBuilder.default(n)
