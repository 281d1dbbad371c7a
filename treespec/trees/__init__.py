"""Tree builders: turn a drafter's distributions into a draft tree within a budget.

Every builder drives every drafter through ``build(drafter, root_token, sampling, generator)``,
has a ``budget`` (max tree nodes, root included) and a ``max_depth``, and makes one batched
drafter call per depth level (per round for best-first), never one per node.

    ChainBuilder(k)                             one path of k tokens
    StaticTreeBuilder(choices) / .default(n)    fixed Medusa-style topology (rank-path tuples)
    DynamicTreeBuilder(budget, depth, top_k)    EAGLE-2: expand the best frontier, rerank
    BestFirstBuilder(budget, max_width, max_rounds)   SpecExec: best-first rounds, early stop
    SequoiaBuilder(budget, depth, acceptance)   Sequoia's DP-optimal static topology

``mode`` = "deterministic" (ranked candidates) | "with_replacement" (i.i.d. draws from q) |
"without_replacement" (sequential draws); each mode is verified with its exact rule. A greedy
target always gets deterministic candidates. ``min_confidence`` (dynamic, best-first) stops
growth once the best frontier's path probability is below it.

Batches: every builder's ``grow`` is ``build`` as a generator of drafter calls; ``build_batch``
(``treespec.trees.batch``) grows the trees of many requests with ONE batched drafter call per
round (``treespec.drafters.batched``).
"""

from treespec.trees.base import BuiltTree, ExpandCall, TreeBuilder, draw_children, run_alone
from treespec.trees.batch import BuildJob, build_batch
from treespec.trees.best_first import BestFirstBuilder
from treespec.trees.chain import ChainBuilder
from treespec.trees.dynamic import DynamicTreeBuilder
from treespec.trees.sequoia import SequoiaBuilder, optimal_tree
from treespec.trees.static import StaticTreeBuilder, default_choices

__all__ = [
    "BestFirstBuilder", "BuildJob", "BuiltTree", "ChainBuilder", "ExpandCall", "build_batch",
    "run_alone", "DynamicTreeBuilder", "SequoiaBuilder",
    "StaticTreeBuilder", "TreeBuilder", "default_choices", "draw_children",
    "optimal_tree",
]


def __getattr__(name: str):
    """``measure_acceptance_vector`` lives in ``treespec.measure`` (it runs the engine, which
    imports the builders); this old path still resolves, on first use."""
    if name == "measure_acceptance_vector":
        from treespec.measure import measure_acceptance_vector

        return measure_acceptance_vector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
