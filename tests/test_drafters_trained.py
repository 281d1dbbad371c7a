"""Conformance of the trained drafters (eagle, eagle3, mtp, medusa) and of a model drafter.

Fast (tiny random Llamas, randomly initialised drafters):
  * greedy equivalence through the engine (chain and dynamic trees) against plain argmax decoding;
  * commit / rollback leave the drafter's state equal to a fresh drafter's that ``begin``s on the
    committed tokens (its cache, and the root distribution it then proposes);
  * exactness at T = 1: the law of the first two tokens (V = 8) matches the target's exact law
    (chi-square, seeded);
  * checkpoints made for another target, and corrupt EAGLE-3 vocab maps, are refused.
Slow (the real SmolLM2 and the shipped checkpoints): greedy equivalence on MT-bench prompts and
the cards' held-out acceptance reproduced on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import treespec.drafters.eagle  # noqa: F401  (registers eagle, eagle3)
import treespec.drafters.medusa  # noqa: F401
import treespec.drafters.mtp  # noqa: F401
from treespec import BestFirstBuilder, ChainBuilder, DynamicTreeBuilder, SpeculativeGenerator
from treespec.drafters import ModelDrafter, load_drafter
from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.drafters.checkpoint import CheckpointMismatch, save_checkpoint
from treespec.drafters.eagle import FeatureDrafter, random_feature_drafter
from treespec.drafters.medusa import MedusaDrafter, random_medusa
from treespec.targets.loader import tiny_target
from treespec.core.sampling import SamplingConfig

from _engine_helpers import hf_greedy
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

KINDS = ("eagle", "eagle3", "mtp", "medusa")          # the trained, registered kinds
DRAFTERS = KINDS + ("model",)                         # and an independent model drafter (ModelDrafter)
SHIPPED = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m"


def no_eos(target):
    target.model.generation_config.eos_token_id = None
    return target


def make_drafter(kind: str, target, seed: int = 1):
    """A randomly initialised drafter of ``kind`` for a tiny target."""
    if kind in ("eagle", "eagle3", "mtp"):
        return random_feature_drafter(target, kind, seed=seed, draft_vocab=target.vocab_size // 2)
    if kind == "medusa":
        return random_medusa(target, num_heads=3, seed=seed, scale=0.3)
    if kind != "model":
        raise ValueError(f"no tiny drafter of kind {kind!r}")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=target.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return ModelDrafter(model.to(target.dtype).eval().requires_grad_(False), target.vocab_size)


@torch.inference_mode()
def plain_greedy(target, ids: torch.Tensor, n: int) -> list[int]:
    seq = ids.tolist()
    for _ in range(n):
        seq.append(int(target.model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[ids.numel():]


@torch.inference_mode()
def features_of(target, ids: torch.Tensor, layers) -> TargetFeatures:
    hs = target.model(ids[None], output_hidden_states=True).hidden_states
    return TargetFeatures({l: hs[l][0] for l in layers})


# ---------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", DRAFTERS)
@pytest.mark.parametrize("builder", ["chain", "dynamic"])
def test_greedy_equivalence_tiny(kind, builder):
    target = no_eos(tiny_target(vocab_size=32, seed=0))
    drafter = make_drafter(kind, target)
    b = ChainBuilder(budget=5) if builder == "chain" else DynamicTreeBuilder(budget=16, depth=4, top_k=3)
    gen = SpeculativeGenerator(target, drafter, b)
    for prompt in ([5, 7, 9, 11, 3], [4]):
        ids = torch.tensor(prompt)
        out = gen.generate(ids, max_new_tokens=24, temperature=0.0)
        assert out.token_ids.tolist() == plain_greedy(target, ids, 24)


def test_greedy_equivalence_with_a_good_drafter_accepts_much():
    """Sanity of the whole path: the target-as-small-drafter accepts everything at T = 0."""
    target = no_eos(tiny_target(vocab_size=32, seed=0))
    gen = SpeculativeGenerator(target, ModelDrafter(target.model, 32), ChainBuilder(budget=5))
    out = gen.generate(torch.tensor([1, 2, 3]), max_new_tokens=20, temperature=0.0)
    assert out.stats.tau == pytest.approx(5.0)


# ---------------------------------------------------------------------------------- cache
def _root_state(drafter, root: int) -> list[torch.Tensor]:
    """Expand the root; return the tensors a fresh drafter must reproduce."""
    logits = drafter.expand(PartialTree.rooted(root), [0])
    if isinstance(drafter, FeatureDrafter):
        k, v = drafter.committed_cache()
        return [logits, k, v]
    if isinstance(drafter, MedusaDrafter):
        return [logits, drafter.f]
    layers = [t for layer in drafter.cache.layers for t in (layer.keys, layer.values)]
    return [logits] + layers


@pytest.mark.parametrize("kind", DRAFTERS)
def test_commit_leaves_state_of_a_fresh_drafter(kind):
    target = no_eos(tiny_target(vocab_size=32, seed=0))
    drafter = make_drafter(kind, target)
    gen = SpeculativeGenerator(target, drafter, DynamicTreeBuilder(budget=10, depth=4, top_k=3))
    committed: list[int] = []
    depths: list[int] = []

    def hook(built, acc, step):
        committed.extend(acc.tokens.tolist())
        depths.append(acc.path.numel())

    prompt = torch.tensor([3, 8, 1, 9, 4, 4])
    gen.generate(prompt, max_new_tokens=30, temperature=1.0, seed=7, on_step=hook)
    assert len(depths) > 3 and 0 < sum(depths) < 4 * len(depths)   # some accepts, some rejects
    ids = torch.cat([prompt, torch.tensor(committed)])
    used = _root_state(drafter, int(ids[-1]))
    fresh = make_drafter(kind, target)
    fresh.begin(ids, features_of(target, ids[:-1], fresh.target_layers))
    want = _root_state(fresh, int(ids[-1]))
    assert len(used) == len(want)
    for a, b in zip(used, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------- T = 1
def _exact_law(target, ids: torch.Tensor) -> torch.Tensor:
    """[V, V]: P(first two generated tokens) under the target at T = 1."""
    v = target.vocab_size
    with torch.inference_mode():
        p1 = target.model(ids[None]).logits[0, -1].double().softmax(-1)
        seqs = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], 1)
        p2 = target.model(seqs).logits[:, -1].double().softmax(-1)
    return p1[:, None] * p2


@pytest.mark.parametrize("kind,builder", [
    ("eagle", DynamicTreeBuilder(budget=8, depth=3, top_k=2)),
    ("eagle3", ChainBuilder(budget=4, mode="with_replacement")),
    ("eagle3", BestFirstBuilder(budget=8, max_width=2, max_rounds=3, mode="without_replacement")),
    ("mtp", ChainBuilder(budget=3, mode="without_replacement")),
    ("medusa", DynamicTreeBuilder(budget=8, depth=3, top_k=2)),
    ("model", ChainBuilder(budget=4, mode="with_replacement")),
])
def test_exact_law_at_t1(kind, builder):
    from scipy.stats import chisquare

    target = no_eos(tiny_target(vocab_size=8, seed=3))
    gen = SpeculativeGenerator(target, make_drafter(kind, target, seed=2), builder)
    ids = torch.tensor([1, 5, 2, 7])
    law = _exact_law(target, ids).flatten()
    runs = 800
    counts = torch.zeros(64)
    for s in range(runs):
        x = gen.generate(ids, max_new_tokens=2, temperature=1.0, seed=s).token_ids.tolist()
        counts[x[0] * 8 + x[1]] += 1
    expected = law * runs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = chisquare(obs[keep].numpy(), exp[keep].numpy())
    assert stat.pvalue > 1e-3, (kind, stat)


# ---------------------------------------------------------------------------------- checkpoints
def _save_random(kind: str, target, path: Path) -> Path:
    d = make_drafter(kind, target)
    if isinstance(d, FeatureDrafter):
        state, arch = dict(d.head.state_dict()), d.head.cfg.to_json()
    elif isinstance(d, MedusaDrafter):
        state, arch = dict(d.heads.state_dict()), d.heads.cfg.to_json()
    else:
        raise ValueError(f"{kind} has no checkpoint format")
    return save_checkpoint(path / f"{kind}.safetensors", state, kind, arch, target, card={"kind": kind})


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_roundtrip_and_foreign_target_refused(kind, tmp_path):
    target = tiny_target(vocab_size=32, seed=0)
    path = _save_random(kind, target, tmp_path)
    from treespec.drafters.checkpoint import read_header
    assert json.loads(path.with_suffix(".json").read_text()) == {"kind": kind, "checksum": read_header(path)["checksum"]}
    drafter = load_drafter(kind, target, checkpoint=str(path))
    assert drafter.vocab_size == 32
    other = tiny_target(vocab_size=32, seed=1)             # same shape, other weights
    with pytest.raises(CheckpointMismatch, match="fingerprint") as err:
        load_drafter(kind, other, checkpoint=str(path))
    from treespec.targets.loader import model_fingerprint
    assert model_fingerprint(target.model) in str(err.value)
    assert model_fingerprint(other.model) in str(err.value)
    bigger = tiny_target(vocab_size=48, seed=0)            # another vocabulary
    with pytest.raises(CheckpointMismatch, match="vocab_size 32.*vocab_size 48"):
        load_drafter(kind, bigger, checkpoint=str(path))


def test_checkpoint_of_another_kind_or_hidden_size_refused(tmp_path):
    from treespec.targets.loader import Target, tiny_llama

    target = tiny_target(vocab_size=32, seed=0)
    path = _save_random("eagle", target, tmp_path)
    with pytest.raises(CheckpointMismatch, match="'eagle' checkpoint, not 'mtp'"):
        load_drafter("mtp", target, checkpoint=str(path))
    wide = tiny_llama(vocab_size=32, hidden_size=64, seed=0)
    with pytest.raises(CheckpointMismatch, match="hidden_size 32.*hidden_size 64"):
        load_drafter("eagle", Target.from_hf(wide, None, "wide", pack=False), checkpoint=str(path))


@pytest.mark.parametrize("bad", ["duplicate", "range"])
def test_eagle3_vocab_map_validated_on_load(bad, tmp_path):
    target = tiny_target(vocab_size=32, seed=0)
    d = make_drafter("eagle3", target)
    state = dict(d.head.state_dict())
    d2t = state["d2t"].clone()
    d2t[1] = d2t[0] if bad == "duplicate" else 99
    state["d2t"] = d2t
    path = save_checkpoint(tmp_path / "eagle3.safetensors", state, "eagle3", d.head.cfg.to_json(), target)
    with pytest.raises(ValueError, match="draft_to_target"):
        load_drafter("eagle3", target, checkpoint=str(path))


def test_missing_checkpoint_says_how_to_train(tmp_path):
    target = tiny_target(vocab_size=32, seed=0)
    with pytest.raises(FileNotFoundError, match="treespec train eagle"):
        load_drafter("eagle", target, checkpoint=str(tmp_path / "nope.safetensors"))


# ---------------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def smollm():
    from treespec.targets.loader import load_target

    return load_target("smollm2-135m")


def _shipped(kind: str) -> Path:
    path = SHIPPED / f"{kind}.safetensors"
    if not path.exists():
        pytest.skip(f"no shipped {kind} checkpoint")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_shipped_greedy_equivalence_on_smollm2(kind, smollm):
    from treespec.data import chat_prompt, mtbench_questions

    _shipped(kind)
    drafter = load_drafter(kind, smollm)
    gen = SpeculativeGenerator(smollm, drafter, DynamicTreeBuilder(budget=16, depth=5, top_k=4))
    for q in mtbench_questions()[:2]:
        ids = torch.tensor(chat_prompt(smollm.tokenizer, q.turns[0]))
        out = gen.generate(ids, max_new_tokens=32, temperature=0.0)
        assert out.token_ids.tolist() == hf_greedy(smollm.model, ids, smollm.eos_token_ids, 32)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_shipped_card_heldout_reproduced(kind, smollm):
    from treespec.train.loop import heldout_of_checkpoint

    path = _shipped(kind)
    card = json.loads(path.with_suffix(".json").read_text())
    got = heldout_of_checkpoint(kind, smollm, path, sequences=card["heldout"]["sequences"])
    for key in ("top1_by_depth", "beta_top32_by_depth"):
        for a, b in zip(got[key], card["heldout"][key]):
            assert a == pytest.approx(b, abs=0.01), (kind, key, got, card["heldout"])


def test_shipped_checkpoints_are_8bit_blocks_within_their_budget():
    """The shipped heads are stored as 8-bit blocks (their cards measure that it costs no held-out
    acceptance) and fit 18 MiB together, so the tracked tree stays under its 32 MiB."""
    from treespec.drafters.checkpoint import read_header

    files = sorted(SHIPPED.glob("*.safetensors"))
    assert {f.stem for f in files} == set(KINDS)
    assert sum(f.stat().st_size for f in files) <= 18 * 2 ** 20
    for f in files:
        assert read_header(f).get("blocks8"), f"{f.name} is not stored as 8-bit blocks"
        assert json.loads(f.with_suffix(".json").read_text())["storage"]["format"] == "blocks8"


# ---------------------------------------------------------------------------------- reduced vocab
SCATTERED = torch.tensor([29, 3, 17, 8, 0, 22, 11, 5, 30, 14, 26, 19])  # eagle3 draft ids, unsorted


def _hide_compact(drafter):
    """The same drafter seen through ``expand`` only (no reduced-vocabulary fast path)."""

    class Plain:
        def __getattr__(self, name):
            if name == "expand_compact":
                raise AttributeError(name)
            return getattr(drafter, name)

    return Plain()


def test_eagle3_expand_compact_is_expand_restricted_to_its_ids():
    target = no_eos(tiny_target(vocab_size=32, seed=0))
    ids = torch.tensor([3, 8, 1, 9])
    a, b = (random_feature_drafter(target, "eagle3", seed=4, draft_ids=SCATTERED) for _ in range(2))
    for d in (a, b):
        d.begin(ids, features_of(target, ids[:-1], d.target_layers))
    full = a.expand(PartialTree.rooted(9), [0])
    compact, cols = b.expand_compact(PartialTree.rooted(9), [0])
    assert cols.tolist() == SCATTERED.tolist()
    torch.testing.assert_close(full[:, SCATTERED], compact)
    outside = torch.ones(32, dtype=torch.bool)
    outside[SCATTERED] = False
    assert torch.isneginf(full[:, outside]).all()


@pytest.mark.parametrize("builder", [
    DynamicTreeBuilder(budget=12, depth=4, top_k=3),
    BestFirstBuilder(budget=12, max_width=3, max_rounds=4),
    ChainBuilder(budget=5),
])
def test_reduced_vocab_fast_path_builds_the_same_trees(builder):
    """Greedy: identical trees with and without ``expand_compact``; T = 1: identical q rows
    (scattered back to V) and every drawn child inside the draft vocabulary."""
    target = no_eos(tiny_target(vocab_size=32, seed=0))
    prompt = torch.tensor([3, 8, 1, 9, 4])
    trees = {}
    for fast in (True, False):
        d = random_feature_drafter(target, "eagle3", seed=4, draft_ids=SCATTERED)
        gen = SpeculativeGenerator(target, d if fast else _hide_compact(d), builder)
        seen = []
        gen.generate(prompt, max_new_tokens=12, temperature=0.0,
                     on_step=lambda built, acc, step: seen.append(built.tree))
        trees[fast] = [(t.tokens.tolist(), t.parents.tolist()) for t in seen]
    assert trees[True] == trees[False]

    stochastic = type(builder)(**{**vars(builder.config), "mode": "without_replacement"})
    for fast in (True, False):
        d = random_feature_drafter(target, "eagle3", seed=4, draft_ids=SCATTERED)
        d.begin(prompt, features_of(target, prompt[:-1], d.target_layers))
        tree = stochastic.build(d if fast else _hide_compact(d), 4, SamplingConfig(temperature=1.0),
                                torch.Generator().manual_seed(0)).tree
        assert tree.num_nodes > 2 and set(tree.tokens[1:].tolist()) <= set(SCATTERED.tolist())
        trees[fast] = tree.draft_probs[0]
    torch.testing.assert_close(trees[True], trees[False])


def test_eagle3_projection_follows_the_targets_packed_head():
    """On a packed target the draft-vocabulary projection is packed like the target's LM head
    (same numbers within fp32 rounding), stays out of the head's parameters, works when first
    built under inference_mode, and follows an in-place edit of the target's head."""
    from treespec.fastpath.packing import PackedLinear, panel_status, pack_linears

    if not panel_status()[0]:
        pytest.skip(f"panel kernel not available: {panel_status()[1]}")
    plain_target, packed_target = (no_eos(tiny_target(vocab_size=32, seed=0)) for _ in range(2))
    pack_linears(packed_target.model, kernel="panel")
    assert isinstance(packed_target.model.get_output_embeddings(), PackedLinear)
    ids = torch.tensor([3, 8, 1, 9])
    logits = []
    for target in (plain_target, packed_target):
        d = random_feature_drafter(target, "eagle3", seed=4, draft_ids=SCATTERED)
        names = {n for n, _ in d.head.named_parameters()}
        d.begin(ids, features_of(target, ids[:-1], d.target_layers))
        with torch.inference_mode():
            logits.append(d.expand_compact(PartialTree.rooted(9), [0])[0])
        assert {n for n, _ in d.head.named_parameters()} == names
        assert isinstance(d.head._projection(), PackedLinear) == (target is packed_target)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=0)
    head = d.head
    with torch.no_grad():
        packed_target.model.get_output_embeddings().weight.mul_(2.0)
    torch.testing.assert_close(head.head_weight(),
                               2.0 * plain_target.model.get_output_embeddings().weight[SCATTERED])
