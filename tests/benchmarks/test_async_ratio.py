"""benchmarks/async_ratio.py: issue 58's no-collapse check and off-policy indicator per run, on hand-written
TensorBoard logs and evaluation files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchmarks.async_ratio import main, start_kl, summarise
from lightning_opd.cpu_isa import cpu_name
from tests.benchmarks.test_run_logs import _write as _write_logs  # one value per step of each tag


def _evaluation(path: Path, name: str, kl: float, success: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"students": [{"name": name, "summary": {
        "greedy": {"success": success}, "teacher_traj_kl": {"mean": kl}}}]}))


def test_rows_by_hand(tmp_path, capsys):
    _evaluation(tmp_path / "start" / "evaluation.json", "student before", 4.8, 0.0)
    _write_logs(tmp_path / "async" / "seed0", {
        "train/kl": [2.0, 1.5, 1.0], "train/off_policy_gap": [0.0, 0.3, 0.2],
        "train/off_policy_gap_corrected": [0.0, 0.1, -0.1], "train/ratio_mean": [1.0, 0.9, 1.1],
        "train/ratio_clip_frac": [0.0, 0.1, 0.2], "train/grad_norm": [1.0, 3.0, 2.0],
        "train/applied_updates": [1, 0, 1], "rollout/lag_mean": [0.0, 1.0, 2.0]})
    _evaluation(tmp_path / "async" / "seed0" / "eval" / "step=10.json", "async", 9.0, 0.0)  # an earlier checkpoint
    _evaluation(tmp_path / "async" / "seed0" / "eval" / "step=20.json", "async", 3.1, 0.5)  # the last: read
    _write_logs(tmp_path / "sync" / "seed0", {"train/kl": [2.0, 1.0], "train/grad_norm": [1.0, 1.0]})
    _evaluation(tmp_path / "sync" / "seed0" / "eval" / "step=20.json", "sync", 5.0, 0.1)
    (tmp_path / "sync" / "seed1" / "logs").mkdir(parents=True)  # unfinished: no evaluation, no row
    assert start_kl(tmp_path) == 4.8
    rows = summarise(tmp_path)
    assert [(r["arm"], r["seed"]) for r in rows] == [("async", 0), ("sync", 0)]
    a, s = rows
    assert a["steps"] == 3 and a["applied"] == 2 and a["lag_mean"] == pytest.approx(1.0)
    assert a["gap"] == pytest.approx(0.5 / 3) and a["gap_corrected"] == pytest.approx(0.0, abs=1e-7)
    assert a["ratio_mean"] == pytest.approx(1.0) and a["ratio_clip_frac"] == pytest.approx(0.1)
    assert (a["grad_norm_median"], a["grad_norm_max"]) == (2.0, 3.0)
    assert (a["success"], a["kl_after"], a["collapsed"]) == (0.5, 3.1, False)
    assert (s["gap"], s["ratio_mean"], s["collapsed"]) == (None, None, True)  # 5.0 >= 4.8: collapsed
    text = main([str(tmp_path), "--json", str(tmp_path / "out.json")])
    assert "| async | 0 | 3 | 2 | 1.000 | 0.167 |" in text and text.endswith("| 4.800 | yes |")
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["runs"][0]["kl_after"] == 3.1
    assert (out["cpu"], out["cores"]) == (cpu_name(), len(os.sched_getaffinity(0)))  # the CPU model, not lscpu's
    assert capsys.readouterr().out.strip() == text


def test_without_a_start_measurement_collapse_is_unknown(tmp_path):
    _write_logs(tmp_path / "async" / "seed0", {"train/kl": [1.0]})
    _evaluation(tmp_path / "async" / "seed0" / "eval" / "step=1.json", "async", 3.0, 0.0)
    (row,) = summarise(tmp_path)
    assert row["kl_start"] is None and row["collapsed"] is None
