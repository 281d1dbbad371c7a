"""DraftTree: derived structure against hand-written examples, constructors, and bad input."""

from __future__ import annotations

import pytest
import torch

from treespec.core.tree import DraftTree

from _tiny import one_thread  # noqa: F401  (autouse fixture)

#        0 (root, token 9)
#       / \
#      1   2          tokens 4, 5
#     / \   \
#    3   4   5        tokens 6, 7, 6
#    |
#    6                token 8
TOKENS = [9, 4, 5, 6, 7, 6, 8]
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def example() -> DraftTree:
    return DraftTree(torch.tensor(TOKENS), torch.tensor(PARENTS))


def test_derived_structure_by_hand():
    t = example()
    assert t.num_nodes == len(t) == 7
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.max_depth == 3
    assert t.children == ((1, 2), (3, 4), (5,), (6,), (), (), ())
    assert t.leaves == (4, 5, 6)
    assert t.paths == ((0, 1, 4), (0, 2, 5), (0, 1, 3, 6))
    assert t.path_to(6) == [0, 1, 3, 6] and t.path_to(0) == [0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(t.ancestor_mask, expected)
    assert t.depth.dtype == torch.long and t.ancestor_mask.dtype == torch.bool
    assert t.vocab_size is None and t.sampling == "deterministic"
    assert "N=7" in repr(t) and "depth=3" in repr(t)


def test_root_only_tree():
    t = DraftTree(torch.tensor([3]), torch.tensor([-1]))
    assert t.depth.tolist() == [0] and t.max_depth == 0
    assert t.children == ((),) and t.leaves == (0,) and t.paths == ((0,),)
    assert t.ancestor_mask.tolist() == [[True]]


def test_vocab_size_taken_from_draft_probs():
    q = torch.full((2, 6), 1 / 6)
    t = DraftTree(torch.tensor([0, 5]), torch.tensor([-1, 0]), q, "with_replacement")
    assert t.vocab_size == 6


def test_to_networkx():
    g = example().to_networkx()
    assert sorted(g.edges) == [(0, 1), (0, 2), (1, 3), (1, 4), (2, 5), (3, 6)]
    assert [g.nodes[i]["token"] for i in range(7)] == TOKENS
    assert [g.nodes[i]["depth"] for i in range(7)] == [0, 1, 1, 2, 2, 2, 3]
    import networkx as nx

    assert nx.is_arborescence(g)


def test_from_paths_merges_prefixes_breadth_first():
    t = DraftTree.from_paths(9, [[4, 6, 8], [4, 7], [5, 6]])
    # depth 1: 4, 5; depth 2: (4,6), (4,7), (5,6); depth 3: (4,6,8) -> the example tree
    assert t.tokens.tolist() == TOKENS and t.parents.tolist() == PARENTS
    single = DraftTree.from_paths(1, [])
    assert single.tokens.tolist() == [1] and single.parents.tolist() == [-1]


def test_from_paths_with_draft_probs_and_vocab():
    q = torch.full((3, 4), 0.25)
    t = DraftTree.from_paths(0, [[1, 2]], q, "without_replacement")
    assert t.sampling == "without_replacement" and t.vocab_size == 4
    with pytest.raises(TypeError, match="paths must be a list of token sequences"):
        DraftTree.from_paths(0, torch.tensor([[1, 2]]))


def test_from_choices_medusa_style():
    ranked = torch.tensor([[10, 11, 12], [20, 21, 22]])  # [D=2, K=3]
    t = DraftTree.from_choices(0, [(0,), (1,), (0, 0), (0, 2), (1, 0)], ranked)
    # sorted by (length, ranks): (0,), (1,), (0,0), (0,2), (1,0)
    assert t.tokens.tolist() == [0, 10, 11, 20, 22, 20]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    # order and duplicates in the input do not matter
    t2 = DraftTree.from_choices(0, [(1, 0), (0, 2), (0,), (1,), (0, 0), (0,)], ranked)
    assert torch.equal(t.tokens, t2.tokens) and torch.equal(t.parents, t2.parents)


@pytest.mark.parametrize(
    "choices,ranked,match",
    [
        ([(0,), (1, 0)], torch.tensor([[1, 2], [3, 4]]), r"choice \(1, 0\) has no parent choice \(1,\)"),
        ([()], torch.tensor([[1, 2]]), "must not contain the empty path"),
        ([(0,), (0, 0)], torch.tensor([[1, 2]]), r"needs depth 2 and rank 0.*\[D=1, K=2\]"),
        ([(2,)], torch.tensor([[1, 2]]), r"needs depth 1 and rank 2"),
        ([(0,)], torch.tensor([1, 2]), r"ranked_tokens must be LongTensor\[D, K\]"),
    ],
)
def test_from_choices_errors(choices, ranked, match):
    with pytest.raises(ValueError, match=match):
        DraftTree.from_choices(0, choices, ranked)


def test_from_choices_repeated_tokens_across_ranks_are_caught():
    ranked = torch.tensor([[7, 7]])  # two ranks with the same token: siblings would repeat
    with pytest.raises(ValueError, match="distinct sibling tokens"):
        DraftTree.from_choices(0, [(0,), (1,)], ranked)


# ---------------------------------------------------------------------------- bad input
def _t(tokens, parents, probs=None, sampling="deterministic", vocab=None):
    return DraftTree(torch.as_tensor(tokens), torch.as_tensor(parents), probs, sampling, vocab)


@pytest.mark.parametrize(
    "parents,match",
    [
        ([-1, 1, 0], r"parents must be topological \(0 <= parents\[i\] < i\); node 1 has parent 1"),
        ([-1, 0, 3], r"node 2 has parent 3"),
        ([-1, 0, -1], r"node 2 has parent -1"),
        ([0, 0, 1], r"parents\[0\] must be -1 \(the root\), got 0"),
        ([-1, 0], "parents has 2 entries but tokens has 3"),
    ],
)
def test_bad_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        _t([1, 2, 3], parents)


def test_wrong_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"tokens must have dtype torch.long, got torch.int32"):
        _t(torch.tensor([1, 2], dtype=torch.int32), [-1, 0])
    with pytest.raises(ValueError, match=r"parents must have dtype torch.long, got torch.float32"):
        _t([1, 2], torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match=r"tokens must be 1-D \[N\], got shape \(1, 2\)"):
        _t([[1, 2]], [-1, 0])
    with pytest.raises(TypeError, match="tokens must be a torch.LongTensor, got list"):
        DraftTree([1, 2], torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match=r"needs at least the root node \(N >= 1\)"):
        _t(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))


