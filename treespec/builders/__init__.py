"""Tree builders: turn a drafter's distributions into a draft tree within a budget.

Every builder drives every drafter through ``build(drafter, root_token, sampling, generator)``,
has a ``budget`` (max tree nodes, root included) and a ``max_depth``, and makes one batched
drafter call per depth level (per round for best-first), never one per node.

    ChainBuilder(budget)                        one path of budget - 1 draft tokens
    StaticTreeBuilder(choices) / .default(n)    fixed Medusa-style topology (rank-path tuples)
    DynamicTreeBuilder(budget, depth, top_k)    EAGLE-2: expand the best frontier, rerank
    BestFirstBuilder(budget, max_width, max_rounds)   SpecExec: best-first rounds, early stop
    SequoiaBuilder(budget, depth, acceptance)   Sequoia's DP-optimal static topology
    SwitchBuilder(head, lookup)                 a SwitchDrafter's head trees by one builder,
                                                its lookup trees by another

``mode`` = "deterministic" (ranked candidates) | "with_replacement" (i.i.d. draws from q) |
"without_replacement" (sequential draws); each mode is verified with its exact rule. A greedy
target always gets deterministic candidates. ``min_confidence`` (dynamic, best-first) stops
growth once the best frontier's path probability is below it.

Batches: every builder's ``grow`` is ``build`` as a generator of drafter calls; ``build_batch``
(``treespec.builders.batch``) grows the trees of many requests with ONE batched drafter call per
round (``treespec.drafters.batched``).
"""

from treespec.builders.base import BuiltTree, ExpandCall, TreeBuilder, draw_children, run_alone
from treespec.builders.batch import BuildJob, build_batch
from treespec.builders.best_first import BestFirstBuilder
from treespec.builders.chain import ChainBuilder
from treespec.builders.dynamic import DynamicTreeBuilder
from treespec.builders.sequoia import SequoiaBuilder
from treespec.builders.static import StaticTreeBuilder, default_choices
from treespec.builders.switch import SwitchBuilder

__all__ = [
    "BestFirstBuilder", "BuildJob", "BuiltTree", "ChainBuilder", "ExpandCall", "build_batch",
    "run_alone", "DynamicTreeBuilder", "SequoiaBuilder",
    "StaticTreeBuilder", "SwitchBuilder", "TreeBuilder", "default_choices", "draw_children",
]
