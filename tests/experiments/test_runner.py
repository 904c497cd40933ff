"""The experiment runner (lightning_opd.experiments.runner): killed at any moment and rerun, finished (arm, seed)
pairs are never rerun and unfinished fits resume from their last checkpoint; with a fake ``fit``/``evaluate``
(tests/experiments/fake_lopd.py) for the kill tests and the real commands on the tiny models end to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lightning_opd.cpu_isa import cpu_name
from lightning_opd.experiments.experiment import Arm, Experiment, load_experiment
from lightning_opd.experiments.runner import Runner, files_sha256
from tests.experiments.arm_configs import resolved_arms, without_controllers

ROOT = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, str(Path(__file__).with_name("fake_lopd.py"))]
pytestmark = pytest.mark.timeout(300)


def spec(tmp_path, step_seconds: float, **extra) -> Path:
    data = {"name": "exp", "seeds": [0, 1], "checkpoint_every": 2, "evaluate_checkpoints": "all",
            "arms": {"a": {"configs": ["conf-a.yaml"], "overrides": ["--trainer.max_steps=4"]},
                     "b": {"configs": ["conf-b.yaml"], "overrides": ["--trainer.max_steps=4"]}},
            "fit_command": FAKE + ["fit"], "evaluate_command": FAKE + ["evaluate"], "evaluate": ["--avg-k", "2"]}
    data.update(extra)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start(tmp_path, step_seconds: float) -> subprocess.Popen:
    env = {**os.environ, "FAKE_CALLS": str(tmp_path / "calls.jsonl"), "FAKE_STEP_SECONDS": str(step_seconds),
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "benchmarks.experiment", str(tmp_path / "exp.yaml"), "--results",
                             str(tmp_path / "results")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def calls(tmp_path) -> list[dict]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.02)


def test_killed_runner_skips_finished_pairs_and_resumes_the_unfinished_fit(tmp_path):
    spec(tmp_path, 0.3)
    runs = tmp_path / "results" / "exp"
    proc = start(tmp_path, 0.3)
    wait_for(runs / "b" / "seed0" / "checkpoints" / "step=2.ckpt", proc)  # (a, 0) done, (b, 0) half-way: seed by seed
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (runs / "a" / "seed0" / "done.json").is_file() and not (runs / "b" / "seed0" / "done.json").exists()
    assert not (runs / "a" / "seed1").exists()  # seed 1 waits for every arm of seed 0
    time.sleep(1.5)  # two more fake steps (0.6 s) would have written step=4: the fit died with the runner
    assert not (runs / "b" / "seed0" / "checkpoints" / "step=4.ckpt").exists()
    before = calls(tmp_path)

    proc = start(tmp_path, 0.0)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    new = calls(tmp_path)[len(before):]
    fits = [c for c in new if c["cmd"] == "fit"]
    assert not any(c["dir"].endswith("a/seed0") for c in new if c["cmd"] == "fit")  # finished pair: not rerun
    assert not any("/a/seed0/" in c["out"] for c in new if c["cmd"] == "evaluate")
    (resumed,) = [c for c in fits if c["dir"].endswith("b/seed0")]
    assert resumed["ckpt_path"].endswith("b/seed0/checkpoints/last.ckpt") and resumed["start"] == 2
    assert [c["dir"][-7:] for c in fits] == ["b/seed0", "a/seed1", "b/seed1"]  # seed by seed
    assert all(c["seed"] == c["data_seed"] for c in fits)  # the DataModule gets the seed too
    assert "[a seed 0] done, skipped" in output and "resuming fit" in output
    for arm in "ab":
        for seed in (0, 1):
            done = json.loads((runs / arm / f"seed{seed}" / "done.json").read_text())
            assert [Path(p).name for p in done["evaluations"]] == ["step=2.json", "step=4.json"]
    # the comparison of the last checkpoints, seeds merged: b wins all 8 paired episodes, a 4 of them (tasks
    # t0, t1); per task the difference is 0, 0, 1, 1 in both seeds (training runs), so a two-level resample (runs,
    # then the same 4 tasks in each drawn run) has a mean difference in [0, 1], both ends with probability
    # 1/16 > 2.5%: 2 runs x 4 tasks cannot show it; the runs agree (+0.50 each), so the t-interval is a point
    compare = (runs / "compare.md").read_text()
    assert ("| b | +0.50 | [+0.00, +1.00] | [+0.50, +0.50] | [+0.00, +1.00] | +0.50 (seed 0), +0.50 (seed 1) | 8 (4) | "
            "no difference detected at n = 2 runs x 4 tasks |") in compare
    assert "| a | 0.50 |" in compare and "| success |" in compare

    again = start(tmp_path, 0.0)
    output, _ = again.communicate(timeout=120)
    assert again.returncode == 0 and len(calls(tmp_path)) == len(before) + len(new)  # nothing left to run
    assert output.count("done, skipped") == 4


def test_repeatedly_killed_runner_finishes_with_every_step_trained_once_per_run(tmp_path):
    """Killed again and again wherever it is (start-up, fit, evaluate, writing markers), each attempt
    living a little longer, until it completes: each pair's fits continue where the last checkpoint left
    off, and every evaluation exists exactly once."""
    spec(tmp_path, 0.1, seeds=[0], evaluate_checkpoints="all")
    for attempt in range(31):
        proc = start(tmp_path, 0.1)
        try:  # the 31st attempt is not killed: on a loaded machine (CI sharing the cores) ~10 s may not be enough
            proc.wait(timeout=0.8 + 0.25 * attempt if attempt < 30 else 600)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.returncode == 0:
            break
    assert proc.returncode == 0, f"not finished after {attempt + 1} attempts"
    assert attempt >= 1  # it was killed at least once (the work takes longer than the first attempt's 0.8 s)
    runs = tmp_path / "results" / "exp"
    for arm in "ab":
        fits = [c for c in calls(tmp_path) if c["cmd"] == "fit" and c["dir"].endswith(f"{arm}/seed0")]
        starts = [c["start"] for c in fits]
        assert starts == sorted(starts) and starts[0] == 0  # never back to an earlier step than reached
        assert json.loads((runs / arm / "seed0" / "done.json").read_text())["arm"] == arm
        assert sorted(p.name for p in (runs / arm / "seed0" / "eval").iterdir()) == ["step=2.json", "step=4.json"]


def test_evaluate_arguments_come_from_the_fit_configuration(tmp_path):
    exp = Experiment(name="x", arms=[Arm("a", ["c.yaml"])], seeds=[3], checkpoint_every=2, results=tmp_path,
                     evaluate=["--avg-k", "2", "--max-turns", "5"])
    config = {"model": {"init_args": {"student": "base", "teacher": "teach"}},
              "data": {"init_args": {"env": {"class_path": "m.Env", "init_args": {"games_dir": "g"}},
                                     "max_turns": 8, "eval_max_turns": 6, "max_new_tokens": 16}}}
    args = Runner(exp).evaluate_args(config, 3)
    assert args == ["--base", "base", "--seeds", "3", "--env", "m.Env", "--env-args", '{"games_dir": "g"}',
                    "--max-turns", "6", "--max-new-tokens", "16", "--teacher", "teach", "--avg-k", "2",
                    "--max-turns", "5"]  # the experiment's own flags come last and win


def test_bad_experiments_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['seed'\]"):
        load_experiment(spec(tmp_path, 0, seed=[1]))
    with pytest.raises(ValueError, match="arm 'a': unknown key"):
        load_experiment(spec(tmp_path, 0, arms={"a": {"config": ["x.yaml"]}}))
    with pytest.raises(ValueError, match="must not repeat"):
        load_experiment(spec(tmp_path, 0, seeds=[1, 1]))
    with pytest.raises(ValueError, match="checkpoint_every=0"):
        load_experiment(spec(tmp_path, 0, checkpoint_every=0))
    with pytest.raises(ValueError, match="arm 'b': checkpoint_every=0"):
        load_experiment(spec(tmp_path, 0, arms={"a": {}, "b": {"checkpoint_every": 0}}))
    with pytest.raises(ValueError, match="max_time=0 must be a whole number of seconds"):
        load_experiment(spec(tmp_path, 0, max_time=0))
    with pytest.raises(ValueError, match=r"targets=\[1.5\]"):
        load_experiment(spec(tmp_path, 0, targets=[1.5]))
    two = {"a": {}, "b": {}}
    for bad in (["a", "c"], ["a", "a"], ["a"], "a"):
        with pytest.raises(ValueError, match="contrast .*: give two different arm names of \\['a', 'b'\\]"):
            load_experiment(spec(tmp_path, 0, arms=two, contrasts=[bad]))
    assert load_experiment(spec(tmp_path, 0, arms=two, contrasts=[["b", "a"]])).contrasts == [["b", "a"]]
    os.environ["FAKE_CALLS"] = str(tmp_path / "calls.jsonl")
    quiet = {"cwd": ROOT, "echo": lambda *_: None}
    exp = load_experiment(spec(tmp_path, 0, max_time=60), results=tmp_path / "r1")
    with pytest.raises(ValueError, match=r"trainer.limit_val_batches=1.0 with max_time=60: in-fit validation would "
                                         r"be counted in the time budget; add --trainer.limit_val_batches=0"):
        Runner(exp, **quiet).run()
    exp = load_experiment(spec(tmp_path, 0, arms={"a": {"overrides": ["--trainer.max_time=00:00:10:00"]}}),
                          results=tmp_path / "r2")
    with pytest.raises(ValueError, match=r"trainer.max_time='00:00:10:00': give the budget as the experiment's max_time"):
        Runner(exp, **quiet).run()


def test_a_second_experiment_under_the_same_results_root_is_refused(tmp_path):
    """Training seconds mean something only on cores nothing else uses: while one runner works, another
    experiment under the same results root stops at once and names the running one."""
    import fcntl

    results = tmp_path / "results"
    results.mkdir()
    with open(results / ".runner.lock", "w") as held:
        held.write("fopd_lag2, pid 123\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        exp = load_experiment(spec(tmp_path, 0), results=results)
        with pytest.raises(RuntimeError, match=r"another experiment is running under .*results \(fopd_lag2, pid 123\)"):
            Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert not (results / "exp" / "a").exists()  # nothing was started


def test_final_step_is_checkpointed_and_a_time_budget_stops_every_run(tmp_path, monkeypatch):
    """checkpoint_every need not divide max_steps (the final step is saved too), and with max_time every run
    stops at the first step whose training seconds reach it (fake: 10 s per step); a resumed fit continues
    its saved seconds instead of starting a fresh budget."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("FAKE_SECONDS_PER_STEP", "10")
    arms = {"a": {"overrides": ["--trainer.max_steps=10", "--trainer.limit_val_batches=0"]},
            "b": {"overrides": ["--trainer.max_steps=9", "--trainer.limit_val_batches=0"], "checkpoint_every": 3,
                  "evaluate_final": ["--temperature", "1.0"]}}
    exp = load_experiment(spec(tmp_path, 0, seeds=[0], arms=arms, max_time=45, targets=[0.75],
                               evaluate_final=["--avg-k", "4"]), results=tmp_path / "r")
    # (b, 0) was killed after step 3 (30 s): it resumes there with 15 s of its budget left, not 45
    pre = exp.run_dir(exp.arms[1], 0) / "checkpoints"
    pre.mkdir(parents=True)
    for name in ("step=3.ckpt", "last.ckpt"):
        (pre / name).write_text(json.dumps({"step": 3, "train_seconds": 30.0}))
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    runs = tmp_path / "r" / "exp"
    # a: checkpoints every 2 steps; the budget ends it at step 5 (50 s >= 45 s), saved although 2 does not divide 5
    assert sorted(p.name for p in (runs / "a" / "seed0" / "checkpoints").glob("step=*")) == \
        ["step=2.ckpt", "step=4.ckpt", "step=5.ckpt"]
    # b: 30 s + 2 steps = 50 s at step 5 (not step 8, which a fresh 45 s budget would have allowed)
    assert sorted(p.name for p in (runs / "b" / "seed0" / "checkpoints").glob("step=*")) == ["step=3.ckpt", "step=5.ckpt"]
    (resumed,) = [c for c in calls(tmp_path) if c["cmd"] == "fit" and c["dir"].endswith("b/seed0")]
    assert resumed["start"] == 3 and resumed["seconds"] == 30.0
    evals = {Path(c["out"]).parent.parent.parent.name + "/" + Path(c["out"]).name: c["argv"]
             for c in calls(tmp_path) if c["cmd"] == "evaluate"}
    assert sorted(evals) == ["a/step=2.json", "a/step=4.json", "a/step=5.json", "b/step=3.json", "b/step=5.json"]
    final = {"a/step=5.json": ["--avg-k", "4"], "b/step=5.json": ["--temperature", "1.0"]}  # b: its own final flags
    for name, argv in evals.items():  # the experiment's --avg-k 2 everywhere, evaluate_final's flags on finals
        assert argv[-2:] == final.get(name, ["--avg-k", "2"]), name
        assert "--temperature" not in argv[:-2] and argv.count("--avg-k") == (2 if name == "a/step=5.json" else 1), name
    summary = (runs / "summary.md").read_text()
    # Least-Time: both runs ended at 50 s >= the 45 s budget, so both are read at 45 s and their finals compared
    assert "### Least-Time: 45 training s" in summary
    assert "| a | 5 | 50 | - | 0.50 [" in summary and "| b | 5 | 50 | - | 1.00 [" in summary  # "-": no rollout counts
    # time to 0.75: a never (0.50 at every checkpoint), b at its first evaluated checkpoint (step 3, 30 s)
    assert "| a | 0.75 | not reached (best 0.50) |" in summary and "| b | 0.75 | 30 s (iteration 3; first checkpoint) |" in summary


