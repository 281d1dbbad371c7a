"""Pictures of draft trees: decoded tokens on nodes, the accepted path highlighted.

Layout: depth grows left to right, leaves are stacked top to bottom in tree order (children
in trial order), and each inner node sits at the mean height of its children. The accepted
path is green with thick edges; the new token the target added (residual or bonus) is drawn as
a dashed node in a row of its own, linked to the last accepted node. Needs matplotlib (``pip install treespec[bench]``).
"""

from __future__ import annotations

from pathlib import Path

from treespec.core.tree import DraftTree
from treespec.builders.base import BuiltTree

ACCEPTED, DRAFTED, ROOT, NEW = "#7fd17f", "#e8eef7", "#ffd479", "#f4a3a3"


def _label(token: int, tokenizer) -> str:
    """The decoded token, spaces shown as '·' and control characters escaped; else the id."""
    if tokenizer is None:
        return str(token)
    text = tokenizer.decode([token]).replace(" ", "·")
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    text = text or f"<{token}>"
    return text if len(text) <= 14 else text[:13] + "…"


def _layout(tree: DraftTree) -> list[tuple[float, float]]:
    """(x, y) per node: x = depth, y = leaf slot (leaves top to bottom, parents centred)."""
    y = [0.0] * tree.num_nodes
    next_leaf = 0.0

    def place(n: int) -> float:
        nonlocal next_leaf
        kids = tree.children[n]
        if not kids:
            y[n] = next_leaf
            next_leaf += 1.0
        else:
            ys = [place(c) for c in kids]
            y[n] = sum(ys) / len(ys)
        return y[n]

    place(0)
    depth = tree.depth.tolist()
    return [(float(depth[i]), -y[i]) for i in range(tree.num_nodes)]


def draw_tree(tree: DraftTree | BuiltTree, acceptance=None, tokenizer=None,
              path: str | Path = "tree.png", title: str | None = None) -> Path:
    """Write a PNG of ``tree`` to ``path`` and return the path.

    ``acceptance`` (a ``treespec.Acceptance`` for this tree) highlights the accepted path and
    adds the new token; ``tokenizer`` decodes tokens (token ids are shown without one).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(tree, BuiltTree):
        tree = tree.tree
    if not isinstance(tree, DraftTree):
        raise TypeError(f"draw_tree needs a DraftTree or BuiltTree, got {type(tree).__name__}")
    pos = _layout(tree)
    tokens = tree.tokens.tolist()
    accepted = {0}
    new_token = None
    if acceptance is not None:
        acc_path = acceptance.path.tolist()
        if any(not 0 < n < tree.num_nodes for n in acc_path):
            raise ValueError(f"acceptance path {acc_path} does not fit a tree of {tree.num_nodes} nodes")
        accepted.update(acc_path)
        new_token = (acc_path[-1] if acc_path else 0, int(acceptance.tokens[-1]))
    n_leaves = len(tree.leaves)
    width = 1.6 * (tree.max_depth + 1 + (new_token is not None)) + 1.0
    fig, ax = plt.subplots(figsize=(max(width, 4.0), max(0.45 * (n_leaves + (new_token is not None)) + 1.0, 2.5)))
    for i, p in enumerate(tree.parents.tolist()[1:], start=1):
        on_path = i in accepted and p in accepted
        ax.plot([pos[p][0], pos[i][0]], [pos[p][1], pos[i][1]], color="#2b8a3e" if on_path else "#9aa5b1",
                lw=2.5 if on_path else 0.8, zorder=1)
    boxes = []
    for i in range(tree.num_nodes):
        color = ROOT if i == 0 else ACCEPTED if i in accepted else DRAFTED
        boxes.append((pos[i], _label(tokens[i], tokenizer), color, "solid"))
    if new_token is not None:
        last, tok = new_token
        # its own row below the tree, one column right of the node it follows
        x, y = pos[last][0] + 1.0, min(py for _, py in pos) - 1.0
        ax.plot([pos[last][0], x], [pos[last][1], y], color="#c92a2a", lw=1.5, ls="--", zorder=1)
        boxes.append(((x, y), _label(tok, tokenizer), NEW, "dashed"))
    for (x, y), text, color, style in boxes:
        ax.text(x, y, text, ha="center", va="center", fontsize=8, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc=color, ec="#495057", ls=style))
    ax.set_axis_off()
    ax.margins(x=0.08, y=0.08)
    legend = f"N={tree.num_nodes}, depth={tree.max_depth}, {tree.sampling}"
    if acceptance is not None:
        legend += f", accepted {len(accepted) - 1} (+1 new)"
    ax.set_title(title + "\n" + legend if title else legend, fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def save_step_tree(built: BuiltTree, acceptance, tokenizer, directory: str | Path, step: int) -> Path:
    """``draw_tree`` for one engine step, saved as ``directory/step_0007.png`` (for --show-tree)."""
    return draw_tree(built, acceptance, tokenizer, Path(directory) / f"step_{step:04d}.png",
                     title=f"step {step}")
