"""Property tests (hypothesis): any valid tree validates, its derived structure and masks agree
with its paths, and ``accept`` always returns a root-to-leaf prefix plus one token."""

from __future__ import annotations

import networkx as nx
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec.core.masks import hf_tree_mask, pack_tree_masks, position_ids, tree_bool_mask, unpack_masks
from treespec.core.sampling import logits_to_probs
from treespec.core.tree import SAMPLING_MODES, DraftTree
from treespec.core import accept

from _tiny import one_thread  # noqa: F401  (autouse fixture)

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def trees(draw, max_nodes: int = 24, modes=SAMPLING_MODES):
    """A random valid DraftTree: any topology, tokens distinct among siblings unless the mode is
    with_replacement, draft_probs with full support for the stochastic modes."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    mode = draw(st.sampled_from(modes))
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents[1:], start=1):
        kids.setdefault(p, []).append(i)
    widest = max((len(k) for k in kids.values()), default=1)
    vocab = draw(st.integers(max(2, widest), 40))
    tokens = [draw(st.integers(0, vocab - 1))] + [0] * (n - 1)
    for p, cs in kids.items():
        toks = draw(st.lists(st.integers(0, vocab - 1), min_size=len(cs), max_size=len(cs),
                             unique=mode != "with_replacement"))
        for c, t in zip(cs, toks):
            tokens[c] = t
    probs = None
    if mode != "deterministic":
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        probs = torch.rand(n, vocab, generator=g, dtype=torch.float64) + 1e-3
        probs /= probs.sum(-1, keepdim=True)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), probs, mode, vocab)


@SETTINGS
@given(trees())
def test_derived_structure_agrees_with_parents(tree):
    par = tree.parents.tolist()
    n = tree.num_nodes
    depth = tree.depth.tolist()
    anc = tree.ancestor_mask
    for i in range(n):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert all(par[b] == a for a, b in zip(path, path[1:]))
        assert depth[i] == len(path) - 1
        assert set(anc[i].nonzero().flatten().tolist()) == set(path)
        assert list(tree.children[i]) == [j for j in range(n) if par[j] == i]
    assert tree.max_depth == max(depth)
    assert set(tree.leaves) == {i for i in range(n) if not tree.children[i]}
    assert [p[-1] for p in tree.paths] == list(tree.leaves)
    assert all(list(p) == tree.path_to(p[-1]) for p in tree.paths)
    assert set().union(*map(set, tree.paths)) == set(range(n))
    g = tree.to_networkx()
    assert g.number_of_nodes() == n and (n == 1 or nx.is_arborescence(g))


@SETTINGS
@given(trees(), st.integers(0, 40))
def test_masks_agree_with_paths(tree, prefix):
    n = tree.num_nodes
    m = tree_bool_mask(tree, prefix)
    assert m.shape == (n, prefix + n) and bool(m[:, :prefix].all())
    assert torch.equal(m[:, prefix:], tree.ancestor_mask)
    eager = hf_tree_mask(tree, prefix, "eager")[0, 0]
    assert torch.equal(eager == 0, m)
    assert torch.equal(hf_tree_mask(tree, prefix, "sdpa")[0, 0], m)
    assert position_ids(tree, prefix)[0].tolist() == [prefix + len(tree.path_to(i)) - 1
                                                      for i in range(n)]
    packed, indptr = pack_tree_masks([tree, tree], [prefix, 0])
    back = unpack_masks(packed, indptr, [n, n], [prefix + n, n])
    assert torch.equal(back[0], m) and torch.equal(back[1], tree.ancestor_mask)


@SETTINGS
@given(trees(), st.integers(0, 2**31 - 1), st.floats(0.0, 0.6))
def test_acceptance_is_a_root_to_leaf_prefix_plus_one_token(tree, seed, zero_frac):
    n, vocab = tree.num_nodes, tree.vocab_size
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, vocab, generator=g, dtype=torch.float64)
    p[torch.rand(n, vocab, generator=g) < zero_frac] = 0.0  # target zeros (top-p style)
    p[:, 0] += 1e-3  # every row keeps some mass
    if tree.draft_probs is not None and seed % 2:
        p = 0.5 * p / p.sum(-1, keepdim=True) + 0.5 * tree.draft_probs  # close: walks go deep
    a = accept(tree, p, g)
    path, toks = a.path.tolist(), a.tokens.tolist()
    assert len(toks) == len(path) + 1
    par = tree.parents.tolist()
    prev = 0
    for node in path:  # each accepted node's parent is the previous accepted node (or root)
        assert par[node] == prev
        prev = node
    assert toks[:-1] == [int(tree.tokens[i]) for i in path]
    nodes = [0] + path
    for parent, node in zip(nodes, path):  # a forbidden token is never accepted
        assert p[parent, tree.tokens[node]] > 0
    assert p[nodes[-1], toks[-1]] > 0  # the new token is drawn from (a residual of) p
    assert sum(a.depth_accepts) == len(path) and a.children_tried >= len(path)
    assert a.depth_attempts[:len(path)] == (1,) * len(path)
    if tree.children[nodes[-1]]:
        assert a.depth_attempts[len(path)] == 1 and a.depth_accepts[len(path)] == 0


@SETTINGS
@given(st.integers(2, 30), st.integers(0, 2**31 - 1), st.sampled_from([0.0, 0.5, 1.0, 1.7]),
       st.integers(0, 8), st.floats(0.05, 1.0), st.floats(0.0, 0.9))
def test_processed_rows_are_distributions_keeping_the_argmax(vocab, seed, temp, top_k, top_p, min_p):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    probs = logits_to_probs(logits, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    assert bool((probs >= 0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(3, dtype=torch.float64), atol=1e-12)
    best = logits.argmax(-1)
    assert bool((probs.gather(-1, best[:, None]) > 0).all())
    assert torch.equal(probs.argmax(-1), best)