def test_keep_checkpoints_false_deletes_a_pairs_checkpoints_once_it_is_done(tmp_path, monkeypatch):
    """Evaluations, logs and the done marker stay; the checkpoints (GBs for a real student) go, and a rerun skips
    the pair without needing them."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    exp = load_experiment(spec(tmp_path, 0, seeds=[0], keep_checkpoints=False), results=tmp_path / "r")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    for arm in exp.arms:
        d = exp.run_dir(arm, 0)
        assert (d / "done.json").is_file() and not (d / "checkpoints").exists()
        assert sorted(p.name for p in (d / "eval").iterdir()) == ["step=2.json", "step=4.json"]
    n = len(calls(tmp_path))
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert len(calls(tmp_path)) == n  # nothing rerun
    assert load_experiment(spec(tmp_path, 0)).keep_checkpoints  # the default keeps them



def test_auto_precision_is_picked_once_per_experiment_and_given_to_every_fit(tmp_path, monkeypatch):
    """``trainer.precision: auto`` (the shipped configs', issue 61) is resolved once, at the experiment's first run,
    kept in ``precision.json`` with the CPU, and passed to every fit, so arms and seeds (and a resume on another
    machine) train at one precision; a later session does not probe again."""
    import torch

    import lightning_opd.models.precision as precision

    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    probes = []

    def probe(requested, student, device="cpu", trust_remote_code=False):
        probes.append((requested, student))
        return precision.PrecisionChoice("bf16-mixed", torch.bfloat16, {}, "bf16 matmuls ran 2.00x fp32")

    monkeypatch.setattr(precision, "resolve_student_precision", probe)
    auto = {"overrides": ["--trainer.max_steps=2", "--trainer.precision=auto"]}
    arms = {"a": {"configs": ["conf-a.yaml"], **auto}, "b": {"configs": ["conf-b.yaml"], **auto}}
    exp = load_experiment(spec(tmp_path, 0, seeds=[0], arms=arms, checkpoint_every=2), results=tmp_path / "r")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert probes == [("auto", "base-dir")]  # once for both arms
    record = json.loads((exp.root / "precision.json").read_text())
    assert record == {"precision": "bf16-mixed", "reason": "bf16 matmuls ran 2.00x fp32", "cpu": cpu_name()}
    fits = [c for c in calls(tmp_path) if c["cmd"] == "fit"]
    assert len(fits) == 2 and {c["precision"] for c in fits} == {"bf16-mixed"}

    # the next session (another machine, whose probe would pick fp32) adds seed 1 at the recorded precision
    monkeypatch.setattr(precision, "resolve_student_precision", lambda *a, **k: pytest.fail("probed again"))
    exp = load_experiment(spec(tmp_path, 0, seeds=[0, 1], arms=arms, checkpoint_every=2), results=tmp_path / "r")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    fits = [c for c in calls(tmp_path) if c["cmd"] == "fit"]
    assert len(fits) == 4 and {c["precision"] for c in fits} == {"bf16-mixed"}

    # a config that names its precision is left as it is
    fixed = {"a": {"configs": ["conf-a.yaml"], "overrides": ["--trainer.max_steps=2", "--trainer.precision=32-true"]}}
    exp = load_experiment(spec(tmp_path, 0, seeds=[0], arms=fixed, checkpoint_every=2, name="fixed"),
                          results=tmp_path / "r2")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    fits = [c for c in calls(tmp_path) if c["cmd"] == "fit" and c["dir"].startswith(str(tmp_path / "r2"))]
    assert not (exp.root / "precision.json").exists() and [c["precision"] for c in fits] == ["32-true"]


def test_summary_of_some_arms_uses_the_seeds_they_all_have(tmp_path, monkeypatch):
    """``--summary --arms``: the claim's arms over every seed they share while another arm lacks one; written
    beside the full summary (which keeps only the seed every arm has), with the contrasts among those arms."""
    from lightning_opd.cli.experiment import experiment_command as main
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    arm = {"overrides": ["--trainer.max_steps=2"]}
    path = spec(tmp_path, 0, arms={"a": arm, "b": arm, "c": arm}, contrasts=[["b", "a"], ["c", "a"]])
    Runner(load_experiment(path, results=tmp_path / "r"), cwd=ROOT, echo=lambda *_: None).run()
    # compare.md merges one evaluate file per seed into each arm: the seeds are training runs (`compare` counts them
    # because each arm comes from two files), so the run-level intervals are there
    compare = (tmp_path / "r" / "exp" / "compare.md").read_text()
    assert "2 runs x 4 tasks (training seeds 0, 1)" in compare and "95% t-interval over runs" in compare
    shutil.rmtree(tmp_path / "r" / "exp" / "c" / "seed1")  # c has not run seed 1 yet
    full = main([str(path), "--results", str(tmp_path / "r"), "--summary"])["summary"]
    assert "Seeds [0];" in full and "| c |" in full
    some = main([str(path), "--results", str(tmp_path / "r"), "--summary", "--arms", "b", "a"])["summary"]
    assert some == (tmp_path / "r" / "exp" / "summary-a+b.md").read_text().rstrip("\n")  # the file's order: a, b
    assert "Seeds [0, 1];" in some and "| c |" not in some
    # a wins t0, t1 per seed, b all 4: b - a = +0.50 over 8 paired episodes; per task 0, 0, 1, 1, and a draw of
    # 4 tasks (the same in both drawn runs) is all from {t0, t1} (or all from {t2, t3}) with chance 1/16 > 2.5%:
    # CI [0, 1] over runs then tasks, and over tasks with the runs fixed; the t-interval over the two runs' +0.50 is a
    # point; c's contrast is left out
    assert ("| b - a | +0.50 [+0.00, +1.00] | 0.50 | [+0.50, +0.50] | [+0.00, +1.00] | 8 (4) | no difference detected "
            "at n = 2 runs x 4 tasks | +0.50 (seed 0), +0.50 (seed 1) |") in some
    assert "c - a" not in some
    with pytest.raises(ValueError, match=r"--arms \['d'\]: not arms of exp"):
        main([str(path), "--results", str(tmp_path / "r"), "--summary", "--arms", "a", "d"])


def test_a_run_with_arms_fits_only_those_pairs_and_a_later_run_adds_the_rest(tmp_path, monkeypatch):
    """A run with ``--arms``: only those arms' pairs, seed by seed; the comparison of every arm waits for a full
    run, which then fits only the pairs still missing."""
    from lightning_opd.cli.experiment import experiment_command as main
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    arm = {"overrides": ["--trainer.max_steps=2"]}
    path = spec(tmp_path, 0, arms={"a": arm, "b": arm, "c": arm}, contrasts=[["c", "b"]])
    root = tmp_path / "r" / "exp"
    with pytest.raises(ValueError, match=r"--arms \['d'\]: not arms of exp"):
        main([str(path), "--results", str(tmp_path / "r"), "--arms", "d"])
    assert not root.exists()  # refused before anything is created or locked
    with pytest.raises(ValueError, match="--arms is empty"):
        Runner(load_experiment(path, results=tmp_path / "r"), cwd=ROOT, echo=lambda *_: None).run([])
    done = main([str(path), "--results", str(tmp_path / "r"), "--arms", "c", "a"])
    assert list(done) == [("a", 0), ("c", 0), ("a", 1), ("c", 1)]  # the experiment's order, seed by seed
    fits = [c["dir"] for c in calls(tmp_path) if c["cmd"] == "fit"]
    assert [Path(d).relative_to(root).as_posix() for d in fits] == ["a/seed0", "c/seed0", "a/seed1", "c/seed1"]
    assert not (root / "compare.md").exists() and not (root / "b").exists()
    summary = (root / "summary.md").read_text()  # what is evaluated so far; c - b waits for b
    assert "| a |" in summary and "| c |" in summary and "| b |" not in summary and "c - b" not in summary
    done = main([str(path), "--results", str(tmp_path / "r"), "--arms", "b"])  # the last missing pairs
    assert list(done) == [("b", 0), ("b", 1)] and (root / "compare.md").exists()  # every pair done: compared
    assert "| b |" in (root / "compare.md").read_text() and "c - b" in (root / "summary.md").read_text()
    fits = [c["dir"] for c in calls(tmp_path) if c["cmd"] == "fit"]
    assert [Path(d).relative_to(root).as_posix() for d in fits[4:]] == ["b/seed0", "b/seed1"]
    assert len(main([str(path), "--results", str(tmp_path / "r")])) == 6  # a full run after: nothing refit
    assert len([c for c in calls(tmp_path) if c["cmd"] == "fit"]) == 6


def test_a_stop_file_ends_the_run_between_pairs_and_the_same_command_continues(tmp_path, monkeypatch):
    """``<results>/<name>/STOP`` written while (a, 0) fits: that pair finishes (fit, evaluations, done.json), no
    other starts, the file is removed; the next run fits exactly the 3 pairs left, in the usual order."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    path = spec(tmp_path, 0)
    root = tmp_path / "r" / "exp"
    lines = []

    def echo(line):
        lines.append(line)
        if line.startswith("[a seed 0] fit"):  # the fit of the first pair has started
            (root / "STOP").touch()

    done = Runner(load_experiment(path, results=tmp_path / "r"), cwd=ROOT, echo=echo).run()
    assert list(done) == [("a", 0)] and (root / "a" / "seed0" / "done.json").is_file()
    assert not (root / "b").exists() and not (root / "STOP").exists() and not (root / "compare.md").exists()
    assert any(line.startswith("[b seed 0] not started") for line in lines)
    assert [c["dir"][-7:] for c in calls(tmp_path) if c["cmd"] == "fit"] == ["a/seed0"]
    done = Runner(load_experiment(path, results=tmp_path / "r"), cwd=ROOT, echo=lambda *_: None).run()
    assert list(done) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)] and (root / "compare.md").is_file()
    assert [c["dir"][-7:] for c in calls(tmp_path) if c["cmd"] == "fit"] == ["a/seed0", "b/seed0", "a/seed1",
                                                                              "b/seed1"]


