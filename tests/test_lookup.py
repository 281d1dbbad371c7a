"""Prompt-lookup drafter: n-gram votes, proper distributions, bad config."""

import math
import random

import numpy as np

import pytest
import torch

from treespec.drafters import LookupConfig, LookupDrafter, PartialTree
from treespec.drafters.base import TargetFeatures
from treespec.drafters.lookup import SuffixIndex, suffix_votes


def test_longest_ngram_votes_for_its_followers():
    d = LookupDrafter(10, LookupConfig(max_ngram=2, floor=1e-3))
    # context ... 1 2 3 ... 1 2 4 ... 1 2 | root=2 ; suffix "1 2" was followed by 3 and 4
    d.begin(torch.tensor([1, 2, 3, 7, 1, 2, 4, 8, 1, 2]), TargetFeatures.empty())
    q = d.expand(PartialTree.rooted(2), [0]).exp()[0]
    assert torch.allclose(q.sum(), torch.tensor(1.0), atol=1e-6)
    assert math.isclose(q[3].item(), q[4].item(), rel_tol=1e-6)
    assert q[3] > 0.49 and q[5] < 1e-3


def test_path_tokens_extend_the_context():
    d = LookupDrafter(10)
    d.begin(torch.tensor([5, 6, 7, 9, 5]), TargetFeatures.empty())
    tree = PartialTree.rooted(5)
    child = tree.add(0, 6)
    q = d.expand(tree, [0, child]).exp()
    assert int(q[0].argmax()) == 6      # after "5": 6
    assert int(q[1].argmax()) == 7      # after "5 6": 7


def test_no_match_is_uniform_and_commit_appends():
    d = LookupDrafter(4)
    d.begin(torch.tensor([0, 1]), TargetFeatures.empty())
    q = d.expand(PartialTree.rooted(1), [0]).exp()[0]
    assert torch.allclose(q, torch.full((4,), 0.25))
    d.commit(torch.tensor([], dtype=torch.long), torch.tensor([3]), TargetFeatures.empty())
    assert d.history == [0, 1, 3]


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_ngram=1, min_ngram=2), "min_ngram"),
    (dict(max_matches=0), "max_matches"),
    (dict(floor=0.0), "floor"),
])
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LookupConfig(**kwargs)


def test_suffix_index_gives_the_scans_votes_in_the_same_order():
    """The hybrid's incremental index answers exactly like the full scan (n, votes, vote order),
    matches reaching into the path and the suffix's own position included."""
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 5, 50])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        path = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        max_ngram = rng.randrange(1, 5)
        args = (max_ngram, rng.randrange(1, max_ngram + 1), rng.randrange(1, 6))
        index = SuffixIndex(*args)
        index.extend(tokens[: len(tokens) // 2])
        index.extend(tokens[len(tokens) // 2:])
        got, want = index.votes(path), suffix_votes(np.array(tokens + path), *args)
        assert got == want and list(got[1].items()) == list(want[1].items()), (tokens, path, args)
