"""An arm's ``reuse: <experiment>/<arm>`` (lightning_opd.experiments.reuse): another experiment's finished pair is
copied only when it is the same recipe (resolved configuration, evaluations, starting student), checked per seed; a
seed the source lacks is fitted. With the fake ``fit``/``evaluate`` of tests/experiments/fake_lopd.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from lightning_opd.experiments.experiment import Arm, Experiment, load_experiment
from lightning_opd.experiments.reuse import (check_reusable, config_differences, evaluation_command, needed_steps)
from lightning_opd.experiments.runner import Runner

ROOT = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, str(Path(__file__).with_name("fake_lopd.py"))]
pytestmark = pytest.mark.timeout(300)


def experiment(tmp_path, name: str, seeds, arm: dict, **extra) -> Experiment:
    data = {"name": name, "seeds": seeds, "checkpoint_every": 2, "evaluate_checkpoints": "last",
            "arms": {"a": arm}, "fit_command": FAKE + ["fit"], "evaluate_command": FAKE + ["evaluate"],
            "evaluate": ["--avg-k", "2"], **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_experiment(path, results=tmp_path / "results")


def fits(tmp_path) -> list[str]:
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    return [c["dir"] for c in map(json.loads, lines) if c["cmd"] == "fit"]


RECIPE = {"configs": ["conf-a.yaml"], "overrides": ["--trainer.max_steps=4"]}


@pytest.fixture
def source(tmp_path, monkeypatch):
    """``src``'s arm ``a``, seed 0 only, fitted and evaluated (steps 2 and 4: evaluate_checkpoints all)."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    exp = experiment(tmp_path, "src", [0], RECIPE, evaluate_checkpoints="all")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert fits(tmp_path) == [str(exp.run_dir(exp.arms[0], 0))]
    return exp


def test_the_same_recipe_is_copied_for_the_seeds_it_has_and_the_others_are_fitted(tmp_path, source):
    exp = experiment(tmp_path, "tgt", [0, 1], {**RECIPE, "reuse": "src/a"})
    lines = []
    Runner(exp, cwd=ROOT, echo=lines.append).run()
    src0, d0, d1 = source.run_dir(source.arms[0], 0), exp.run_dir(exp.arms[0], 0), exp.run_dir(exp.arms[0], 1)
    assert fits(tmp_path) == [str(src0), str(d1)]  # seed 0 copied, not fitted; seed 1 (src lacks it) fitted
    done = json.loads((d0 / "done.json").read_text())
    assert done["reused_from"] == {"run_dir": str(src0), "copied_from": str(src0)}
    assert done["run_dir"] == str(d0) and done["evaluations"] == [str(d0 / "eval" / "step=4.json")]
    assert (d0 / "eval" / "step=4.json").read_bytes() == (src0 / "eval" / "step=4.json").read_bytes()
    assert (d0 / "fit.done").is_file() and (d0 / "fit.log").read_text() == (src0 / "fit.log").read_text()  # copied
    assert not (d0 / "eval" / "step=2.json").exists()  # but only the evaluations this arm ("last") makes
    assert done["arm"] == "a" and done["seed"] == 0
    assert any(f"[a seed 0] reused {src0}" in line for line in lines)
    assert any(f"[a seed 1] {source.root / 'a' / 'seed1'} is not finished: fitting this pair" in line for line in lines)
    assert "reused_from" not in json.loads((d1 / "done.json").read_text())
    # a copy of a copy names where the run happened, and the evaluations it checks are the ones made there
    again = experiment(tmp_path, "tgt2", [0], {**RECIPE, "reuse": "tgt/a"})
    Runner(again, cwd=ROOT, echo=lambda *_: None).run()
    chained = json.loads((again.run_dir(again.arms[0], 0) / "done.json").read_text())["reused_from"]
    assert chained == {"run_dir": str(src0), "copied_from": str(d0)}
    assert fits(tmp_path) == [str(src0), str(d1)]


@pytest.mark.parametrize("arm, extra, message", [
    ({"configs": ["conf-a.yaml"], "overrides": ["--trainer.max_steps=6"]}, {},
     r"the resolved fit configurations differ in trainer.max_steps: 6 here, 4 in the source"),
    (RECIPE, {"evaluate": ["--avg-k", "4"]},
     r"step 4 was evaluated with other arguments:\n  source: --base base-dir .* --avg-k 2\n  here:   --base .* --avg-k 4"),
    (RECIPE, {"evaluate_final": ["--temperature", "1.0"]}, r"step 4 was evaluated with other arguments"),
])
def test_another_recipe_is_refused_naming_what_differs(tmp_path, source, arm, extra, message):
    exp = experiment(tmp_path, "tgt", [0], {**arm, "reuse": "src/a"}, **extra)
    with pytest.raises(ValueError, match=message + r"[\s\S]*fit this pair instead \(remove `reuse` from the arm\)"):
        Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert not (exp.run_dir(exp.arms[0], 0) / "done.json").exists() and len(fits(tmp_path)) == 1


def test_evaluations_the_source_did_not_make_are_refused(tmp_path, monkeypatch):
    """The source evaluated its final checkpoint only (and deleted the rest): an arm evaluating every checkpoint
    (steps 2 and 4) cannot take it."""
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.jsonl"))
    Runner(experiment(tmp_path, "src", [0], RECIPE, keep_checkpoints=False), cwd=ROOT, echo=lambda *_: None).run()
    exp = experiment(tmp_path, "tgt", [0], {**RECIPE, "reuse": "src/a"}, evaluate_checkpoints="all")
    with pytest.raises(ValueError, match=r"it has no evaluation of step 2 \(it evaluated steps \[4\]\)"):
        Runner(exp, cwd=ROOT, echo=lambda *_: None).run()


