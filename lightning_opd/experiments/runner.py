"""Resumable experiment runner: arms x seeds of ``lightning-opd fit``, each checkpoint evaluated afterwards
(the experiment file: :mod:`lightning_opd.experiments.experiment`).

Run it with ``lightning-opd experiment EXPERIMENT.yaml`` (or ``python -m benchmarks.experiment EXPERIMENT.yaml``); it
can be stopped at any moment (Ctrl-C, ``kill -9``, a reboot) and run again with the same command to continue.

Per (arm, seed), in ``<results>/<name>/<arm>/seed<k>/``:

1. ``fit_config.yaml``: the resolved configuration (``fit ... --print_config``), read for the student's
   base directory, the teacher, the environment and the episode limits that evaluation reuses;
2. ``lightning-opd fit`` in its own process with the arm's config files and overrides, then the runner's
   overlay ``runner_overlay.yaml`` (TensorBoard logs in ``logs/``, a ``ModelCheckpoint`` every
   ``checkpoint_every`` steps keeping every checkpoint, ``checkpoints/step=N.ckpt`` and ``last.ckpt``,
   a link to the latest (a checkpoint is written once: writing counts in a time budget), the export in
   ``student/``; a ``Timer`` that records the training seconds in every checkpoint and stops
   the fit at ``max_time``, see :mod:`.checkpointing`), then ``--seed_everything=k`` and ``--data.init_args.seed=k`` (the
   DataModule's seed sets the task order and every episode's sampling seed, so seeds differ in their
   rollouts, not only in their initial random state). An unfinished fit resumes from
   ``checkpoints/last.ckpt`` (``--ckpt_path``; Lightning writes checkpoints atomically), its Timer restored
   from it: the training seconds continue and a time budget is not renewed. ``fit.done`` is written when it
   exits with 0. With ``evaluate_at_seconds`` the ``StepCheckpoint`` also saves the first optimizer step whose
   training seconds reach each mark and records it in ``at_seconds.json`` (:mod:`.marks`; once per mark, a
   resumed fit included);
3. ``lightning-opd evaluate`` in a separate process per evaluated checkpoint, ``--seeds k`` (episodes
   keyed by the training seed, so arms pair by (task, seed) in ``compare``), written to
   ``eval/step=N.json`` (atomically; an existing file is not redone): the final checkpoint, every checkpoint
   with ``evaluate_checkpoints: all``, and the checkpoints of the ``evaluate_at_seconds`` marks (a mark the fit
   did not reach, because ``max_steps`` ended it first, is stood for by the final), each of their files with
   ``"at_seconds": [{"mark": s, "reached": bool}]`` (its step and training seconds are in ``students[0]``:
   ``global_step``, ``train_seconds``);
4. ``done.json``, written last and atomically: a pair with it is never run again.

An arm with ``reuse: <experiment>/<arm>`` copies that experiment's finished pair of the same seed instead of steps 2-3,
once its resolved configuration, evaluations and starting student are checked to be this pair's (:mod:`.reuse`); a
seed the source has not finished is fitted.

With ``evaluate_start: true`` (every arm continues one trained student, ``model.init_args.student``), that
student is evaluated once per seed, before the first fit of the seed, to ``<results>/<name>/start/seed<k>/eval/
step=0.json`` with the ``evaluate`` flags (not ``evaluate_final``): iteration 0 at 0 training seconds of every
arm in the summary. ``start/start.json`` records its path, a sha256 of its files and the CPU of the machine
that first recorded it (``cpu_name``; normally the one that built it: the AVX2 pin of ``make student-opd``
reproduced the student on two AMD EPYC machines but not on an Intel Xeon, lightning_opd/cpu_isa.py); a later
fit of the experiment whose starting student differs (another path, or the files changed, e.g. ``make demo``
refit it) is refused, naming both CPUs, so every arm and seed continues the same weights; a rebuild shown to play
the same episodes (``equivalents`` in start.json, benchmarks/compare_start_evaluations.py) is accepted and its
sha256 recorded in the pair's ``done.json``.

Pairs run seed by seed (every arm of the first seed, in the file's order, then the next seed), so a run
stopped part-way already holds paired (task, seed) evaluations of every arm it reached. ``--arms A B ...`` runs
only those arms' pairs (e.g. the pair that fits the hours at hand); the comparison below waits until every pair
of the experiment is done, the summary covers what is evaluated so far (contrasts with an arm not yet
evaluated left out).

To end a run between pairs (no fit killed part-way), create ``<results>/<name>/STOP`` (``touch``): the runner
finishes the pair it is on, removes the file and starts no other pair; the same command continues later.

Child processes die with the runner (Linux ``PR_SET_PDEATHSIG``); a lock file stops two runners from
working on one experiment at once, and another (``<results>/.runner.lock``) two experiments under one results
root (training seconds are only comparable on cores nothing else uses). At the end, once every pair is done, the runner prints ``lightning-opd compare`` of the
last evaluated checkpoint of every arm (all seeds merged, paired by (task, seed)) and writes it to
``<results>/<name>/compare.json``, then the summary over every evaluated checkpoint
(:mod:`lightning_opd.analysis.curves`: success vs rollout iterations and training seconds, Same-Step, Least-Time,
time to target, final and best, the arms at each ``evaluate_at_seconds`` mark) to ``summary.md`` and
``summary.json``, with, for runs with TurnOPD's rollout-depth controller, its validity checks read from the fits'
TensorBoard logs (:mod:`lightning_opd.analysis.rollout_validity`). ``--summary`` writes that summary from what is evaluated so far.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lightning_opd.cpu_isa import cpu_name  # imports torch only to pin
from lightning_opd.experiments.experiment import ROOT, Arm, Experiment
from lightning_opd.experiments.marks import MARKS_FILE, mark_steps, read_marks  # pure Python
from lightning_opd.experiments.reuse import check_reusable, copy_pair, evaluated_steps, needed_steps
from lightning_opd.files import write_text_atomic

_STEP = re.compile(r"^step=(\d+)\.ckpt$")


# --------------------------------------------------------------------------------------------- files
def files_sha256(path: Path) -> str:
    """sha256 over a model directory's files (relative names and contents, sorted by name) or one file.

    Raises:
        FileNotFoundError: ``path`` does not exist (named).
    """
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for f in files:
        digest.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _run(cmd: list[str], log: Path, cwd: Path) -> int:
    """Run ``cmd`` with output appended to ``log``; the child is killed if the runner dies."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        pre = _die_with_parent if sys.platform.startswith("linux") else None
        return subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pre).returncode


