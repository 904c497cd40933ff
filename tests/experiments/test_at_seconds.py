"""``evaluate_at_seconds`` in the experiment runner (lightning_opd/experiments/runner.py, marks.py): the checkpoints
of the first steps reaching given training seconds are evaluated besides the final, and only those; each
evaluation says which mark it stands for; the summary compares the arms at each mark. With the fake
``fit``/``evaluate`` of tests/experiments/fake_lopd.py (10 training s per step, counted); the callback itself is
tested with Lightning in test_checkpointing.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from lightning_opd.experiments.marks import mark_steps
from lightning_opd.experiments.experiment import load_experiment
from lightning_opd.experiments.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, str(Path(__file__).with_name("fake_lopd.py"))]
pytestmark = pytest.mark.timeout(300)


def spec(tmp_path, **extra) -> Path:
    data = {"name": "exp", "seeds": [0], "checkpoint_every": 4, "evaluate_checkpoints": "last", "max_time": 60,
            "evaluate_at_seconds": [25, 45],
            "arms": {"a": {"overrides": ["--trainer.max_steps=10", "--trainer.limit_val_batches=0"]},
                     "b": {"overrides": ["--trainer.max_steps=4", "--trainer.limit_val_batches=0"]}},
            "fit_command": FAKE + ["fit"], "evaluate_command": FAKE + ["evaluate"]}
    data.update(extra)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def calls(tmp_path, cmd) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [c for c in map(json.loads, path.read_text().splitlines()) if c["cmd"] == cmd]


def test_the_checkpoints_at_the_marks_and_the_final_are_evaluated(tmp_path, monkeypatch):
    """Marks 25 s and 45 s, 10 s per step, a checkpoint every 4 steps, budget 60 s.
    a (max_steps 10): 25 s first reached at step 3 (30 s), 45 s at step 5 (50 s), the budget ends it at step 6
    (60 s): checkpoints 3, 4, 5, 6, each written once; evaluated 3, 5 and the final 6, not the periodic 4.
    b (max_steps 4): 25 s at step 3, then max_steps ends it at step 4 (40 s) before 45 s: its final stands for 45 s."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    exp = load_experiment(spec(tmp_path), results=tmp_path / "r")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    runs = tmp_path / "r" / "exp"
    saves = [(Path(c["dir"]).parent.name, c["step"]) for c in calls(tmp_path, "save")]
    assert saves == [("a", 3), ("a", 4), ("a", 5), ("a", 6), ("b", 3), ("b", 4)]
    evaluated = [f"{Path(c['out']).parents[2].name}/{Path(c['out']).name}" for c in calls(tmp_path, "evaluate")]
    assert evaluated == ["a/step=3.json", "a/step=5.json", "a/step=6.json", "b/step=3.json", "b/step=4.json"]
    expected = {"a": {3: [{"mark": 25.0, "reached": True}], 5: [{"mark": 45.0, "reached": True}], 6: []},
                "b": {3: [{"mark": 25.0, "reached": True}], 4: [{"mark": 45.0, "reached": False}]}}
    for arm, files in expected.items():
        for step, marks in files.items():
            data = json.loads((runs / arm / "seed0" / "eval" / f"step={step}.json").read_text())
            assert data["at_seconds"] == marks, (arm, step)
            assert data["students"][0]["global_step"] == step  # its step and training seconds, from the checkpoint
            assert data["students"][0]["train_seconds"] == 10.0 * step
    done = json.loads((runs / "b" / "seed0" / "done.json").read_text())
    assert done["at_seconds"] == [{"mark": 25.0, "step": 3, "seconds": 30.0}, {"mark": 45.0, "step": None, "seconds": None}]
    summary = (runs / "summary.md").read_text()
    # the fake evaluation: a wins 2 of 4 tasks, b all 4; each row shows the point's iteration and training s
    at25 = summary.split("### At 25 training s")[1].split("###")[0]
    assert "| a | 3 | 30 | - | 0.50 [" in at25 and "| b | 3 | 30 | - | 1.00 [" in at25
    at45 = summary.split("### At 45 training s")[1].split("###")[0]
    assert "| a | 5 | 50 | - | 0.50 [" in at45 and "| b | 4 | 40 | - | 1.00 [" in at45
    assert "Not reached (the fit ended at max_steps first; its final checkpoint stands for 45 s): b seed 0 (40 s)." in at45
    data = json.loads((runs / "summary.json").read_text())
    assert data["at_seconds"]["45"]["points"]["b"]["0"]["seconds"] == 40.0
    assert data["at_seconds"]["45"]["not_reached"] == ["b seed 0 (40 s)"]


