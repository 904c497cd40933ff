"""``lightning-opd report``: scalars read back from event files, the per-turn KL matrix (worked out by
hand), and the PNG + HTML rendered from a recorded run (tests/fixtures/recorded_run: the TensorBoard
events of a real run, committed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_opd.cli import main
from lightning_opd.report import kl_matrix, read_scalars, render_report

RECORDED = Path(__file__).parent / "fixtures" / "recorded_run"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(run: Path, points: dict[str, list[tuple[int, float]]]) -> None:
    w = SummaryWriter(str(run))
    for tag, values in points.items():
        for step, v in values:
            w.add_scalar(tag, v, step)
    w.close()


def test_kl_matrix_by_hand(tmp_path):
    _write(tmp_path, {"kl/turn_00": [(0, 3.0), (1, 2.0), (2, 1.0)], "kl/turn_01": [(0, 5.0), (2, 4.0)],
                      "val/success": [(2, 0.5)]})
    turns, steps, matrix = kl_matrix(read_scalars(tmp_path))
    assert (turns, steps) == ([0, 1], [0, 1, 2])
    assert matrix[0] == [3.0, 2.0, 1.0]
    assert matrix[1][0] == 5.0 and math.isnan(matrix[1][1]) and matrix[1][2] == 4.0  # turn 1 not reached at step 1


def test_later_event_files_win_at_equal_steps(tmp_path):
    _write(tmp_path / "version_0", {"train/loss": [(0, 1.0), (1, 2.0)]})
    _write(tmp_path / "version_1", {"train/loss": [(1, 7.0), (2, 3.0)]})  # a resumed run rewrites step 1
    assert read_scalars(tmp_path)["train/loss"] == ([0, 1, 2], [1.0, 7.0, 3.0])


def test_missing_run_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files under"):
        render_report(tmp_path)


def test_report_renders_recorded_run(tmp_path, capsys):
    series = read_scalars(RECORDED)
    assert any(t.startswith("kl/turn_") for t in series) and "val/success" in series
    main(["report", str(RECORDED), "--out", str(tmp_path)])
    png, page = (Path(line) for line in capsys.readouterr().out.split())
    assert png == tmp_path / "report.png" and page == tmp_path / "report.html"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (810, 1440)  # 9 x 16 inches at 90 dpi: the KL heat map + four panels
    text = page.read_text()
    assert "data:image/png;base64," in text and "kl/turn_00" in text and "val/success" in text


def test_report_says_what_a_run_did_not_log(tmp_path):
    _write(tmp_path, {"kl/turn_00": [(0, 1.0)]})
    png, page = render_report(tmp_path)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "val/success" not in page.read_text()  # only logged tags are tabulated