def _is_checkpoint(path: Path) -> bool:
    """A Lightning checkpoint: a file or an FSDP run's folder of shards (imported here: ``lightning_opd.models``
    loads transformers)."""
    from lightning_opd.models.checkpoints import is_checkpoint

    return is_checkpoint(path)


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of ``checkpoints/step=N.ckpt``, by step."""
    folder = run_dir / "checkpoints"
    found = [(int(m.group(1)), p) for p in folder.glob("step=*.ckpt") if (m := _STEP.match(p.name))]
    return sorted(found)


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class Runner:
    """Runs an :class:`Experiment` to completion, skipping what is done (module docstring)."""

    def __init__(self, exp: Experiment, cwd: str | os.PathLike = ROOT, echo=print) -> None:
        self.exp = exp
        self.cwd = Path(cwd)
        self.echo = echo

    # ------------------------------------------------------------------------------------------- run
    def run(self, arms: list[str] | None = None) -> dict:
        """Every (arm, seed) not yet done, then the comparison and the summary; returns
        ``{(arm, seed): done record}`` for the pairs it ran or found done.

        ``arms``: only these arms' pairs (seed by seed, in the experiment's order; e.g. to fit the pair that
        fits the hours at hand first). The comparison of every arm (``compare.md``) is written once every pair
        of the experiment is done (those of other arms read from their ``done.json``); the summary
        (``summary.md``) always covers what is evaluated so far.

        Raises:
            ValueError: ``arms`` is empty or names an arm the experiment does not have; an arm's ``max_steps``
                does not fit its checkpoint cadence, or the starting student changed (``evaluate_start``).
            RuntimeError: another runner holds the experiment's lock or the results root's (another experiment is
                running; the message names it), or a fit/evaluate process failed
                (the message names its log file).
        """
        self.check_arms(arms)
        self.exp.root.mkdir(parents=True, exist_ok=True)
        with open(self.exp.root / ".lock", "w") as lock, open(self.exp.results / ".runner.lock", "a+") as machine:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"another runner is working on {self.exp.root} (lock held)") from None
            try:
                fcntl.flock(machine, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                machine.seek(0)
                raise RuntimeError(
                    f"another experiment is running under {self.exp.results} ({machine.read().strip() or 'unknown'}): "
                    "one at a time, since training seconds (Least-Time, time to target, max_time) mean something "
                    "only on cores nothing else uses; wait for it, or give a separate --results root if the "
                    "machine has room for both") from None
            machine.seek(0)
            machine.truncate()
            machine.write(f"{self.exp.name}, pid {os.getpid()}\n")
            machine.flush()
            done, every = {}, {}  # the pairs this run ran or found done; those plus other arms' finished pairs
            stopped = False
            for seed in self.exp.seeds:  # seed by seed: a stopped run already pairs every arm on its first seeds
                for arm in self.exp.arms:
                    marker = self.exp.run_dir(arm, seed) / "done.json"
                    if (arms is None or arm.name in arms) and not stopped:
                        stopped = not marker.is_file() and self._stop_requested(arm, seed)
                        if not stopped:
                            done[(arm.name, seed)] = every[(arm.name, seed)] = self.run_pair(arm, seed)
                    elif marker.is_file():  # another arm's finished pair (a run with --arms)
                        every[(arm.name, seed)] = json.loads(marker.read_text())
            if len(every) == len(self.exp.arms) * len(self.exp.seeds):
                self.summarise(every)
            else:
                self.echo(f"no comparison yet: {len(every)} of {len(self.exp.arms) * len(self.exp.seeds)} "
                          "(arm, seed) pairs done")
                self.summarise_curves()
            return done

    def _stop_requested(self, arm: Arm, seed: int) -> bool:
        """True (and the request consumed) when ``<results>/<name>/STOP`` exists: the runner starts no further
        (arm, seed) pair, so a run can end between pairs (e.g. before a session's end) without killing a fit;
        the same command later continues with ``arm`` x ``seed``."""
        stop = self.exp.root / "STOP"
        if not stop.is_file():
            return False
        stop.unlink()
        self.echo(f"[{arm.name} seed {seed}] not started: {stop} asked the runner to stop between pairs (removed); "
                  "run the same command again to continue from here")
        return True

    def check_arms(self, arms: list[str] | None) -> None:
        """Raises ValueError when ``arms`` (``--arms``) is empty or names an arm the experiment does not have."""
        names = [a.name for a in self.exp.arms]
        if arms is not None and not arms:
            raise ValueError(f"--arms is empty: give one or more arms of {self.exp.name} ({names}), or none for all")
        unknown = [a for a in arms or [] if a not in names]
        if unknown:
            raise ValueError(f"--arms {unknown}: not arms of {self.exp.name} ({names})")

    def run_pair(self, arm: Arm, seed: int) -> dict:
        """Fit (or resume), evaluate and mark one (arm, seed); a marked pair is returned as recorded."""
        d = self.exp.run_dir(arm, seed)
        marker = d / "done.json"
        if marker.is_file():
            self.echo(f"[{arm.name} seed {seed}] done, skipped")
            return json.loads(marker.read_text())
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        overlay = self._write_overlay(d, arm)
        base_cmd = (self.exp.fit_command + [a for c in arm.configs for a in ("--config", c)] + ["--config", str(overlay)]
                    + arm.overrides + [f"--seed_everything={seed}"] + [f"--{k}={seed}" for k in self.exp.seed_keys])
        config = self._resolved_config(d, base_cmd)
        self._check_steps(config, arm)
        precision = self._experiment_precision(config)
        if precision is not None:  # one precision for every arm and seed, whatever machine a resume lands on
            base_cmd = base_cmd + [f"--trainer.precision={precision}"]
        start_sha256 = self.evaluate_start(arm, seed, config)[1] if self.exp.evaluate_start else None
        if arm.reuse and not (d / "fit.done").is_file() and (
                reused := self._reuse(arm, seed, d, config, start_sha256, precision)):
            return reused
        if not (d / "fit.done").is_file():
            cmd = list(base_cmd)
            last = d / "checkpoints" / "last.ckpt"
            if _is_checkpoint(last):  # a file, or an FSDP run's folder of shards (F30)
                cmd.append(f"--ckpt_path={last}")
                self.echo(f"[{arm.name} seed {seed}] resuming fit from {last}")
            else:
                self.echo(f"[{arm.name} seed {seed}] fit")
            t_fit = time.time()  # the fit process alone (not the config resolution nor the start's evaluation)
            if _run(cmd, d / "fit.log", self.cwd) != 0:
                raise RuntimeError(f"[{arm.name} seed {seed}] fit failed; see {d / 'fit.log'}")
            write_text_atomic(d / "fit.done", json.dumps({"seconds": round(time.time() - t_fit, 1)}))
        evals = self._evaluate(arm, seed, d, config)
        record = {"arm": arm.name, "seed": seed, "run_dir": str(d), "evaluations": [str(p) for p in evals],
                  "fit": json.loads((d / "fit.done").read_text()), "seconds_this_session": round(time.time() - t0, 1)}
        if self.exp.at_seconds(arm):
            record["at_seconds"] = read_marks(d)  # kept after keep_checkpoints: false (also in the eval files)
        if start_sha256 is not None:
            record["start_sha256"] = start_sha256
        write_text_atomic(marker, json.dumps(record, indent=1))
        if not self.exp.keep_checkpoints:
            for sub in ("checkpoints", "student"):
                shutil.rmtree(d / sub, ignore_errors=True)
        return record

    def _reuse(self, arm: Arm, seed: int, d: Path, config: dict, start_sha256: str | None,
               precision: str | None) -> dict | None:
        """Copy ``arm.reuse``'s finished pair for ``seed`` into ``d`` once it is checked to be this pair's recipe
        (:mod:`.reuse`) and return its ``done.json`` record; ``None`` (this pair is fitted) when the source has not
        finished that seed.

        Raises:
            ValueError: the source pair is another recipe (:func:`~.reuse.check_reusable`) or has no evaluation.
        """
        source = self.exp.results / str(arm.reuse) / f"seed{seed}"
        if not (source / "done.json").is_file():
            self.echo(f"[{arm.name} seed {seed}] {source} is not finished: fitting this pair")
            return None
        recorded = json.loads((source / "done.json").read_text())
        steps = evaluated_steps(recorded)
        if not steps:
            raise ValueError(f"{d} cannot reuse {source}: its done.json lists no eval/step=N.json evaluation")
        final = steps[-1]
        marks = [m.get("step") or final for m in recorded.get("at_seconds") or []] if self.exp.at_seconds(arm) else []
        flags = self.evaluate_args(config, seed)
        expected = {s: flags + (self.exp.final_flags(arm) if s == final else [])
                    for s in needed_steps(final, self.exp.every(arm), self.exp.evaluated(arm), marks)}
        record = copy_pair(source, d, check_reusable(source, d, config, expected, start_sha256, precision),
                           list(expected))
        if not self.exp.keep_checkpoints:
            for sub in ("checkpoints", "student"):
                shutil.rmtree(d / sub, ignore_errors=True)
        self.echo(f"[{arm.name} seed {seed}] reused {source}: the same resolved configuration and evaluations")
        return record

    # ---------------------------------------------------------------------------------------- pieces
    def _write_overlay(self, d: Path, arm: Arm) -> Path:
        budget = self.exp.max_time
        duration = None if budget is None else (f"{budget // 86400:02d}:{budget // 3600 % 24:02d}:"
                                                f"{budget // 60 % 60:02d}:{budget % 60:02d}")  # DD:HH:MM:SS
        marks = self.exp.at_seconds(arm)
        at = {"at_seconds": marks, "marks_file": str(d / MARKS_FILE)} if marks else {}
        overlay = {"trainer": {
            "enable_checkpointing": True, "default_root_dir": str(d),
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(d), "name": "logs", "version": ""}},
            "callbacks+": [{"class_path": "lightning.pytorch.callbacks.Timer",
                            "init_args": {"duration": duration, "interval": "step"}},
                           {"class_path": "lightning_opd.experiments.checkpointing.StepCheckpoint",
                            "init_args": {"dirpath": str(d / "checkpoints"), "filename": "step={step}",
                                          "auto_insert_metric_name": False,
                                          "every_n_train_steps": self.exp.every(arm),
                                          "save_top_k": -1, "save_last": "link", "enable_version_counter": False,
                                          **at}}]},
            "model": {"init_args": {"export_dir": str(d / "student")}}}
        path = d / "runner_overlay.yaml"
        header = "# written by lightning_opd.experiments.runner: logs, checkpoints and export of this (arm, seed)\n"
        write_text_atomic(path, header + yaml.safe_dump(overlay, sort_keys=False))
        return path

    def _resolved_config(self, d: Path, base_cmd: list[str]) -> dict:
        path = d / "fit_config.yaml"
        if not path.is_file():
            out = subprocess.run(base_cmd + ["--print_config"], cwd=self.cwd, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"the fit configuration does not parse:\n$ {' '.join(base_cmd)} --print_config\n"
                                   f"{out.stderr[-3000:]}")
            write_text_atomic(path, out.stdout)
        return yaml.safe_load(path.read_text()) or {}

    def _experiment_precision(self, config: dict) -> str | None:
        """The experiment's pick for ``trainer.precision: auto`` (issue 61): resolved once, at its first run, at the
        student's shapes on that machine (:func:`~lightning_opd.models.precision.resolve_student_precision`), and
        kept in ``<root>/precision.json`` with the CPU and the probe's reason, so that every arm and seed, resumed on
        any machine, trains at one precision (a probe per run could pick fp32 on one machine and bf16 on another,
        and the arms would differ in more than the method). ``None`` when the config names a precision.

        Raises:
            ValueError: the student's config cannot be read (from the probe).
        """
        if str(_get(config, "trainer.precision")) != "auto":
            return None
        path = self.exp.root / "precision.json"
        if path.is_file():
            return json.loads(path.read_text())["precision"]
        import torch

        from lightning_opd.models import precision as precision_mod

        device = "cuda" if torch.cuda.is_available() else "cpu"
        choice = precision_mod.resolve_student_precision("auto", str(_get(config, "model.init_args.student")), device)
        write_text_atomic(path, json.dumps({"precision": choice.trainer_precision, "reason": choice.reason,
                                            "cpu": cpu_name()}, indent=1))
        self.echo(f"[{self.exp.name}] trainer.precision=auto: {choice.trainer_precision} for every run "
                  f"({choice.reason}); kept in {path}")
        return choice.trainer_precision

    def _check_steps(self, config: dict, arm: Arm) -> None:
        steps = _get(config, "trainer.max_steps")
        if self.exp.max_time is None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"arm {arm.name!r}: trainer.max_steps={steps!r}; the runner needs a step budget "
                             "(--trainer.max_steps=N) or the experiment's max_time")
        if _get(config, "trainer.max_time") is not None:
            raise ValueError(f"arm {arm.name!r}: trainer.max_time={_get(config, 'trainer.max_time')!r}: give the "
                             "budget as the experiment's max_time (seconds); the runner's Timer records the training "
                             "seconds, and Lightning ignores trainer.max_time beside it")
        timers = [c for c in (_get(config, "trainer.callbacks") or [])
                  if isinstance(c, dict) and str(c.get("class_path", "")).endswith(".Timer")]
        if len(timers) > 1:
            raise ValueError(f"arm {arm.name!r}: the configuration adds its own Timer callback; remove it (the "
                             "runner adds one, with the experiment's max_time)")
        val = _get(config, "trainer.limit_val_batches")
        if self.exp.max_time is not None and val not in (0, 0.0):
            raise ValueError(f"arm {arm.name!r}: trainer.limit_val_batches={val!r} with max_time={self.exp.max_time}: "
                             "in-fit validation would be counted in the time budget; add "
                             "--trainer.limit_val_batches=0 (the runner evaluates the checkpoints afterwards)")

    def evaluate_args(self, config: dict, seed: int) -> list[str]:
        """``evaluate`` flags from the fit configuration (base model, environment, episode limits, teacher),
        the seed, then the experiment's own ``evaluate`` flags (which win). The teacher (``--teacher``, the
        teacher-trajectory KL) is ``model.init_args.teacher`` when it is a directory, its ``init_args.path`` when it is a
        class that names one (the placebo ``ShuffledTeacher``: the real teacher it shuffles), and none otherwise."""
        data = _get(config, "data.init_args") or {}
        env = data.get("env") or {}
        args = ["--base", str(_get(config, "model.init_args.student")), "--seeds", str(seed)]
        if isinstance(env, dict) and env.get("class_path"):
            args += ["--env", env["class_path"], "--env-args", json.dumps(env.get("init_args") or {})]
        for flag, key in (("--max-turns", "eval_max_turns"), ("--max-turns", "max_turns"),
                          ("--max-new-tokens", "max_new_tokens"), ("--max-context-tokens", "max_context_tokens")):
            if data.get(key) is not None and flag not in args:
                args += [flag, str(data[key])]
        teacher = _get(config, "model.init_args.teacher")
        if isinstance(teacher, dict):  # a Teacher class: its weights' directory where it names one (ShuffledTeacher's
            teacher = _get(teacher, "init_args.path")  # real teacher), else none (a served or privileged teacher)
        if self.exp.teacher_kl and teacher:
            args += ["--teacher", str(teacher)]
        return args + list(self.exp.evaluate)

    def evaluate_start(self, arm: Arm, seed: int, config: dict) -> tuple[Path, str]:
        """Check that ``arm`` starts from the experiment's recorded starting student (recording it the first
        time) and evaluate that student once for ``seed``; returns ``start/seed<k>/eval/step=0.json`` and the
        student's sha256 (recorded in the pair's ``done.json``).

        A student whose files differ is accepted only if ``start.json`` lists its sha256 under ``equivalents``
        (``[{"sha256": ..., "cpu": ..., "evidence": ...}]``), written by hand once the evidence shows it is the
        same start in all but rounding, e.g. a rebuild on another kind of CPU whose own start evaluation played
        the recorded student's greedy episodes on every task.

        Raises:
            ValueError: the arm starts from another path than the recorded one.
            RuntimeError: the starting student's files changed since they were recorded (sha256), or the
                evaluation failed (names its log).
            FileNotFoundError: the starting student does not exist.
        """
        student = str(_get(config, "model.init_args.student"))
        folder = self.exp.root / "start"
        digest = files_sha256(self.cwd / student)
        record = folder / "start.json"
        if record.is_file():
            known = json.loads(record.read_text())
            if known["student"] != student:
                raise ValueError(f"arm {arm.name!r} starts from {student}, but this experiment's starting student is "
                                 f"{known['student']} ({record}): with evaluate_start every arm continues one student")
            equivalent = {e["sha256"]: e for e in known.get("equivalents", [])}
            if digest in equivalent and digest != known["sha256"]:
                self.echo(f"[start] {student} is {digest[:12]}..., not {known['sha256'][:12]}...: continuing it as "
                          f"the equivalent start listed in {record} (evidence: {equivalent[digest].get('evidence')})")
            elif known["sha256"] != digest:
                recorded = known.get("cpu")
                where = f"recorded on {recorded}" if recorded else "recorded on an unrecorded CPU"
                like = f" on a CPU like {recorded}" if recorded else ""
                raise RuntimeError(f"the starting student {student} changed since this experiment began (sha256 "
                                   f"{known['sha256'][:12]}... in {record}, {where}; {digest[:12]}... now, on "
                                   f"{cpu_name()}; e.g. `make demo` refit it, it was fit unpinned on an AVX-512 "
                                   "machine, or this CPU is of another kind): rebuild it with `rm -rf "
                                   f"{student}; make student-opd` (pinned to AVX2: the same file on two AMD EPYC "
                                   "machines, AVX2 and AVX-512, but not on an Intel Xeon; lightning_opd/cpu_isa.py)"
                                   f"{like}, or run the experiment into a new --results folder (or, if a start "
                                   "evaluation of it plays the recorded student's episodes, list its sha256 under "
                                   "\"equivalents\" in start.json with that evidence)")
        else:
            write_text_atomic(record, json.dumps({"student": student, "sha256": digest, "cpu": cpu_name()}, indent=1))
        out = folder / f"seed{seed}" / "eval" / "step=0.json"
        if not out.is_file():
            self.echo(f"[start seed {seed}] evaluate {student}")
            cmd = (self.exp.evaluate_command + ["--students", f"start={student}", "--out", str(out)]
                   + self.evaluate_args(config, seed))
            if _run(cmd, folder / f"seed{seed}" / "eval.log", self.cwd) != 0:
                raise RuntimeError(f"[start seed {seed}] evaluate failed; see {folder / f'seed{seed}' / 'eval.log'}")
        return out, digest

    def marks_of(self, arm: Arm, d: Path, found: list[tuple[int, Path]]) -> dict[int, list[dict]] | None:
        """The checkpoints standing for ``arm``'s training-second marks after its fit, ``{step: [{"mark",
        "reached"}]}`` (:func:`~.marks.mark_steps`), or ``None`` when the arm has no marks.

        Raises:
            RuntimeError: the fit's ``at_seconds.json`` is missing or disagrees with the marks (names the file).
        """
        marks = self.exp.at_seconds(arm)
        if not marks:
            return None
        try:
            return mark_steps(marks, read_marks(d), [s for s, _ in found])
        except (FileNotFoundError, ValueError) as err:
            raise RuntimeError(f"[{arm.name}] {d / MARKS_FILE}: {err}") from None

    def _evaluate(self, arm: Arm, seed: int, d: Path, config: dict) -> list[Path]:
        found = checkpoints(d)
        if not found:
            raise RuntimeError(f"[{arm.name} seed {seed}] fit finished without checkpoints in {d / 'checkpoints'}")
        at = self.marks_of(arm, d, found)
        chosen = [c for c in found if self.exp.evaluated(arm) == "all" or c == found[-1] or (at and c[0] in at)]
        final_flags = self.exp.final_flags(arm)
        outs = []
        for step, ckpt in chosen:
            extra = final_flags if step == found[-1][0] else []  # the fit is done: the last is final
            out = d / "eval" / f"step={step}.json"
            outs.append(out)
            if not out.is_file():
                self.echo(f"[{arm.name} seed {seed}] evaluate step {step}")
                cmd = (self.exp.evaluate_command + ["--students", f"{arm.name}={ckpt}", "--out", str(out)]
                       + self.evaluate_args(config, seed) + extra)
                if _run(cmd, d / "eval.log", self.cwd) != 0:
                    raise RuntimeError(f"[{arm.name} seed {seed}] evaluate failed; see {d / 'eval.log'}")
            if at is not None:  # which marks this checkpoint stands for (again if the runner died before)
                data = json.loads(out.read_text())
                if data.get("at_seconds") != at.get(step, []):
                    data["at_seconds"] = at.get(step, [])
                    write_text_atomic(out, json.dumps(data, indent=1))
        return outs

    def summarise(self, done: dict) -> str | None:
        """Compare the arms on their last evaluated checkpoint, every seed merged (printed, and written
        to ``compare.json`` and ``compare.md``)."""
        from lightning_opd.analysis.bootstrap import paired_bootstrap
        from lightning_opd.analysis.compare import load_arm_sources, runs_for_files

        specs = []
        for arm in self.exp.arms:
            files = [done[(arm.name, s)]["evaluations"][-1] for s in self.exp.seeds]
            specs.append(f"{arm.name}={','.join(files)}")
        try:
            tables, sources = load_arm_sources(specs)  # one file per seed: each seed a training run
            result = paired_bootstrap(tables, metric="success", runs=runs_for_files(sources))
        except ValueError as err:  # e.g. arms evaluated on different tasks
            self.echo(f"no comparison: {err}")
            return None
        text = result.to_markdown()
        write_text_atomic(self.exp.root / "compare.json", json.dumps(result.to_dict(), indent=1))
        write_text_atomic(self.exp.root / "compare.md", text + "\n")
        self.echo(text)
        self.summarise_curves()
        return text

    def summarise_curves(self, arms: list[str] | None = None) -> str | None:
        """The summary over every evaluated checkpoint (:mod:`lightning_opd.analysis.curves`), printed and
        written to ``summary.md`` and ``summary.json``; ``None`` (and a line saying why) when there is nothing to
        summarise yet.

        ``arms``: only these arms (in the experiment's order) and the contrasts between them, over the seeds they
        all have (e.g. the claim's arms once they have a seed the others lack); written to
        ``summary-<arm>+<arm>....md``/``.json`` beside the full summary.

        Raises:
            ValueError: an arm name the experiment does not have.
        """
        from lightning_opd.analysis.curves import load_runs  # numpy and yaml only, no torch
        from lightning_opd.analysis.summary import Summary, summarise
        from lightning_opd.analysis.rollout_validity import validity_table  # tensorboard's reader, no torch

        names = [a.name for a in self.exp.arms]
        stem = "summary"
        contrasts = self.exp.contrasts
        if arms is not None:
            self.check_arms(arms)
            names = [n for n in names if n in arms]
            stem = "summary-" + "+".join(names)
            contrasts = [c for c in contrasts if set(c) <= set(names)]
        runs = load_runs(self.exp.root, names, self.exp.seeds)
        waiting = [c for c in contrasts if not set(c) <= set(runs)]
        if waiting:  # an arm with nothing evaluated yet (e.g. a run with --arms): its contrasts wait for it
            self.echo(f"contrasts {waiting} left out: an arm of each has no evaluated checkpoint yet")
            contrasts = [c for c in contrasts if c not in waiting]
        marks = sorted({m for a in self.exp.arms if a.name in names for m in self.exp.at_seconds(a)})
        try:
            summary = summarise(runs, name=self.exp.name, budget=self.exp.max_time, targets=self.exp.targets,
                                contrasts=contrasts, marks=marks)
        except ValueError as err:
            self.echo(f"no summary: {err}")
            return None
        checks = validity_table(self.exp.root, names, self.exp.seeds, max_cap=self.exp.validity_max_cap)
        if checks is not None:  # runs with the rollout-depth controller: its validity checks beside the tables
            summary = Summary(summary.markdown + "\n\n" + checks[0], {**summary.data, "rollout_validity": checks[1]})
        write_text_atomic(self.exp.root / f"{stem}.md", summary.markdown + "\n")
        write_text_atomic(self.exp.root / f"{stem}.json", summary.to_json())
        self.echo(summary.markdown)
        return summary.markdown