def test_paths_under_the_source_run_folder_are_read_as_this_one_and_the_start_must_match(tmp_path):
    """Hand-made pair: the source's logger and checkpoint paths name its own folder (where it ran, ``run_dir``),
    which equals this pair's config once read as this folder; another starting student's sha256 is refused."""
    ran, src, tgt = tmp_path / "old" / "a" / "seed0", tmp_path / "copy" / "a" / "seed0", tmp_path / "new" / "a" / "seed0"
    for d in (src, tgt):
        d.mkdir(parents=True)
    config = {"trainer": {"default_root_dir": str(tgt), "max_steps": 20}, "model": {"lr": 1e-4}}
    (src / "fit_config.yaml").write_text(yaml.safe_dump({**config, "trainer": {"default_root_dir": str(ran),
                                                                                "max_steps": 20}}))
    out = ran / "eval" / "step=20.json"
    (src / "eval.log").write_text(f"\n$ python -m lightning_opd evaluate --students a={ran}/c --out {out} --base m "
                                  "--seeds 0 --avg-k 0\n")
    (src / "done.json").write_text(json.dumps({"run_dir": str(ran), "evaluations": [str(out)], "start_sha256": "ab" * 32}))
    args = {20: ["--base", "m", "--seeds", "0", "--avg-k", "0"]}
    assert check_reusable(src, tgt, config, args, "ab" * 32)["run_dir"] == str(ran)
    with pytest.raises(ValueError, match=r"another starting student \(sha256 abababababab\.\.\., this experiment's "
                                         r"cdcdcdcdcdcd\.\.\."):
        check_reusable(src, tgt, config, args, "cd" * 32)
    with pytest.raises(ValueError, match=r"differ in model.lr: 0.0002 here, 0.0001 in the source"):
        check_reusable(src, tgt, {**config, "model": {"lr": 2e-4}}, args, None)
    # trainer.precision: auto is resolved per experiment (precision.json): the picks must agree
    with pytest.raises(ValueError, match=r"trainer.precision=auto picked None there .*'bf16-mixed' here"):
        check_reusable(src, tgt, config, args, None, precision="bf16-mixed")
    (tmp_path / "copy" / "precision.json").write_text(json.dumps({"precision": "32-true"}))
    assert check_reusable(src, tgt, config, args, None, precision="32-true")["run_dir"] == str(ran)
    with pytest.raises(ValueError, match=r"picked '32-true' there .*'bf16-mixed' here"):
        check_reusable(src, tgt, config, args, None, precision="bf16-mixed")


def test_a_partial_fit_in_the_target_is_replaced_not_merged(tmp_path, source):
    """A pair fitted part-way before the source finished: its logs and checkpoints go before the copy (TensorBoard
    readers would otherwise see steps 1..N twice)."""
    exp = experiment(tmp_path, "tgt", [0], {**RECIPE, "reuse": "src/a"})
    d = exp.run_dir(exp.arms[0], 0)
    (d / "logs").mkdir(parents=True)
    (d / "logs" / "events.out.old").write_text("stale")
    (d / "checkpoints").mkdir()
    (d / "checkpoints" / "step=2.ckpt").write_text("{}")
    (d / "checkpoints" / "last.ckpt").symlink_to("step=2.ckpt")
    Runner(exp, cwd=ROOT, echo=lambda *_: None).run()
    assert not (d / "logs" / "events.out.old").exists()
    src = source.run_dir(source.arms[0], 0)
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == sorted(p.name for p in (src / "checkpoints").iterdir())
    assert json.loads((d / "done.json").read_text())["reused_from"]["copied_from"] == str(src)


def test_config_differences_needed_steps_and_the_evaluation_command_by_hand(tmp_path):
    a = {"t": {"x": 1, "cb": [{"k": 1}, {"k": 2}]}, "only_a": 0}
    b = {"t": {"x": 1, "cb": [{"k": 1}, {"k": 3}]}, "only_b": None}
    assert config_differences(a, b) == ["only_a: 0 here, missing in the source", "only_b: missing here, None in the source",
                                        "t.cb[1].k: 2 here, 3 in the source"]
    assert config_differences(a, a) == []
    assert config_differences({"limit": 1}, {"limit": 1.0}) == ["limit: 1 here, 1.0 in the source"]  # 1 batch, all
    assert needed_steps(20, 10, "last", []) == [20]
    assert needed_steps(20, 10, "all", []) == [10, 20]
    assert needed_steps(128, 32, "all", []) == [32, 64, 96, 128]
    assert needed_steps(23, 10, "last", [14, 23]) == [14, 23]  # a mark's checkpoint; one not reached is the final
    log = tmp_path / "eval.log"
    log.write_text("\n$ py evaluate --students a=c --out /r/eval/step=4.json --base m --avg-k 2\nfailed\n"
                   "\n$ py evaluate --students a=c --out /r/eval/step=4.json --base m --avg-k 3\n"
                   "\n$ py evaluate --students a=c --out /r/eval/step=40.json --base m --avg-k 9\n")
    assert evaluation_command(log, Path("/r/eval/step=4.json")) == "--base m --avg-k 3"  # the last one that wrote it
    assert evaluation_command(log, Path("/r/eval/step=8.json")) is None


@pytest.mark.parametrize("reuse", ["src", "src/a/b", "../x/a", "exp/a", 3, "../a", "src/..", "./a"])
def test_a_reuse_that_is_not_another_experiments_arm_is_refused(tmp_path, reuse):
    with pytest.raises(ValueError, match=r"arm 'a': reuse=.*give another experiment's arm as '<experiment>/<arm>'"):
        Experiment(name="exp", arms=[Arm("a", ["c.yaml"], reuse=reuse)], seeds=[0], checkpoint_every=2, results=tmp_path)
