"""Training: the training unroll computes what the runtime drafter computes; runs are seeded,
resumable, and write checkpoints + cards that load and reproduce their held-out numbers.

Everything here runs on tiny random Llamas with synthetic (random-token) feature caches; the
real ShareGPT cache is exercised only by ``exchanges`` (no target pass).
"""

from __future__ import annotations

import json

import pytest
import torch

from treespec.drafters.base import PartialTree, TargetFeatures
from treespec.drafters.eagle import random_feature_drafter
from treespec.drafters.medusa import random_medusa
from treespec.targets.loader import tiny_target
from treespec.train.data import Batch, DataConfig, cache_dir, load_chunks, make_batch, target_pass
from treespec.train.loop import TrainConfig, heldout_of_checkpoint, train_drafter
from treespec.train.objectives import depth_view, topk_kd, ttt_unroll
from treespec.train.recipes import KINDS, RecipeConfig

from _shards import synthetic_cache
from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)

V = 32
LAYERS = (0, 1, 2)      # every hidden_states index of the 2-layer tiny Llama


def _features(target, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    rec = target_pass(target, ids.tolist(), LAYERS, 8)
    return {l: rec[f"h{l}"].float() for l in LAYERS}, rec


def _batch(target, ids: torch.Tensor) -> Batch:
    hidden, rec = _features(target, ids)
    n = ids.numel()
    return Batch(tokens=ids[None], valid=torch.ones(1, n, dtype=torch.bool),
                 reply=torch.ones(1, n, dtype=torch.bool), hidden={l: h[None] for l, h in hidden.items()},
                 top_i=rec["top_i"].long()[None], top_p=rec["top_p"].float()[None])


def _feats(hidden: dict[int, torch.Tensor], rows: slice) -> TargetFeatures:
    return TargetFeatures({l: h[rows] for l, h in hidden.items()})


# ---------------------------------------------------------------------------------- conventions
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_runtime_equals_training_unroll(kind):
    """Root, depth-1 and depth-2 draft logits at runtime == the TTT unroll used in training and
    evaluation, at the same slot; siblings do not leak; after commit the next root matches too.
    A slot convention off by one breaks this equality."""
    target = tiny_target(vocab_size=V, seed=0)
    drafter = random_feature_drafter(target, kind, seed=3, draft_vocab=16)
    head = drafter.head
    ids = torch.randint(0, V, (20,), generator=torch.Generator().manual_seed(1))
    batch = _batch(target, ids)
    with torch.no_grad():
        outs = ttt_unroll(head, head.fuse({l: batch.hidden[l] for l in head.target_layers}), batch, 3)

    def want(j: int, slot: int) -> torch.Tensor:
        """Draft-vocabulary logits of the training unroll at depth j, slot ``slot``."""
        return head.logits(outs[j][0, slot]).float()

    def got(x: torch.Tensor) -> torch.Tensor:
        """Runtime logits [V] restricted to the draft vocabulary (eagle3), else as they are."""
        return x if drafter.d2t is None else x[drafter.d2t]

    k = 10
    hidden = {l: batch.hidden[l][0] for l in head.target_layers}
    drafter.begin(ids[: k + 1], _feats(hidden, slice(0, k)))
    tree = PartialTree.rooted(int(ids[k]))
    torch.testing.assert_close(got(drafter.expand(tree, [0])[0]), want(0, k - 1), atol=1e-4, rtol=1e-4)
    a = tree.add(0, int(ids[k + 1]))
    b = tree.add(0, (int(ids[k + 1]) + 5) % V)
    rows = drafter.expand(tree, [a, b])
    torch.testing.assert_close(got(rows[0]), want(1, k - 1), atol=1e-4, rtol=1e-4)
    c = tree.add(b, 3)
    d = tree.add(a, int(ids[k + 2]))
    rows = drafter.expand(tree, [c, d])
    torch.testing.assert_close(got(rows[1]), want(2, k - 1), atol=1e-4, rtol=1e-4)
    # accept a, d; the new token is ids[k + 3]: features cover the old root, a and d
    drafter.commit(torch.tensor([a, d]), ids[k + 1: k + 4], _feats(hidden, slice(k, k + 3)))
    torch.testing.assert_close(got(drafter.expand(PartialTree.rooted(int(ids[k + 3])), [0])[0]),
                               want(0, k + 2), atol=1e-4, rtol=1e-4)


def test_medusa_runtime_equals_training_heads():
    """Medusa's depth-d expansion is head d + 1 on the feature before the root, path-independent."""
    target = tiny_target(vocab_size=V, seed=0)
    drafter = random_medusa(target, num_heads=3, seed=2)
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(4))
    hidden, _ = _features(target, ids)
    f = hidden[2]
    drafter.begin(ids[:8], _feats({2: f}, slice(0, 7)))
    tree = PartialTree.rooted(int(ids[7]))
    lm = target.model.lm_head
    with torch.no_grad():
        torch.testing.assert_close(drafter.expand(tree, [0])[0], lm(drafter.heads(f[6], 1)))
        x, y = tree.add(0, 1), tree.add(0, 2)
        rows = drafter.expand(tree, [x, y])
        torch.testing.assert_close(rows[0], rows[1])
        torch.testing.assert_close(rows[0], lm(drafter.heads(f[6], 2)))
        z = tree.add(x, 5)
        w = tree.add(z, 6)
        drafter.expand(tree, [z])
        torch.testing.assert_close(drafter.expand(tree, [w])[0], lm(drafter.heads(f[6], 3)))  # capped at K


