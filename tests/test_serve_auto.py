"""`treespec serve --budget auto` ensures this machine's calibration (the drafter under its key,
the batched passes up to --max-batch) before it serves, as `treespec generate --budget auto`
does, and its plan shrinks the tree as the batch grows: a tree alone, a chain at a few
requests, plain decoding at the largest batch."""

from __future__ import annotations

import pytest

from _tiny import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def _compute_bound_calibration(device: str, batches, flat_tokens: int = 8):
    """A target whose verify pass is flat up to 8 tokens in all (the whole batch's), then linear:
    one request can verify a tree for free, four a short chain, eight nothing. The drafter is
    prompt lookup (free) with a high measured acceptance."""
    from treespec.planning import Calibration, Curve, model_shape

    ns = (1, 2, 4, 8, 16, 32, 64)

    def curve(b: int) -> Curve:
        return Curve.fit(ns, [max(1.0, b * n / flat_tokens) for n in ns])

    return Calibration(
        model="tiny", shape=model_shape("smollm2-135m", bytes_per_weight=4), context=64,
        target=curve(1), drafters={"early_exit": Curve.fit(ns, [0.01 * n for n in ns])},
        drafter_layers={"early_exit": 2}, device=device,
        acceptance={"lookup[min_ngram=2]": (0.6, 0.3)},
        batch_target={b: curve(b) for b in batches},
    )


def test_serve_auto_ensures_the_calibration_and_shrinks_the_tree_as_the_batch_grows(tmp_path, monkeypatch,
                                                                                     capsys) -> None:
    import treespec
    import treespec.calibrate.ensure as ensure
    from treespec.cli import serve
    from treespec.cli.main import build_parser
    from treespec.planning.calibration import _device_description, model_calibration_path
    from treespec.runtime.server import SpeculativeServer
    from treespec.targets.loader import tiny_target

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = tiny_target(vocab_size=32, seed=0)
    monkeypatch.setattr(treespec, "load_target", lambda *a, **k: target)
    seen = []

    def measure(t, key, out=None, batches=()):
        """What ensure_calibration leaves on disk: the file auto then reads."""
        seen.append((t, key, tuple(batches)))
        path = model_calibration_path(t.name, t.model)
        return _compute_bound_calibration(_device_description(t.device), batches).save(path)

    monkeypatch.setattr(ensure, "ensure_calibration", measure)
    args = build_parser().parse_args(["serve", "--no-compile", "--drafter", "lookup", "--drafter-option", "min_ngram=2",
                                      "--max-batch", "8", "--threads", "1"])
    got, server = serve.build_server(args)
    assert got is target and isinstance(server, SpeculativeServer)
    assert seen == [(target, "lookup[min_ngram=2]", (2, 4, 8))]   # the drafter's key, the batches served
    err = capsys.readouterr().err
    plan = [line for line in err.splitlines() if line.startswith("[auto at batch") and ", T = 0:" in line]
    assert [line.split(":")[0] for line in plan] == [f"[auto at batch {b}, T = 0" for b in (1, 2, 4, 8)]
    assert "a tree of" in plan[0]
    assert "a chain of" in plan[2]
    assert plan[3].endswith("plain decoding (no draft)]")
    assert "not run" not in err                     # a tree pays somewhere: the drafter stays
    # and the server itself plans the same way as its batch grows
    for b in range(1, 9):
        server.add_request([1, 2, 3, 1, 2, 3, 1, 2][:3 + b % 5], max_new_tokens=4)
    server.step()
    assert len(server.live) == 8 and server._auto_builder(0.0, 8).budget == 1


def test_where_auto_plans_no_tree_at_any_batch_the_server_runs_without_the_drafter(tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    """A verify pass that costs its tokens from the first one: no tree pays, alone or batched,
    greedy or sampled, so the drafter (whose commit costs every step) is not run at all."""
    import treespec
    import treespec.calibrate.ensure as ensure
    from treespec.cli import serve
    from treespec.cli.main import build_parser
    from treespec.runtime.server import PlainDrafter
    from treespec.planning.calibration import _device_description, model_calibration_path
    from treespec.targets.loader import tiny_target

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target = tiny_target(vocab_size=32, seed=0)
    monkeypatch.setattr(treespec, "load_target", lambda *a, **k: target)

    def measure(t, key, out=None, batches=()):
        path = model_calibration_path(t.name, t.model)
        return _compute_bound_calibration(_device_description(t.device), batches, flat_tokens=1).save(path)

    monkeypatch.setattr(ensure, "ensure_calibration", measure)
    args = build_parser().parse_args(["serve", "--no-compile", "--drafter", "lookup", "--drafter-option", "min_ngram=2",
                                      "--max-batch", "4", "--threads", "1"])
    _, server = serve.build_server(args)
    err = capsys.readouterr().err
    assert "no tree pays on this machine at any batch size up to 4, greedy or sampled" in err
    assert isinstance(server.drafter, PlainDrafter)      # drafter=None: plain decoding


def test_serve_auto_refuses_an_unnameable_drafter_option_before_loading(monkeypatch) -> None:
    import treespec
    from treespec.cli.main import main

    monkeypatch.setattr(treespec, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["serve", "--drafter", "lookup", "--drafter-option", "min_ngram=a,b"]) == 2


@pytest.mark.parametrize("max_batch, batches",
                         [(1, ()), (2, (2,)), (6, (2, 4, 6)), (8, (2, 4, 8)), (12, (2, 4, 8, 12))])
def test_auto_batches_cover_the_served_batch_sizes(max_batch, batches) -> None:
    from treespec.cli.serve import auto_batches

    assert auto_batches(max_batch) == batches
