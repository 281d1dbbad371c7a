"""treespec.cli.viz: PNG pictures of draft trees (tokens on nodes, accepted path highlighted)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from treespec.core.tree import DraftTree
from treespec.builders.base import BuiltTree
from treespec.core import Acceptance
from treespec.cli.viz import ACCEPTED, NEW, _label, _layout, draw_tree, save_step_tree

from _engine_helpers import word_tokenizer

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def small_tree() -> DraftTree:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    return DraftTree(torch.tensor([0, 1, 5, 2, 6, 7]), torch.tensor([-1, 0, 0, 1, 1, 2]))


def acceptance(path: list[int], tokens: list[int]) -> Acceptance:
    return Acceptance(torch.tensor(path, dtype=torch.long), torch.tensor(tokens, dtype=torch.long),
                      (1, 1), (1, 0), 3)


def has_color(png, hex_color: str) -> bool:
    import matplotlib.image as mpimg

    img = mpimg.imread(png)[..., :3]
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return bool((np.abs(img - rgb).max(-1) < 0.02).any())


def test_draw_tree_writes_a_png_with_the_accepted_path(tmp_path) -> None:
    tree = small_tree()
    plain = draw_tree(tree, path=tmp_path / "plain.png")
    assert plain.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not has_color(plain, ACCEPTED) and not has_color(plain, NEW)
    tok = word_tokenizer(WORDS)
    out = draw_tree(tree, acceptance([1, 3], [1, 2, 4]), tok, path=tmp_path / "sub" / "acc.png")
    assert out.exists() and has_color(out, ACCEPTED) and has_color(out, NEW)
    built = BuiltTree(tree, torch.arange(6), drafter_calls=2, drafted=6)
    step = save_step_tree(built, acceptance([], [3]), tok, tmp_path / "steps", 7)
    assert step == tmp_path / "steps" / "step_0007.png" and step.exists()


def test_layout_and_labels() -> None:
    pos = _layout(small_tree())
    assert [x for x, _ in pos] == [0, 1, 1, 2, 2, 2]
    ys = [y for _, y in pos]
    assert ys[3] > ys[4] > ys[5]  # leaves top to bottom in tree order
    assert ys[1] == pytest.approx((ys[3] + ys[4]) / 2) and ys[2] == ys[5]
    assert _label(5, None) == "5"
    tok = word_tokenizer(WORDS)
    assert _label(1, tok) == "cat"

    class Spaces:
        def decode(self, ids):
            return {0: " the", 1: "\n", 2: "x" * 40}[ids[0]]

    assert _label(0, Spaces()) == "·the"
    assert _label(1, Spaces()) == "\\n"
    assert len(_label(2, Spaces())) == 14


def test_bad_inputs(tmp_path) -> None:
    with pytest.raises(TypeError, match="DraftTree or BuiltTree"):
        draw_tree([0, 1], path=tmp_path / "x.png")
    with pytest.raises(ValueError, match="does not fit"):
        draw_tree(small_tree(), acceptance([9], [1, 2]), path=tmp_path / "x.png")