def test_an_arms_evaluate_checkpoints_wins_for_that_arm(tmp_path, monkeypatch):
    """The experiment evaluates every checkpoint (a learning curve); arm b says ``last``: only its final is
    evaluated, though it writes the same checkpoints (steps 2 and 4) as a, so both pay the same writes."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    arms = {"a": {"overrides": ["--trainer.max_steps=4"]},
            "b": {"overrides": ["--trainer.max_steps=4"], "evaluate_checkpoints": "last"}}
    exp = load_experiment(spec(tmp_path, 0, seeds=[0], arms=arms), results=tmp_path / "r")
    assert [a.evaluate_checkpoints for a in exp.arms] == [None, "last"]
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    for arm, evaluated in (("a", ["step=2.json", "step=4.json"]), ("b", ["step=4.json"])):
        d = tmp_path / "r" / "exp" / arm / "seed0"
        assert sorted(p.name for p in (d / "checkpoints").glob("step=*")) == ["step=2.ckpt", "step=4.ckpt"]
        assert sorted(p.name for p in (d / "eval").iterdir()) == evaluated
    with pytest.raises(ValueError, match=r"arm 'b': evaluate_checkpoints='final': use 'last' or 'all'"):
        load_experiment(spec(tmp_path, 0, arms={**arms, "b": {"evaluate_checkpoints": "final"}}))


def test_an_arms_evaluate_final_must_be_a_list(tmp_path):
    path = spec(tmp_path, 0, arms={"a": {"evaluate_final": "--avg-k 4"}})
    with pytest.raises(ValueError, match=r"arm 'a': evaluate_final='--avg-k 4' must be a list of flags"):
        load_experiment(path)


def test_evaluate_start_evaluates_the_common_start_once_per_seed_and_refuses_a_changed_one(tmp_path, monkeypatch):
    """With evaluate_start the arms' starting student is evaluated once per seed (iteration 0 at 0 s of every
    arm in the summary) before the seed's first fit; a fit whose start differs (files or path) is refused."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    model = tmp_path / "student-opd"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights v1")
    start = [f"--model.init_args.student={model}", "--trainer.max_steps=4"]
    exp = load_experiment(spec(tmp_path, 0, arms={"a": {"overrides": start}, "b": {"overrides": start}},
                               evaluate_start=True, targets=[0.25, 0.5]), results=tmp_path / "r")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    evals = [c for c in calls(tmp_path) if c["cmd"] == "evaluate"]
    starts = [c for c in evals if c["ckpt"] == str(model)]
    assert [Path(c["out"]).relative_to(tmp_path / "r" / "exp").as_posix() for c in starts] == \
        ["start/seed0/eval/step=0.json", "start/seed1/eval/step=0.json"]
    assert evals.index(starts[1]) == 5  # after seed 0: its start and 2 arms x 2 checkpoints; before seed 1's fits
    assert starts[0]["argv"][-2:] == ["--avg-k", "2"]  # the experiment's evaluate flags
    summary = (tmp_path / "r" / "exp" / "summary.md").read_text()
    # the fake start wins 1 of 4 tasks: iteration 0 at 0 s in every arm's curve; target 0.25 met at the start,
    # 0.5 first at step 2 (20 s; a wins 2 of 4, b 4 of 4); Same-Step is at 4 (the start compares nothing)
    assert "| a | 0 | 0 | 2 | 0.25 | - |" in summary and "| b | 0 | 0 | 2 | 0.25 | - |" in summary
    assert "| a | 0.25 | 0 s (at the start) | 0 s (at the start) |" in summary
    assert "| a | 0.50 | 20 s (iteration 2; below at 0 s) | 20 s (iteration 2; below at 0 s) |" in summary
    assert "### Same-Step: iteration 4 " in summary

    record = json.loads((tmp_path / "r" / "exp" / "start" / "start.json").read_text())
    assert record["cpu"] == cpu_name() and record["sha256"] == files_sha256(model)
    (model / "model.safetensors").write_bytes(b"weights v2")  # e.g. `make demo` refit it
    (tmp_path / "r" / "exp" / "b" / "seed1" / "done.json").unlink()
    with pytest.raises(RuntimeError, match=r"the starting student .*student-opd changed since this experiment began"):
        Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    record["cpu"] = "AuthenticAMD AMD EPYC 7B13"  # built on another kind of CPU: the refusal names both
    (tmp_path / "r" / "exp" / "start" / "start.json").write_text(json.dumps(record))
    with pytest.raises(RuntimeError, match=rf"recorded on AuthenticAMD AMD EPYC 7B13; [0-9a-f]{{12}}\.\.\. now, on "
                       rf"{re.escape(cpu_name())};.* on a CPU like AuthenticAMD AMD EPYC 7B13, or run"):
        Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    del record["cpu"]  # a record from before the CPU was recorded: no CPU to point at
    (tmp_path / "r" / "exp" / "start" / "start.json").write_text(json.dumps(record))
    with pytest.raises(RuntimeError, match=r"recorded on an unrecorded CPU; .*lightning_opd/cpu_isa.py\), or run") as err:
        Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert "a CPU like" not in str(err.value)
    v2 = files_sha256(model)  # shown equivalent (e.g. a rebuild on another CPU that plays the same episodes)
    record["equivalents"] = [{"sha256": v2, "cpu": "GenuineIntel Xeon", "evidence": "start/equivalence.md"}]
    (tmp_path / "r" / "exp" / "start" / "start.json").write_text(json.dumps(record))
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    done = json.loads((tmp_path / "r" / "exp" / "b" / "seed1" / "done.json").read_text())
    assert done["start_sha256"] == v2 != record["sha256"]
    assert json.loads((tmp_path / "r" / "exp" / "a" / "seed0" / "done.json").read_text())["start_sha256"] == \
        record["sha256"]
    (model / "model.safetensors").write_bytes(b"weights v1")
    other = tmp_path / "other"
    other.mkdir()
    exp.arms[1].overrides = [f"--model.init_args.student={other}", "--trainer.max_steps=4"]
    shutil.rmtree(tmp_path / "r" / "exp" / "b" / "seed1")
    with pytest.raises(ValueError, match=r"arm 'b' starts from .*other, but this experiment's starting student is "):
        Runner(exp, cwd=ROOT, echo=lambda *_: None).run()

