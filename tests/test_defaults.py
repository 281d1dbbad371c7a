"""One set of sampling defaults, one argument order, one meaning of "budget"."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from treespec import SamplingConfig, SpeculativeGenerator, logits_to_probs
from treespec.runtime.server import SpeculativeServer, generate_batch

SAMPLING = [f.name for f in dataclasses.fields(SamplingConfig)]


def test_sampling_defaults_are_greedy():
    assert SAMPLING == ["temperature", "top_k", "top_p", "min_p"]
    assert SamplingConfig().greedy


@pytest.mark.parametrize("fn", [SpeculativeGenerator.generate, SpeculativeGenerator.stream, logits_to_probs])
def test_every_front_door_takes_the_sampling_settings_in_one_order_with_one_default(fn):
    params = inspect.signature(fn).parameters
    names = [n for n in params if n in SAMPLING]
    assert names == SAMPLING
    defaults = SamplingConfig()
    assert {n: params[n].default for n in names} == {n: getattr(defaults, n) for n in SAMPLING}


def test_the_cli_uses_the_same_defaults():
    from treespec.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert {n: getattr(args, n) for n in SAMPLING} == dataclasses.asdict(SamplingConfig())


def test_requests_default_to_the_config_and_a_fresh_seed():
    """Without seeds, a sampled batch draws fresh seeds like ``generate`` does (two runs differ);
    without configs it is greedy (two runs agree)."""
    import torch

    from _engine_helpers import NGramDrafter, peaky_target
    from treespec import ChainBuilder

    assert inspect.signature(SpeculativeServer.add_request).parameters["seed"].default is None
    target = peaky_target(16, seed=2, std=0.3, hidden_size=32, num_layers=2)
    prompts, limits = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])], [24, 24]

    def run(configs=None):
        return generate_batch(target, [NGramDrafter(16, seed=1), NGramDrafter(16, seed=2)], ChainBuilder(budget=4),
                              prompts, limits, configs)

    assert run() == run()
    sampled = [SamplingConfig(temperature=1.0)] * 2
    assert run(sampled) != run(sampled)     # 48 tokens from 16 each: equal by chance with p < 1e-20


def test_budget_counts_the_root_in_builders_planner_and_optimal_tree():
    from treespec import ChainBuilder, DynamicTreeBuilder, optimal_tree
    from treespec.planning import best_tree

    assert ChainBuilder(budget=5).budget == 5 and DynamicTreeBuilder(budget=16).budget == 16
    tree = optimal_tree((0.6, 0.3), budget=4, depth=3)
    assert len(tree.parents) == tree.budget == 4 and tree.drafts == 3
    choice = best_tree("llama-3-8b", "eagle", "h100", batch=1, context=128)
    assert choice.budget == sum(choice.level_sizes) == choice.drafts + 1


def test_optional_drafter_capabilities_are_read_in_one_place():
    """``capabilities`` gives the declared defaults for a bare protocol drafter and the
    drafter's own members where it has them; the runtime reads nothing else."""
    import pathlib

    from _engine_helpers import NGramDrafter
    from treespec.drafters.base import capabilities

    bare = capabilities(NGramDrafter(8))
    assert (bare.cost_kind, bare.registry_name, bare.expand_compact, bare.batched) == ("early_exit", None, None, None)

    class Rich(NGramDrafter):
        cost_kind, registry_name = "lookup", "mine"

        def batched(self):
            return "batched form"

    rich = capabilities(Rich(8))
    assert (rich.cost_kind, rich.registry_name, rich.batched()) == ("lookup", "mine", "batched form")
    root = pathlib.Path(__file__).parents[1] / "treespec"
    probes = [str(p.relative_to(root)) for p in root.rglob("*.py")
              for name in ("cost_kind", "registry_name", "expand_compact", '"batched"')
              if f'getattr(drafter, "{name.strip(chr(34))}"' in p.read_text() or f'getattr(d, "{name.strip(chr(34))}"' in p.read_text()]
    assert sorted(set(probes)) == ["drafters/base.py"]
