"""generate_batch: B requests with different prompt lengths, limits, drafters and (for T > 0)
seeds run together, one target forward per step; each request's output equals running it alone
with SpeculativeGenerator (and, greedy, HF ``generate``). Requests leave at different steps
(limits, EOS), so the cache rows are retained and reordered mid-run.
"""

from __future__ import annotations

import random

import pytest
import torch

from treespec import ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.runtime.server import generate_batch
from treespec.drafters import ModelDrafter
from treespec.core.sampling import SamplingConfig

from _engine_helpers import NGramDrafter, hf_greedy, one_thread, peaky_llama, peaky_target  # noqa: F401
from test_verifier import greedy_continuation

V = 16
pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT_LENS = (1, 4, 9, 13)
LIMITS = [5, 17, 9, 12]
BUILDERS = {
    "chain": lambda mode: ChainBuilder(budget=5, mode=mode) if mode else ChainBuilder(budget=5),
    "dynamic": lambda mode: DynamicTreeBuilder(budget=10, depth=4, top_k=3, mode=mode) if mode
    else DynamicTreeBuilder(budget=10, depth=4, top_k=3),
}


def make_drafters(target):
    """A different drafter per request: random trigram (low acceptance), another model, the
    target itself (everything accepted), another trigram."""
    other = peaky_llama(V, seed=7, hidden_size=16, num_layers=1, std=0.3, dtype=target.dtype)
    return [NGramDrafter(V, seed=1), ModelDrafter(other, V), ModelDrafter(target.model, V),
            NGramDrafter(V, seed=2)]


