"""``lightning-opd report``: scalars read back from event files, the per-turn KL matrix (worked out by
hand), and the PNG + HTML rendered from a recorded run (tests/fixtures/recorded_run: the TensorBoard
events of a real run, committed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lightning_opd.cli import main
from lightning_opd.analysis.report import baseline_value, kl_matrix, panels, read_scalars, render_report
from tests.analysis.scalars import write_scalars as _write

RECORDED = Path(__file__).parents[1] / "fixtures" / "recorded_run"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


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
    # 9 x 9.6 inches at 90 dpi: a plain OPD run draws the KL heat map, train/kl and success (no empty panels)
    assert (width, height) == (810, 864)
    text = page.read_text()
    assert "data:image/png;base64," in text and "kl/turn_00" in text and "val/success" in text


def test_report_says_what_a_run_did_not_log(tmp_path):
    _write(tmp_path, {"kl/turn_00": [(0, 1.0)]})
    png, page = render_report(tmp_path)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "val/success" not in page.read_text()  # only logged tags are tabulated


def _drawn_figure(monkeypatch, **kwargs):
    """Render the recorded run and return the matplotlib figure it drew (``plt.close`` intercepted)."""
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    try:
        render_report(RECORDED, **kwargs)
    finally:
        monkeypatch.setattr(plt, "close", close)
    return figures[0]


def test_plain_opd_run_draws_only_logged_panels():
    """The recorded run is plain synchronous OPD: no controller, no schedule, rollout/lag_max always 0."""
    chosen = panels(read_scalars(RECORDED))
    assert [(title, tags) for title, tags, _, _ in chosen] == [
        ("Training reverse KL", ["train/kl"]), ("Success rate", ["val/success", "rollout/success"])]


def test_async_lag_and_sft_loss_get_their_panels(tmp_path):
    _write(tmp_path, {"train/loss": [(0, 2.0)], "rollout/lag_max": [(0, 0.0), (1, 2.0)], "controller/cap": [(0, 3.0)]})
    chosen = [(title, tags) for title, tags, _, _ in panels(read_scalars(tmp_path))]
    assert chosen == [("Training loss", ["train/loss"]), ("Rollout-depth controller", ["controller/cap"]),
                      ("Staleness", ["rollout/lag_max"])]


def test_a_served_teacher_run_plots_the_k1_kl(tmp_path):
    """A run with a served teacher logs train/kl_sampled and kl_sampled/turn_NN (docs/algorithms.md §6.5): the heat map
    and the KL panel read those, named as the estimate."""
    _write(tmp_path, {"train/kl_sampled": [(0, 0.5), (1, -0.1)], "kl_sampled/turn_00": [(0, 0.4), (1, 0.2)],
                      "kl_sampled/turn_01": [(1, -0.3)]})
    series = read_scalars(tmp_path)
    turns, steps, matrix = kl_matrix(series)
    assert (turns, steps) == ([0, 1], [0, 1]) and matrix[0] == pytest.approx([0.4, 0.2])
    assert math.isnan(matrix[1][0]) and matrix[1][1] == pytest.approx(-0.3)
    chosen = [(title, tags) for title, tags, _, _ in panels(series)]
    assert chosen == [("Training reverse KL (k1 estimate at the sampled tokens)", ["train/kl_sampled"])]


def test_success_axis_is_pinned_turn_ticks_are_integers_and_baselines_drawn(tmp_path, monkeypatch):
    before = tmp_path / "before"
    _write(before, {"val/success": [(0, 0.25)]})
    fig = _drawn_figure(monkeypatch, out_dir=tmp_path / "out", baselines={"student before": str(before),
                                                                           "teacher": "0.92"})
    heat, kl, success = fig.axes[:3]
    assert (heat.get_title(), kl.get_title(), success.get_title()) == (
        "Per-turn reverse KL", "Training reverse KL", "Success rate")
    assert success.get_ylim() == (-0.02, 1.02)
    ticks = [t for t in heat.get_yticks() if heat.get_ylim()[0] <= t <= heat.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)  # turns 0..3, no half turns
    labels = success.get_legend_handles_labels()[1]
    assert "student before (0.25)" in labels and "teacher (0.92)" in labels
    page = (tmp_path / "out" / "report.html").read_text()
    assert "baseline: teacher</td><td></td><td>0.92<" in page


def test_bad_baselines_name_the_problem(tmp_path):
    assert baseline_value("t", "0.5") == 0.5
    with pytest.raises(ValueError, match=r"baseline 't'=1.5: a success rate must be in \[0, 1\]"):
        baseline_value("t", "1.5")
    with pytest.raises(FileNotFoundError, match="no TensorBoard event files under"):
        baseline_value("t", str(tmp_path / "missing"))
    _write(tmp_path / "nosuccess", {"train/kl": [(0, 1.0)]})
    with pytest.raises(KeyError, match="logged no val/success"):
        baseline_value("t", str(tmp_path / "nosuccess"))


def test_report_command_exits_non_zero_on_a_missing_run(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", str(tmp_path / "nope")])
    assert exc.value.code == 1
    assert "no TensorBoard event files under" in capsys.readouterr().err


def test_report_never_replaces_its_files_without_force(tmp_path, capsys):
    (tmp_path / "report.html").write_text("kept")
    with pytest.raises(SystemExit) as exc:
        main(["report", str(RECORDED), "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert f"{tmp_path / 'report.html'} exists; pass --force to replace it" in capsys.readouterr().err
    assert (tmp_path / "report.html").read_text() == "kept" and not (tmp_path / "report.png").exists()
    main(["report", str(RECORDED), "--out", str(tmp_path), "--force"])
    assert (tmp_path / "report.html").read_text() != "kept" and (tmp_path / "report.png").is_file()
