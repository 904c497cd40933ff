"""TurnOPD's validity checks (lightning_opd/analysis/rollout_validity.py) on tiny TensorBoard event files written
here, with the expected means worked out by hand in the comments."""

from __future__ import annotations

import json
import math
import os

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_opd.analysis.rollout_validity import read_step_scalars, run_validity, validity_table


def write_run(log_dir, steps, tags=("rollout/is_probe", "rollout/cap", "rollout/success"), age=0):
    """One event file with ``steps``: ``[(step, probe, cap, success)]`` under ``tags``; ``age`` seconds older
    than now (several files of one run: the resumed one is the newer)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    before = set(log_dir.iterdir())
    writer = SummaryWriter(str(log_dir))
    for step, probe, cap, success in steps:
        for tag, value in zip(tags, (probe, cap, success)):
            writer.add_scalar(tag, value, step)
    writer.close()
    (new,) = set(log_dir.iterdir()) - before
    t = new.stat().st_mtime - age
    os.utime(new, (t, t))


#  step:                probe  cap  success
TURNOPD_0 = [(0, 1.0, 12, 0.25), (1, 1.0, 12, 0.5), (2, 1.0, 12, 0.0),    # warm-up probes: success 0.25 mean
             (3, 0.0, 5, 0.5), (4, 0.0, 6, 0.25), (5, 0.0, 7, 0.5)]        # capped: cap 6.0, success 0.4167
DEPTH_0 = [(0, 1.0, 12, 0.5), (1, 1.0, 12, 0.5),                           # probes: success 0.5
           (2, 0.0, 8, 0.0), (3, 0.0, 9, 0.0)]                             # capped: cap 8.5 > 7, success 0 < 0.5
VANILLA_0 = [(0, 0.0, 12, 0.5), (1, 0.0, 12, 0.75)]                        # never a probe: not applicable


def test_checks_per_run_with_pass_and_fail(tmp_path):
    write_run(tmp_path / "vanilla" / "seed0" / "logs", VANILLA_0)
    write_run(tmp_path / "turnopd" / "seed0" / "logs", TURNOPD_0)
    write_run(tmp_path / "depth_only" / "seed0" / "logs", DEPTH_0)
    md, data = validity_table(tmp_path, ["vanilla", "turnopd", "depth_only"], [0, 1], max_cap=7)
    t = data["runs"]["turnopd"]["0"]
    assert (t["probe_steps"], t["non_probe_steps"], t["mean_cap_non_probe"]) == (3, 3, 6.0)
    assert t["success_probe"] == pytest.approx(0.25) and t["success_non_probe"] == pytest.approx(1.25 / 3)
    assert (t["cap_ok"], t["success_ok"]) == (True, True)
    d = data["runs"]["depth_only"]["0"]
    assert (d["mean_cap_non_probe"], d["success_probe"], d["success_non_probe"]) == (8.5, 0.5, 0.0)
    assert (d["cap_ok"], d["success_ok"]) == (False, False)
    assert data["no_probe_steps"] == ["vanilla seed 0"]  # seed 1 has no log: not listed
    assert "| turnopd | 0 | 3 / 3 | 6.00 | 0.25 | 0.42 | pass | pass |" in md
    assert "| depth_only | 0 | 2 / 2 | 8.50 | 0.50 | 0.00 | FAIL | FAIL |" in md
    assert "cap <= 7 |" in md and "not applicable): vanilla seed 0." in md
    _, unbounded = validity_table(tmp_path, ["turnopd"], [0])  # no bound: the mean without a verdict
    assert unbounded["runs"]["turnopd"]["0"]["cap_ok"] is None and unbounded["runs"]["turnopd"]["0"]["success_ok"]


def test_no_section_without_a_probe_step(tmp_path):
    write_run(tmp_path / "vanilla" / "seed0" / "logs", VANILLA_0)
    assert validity_table(tmp_path, ["vanilla", "other"], [0], max_cap=7) is None


def test_a_resumed_fit_replaces_the_steps_it_repeats(tmp_path):
    """The first attempt logged steps 0-5 and died; its last checkpoint was at step 3, so the resumed fit's file
    starts at step 3 (here it stops at step 4): steps 3, 4 come from the new file, and the dead attempt's step 5
    is dropped. Capped steps 3, 4 with caps 4, 6 -> mean 5.0; their success 1.0, 0.5 -> 0.75 (the dead attempt's
    caps 11 and success 0 would give 11.0 and 0.0)."""
    logs = tmp_path / "turnopd" / "seed0" / "logs"
    write_run(logs, [(0, 1, 12, 0.5), (1, 1, 12, 0.5), (2, 1, 12, 0.5), (3, 0, 11, 0.0), (4, 0, 11, 0.0),
                     (5, 0, 11, 0.0)], age=100)
    write_run(logs, [(3, 0, 4, 1.0), (4, 0, 6, 0.5)])
    series = read_step_scalars(logs, ["rollout/cap", "rollout/success", "never/logged"])
    assert series["rollout/cap"] == {0: 12.0, 1: 12.0, 2: 12.0, 3: 4.0, 4: 6.0} and series["never/logged"] == {}
    run = run_validity(logs, "turnopd", 0)
    assert (run.probe_steps, run.other_steps, run.mean_cap, run.success_other) == (3, 2, 5.0, 0.75)


def test_logs_from_before_rollout_cap_use_the_controllers_tags(tmp_path):
    """A fit logged before ``rollout/cap`` existed (e.g. turnopd_quest3's): the controller's ``controller/probe``
    and ``controller/cap`` stand in, and the table names the fallback."""
    write_run(tmp_path / "turnopd" / "seed0" / "logs", TURNOPD_0,
              tags=("controller/probe", "controller/cap", "rollout/success"))
    md, data = validity_table(tmp_path, ["turnopd"], [0], max_cap=7)
    assert data["runs"]["turnopd"]["0"]["tags"] == ["controller/probe", "controller/cap"]
    assert "| turnopd | 0 | 3 / 3 | 6.00 (controller/cap) | 0.25 | 0.42 | pass | pass |" in md
    assert not math.isnan(data["runs"]["turnopd"]["0"]["mean_cap_non_probe"])
    json.dumps(data)  # JSON-ready
