"""Conformance kit for drafters of your own: ``check_drafter(factory, target=...)``.

    from treespec.testing import check_drafter
    check_drafter("mypkg.mod:factory")        # or a factory(target) -> Drafter; raises on a broken one

It checks, in well under a minute on tiny random targets: the protocol members and the shape of
``expand``; batched ``expand`` against one node at a time; greedy output equal to plain decoding
under a chain and a tree builder; and the output law at T = 1 (the target's law of the first two
tokens, enumerated exactly on an 8-token vocabulary) against seeded runs of the engine.
"""

from treespec.testing.conformance import (
    CheckResult, ConformanceReport, DrafterConformanceError, check_drafter, conformance_targets,
)
from treespec.testing.laws import chisquare_pvalue, first_tokens_law, plain_greedy

__all__ = [
    "CheckResult", "ConformanceReport", "DrafterConformanceError", "check_drafter", "chisquare_pvalue",
    "conformance_targets", "first_tokens_law", "plain_greedy",
]