def prompts_of(seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    return [torch.tensor([rng.randrange(V) for _ in range(n)]) for n in PROMPT_LENS]


def alone(target, b: int, builder, prompt, limit, config=SamplingConfig(0.0), seed=0) -> list[int]:
    gen = SpeculativeGenerator(target, make_drafters(target)[b], builder)
    return gen.generate(prompt, limit, temperature=config.temperature, top_p=config.top_p,
                        seed=seed).token_ids.tolist()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_greedy_batch_equals_each_request_alone(kind: str) -> None:
    target = peaky_target(V, seed=2, std=0.3, hidden_size=32, num_layers=2)
    builder = BUILDERS[kind](None)
    prompts = prompts_of(0)
    refs = [greedy_continuation(target.model, p.tolist(), m) for p, m in zip(prompts, LIMITS)]
    # an EOS that request 1 meets mid-way: requests now leave by EOS and by limit
    eos = refs[1][6]
    target.model.generation_config.eos_token_id = eos
    refs = [hf_greedy(target.model, p, (eos,), m) for p, m in zip(prompts, LIMITS)]
    assert len({len(r) for r in refs}) >= 3, refs      # they end at different steps
    outs = generate_batch(target, make_drafters(target), builder, prompts, LIMITS)
    for b, (p, m) in enumerate(zip(prompts, LIMITS)):
        assert outs[b] == refs[b], f"request {b}"
        assert outs[b] == alone(target, b, builder, p, m), f"request {b}"


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_seeded_sampling_batch_equals_each_request_alone(kind: str) -> None:
    """T > 0, stochastic trees, per-request configs and seeds: bit for bit the run alone. fp64
    target so the batched and single forwards agree to ~1e-16 (no uniform falls in between)."""
    target = peaky_target(V, seed=2, std=0.3, hidden_size=32, num_layers=2, dtype=torch.float64)
    builder = BUILDERS[kind]("with_replacement" if kind == "chain" else "without_replacement")
    prompts = prompts_of(1)
    configs = [SamplingConfig(1.0), SamplingConfig(0.8, top_p=0.9), SamplingConfig(1.0), SamplingConfig(0.6)]
    seeds = [11, 12, 13, 14]
    outs = generate_batch(target, make_drafters(target), builder, prompts, LIMITS, configs, seeds)
    for b, (p, m) in enumerate(zip(prompts, LIMITS)):
        assert len(outs[b]) == m
        assert outs[b] == alone(target, b, builder, p, m, configs[b], seeds[b]), f"request {b}"
    # the seed matters: request 0 with another seed differs (so equality above is not trivial)
    other = generate_batch(target, make_drafters(target), builder, prompts, LIMITS, configs, [99, 12, 13, 14])
    assert other[0] != outs[0] and other[1:] == outs[1:]


def test_generate_batch_errors() -> None:
    target = peaky_target(V, seed=2)
    builder = ChainBuilder(budget=3)
    prompts = prompts_of(2)[:2]
    ds = make_drafters(target)[:2]
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries but there are 2 prompts"):
        generate_batch(target, ds, builder, prompts, [3])
    with pytest.raises(ValueError, match="its own drafter"):
        generate_batch(target, [ds[0], ds[0]], builder, prompts, [3, 3])
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a 1-D LongTensor"):   # ids, text or a list of ids
        generate_batch(target, ds, builder, [prompts[0], torch.zeros(2, 2, dtype=torch.long)], [3, 3])
    with pytest.raises(TypeError, match=r"prompts\[1\]: prompt must be text, token ids"):
        generate_batch(target, ds, builder, [prompts[0], 3.5], [3, 3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\] must be an int > 0"):
        generate_batch(target, ds, builder, prompts, [0, 3])
    with pytest.raises(ValueError, match=r"drafters\[1\] has vocab size 17 but the target has 16"):
        generate_batch(target, [ds[0], NGramDrafter(V + 1)], builder, prompts, [3, 3])
    with pytest.raises(ValueError, match="request 1 does not fit the context window"):
        generate_batch(target, ds, builder, prompts, [3, 250])
    with pytest.raises(TypeError, match=r"configs\[0\] must be a SamplingConfig"):
        generate_batch(target, ds, builder, prompts, [3, 3], [0.0, 0.0])


def recorded(drafter, log: list):
    """``drafter`` with begin / commit wrapped (on this instance) to log what the target sent."""
    begin, commit = drafter.begin, drafter.commit

    def rec_begin(prompt, feats):
        log.append(("begin", prompt.tolist(), {k: v.clone() for k, v in feats.hidden.items()}))
        begin(prompt, feats)

    def rec_commit(path, tokens, feats):
        log.append(("commit", tokens.tolist(), {k: v.clone() for k, v in feats.hidden.items()}))
        commit(path, tokens, feats)

    drafter.begin, drafter.commit = rec_begin, rec_commit
    return drafter


def test_feature_drafters_in_one_batch() -> None:
    """Drafters that read target hidden states (EAGLE, EAGLE-3, MTP, Medusa; different layers
    each) get exactly their own request's features from the batched prefill and verify passes:
    per request, the same begin / commit calls with the same features (1e-5) as the run alone,
    and greedy output equal to plain decoding."""
    import treespec.drafters.eagle  # noqa: F401  (registers the feature drafters)
    from treespec.drafters.eagle import random_feature_drafter
    from treespec.drafters.medusa import random_medusa
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    target.model.generation_config.eos_token_id = None

    def make(b: int, log: list):
        d = random_medusa(target, num_heads=3, seed=1, scale=0.3) if b == 3 else \
            random_feature_drafter(target, ("eagle", "eagle3", "mtp")[b], seed=1, draft_vocab=16)
        return recorded(d, log)

    logs = [[] for _ in range(4)]
    drafters = [make(b, logs[b]) for b in range(4)]
    assert len({tuple(d.target_layers) for d in drafters}) >= 2 and all(d.needs_target_hidden for d in drafters)
    rng = random.Random(4)
    prompts = [torch.tensor([rng.randrange(32) for _ in range(n)]) for n in (5, 1, 8, 3)]
    limits = [14, 6, 20, 9]
    builder = DynamicTreeBuilder(budget=12, depth=4, top_k=3)
    outs = generate_batch(target, drafters, builder, prompts, limits)
    for b, (p, m) in enumerate(zip(prompts, limits)):
        assert outs[b] == greedy_continuation(target.model, p.tolist(), m), f"request {b}"
        solo: list = []
        SpeculativeGenerator(target, make(b, solo), builder).generate(p, m, temperature=0.0)
        assert [e[:2] for e in logs[b]] == [e[:2] for e in solo], f"request {b}"
        for (_, _, got), (_, _, want) in zip(logs[b], solo):
            assert got.keys() == want.keys() and got
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0)
