"""``lightning-opd results`` (lightning_opd/analysis/results.py): the last logged value per run, runs that have not
logged it yet, and the errors for a missing run, a folder without events and a misspelled metric."""

from __future__ import annotations

import pytest

from lightning_opd.cli import main
from tests.analysis.scalars import write_scalars


def _exit(capsys, argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    return exc.value.code, captured.err + captured.out


def test_results_table_and_errors(capsys, tmp_path):
    a = write_scalars(tmp_path / "a", {"val/success": [(9, 0.5), (19, 0.92)], "val/episodes": [(19, 50.0)]})
    b = write_scalars(tmp_path / "b", {"train/kl": [(0, 1.0)]})  # has not validated yet
    main(["results", f"after={a}", str(b)])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[1].split("|")[1:] == ["       0.920 ", "       50 ", " 19"]
    assert lines[2].split("|")[1].strip() == "-" and f"{b} has not logged val/success yet" in captured.err
    code, text = _exit(capsys, ["results", f"after={a}", f"x={tmp_path / 'missing'}"])
    assert code == 1 and f"run directory '{tmp_path / 'missing'}' does not exist (label 'x')" in text
    (tmp_path / "empty").mkdir()
    code, text = _exit(capsys, ["results", str(tmp_path / "empty")])
    assert code == 1 and "no TensorBoard event files under" in text
    code, text = _exit(capsys, ["results", str(a), str(b), "--metric", "val/sucess"])
    assert code == 1 and "no run logged metric 'val/sucess'; did you mean 'val/success' or 'val/episodes'?" in text
