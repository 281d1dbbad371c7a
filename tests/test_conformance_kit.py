"""treespec.testing.check_drafter passes a correct drafter and fails each kind of broken copy
loudly, naming the check and the fix."""

from __future__ import annotations

import pytest
import torch

from treespec.drafters.base import PartialTree
from treespec.testing import DrafterConformanceError, check_drafter, chisquare_pvalue, first_tokens_law
from treespec.targets.loader import tiny_target

from _tiny import one_thread  # noqa: F401  (autouse fixture: one intra-op thread)


class Bigram:
    """q(next | last token) from bigram counts of the committed text, smoothed: a correct drafter."""

    needs_target_hidden = False
    target_layers = ()
    path_independent = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.counts = torch.ones(vocab_size, vocab_size)

    def begin(self, prompt_ids, features):
        self.counts = torch.ones(self.vocab_size, self.vocab_size)
        self.last = int(prompt_ids[-1])
        self._count(prompt_ids.tolist())

    def _count(self, ids):
        for a, b in zip(ids, ids[1:]):
            self.counts[a, b] += 4.0

    def expand(self, tree: PartialTree, nodes: list[int]) -> torch.Tensor:
        rows = self.counts[[tree.tokens[n] for n in nodes]]
        return (rows / rows.sum(-1, keepdim=True)).log()

    def commit(self, path, tokens, features):
        self._count([self.last] + tokens.tolist())
        self.last = int(tokens[-1])


class NoCommit(Bigram):
    commit = None


class FirstRowForAll(Bigram):
    """Batched bug: every row of a call gets the first node's q."""

    def expand(self, tree, nodes):
        return super().expand(tree, nodes[:1]).expand(len(nodes), -1).clone()


class RaisesOnLongCalls(Bigram):
    def expand(self, tree, nodes):
        if len(nodes) > 2:
            raise RuntimeError("only two nodes at a time")
        return super().expand(tree, nodes)


class TouchesTheTarget(Bigram):
    """Changes the target it was built for (adds to the LM head on every commit)."""

    def __init__(self, target):
        super().__init__(target.vocab_size)
        self.head = target.model.get_output_embeddings().weight

    def commit(self, path, tokens, features):
        super().commit(path, tokens, features)
        with torch.no_grad():
            self.head.add_(0.5 * torch.randn_like(self.head))


class RewritesTheTree(Bigram):
    """Replaces each drawn token it is asked to expand by the most likely one: the tree no longer
    holds what the builder drew from q, so the output law is biased (greedy stays exact)."""

    def expand(self, tree, nodes):
        out = super().expand(tree, nodes)
        for n in nodes:
            if tree.depth[n] > 0:
                tree.tokens[n] = int(super().expand(tree, [tree.parents[n]]).argmax())
        return out


class NaNs(Bigram):
    def expand(self, tree, nodes):
        out = super().expand(tree, nodes)
        out[:, 0] = float("nan")
        return out


def test_a_correct_drafter_passes_every_check_in_under_a_minute():
    report = check_drafter(lambda target: Bigram(target.vocab_size))
    assert report.ok and [r.name for r in report.results] == ["protocol", "batched", "greedy", "law"]
    assert all(r.passed for r in report.results), str(report)
    assert sum(r.seconds for r in report.results) < 60, str(report)


@pytest.mark.parametrize("make,check,words", [
    (lambda t: NoCommit(t.vocab_size), "protocol", "lacks commit"),
    (lambda t: NaNs(t.vocab_size), "protocol", "NaN or \\+inf"),
    (lambda t: Bigram(t.vocab_size + 1), "protocol", "vocab_size is 33 but the target has 32"),
    (lambda t: FirstRowForAll(t.vocab_size), "batched", "row i of expand\\(tree, nodes\\) must be q after"),
    (lambda t: RaisesOnLongCalls(t.vocab_size), "batched", "raised RuntimeError: only two nodes"),
    (TouchesTheTarget, "greedy", "greedy output differs from plain decoding"),
])
def test_broken_copies_fail_loudly(make, check, words):
    with pytest.raises(DrafterConformanceError, match=words) as err:
        check_drafter(make, law_runs=100)
    assert check in [r.name for r in err.value.report.failures()]


def test_a_drafter_that_rewrites_the_tree_fails_the_law():
    report = check_drafter(lambda t: RewritesTheTree(t.vocab_size), raise_on_failure=False)
    failed = {r.name: r.detail for r in report.failures()}
    assert "law" in failed and "do not follow the target's law" in failed["law"], str(report)


def test_names_resolve_and_a_big_target_skips_the_law():
    target = tiny_target(vocab_size=32, seed=0)
    target.model.generation_config.eos_token_id = None
    report = check_drafter("lookup", target=target)
    assert report.ok and report.results[-1].passed is None and "skipped" in report.results[-1].detail


def test_first_tokens_law_and_chisquare():
    target = tiny_target(vocab_size=8, seed=3)
    law = first_tokens_law(target, torch.tensor([1, 2, 3]), 2)
    assert law.shape == (64,) and abs(float(law.sum()) - 1) < 1e-12
    counts = (law * 1000).round()
    assert chisquare_pvalue(counts, law)[0] > 0.5
    assert chisquare_pvalue(counts.flip(0), law)[0] < 1e-6