TINY = """\
trainer:
  accelerator: cpu
  max_steps: 3
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  enable_model_summary: false
model:
  class_path: lightning_opd.learner.OPDModule
  init_args:
    student: {student}
    teacher: {teacher}
    max_logged_turns: 3
    log_text_every_n_steps: 0
data:
  class_path: lightning_opd.data.RolloutDataModule
  init_args:
    env:
      class_path: tests.helpers.KeywordEnvFactory
      init_args:
        need: 2
    episodes_per_step: 2
    max_turns: 3
    max_new_tokens: 4
    max_context_tokens: 512
"""


@pytest.mark.slow  # four Python processes that import torch, Lightning and transformers: about a minute
@pytest.mark.timeout(600)
def test_real_fit_and_evaluate_on_the_tiny_models(model_dirs, tmp_path):
    """``lightning-opd fit`` and ``evaluate`` for real (tiny models, keyword environment): a checkpoint every 2
    steps and at the final step 3, each evaluated with the training seed as key, its training seconds (the
    runner's Timer) and the run's teacher giving the KL; the summary over both checkpoints."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(**model_dirs))
    exp = Experiment(name="tiny", arms=[Arm("opd", [str(config)])], seeds=[5], checkpoint_every=2,
                     evaluate_checkpoints="all", results=tmp_path / "results",
                     evaluate=["--backend", "hf", "--avg-k", "1", "--cache-dir", str(tmp_path / "cache")])
    done = Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    run = tmp_path / "results" / "tiny" / "opd" / "seed5"
    assert [Path(p).name for p in done[("opd", 5)]["evaluations"]] == ["step=2.json", "step=3.json"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step=2.ckpt", "step=3.ckpt"]
    assert (run / "checkpoints" / "last.ckpt").is_file() and (run / "student" / "config.json").is_file()
    assert os.readlink(run / "checkpoints" / "last.ckpt") == "step=3.ckpt"  # a link: each checkpoint written once
    assert list((run / "logs").glob("events.out.tfevents.*"))
    (early,) = json.loads((run / "eval" / "step=2.json").read_text())["students"]
    res = json.loads((run / "eval" / "step=3.json").read_text())
    (student,) = res["students"]
    assert student["kind"] == "ckpt" and student["policy_version"] == 3 and student["name"] == "opd"
    assert 0 < early["train_seconds"] < student["train_seconds"]
    assert {(r["task_id"], r["seed"]) for r in student["greedy"]} == {("north", 5), ("south", 5)}
    assert res["config"]["max_turns"] == 3 and res["config"]["teacher"] == model_dirs["teacher"]
    assert student["summary"]["teacher_traj_kl"]["mean"] > 0
    assert sum(part["episodes"] for part in student["summary"]["own_traj_kl"].values()) == 2
    assert (tmp_path / "results" / "tiny" / "compare.md").is_file()
    summary = (tmp_path / "results" / "tiny" / "summary.md").read_text()
    assert "### Same-Step: iteration 3" in summary and "| opd | 3 | " in summary


EXPERIMENTS = sorted((ROOT / "benchmarks" / "experiments").glob("*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_shipped_experiments_parse(path):
    """Every experiment file loads (known keys, valid values) and names config files that exist; every one but a
    go/no-go pilot (``*_pilot``, e.g. atod_pilot's one seed) has at least two seeds."""
    exp = load_experiment(path)
    assert exp.name == path.stem and len(exp.seeds) >= (1 if path.stem.endswith("_pilot") else 2)
    for arm in exp.arms:
        for config in arm.configs:
            assert (ROOT / config).is_file(), f"{path.name}: arm {arm.name!r} names a missing config {config}"


@pytest.mark.slow  # one `lightning-opd fit --print_config` process per arm (imports torch, Lightning, transformers)
@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.stem)
def test_shipped_experiment_arms_build(path, tmp_path):
    """Each arm's fit configuration parses with the runner's overlay (``fit ... --print_config``) and passes the
    runner's checks; turnopd_quest3's arms differ only in their controllers (same loss, games, turns)."""
    exp, configs = resolved_arms(path, tmp_path)
    if path.stem == "fopd_lag2":  # one loss and step size for every arm; lag 2 in all but sync; the recipe's tolerances
        for name, c in configs.items():
            init = c["model"]["init_args"]
            assert init["loss"]["class_path"] == "lightning_opd.losses.SampledTokenReverseKL", name
            assert init["optimizer"]["init_args"]["lr"] == 1e-4, name
            assert c["data"]["init_args"]["forced_lag"] == (0 if name == "sync" else 2), name
            monitors = [m["init_args"]["freshness"] for m in c["trainer"]["callbacks"]
                        if m["class_path"].endswith("StalenessMonitor")]
            assert len(monitors) == (1 if name in ("lag2_fopd", "lag2_age_only") else 0), name
            for m in monitors:
                assert (m["tau_rho"], m["tau_chi"], m["score"]) == (0.2036, 0.176, "age_only" if "age" in name else "full")
        assert configs["lag2_vanilla"]["model"]["init_args"]["loss"]["init_args"]["signal"] == "behaviour"
    if path.stem == "turnopd_quest3":
        stripped = {name: without_controllers(c) for name, c in configs.items()}
        assert all(c == stripped["vanilla"] for c in stripped.values())
        assert configs["vanilla"]["model"]["init_args"]["loss"]["class_path"] == \
            "lightning_opd.losses.TeacherTopKRenormalizedReverseKL"
        assert configs["vanilla"]["data"]["init_args"]["max_turns"] == 12
        finals = {arm.name: exp.evaluate_final if arm.evaluate_final is None else arm.evaluate_final for arm in exp.arms}
        assert {name: "--avg-k" in f for name, f in finals.items()} == \
            {"vanilla": True, "turnopd": True, "depth_only": False, "blend_only": False}  # Avg@4: the claim's arms
        assert all("--own-traj-kl" in f for f in finals.values())
        assert configs["vanilla"]["model"]["init_args"]["student"] == "artifacts/models/student-opd"  # see the file
        for name in ("turnopd", "blend_only"):  # the blend's progress is training s / max_time: alpha ends at 1
            (blend,) = [c for c in configs[name]["trainer"]["callbacks"] if c["class_path"].endswith("TurnLossBlend")]
            assert blend["init_args"]["horizon"] == "time", name
        assert exp.keep_checkpoints is False and exp.max_time == 1500 and exp.evaluate_start
    if path.stem == "atod_quest5":  # partial credit: the quest's progress (the games' only point is the win)
        assert exp.evaluate_start  # iteration 0: the OPD student every arm continues
        for name, c in configs.items():
            assert c["data"]["init_args"]["env"]["init_args"]["reward"] == "progress", name
        for name in ("atod", "grpo"):
            assert configs[name]["model"]["init_args"]["reward"]["init_args"]["score_weight"] == 0.5, name
        # one update rule for all three (ATODModule, same batches, updates, lr, student): only the advantage differs
        coefficients = {name: (c["model"]["init_args"]["kappa"], c["model"]["init_args"]["rho"],
                               c["model"]["init_args"]["tdur"],
                               sorted(a["init_args"]["attribute"] for a in c["trainer"]["callbacks"]
                                      if a["class_path"].endswith("AnnealingSchedule")))
                        for name, c in configs.items()}
        assert coefficients == {"opd": (1.0, 0.0, False, []), "atod": (1.0, 1.0, True, ["kappa", "rho"]),
                                "grpo": (0.0, 1.0, False, [])}
        for name, c in configs.items():
            assert c["model"]["class_path"] == "lightning_opd.learner.ATODModule", name
            assert c["trainer"]["max_steps"] == 24 and c["model"]["init_args"]["optimizer"]["init_args"]["lr"] == 5e-5
            assert (c["data"]["init_args"]["episodes_per_step"], c["data"]["init_args"]["group_size"]) == (8, 4), name
            assert (c["model"]["init_args"]["ppo_epochs"], c["model"]["init_args"]["ppo_mini_batches"]) == (1, 2), name
            init, data = c["model"]["init_args"], c["data"]["init_args"]  # one student, one task, one episode shape
            assert init["student"] == "artifacts/models/student-opd", name
            assert init["teacher"] == "artifacts/models/teacher-textworld", name
            assert data["env"]["init_args"]["games_dir"] == "artifacts/games/quest5", name
            assert (data["max_turns"], data["max_context_tokens"], data["max_new_tokens"]) == (12, 3072, 16), name
            assert (data["temperature"], data["seed"]) == (1.0, 0), name
        assert exp.every(exp.arms[0]) == 12  # 2 updates per iteration: checkpoints at iterations 6 and 12
