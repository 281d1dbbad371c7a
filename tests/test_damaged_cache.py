"""A damaged calibration file is named with the command that rebuilds it, never a traceback;
``--budget auto`` measures it again by itself."""

from __future__ import annotations

import pytest

from treespec.planning.calibration import Calibration, DamagedCalibration


def test_a_truncated_calibration_is_named_with_its_rebuild_command(tmp_path):
    path = tmp_path / "calibration-x.json"
    path.write_text('{"version": 1, "model": "x", "shape": {"vocab": 3')
    with pytest.raises(DamagedCalibration, match=rf"the calibration file {path} is damaged \(JSONDecodeError.*"
                                                 r"`treespec calibrate --model <name> --weights pretrained`"):
        Calibration.load(path)


def test_auto_treats_a_damaged_calibration_as_absent(tmp_path, monkeypatch):
    from treespec.cli import main as cli
    from treespec.targets.loader import tiny_target

    path = tmp_path / "calibration-x.json"
    path.write_text("{not json")
    cal, why = cli._cached_calibration(path, tiny_target(vocab_size=32))
    assert cal is None and str(path) in why and "damaged" in why and why.endswith("rebuilding it")


def test_the_cli_prints_error_for_a_damaged_calibration(tmp_path, capsys, monkeypatch):
    from treespec.cli import main as cli

    path = tmp_path / "calibration-x.json"
    path.write_text("{not json")
    assert cli.main(["plan", "--hardware", "local", "--calibration", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: the calibration file {path} is damaged" in err and "Traceback" not in err