def test_bad_draft_probs():
    q = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[N=2, V\], got \(3, 4\)"):
        _t([0, 1], [-1, 0], torch.full((3, 4), 0.25), "with_replacement")
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[N=2, V\], got \(8,\)"):
        _t([0, 1], [-1, 0], torch.full((8,), 0.25), "with_replacement")
    with pytest.raises(TypeError, match=r"draft_probs must be a floating-point tensor \[N, V\]"):
        _t([0, 1], [-1, 0], torch.ones(2, 4, dtype=torch.long), "with_replacement")
    with pytest.raises(ValueError, match="vocab_size=5 disagrees with draft_probs' V=4"):
        _t([0, 1], [-1, 0], q, "with_replacement", vocab=5)


@pytest.mark.parametrize(
    "row0,match",
    [
        ([0.5, 0.2, 0.2, 0.0], r"draft_probs row 0 sums to 0.900000; each row must be a probability"),
        ([0.0, 0.0, 0.0, 0.0], r"draft_probs row 0 sums to 0.000000"),
        ([1.5, -0.5, 0.0, 0.0], "draft_probs must be finite and non-negative"),
        ([float("nan"), 1.0, 0.0, 0.0], "draft_probs must be finite and non-negative"),
        ([float("inf"), 1.0, 0.0, 0.0], "draft_probs must be finite and non-negative"),
        ([-float("inf"), 1.0, 0.0, 0.0], "draft_probs must be finite and non-negative"),
    ],
)
def test_draft_rows_must_be_distributions(row0, match):
    q = torch.tensor([row0, [0.25] * 4])
    with pytest.raises(ValueError, match=match):
        _t([0, 1], [-1, 0], q, "with_replacement")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_softmax_rows_in_any_float_dtype_validate(dtype):
    q = torch.randn(3, 5000, generator=torch.Generator().manual_seed(0)).softmax(-1).to(dtype)
    t = _t([0, 1, 2], [-1, 0, 1], q, "with_replacement")
    assert t.vocab_size == 5000


def test_leaf_draft_rows_may_be_zero_but_not_partial():
    ok = torch.tensor([[0.25] * 4, [0.0] * 4])  # the leaf's row is never used to draw
    _t([0, 1], [-1, 0], ok, "with_replacement")
    bad = torch.tensor([[0.25] * 4, [0.1] * 4])
    with pytest.raises(ValueError, match="draft_probs row 1 sums to 0.400000"):
        _t([0, 1], [-1, 0], bad, "with_replacement")


@pytest.mark.parametrize("sampling", ["with_replacement", "without_replacement"])
def test_stochastic_tree_needs_draft_probs(sampling):
    with pytest.raises(ValueError, match=f"a '{sampling}' tree needs draft_probs"):
        _t([0, 1], [-1, 0], None, sampling)


def test_unknown_sampling_mode():
    with pytest.raises(ValueError, match="sampling must be one of .*got 'greedy'"):
        _t([0, 1], [-1, 0], None, "greedy")


def test_tokens_outside_vocab():
    q = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V=4\), got \[0, 4\]"):
        _t([0, 4], [-1, 0], q, "with_replacement")
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V=None\)"):
        _t([0, -1], [-1, 0])
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V=3\)"):
        _t([0, 3], [-1, 0], vocab=3)


def test_repeated_sibling_tokens():
    with pytest.raises(ValueError, match="deterministic trees need distinct sibling tokens"):
        _t([0, 5, 5], [-1, 0, 0])
    # the same token under different parents, or repeated i.i.d. siblings, are fine
    _t([0, 5, 6, 5, 5], [-1, 0, 0, 1, 2])
    q = torch.full((3, 8), 1 / 8)
    _t([0, 5, 5], [-1, 0, 0], q, "with_replacement")


def test_builder_trees_skip_only_the_draft_probs_scan():
    """``from_builder`` trusts the builders' softmax rows but still checks the structure."""
    tokens, parents = torch.tensor([1, 2]), torch.tensor([-1, 0])
    probs = torch.tensor([[0.5, 0.6, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # row 0 sums to 1.1
    with pytest.raises(ValueError, match="sums to 1.100000"):
        DraftTree(tokens, parents, probs, "with_replacement")
    assert DraftTree.from_builder(tokens, parents, probs, "with_replacement").vocab_size == 4
    with pytest.raises(ValueError, match="topological"):
        DraftTree.from_builder(tokens, torch.tensor([-1, 1]), probs, "with_replacement")
    with pytest.raises(ValueError, match="needs draft_probs"):
        DraftTree.from_builder(tokens, parents, None, "with_replacement")