def test_depth_view_aligns_tokens_and_targets():
    tokens = torch.arange(10)[None]
    n = 10
    top = torch.arange(10)[None, :, None].expand(1, n, 2)
    batch = Batch(tokens, torch.ones(1, n, dtype=torch.bool), torch.arange(n)[None] >= 4, {}, top, top.float())
    v = depth_view(batch, 1)
    assert v.tokens[0, :3].tolist() == [2, 3, 4]          # slot t, depth 1: token t + 2
    assert v.top_i[0, :3, 0].tolist() == [2, 3, 4]        # p_{t+2}: law of token t + 3
    assert v.pos[0, :3].tolist() == [1, 2, 3]
    # drafted token t + 3 must be a reply token (>= 4) and p_{t+2} must exist (t + 2 < 10)
    assert v.mask[0].tolist() == [False] + [True] * 7 + [False] * 2


def test_topk_kd_is_cross_entropy_on_representable_ids():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    top_i = torch.tensor([[5, 7, 9]])
    top_p = torch.tensor([[0.5, 0.3, 0.2]])
    lookup = torch.full((10,), -1)
    lookup[torch.tensor([5, 7, 9])] = torch.tensor([0, 1, 2])
    want = -(top_p * logits.log_softmax(-1)).sum()
    torch.testing.assert_close(topk_kd(logits, top_i, top_p, lookup)[0], want)
    lookup[9] = -1          # id 9 not representable: dropped, the rest renormalised
    w = torch.tensor([0.5, 0.3]) / 0.8
    want = -(w * logits.log_softmax(-1)[0, :2]).sum()
    torch.testing.assert_close(topk_kd(logits, top_i, top_p, lookup)[0], want)


# ---------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    target = tiny_target(vocab_size=V, seed=0)
    data = DataConfig(split="train", sequences=16, max_len=32, layers=LAYERS, top_k=8, chunk_size=8)
    held = DataConfig(split="heldout", sequences=8, max_len=32, layers=LAYERS, top_k=8, chunk_size=8)
    synthetic_cache(target, data, root, 0)
    synthetic_cache(target, held, root, 1)
    return target, data, held, root


def _cfg(steps: int, seed: int = 0) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=4, max_len=32, warmup=2, seed=seed, save_every_s=1e9,
                       recipe=RecipeConfig(draft_vocab=16, frequent=8, subset_top=4, medusa_heads=3))


