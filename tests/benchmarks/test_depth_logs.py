"""benchmarks/depth_logs.py (issue 63, design 1): the cap trajectory per run, whether it moved, the cap it settled on
and the share of capped steps where the success-coverage rule was binding, on hand-written TensorBoard logs."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from benchmarks.depth_logs import depth_report, run_depth
from benchmarks.run_logs import main


def _write(run: Path, tags: dict[str, dict[int, float]]) -> None:
    """``{tag: {step: value}}`` into one event file under ``run/logs``."""
    w = SummaryWriter(str(run / "logs"))
    for tag, values in tags.items():
        for step, v in values.items():
            w.add_scalar(tag, v, step)
    w.close()


def _by_step(values: list[float], first: int = 0) -> dict[int, float]:
    return {first + i: v for i, v in enumerate(values)}


# probes at steps 0-2 (warm-up) and 8; the cap rises 5 -> 7 once H_cov (6, above H_eff 4) is set at step 8
MOVING = {"rollout/is_probe": _by_step([1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]),
          "rollout/cap": _by_step([16, 16, 16, 5, 5, 5, 5, 5, 16, 7, 7, 7]),
          "controller/h_eff": _by_step([3] * 8 + [4] * 4),
          "controller/h_cov": _by_step([6] * 4, first=8),
          "rollout/success": _by_step([0.0] * 12)}
# the cap never moves; H_cov is set from step 2 and equals H_eff (a tie, not binding)
FLAT = {"rollout/is_probe": _by_step([1, 1, 1, 0, 0, 0]), "rollout/cap": _by_step([16, 16, 16, 5, 5, 5]),
        "controller/h_eff": _by_step([4] * 6), "controller/h_cov": _by_step([4] * 4, first=2)}
# vanilla: every batch at the full 16 turns, no probe
VANILLA = {"rollout/is_probe": _by_step([0] * 4), "rollout/cap": _by_step([16] * 4)}


def test_run_depth_by_hand(tmp_path):
    _write(tmp_path / "moving", MOVING)
    r = run_depth(tmp_path / "moving", "turnopd", 0)
    assert r.probes == {0, 1, 2, 8} and r.capped == [3, 4, 5, 6, 7, 9, 10, 11]
    assert r.cap_range() == (5, 7) and r.moved() is True  # range 2 turns
    # second half = steps 6-11; their capped caps 5, 5, 7, 7, 7; upper median 7
    assert r.settled() == 7 and r.first_coverage() == 8
    assert r.coverage(r.capped) == (3, 0)  # steps 9-11: H_cov 6 > H_eff 4
    assert r.coverage(sorted(r.probes)) == (1, 0)  # the decision at step 8
    assert r.trajectory() == "0-2 P16; 3-7 5; 8 P16; 9-11 7"
    _write(tmp_path / "flat", FLAT)
    f = run_depth(tmp_path / "flat", "depth_only", 0)
    assert (f.cap_range(), f.moved(), f.settled(), f.first_coverage()) == ((5, 5), False, 5, 2)
    assert f.coverage(f.capped) == (0, 3) and f.coverage(sorted(f.probes)) == (0, 1)  # step 2 probe: a tie
    assert f.trajectory() == "0-2 P16; 3-5 5"
    _write(tmp_path / "vanilla", VANILLA)
    assert run_depth(tmp_path / "vanilla", "vanilla", 0) is None


def test_settled_cap_is_the_upper_median_of_the_late_capped_steps(tmp_path):
    # 8 steps, probes 0-2; second half = steps 4-7 with caps 6, 8, 6, 8 -> sorted 6, 6, 8, 8 -> upper median 8
    _write(tmp_path / "r", {"rollout/is_probe": _by_step([1, 1, 1, 0, 0, 0, 0, 0]),
                            "rollout/cap": _by_step([16, 16, 16, 4, 6, 8, 6, 8])})
    r = run_depth(tmp_path / "r", "a", 0)
    assert r.settled() == 8 and r.cap_range() == (4, 8) and r.coverage(r.capped) == (0, 0)
    assert r.first_coverage() is None


def test_depth_report_over_an_experiment_folder(tmp_path, capsys):
    _write(tmp_path / "turnopd" / "seed0", MOVING)
    _write(tmp_path / "depth_only" / "seed0", FLAT)
    _write(tmp_path / "vanilla" / "seed0", VANILLA)
    text = main(["depth", str(tmp_path), "--arms", "vanilla", "turnopd", "depth_only"])
    assert "| turnopd seed0 | 4 / 8 | 5-7 | yes | 7 | 8 | 3 (38%) | 0 | 1 of 4 |" in text
    assert "| depth_only seed0 | 3 / 3 | 5-5 | no | 5 | 2 | 0 (0%) | 3 | 0 of 3 |" in text
    assert "- turnopd seed0: 0-2 P16; 3-7 5; 8 P16; 9-11 7" in text
    assert "No probe steps (no rollout-depth controller; not applicable): vanilla seed0." in text
    assert capsys.readouterr().out.strip() == text
    with pytest.raises(FileNotFoundError, match="no run with TensorBoard logs"):
        depth_report(tmp_path, ["fixed_cap"])
    assert depth_report(tmp_path, ["turnopd"], seeds=[0]).count("| turnopd seed0 |") == 1
