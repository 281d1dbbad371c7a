"""Validation at the door: the generator, `generate` and the CLI refuse wrong arguments with one
error that says what was expected, before any model is loaded or any step runs."""

from __future__ import annotations

import pytest

from _engine_helpers import small_generator


@pytest.mark.parametrize("question", ["999", "-1", "80"])
def test_demo_refuses_a_question_out_of_range_before_loading_anything(question, monkeypatch, capsys):
    from treespec.cli import main as cli

    monkeypatch.setattr(cli, "_build_generator", lambda args: pytest.fail("loaded a model"))
    assert cli.main(["demo", "--question", question]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --question") and "0 to 79" in err


def test_python_dash_m_treespec_and_version(monkeypatch, capsys):
    import runpy
    import sys

    import treespec

    assert isinstance(treespec.__version__, str) and treespec.__version__[0].isdigit()
    monkeypatch.setattr(sys, "argv", ["treespec", "--version"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("treespec", run_name="__main__")        # what `python -m treespec` runs
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"treespec {treespec.__version__}"


def test_generator_refuses_a_builder_that_is_not_one():
    from treespec import SpeculativeGenerator
    from _engine_helpers import NGramDrafter, peaky_target

    with pytest.raises(TypeError, match="builder must be a TreeBuilder .*got int"):
        SpeculativeGenerator(peaky_target(8), NGramDrafter(8), 42)
    with pytest.raises(TypeError, match="drafter must be a Drafter .*got int"):
        SpeculativeGenerator(peaky_target(8), 42)


@pytest.mark.parametrize("prompt", [None, 3.5, {"a": 1}, object()])
def test_generate_refuses_a_prompt_of_the_wrong_type(prompt):
    with pytest.raises(TypeError, match="prompt must be text, token ids"):
        small_generator().generate(prompt, max_new_tokens=2)


def test_generate_refuses_a_hook_or_chat_flag_of_the_wrong_type():
    with pytest.raises(TypeError, match="on_step must be a callable"):
        small_generator().generate([1, 2], max_new_tokens=2, on_step=5)
    with pytest.raises(TypeError, match="chat must be True or False"):
        small_generator().generate([1, 2], max_new_tokens=2, chat="yes")


@pytest.mark.parametrize("seed", ["abc", 1.5, True])
def test_generate_refuses_a_seed_that_is_not_an_int(seed):
    with pytest.raises(TypeError, match="seed must be an int or None"):
        small_generator().generate([1, 2], max_new_tokens=2, seed=seed)


@pytest.mark.parametrize("temperature, mode", [(0.0, "deterministic"), (1.0, "with_replacement"),
                                               (1.0, "without_replacement")])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_drafter_returning_nan_logits_is_named_in_every_mode(temperature, mode, bad):
    from treespec import DynamicTreeBuilder
    from _engine_helpers import NGramDrafter

    class BrokenDrafter(NGramDrafter):
        def expand(self, tree, nodes):
            logits = super().expand(tree, nodes)
            logits[:, 3] = bad
            return logits

    gen = small_generator(BrokenDrafter(8), DynamicTreeBuilder(6, 3, 2, mode=mode))
    with pytest.raises(ValueError, match="BrokenDrafter returned non-finite draft logits"):
        gen.generate([1, 2], max_new_tokens=4, temperature=temperature, seed=0)


SETTINGS = [dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=1), dict(temperature=1.0, top_k=3),
            dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, min_p=0.2),
            dict(temperature=1.3, top_k=4, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf", "nan beside -inf", "+inf beside -inf"])
def test_the_finite_check_on_q_catches_every_bad_row_under_every_sampling_setting(settings, bad):
    # the check reads q only: every processing path must leave a NaN in q for a bad logits row
    import torch
    from treespec.builders.base import check_finite_draft, draft_distribution
    from treespec.core.sampling import SamplingConfig

    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    logits[0, 2] = -torch.inf
    row = logits[1]
    if bad == "all -inf":
        row.fill_(-torch.inf)
    else:
        if "beside" in bad:
            row[5] = -torch.inf
        row[7] = torch.nan if bad.startswith("nan") else torch.inf
    q = draft_distribution(logits, SamplingConfig(**settings))
    with pytest.raises(ValueError, match="non-finite draft logits"):
        check_finite_draft(q, small_generator().drafter)


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_finite_check_passes_minus_inf_and_huge_finite_logits(settings):
    import torch
    from treespec.builders.base import check_finite_draft, draft_distribution
    from treespec.core.sampling import SamplingConfig

    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(1))
    logits[0, :5] = -torch.inf                       # outside a drafter's support
    logits[1, :5] = torch.tensor([1e38, 1e38, 1e38, 1e38, -1e38])  # finite; their sum overflows
    q = draft_distribution(logits, SamplingConfig(**settings))
    check_finite_draft(q, small_generator().drafter)
    assert torch.allclose(q.sum(-1), torch.ones(2))


def test_calibrate_does_not_offer_float16():
    from treespec.cli import main as cli

    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(["calibrate", "--dtype", "float16"])
    assert exit_.value.code == 2