def test_a_rerun_adds_a_missing_mark_note_without_evaluating_again_and_refuses_changed_marks(tmp_path, monkeypatch):
    """The runner died between an evaluation and its note (``at_seconds`` missing): the rerun writes the note
    and evaluates nothing. Marks changed after the fit do not match the fit's record: refused, naming the file."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    path = spec(tmp_path, arms={"a": {"overrides": ["--trainer.max_steps=10", "--trainer.limit_val_batches=0"]}})
    Runner(load_experiment(path, results=tmp_path / "r"), cwd=ROOT, echo=lambda *_: None).run()
    d = tmp_path / "r" / "exp" / "a" / "seed0"
    out = d / "eval" / "step=3.json"
    out.write_text(json.dumps({k: v for k, v in json.loads(out.read_text()).items() if k != "at_seconds"}))
    (d / "done.json").unlink()
    n = len(calls(tmp_path, "evaluate"))
    Runner(load_experiment(path, results=tmp_path / "r"), cwd=ROOT, echo=lambda *_: None).run()
    assert len(calls(tmp_path, "evaluate")) == n
    assert json.loads(out.read_text())["at_seconds"] == [{"mark": 25.0, "reached": True}]
    (d / "done.json").unlink()
    changed = load_experiment(spec(tmp_path, evaluate_at_seconds=[25, 50], arms={"a": {
        "overrides": ["--trainer.max_steps=10", "--trainer.limit_val_batches=0"]}}), results=tmp_path / "r")
    with pytest.raises(RuntimeError, match=r"at_seconds.json: the fit recorded marks \[25.0, 45.0\] but the "
                                           r"experiment asks for \[25.0, 50.0\]"):
        Runner(changed, cwd=ROOT, echo=lambda *_: None).run()


def test_the_overlay_asks_for_marks_only_where_an_arm_has_them(tmp_path):
    """Arm b's own ``evaluate_at_seconds: []`` switches them off (its overlay is the one of an experiment without
    marks); arm c's own marks win over the experiment's."""
    arms = {"a": {}, "b": {"evaluate_at_seconds": []}, "c": {"evaluate_at_seconds": [30]}}
    exp = load_experiment(spec(tmp_path, arms=arms), results=tmp_path / "r")
    runner = Runner(exp, cwd=ROOT, echo=lambda *_: None)
    assert [exp.at_seconds(a) for a in exp.arms] == [[25.0, 45.0], [], [30.0]]
    args = {}
    for arm in exp.arms:
        d = exp.run_dir(arm, 0)
        d.mkdir(parents=True)
        overlay = yaml.safe_load(runner._write_overlay(d, arm).read_text())
        (ckpt,) = [c["init_args"] for c in overlay["trainer"]["callbacks+"] if c["class_path"].endswith("StepCheckpoint")]
        args[arm.name] = ckpt
    assert args["a"]["at_seconds"] == [25.0, 45.0] and args["a"]["marks_file"] == str(exp.run_dir(exp.arms[0], 0) / "at_seconds.json")
    assert "at_seconds" not in args["b"] and "marks_file" not in args["b"]
    assert args["c"]["at_seconds"] == [30.0]


def test_bad_marks_are_errors_naming_the_value(tmp_path):
    for bad, message in (([20, 20], "evaluate_at_seconds: 20 does not increase"),
                         ([40, 20], "evaluate_at_seconds: 20 does not increase"),
                         ([0], "evaluate_at_seconds: 0 is not a positive number"),
                         ([-5], "evaluate_at_seconds: -5 is not a positive number"),
                         (["20"], "evaluate_at_seconds: '20' is not a positive number"),
                         (20, "evaluate_at_seconds=20 must be a list"),
                         ([30, 90], "evaluate_at_seconds: 90 is beyond max_time=60 s")):
        with pytest.raises(ValueError, match=message):
            load_experiment(spec(tmp_path, evaluate_at_seconds=bad))
    with pytest.raises(ValueError, match=r"arm 'b': evaluate_at_seconds: -1 is not a positive number"):
        load_experiment(spec(tmp_path, arms={"a": {}, "b": {"evaluate_at_seconds": [-1]}}))
    with pytest.raises(ValueError, match=r"validity_max_cap=0 must be a whole number of turns"):
        load_experiment(spec(tmp_path, validity_max_cap=0))
    assert load_experiment(spec(tmp_path, evaluate_at_seconds=None)).evaluate_at_seconds == []


def test_mark_steps_reads_the_fits_record():
    """Reached marks are their steps (two marks reached at one step share its checkpoint); a mark not reached is
    the final checkpoint; a reached mark whose checkpoint is gone is an error."""
    record = [{"mark": 10.0, "step": 2, "seconds": 12.0}, {"mark": 11.0, "step": 2, "seconds": 12.0},
              {"mark": 50.0, "step": None, "seconds": None}]
    assert mark_steps([10, 11, 50], record, [2, 4, 7]) == {
        2: [{"mark": 10.0, "reached": True}, {"mark": 11.0, "reached": True}], 7: [{"mark": 50.0, "reached": False}]}
    with pytest.raises(FileNotFoundError, match=r"step=2.ckpt of the 10 s mark is missing"):
        mark_steps([10, 11, 50], record, [4, 7])