@pytest.mark.parametrize("kind", KINDS)
def test_train_writes_checkpoint_card_and_reloads(kind, tiny_setup, tmp_path):
    from treespec.drafters import load_drafter
    import treespec.drafters.eagle, treespec.drafters.medusa, treespec.drafters.mtp  # noqa: F401,E401

    target, data, held, root = tiny_setup
    card = train_drafter(kind, target, tmp_path, _cfg(4), data, root, progress=False, heldout=held)
    ckpt = tmp_path / f"{kind}.safetensors"
    assert ckpt.is_file() and json.loads((tmp_path / f"{kind}.json").read_text()) == json.loads(json.dumps(card))
    assert card["train"]["steps_done"] == 4 and card["target"]["fingerprint"]
    assert card["loss"] and len(card["heldout"]["top1_by_depth"]) >= 1
    drafter = load_drafter(kind, target, checkpoint=str(ckpt))
    assert drafter.vocab_size == V
    again = heldout_of_checkpoint(kind, target, ckpt, cache_root=root, heldout=held)
    assert again["top1_by_depth"] == card["heldout"]["top1_by_depth"]
    assert again["beta_top32_by_depth"] == card["heldout"]["beta_top32_by_depth"]


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_train_is_seeded_and_resumable(kind, tiny_setup, tmp_path):
    """Same seed -> same weights; an interrupted run resumed to the end == an uninterrupted run."""
    from safetensors.torch import load_file

    target, data, held, root = tiny_setup
    train_drafter(kind, target, tmp_path / "a", _cfg(6), data, root, progress=False, heldout=held)
    assert train_drafter(kind, target, tmp_path / "b", _cfg(6), data, root, progress=False, heldout=held,
                         interrupt_after=2) is None
    assert not (tmp_path / "b" / f"{kind}.safetensors").exists()
    train_drafter(kind, target, tmp_path / "b", _cfg(6), data, root, progress=False, heldout=held)
    a = load_file(tmp_path / "a" / f"{kind}.safetensors")
    b = load_file(tmp_path / "b" / f"{kind}.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)
    train_drafter(kind, target, tmp_path / "c", _cfg(6, seed=1), data, root, progress=False, heldout=held)
    c = load_file(tmp_path / "c" / f"{kind}.safetensors")
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_resume_refuses_another_kind(tiny_setup, tmp_path):
    target, data, held, root = tiny_setup
    train_drafter("medusa", target, tmp_path, _cfg(2), data, root, progress=False, heldout=held,
                  interrupt_after=1)
    (tmp_path / "medusa.train.safetensors").rename(tmp_path / "eagle.train.safetensors")
    with pytest.raises(ValueError, match="another run"):
        train_drafter("eagle", target, tmp_path, _cfg(2), data, root, progress=False, heldout=held)


def test_make_batch_pads_across_chunks(tiny_setup):
    target, data, _, root = tiny_setup
    chunks = load_chunks(cache_dir(target, data, root), LAYERS)
    b = make_batch(chunks, [(0, 0), (1, 3)])
    n = int(b.valid.sum(1).max())
    assert b.tokens.shape == (2, n) and b.hidden[2].shape == (2, n, 32)
    assert b.reply[:, :6].sum() == 0 and bool(b.reply[:, 6].all())


def test_sharegpt_exchanges_are_chat_templated():
    from transformers import AutoTokenizer

    from treespec.targets.loader import default_cache_root
    from treespec.train.data import exchanges

    dirs = sorted(default_cache_root().glob("smollm2-135m-*"))
    if not dirs:
        pytest.skip("SmolLM2 conversion cache not present")
    tok = AutoTokenizer.from_pretrained(dirs[0])
    cfg = DataConfig(max_len=128)
    rows = [r for r, _ in zip(exchanges(tok, cfg), range(5))]
    assert len(rows) == 5
    for ids, start in rows:
        assert len(ids) <= 128 and len(ids) - start >= cfg.min_response
        assert tok.decode(ids[:start]).endswith("<|im_start|>assistant\n")


def test_unroll_curriculum():
    from treespec.train.recipes import Recipe

    r = Recipe.__new__(Recipe)
    r.cfg = RecipeConfig(unroll=3, unroll_ramp=0.5)
    assert [r.unroll_at(p) for p in (0.0, 0.2, 0.3, 0.49, 0.5, 0.9)] == [1, 1, 2, 2, 3, 3]
    r.cfg = RecipeConfig(unroll=3, unroll_ramp=0.0)
    assert r.unroll_at(0.0) == 3


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_warm_start_from_a_checkpoint(kind, tiny_setup, tmp_path):
    import dataclasses

    target, data, held, root = tiny_setup
    first = train_drafter(kind, target, tmp_path / "a", _cfg(2), data, root, progress=False, heldout=held)
    cfg = dataclasses.replace(_cfg(2), init_from=str(tmp_path / "a" / f"{kind}.safetensors"))
    card = train_drafter(kind, target, tmp_path / "b", cfg, data, root, progress=False, heldout=held)
    assert card["train"]["warm_start"]["steps_done"] == 2
    # the card names the warm start by file name and checksum, never by a machine path
    assert card["train"]["init_from"] == f"{kind}.safetensors"
    assert card["train"]["init_from_checksum"] == first["checksum"]
    assert str(tmp_path) not in json.dumps(card)
    assert card["train"]["total_train_minutes"] >= first["train"]["train_minutes"]


def test_vocab_subset_with_negatives():
    from treespec.train.objectives import VocabSubset

    torch.manual_seed(0)
    sub = VocabSubset(torch.tensor([1, 2]), 1000, negatives=50)
    ids = sub.ids(torch.tensor([[7, 2]]))
    assert {1, 2, 7} <= set(ids.tolist()) and len(ids) > 40
    assert torch.equal(ids, ids.sort().values)
    lookup = sub.lookup(ids)
    assert lookup[ids].tolist() == list(range(len(ids))) and int((lookup >= 0).sum()) == len(ids)


def test_resume_state_is_not_pickled_and_a_pickle_is_never_run(tiny_setup, tmp_path):
    """The resumable state is safetensors + JSON; a legacy ``.train.pt`` is read with
    ``weights_only=True``, so a pickle that would run code is refused, not executed."""
    import pickle

    target, data, held, root = tiny_setup
    assert train_drafter("medusa", target, tmp_path, _cfg(4), data, root, progress=False, heldout=held,
                         interrupt_after=1) is None
    assert (tmp_path / "medusa.train.safetensors").is_file()
    assert not (tmp_path / "medusa.train.pt").exists()

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "eagle.train.pt").write_bytes(pickle.dumps({"kind": "eagle", "x": Payload()}))
    with pytest.raises(ValueError, match="eagle.train.pt.*weights_only"):
        train_drafter("eagle", target, evil, _cfg(2), data, root, progress=False, heldout=held)
    assert not marker.exists()
