"""An experiment: arms x seeds of ``lightning-opd fit`` (:class:`Experiment`), read from a YAML file
(:func:`load_experiment`) and run by :class:`~lightning_opd.experiments.runner.Runner` (``lightning-opd experiment``)::

    name: demo_opd                   # results under <results>/demo_opd/<arm>/seed<k>/
    seeds: [0, 1, 2]
    checkpoint_every: 10             # optimizer steps between checkpoints (the final step is saved too)
    evaluate_checkpoints: last       # or: all (a learning curve)
    max_time: null                   # or seconds: every (arm, seed) gets this training wall-clock budget
    targets: [0.5]                   # time to reach these greedy success rates (summary; optional)
    contrasts: [[opd_lr1e-4, opd]]   # a - b besides each arm minus the first (summary; optional)
    arms:
      opd:
        configs: [conf/textworld/opd.yaml]
        overrides: [--trainer.limit_val_batches=0]
      opd_lr1e-4:
        configs: [conf/textworld/opd.yaml]
        overrides: [--model.init_args.optimizer.init_args.lr=1.0e-4, --trainer.limit_val_batches=0]
        checkpoint_every: 10         # optional, per arm (e.g. 2 optimizer updates per rollout batch)
        evaluate_final: []           # optional, per arm (e.g. Avg@4 on the main arms' finals only)
        evaluate_checkpoints: last   # optional, per arm (e.g. finals only for an ablation)
        evaluate_at_seconds: [600]   # optional, per arm ([]: none)
        reuse: other_exp/opd         # optional: copy <results>/other_exp/opd/seed<k> where it is this recipe (reuse.py)
    evaluate: [--avg-k, "4", --temperature, "0.7"]   # extra `lightning-opd evaluate` flags
    evaluate_final: []               # flags for the final checkpoint only, after `evaluate` (e.g. Avg@4 there only)
    keep_checkpoints: true           # false: delete a pair's checkpoints/ and student/ once it is evaluated
    evaluate_start: false            # true: evaluate the arms' common starting student once per seed (iteration 0)
    evaluate_at_seconds: []          # training seconds, e.g. [600, 1200]: also evaluate the checkpoints that reach them
    validity_max_cap: null           # turns: the TurnOPD validity check's bound on the mean non-probe rollout cap

Run it with ``lightning-opd experiment EXPERIMENT.yaml`` (or ``python -m benchmarks.experiment EXPERIMENT.yaml``);
what it writes where: :mod:`lightning_opd.experiments.runner`.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lightning_opd.analysis.curves import check_contrasts  # numpy and yaml only, no torch
from lightning_opd.experiments.marks import check_at_seconds  # pure Python

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = ROOT / "benchmarks" / "results"
LOPD = [sys.executable, "-m", "lightning_opd"]


@dataclass
class Arm:
    """One training recipe: config files (in order) and command-line overrides of ``lightning-opd fit``."""

    name: str
    configs: list[str]
    overrides: list[str] = field(default_factory=list)
    checkpoint_every: int | None = None  # optimizer steps; None: the experiment's
    evaluate_final: list[str] | None = None  # flags for this arm's final checkpoint; None: the experiment's
    evaluate_checkpoints: str | None = None  # "last" or "all"; None: the experiment's
    evaluate_at_seconds: list[float] | None = None  # training-second marks; None: the experiment's
    reuse: str | None = None  # "<experiment>/<arm>": that arm's finished pairs, checked and copied (reuse.py)


@dataclass
class Experiment:
    """Arms x seeds (see the module docstring for the YAML form).

    Attributes:
        name: folder under ``results``.
        arms: the recipes; names are folder names.
        seeds: training seeds (``--seed_everything`` and every ``seed_keys`` entry).
        checkpoint_every: optimizer steps between checkpoints (an arm's own ``checkpoint_every`` wins); the
            final step is saved as well (:class:`~.checkpointing.StepCheckpoint`).
        evaluate_checkpoints: ``"last"`` (the final weights) or ``"all"``; an arm's own ``evaluate_checkpoints``
            wins for that arm (e.g. learning curves for the arms a claim compares, finals only for ablations:
            checkpoints are still written at the same cadence, so the writes cost every arm alike in its budget).
        max_time: training wall-clock budget of every (arm, seed) in seconds (a ``Timer``; ``None``: none).
            Resumed fits continue the saved count. The fit then needs no in-fit validation
            (``--trainer.limit_val_batches=0``), which the budget would count.
        targets: greedy success rates whose time to reach the summary reports.
        contrasts: pairs ``[a, b]`` of arm names whose difference ``a - b`` (final checkpoints, with its CI
            half-width) the summary reports besides each arm minus the first (e.g. f-OPD minus plain lag 2).
        evaluate: extra ``lightning-opd evaluate`` arguments (after the runner's, so they win).
        evaluate_final: further arguments for the final checkpoint only (after ``evaluate``; e.g. ``--avg-k 4``
            there and greedy-only learning curves, which costs a fifth of Avg@4 at every checkpoint); an arm's
            own ``evaluate_final`` (``[]``: none) replaces it for that arm.
        teacher_kl: pass the run's teacher to ``evaluate`` (``--teacher``: teacher-trajectory KL).
        keep_checkpoints: ``False`` deletes a pair's ``checkpoints/`` and exported ``student/`` once its
            ``done.json`` is written (a 135M-parameter student's checkpoints with AdamW state are about 1.5 GB
            each); the evaluations, logs and configs stay.
        evaluate_start: evaluate the arms' common starting student (``model.init_args.student``) once per seed
            as iteration 0 (module docstring); fits refuse a starting student that differs from the recorded one.
        evaluate_at_seconds: training-second marks (seconds, increasing, none above ``max_time``): each fit also
            saves the first optimizer step whose training seconds reach each mark, and that checkpoint is evaluated
            besides the final (a mark not reached is stood for by the final; :mod:`.marks`); the summary compares
            the arms at each mark. An arm's own ``evaluate_at_seconds`` wins (``[]``: none). ``[]`` (default):
            none, the overlay unchanged.
        validity_max_cap: turns: the bound of the rollout-depth validity check "mean cap over non-probe steps
            <= this" (TurnOPD runs; :mod:`lightning_opd.analysis.rollout_validity`); ``None``: the mean is
            reported without a verdict.
        seed_keys: config keys set to the seed besides ``--seed_everything``.
        results: results root (default ``benchmarks/results``).
        fit_command, evaluate_command: how to launch ``fit`` / ``evaluate`` (tests swap in fakes).

    Raises:
        ValueError: no arms or seeds, a repeated arm name or seed, a name that is not a plain folder
            name, ``checkpoint_every < 1``, ``max_time <= 0``, a target outside [0, 1] or an unknown
            ``evaluate_checkpoints``, or a contrast that is not two different arm names; a bad
            ``evaluate_at_seconds`` (not a list of positive, increasing seconds within ``max_time``; the message
            names the value) or ``validity_max_cap`` (not an integer >= 1); an arm's ``reuse`` that is not
            ``"<experiment>/<arm>"`` of another arm.
    """

    name: str
    arms: list[Arm]
    seeds: list[int]
    checkpoint_every: int
    evaluate_checkpoints: str = "last"
    max_time: int | None = None
    targets: list[float] = field(default_factory=list)
    contrasts: list[list[str]] = field(default_factory=list)
    evaluate: list[str] = field(default_factory=list)
    evaluate_final: list[str] = field(default_factory=list)
    teacher_kl: bool = True
    keep_checkpoints: bool = True
    evaluate_start: bool = False
    evaluate_at_seconds: list[float] = field(default_factory=list)
    validity_max_cap: int | None = None
    seed_keys: list[str] = field(default_factory=lambda: ["data.init_args.seed"])
    results: Path = DEFAULT_RESULTS
    fit_command: list[str] = field(default_factory=lambda: LOPD + ["fit"])
    evaluate_command: list[str] = field(default_factory=lambda: LOPD + ["evaluate"])

    def __post_init__(self) -> None:
        self.results = Path(self.results)
        if not self.arms or not self.seeds:
            raise ValueError("an experiment needs at least one arm and one seed")
        names = [a.name for a in self.arms]
        for n in [self.name, *names]:
            if not re.fullmatch(r"[\w.+-]+", n):
                raise ValueError(f"name {n!r}: use letters, digits, '_', '-', '.', '+' (it becomes a folder)")
        if len(set(names)) != len(names) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"arms {names} and seeds {self.seeds} must not repeat")
        for where, every in [("", self.checkpoint_every)] + [(f"arm {a.name!r}: ", a.checkpoint_every) for a in self.arms]:
            if every is not None and (not isinstance(every, int) or every < 1):
                raise ValueError(f"{where}checkpoint_every={every} must be an integer >= 1 (optimizer steps)")
        if self.max_time is not None and (not isinstance(self.max_time, int) or self.max_time < 1):
            raise ValueError(f"max_time={self.max_time!r} must be a whole number of seconds >= 1 (or null: no budget)")
        self.targets = [float(t) for t in self.targets]
        if any(not 0 <= t <= 1 for t in self.targets):
            raise ValueError(f"targets={self.targets}: success rates in [0, 1]")
        check_contrasts(self.contrasts, names)
        for where, how in [("", self.evaluate_checkpoints)] + [(f"arm {a.name!r}: ", a.evaluate_checkpoints)
                                                                for a in self.arms if a.evaluate_checkpoints is not None]:
            if how not in ("last", "all"):
                raise ValueError(f"{where}evaluate_checkpoints={how!r}: use 'last' or 'all'")
        self.evaluate_at_seconds = check_at_seconds([] if self.evaluate_at_seconds is None else self.evaluate_at_seconds,
                                                    budget=self.max_time)
        for a in self.arms:
            if a.evaluate_at_seconds is not None:
                a.evaluate_at_seconds = check_at_seconds(a.evaluate_at_seconds, f"arm {a.name!r}: ", self.max_time)
        for a in self.arms:
            if a.reuse is not None and (not isinstance(a.reuse, str)
                                        or not re.fullmatch(r"[\w.+-]+/[\w.+-]+", a.reuse)
                                        or a.reuse == f"{self.name}/{a.name}"
                                        or {".", ".."} & set(a.reuse.split("/"))):
                raise ValueError(f"arm {a.name!r}: reuse={a.reuse!r}: give another experiment's arm as "
                                 "'<experiment>/<arm>' (folders under the results root), e.g. 'lora_demo/full'")
        cap = self.validity_max_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"validity_max_cap={cap!r} must be a whole number of turns >= 1 (or null: no verdict)")

    @property
    def root(self) -> Path:
        return self.results / self.name

    def run_dir(self, arm: Arm, seed: int) -> Path:
        return self.root / arm.name / f"seed{seed}"

    def every(self, arm: Arm) -> int:
        """Optimizer steps between ``arm``'s checkpoints."""
        return arm.checkpoint_every if arm.checkpoint_every is not None else self.checkpoint_every

    def evaluated(self, arm: Arm) -> str:
        """Which of ``arm``'s checkpoints are evaluated: ``"last"`` or ``"all"`` (the arm's own setting wins)."""
        return arm.evaluate_checkpoints if arm.evaluate_checkpoints is not None else self.evaluate_checkpoints

    def at_seconds(self, arm: Arm) -> list[float]:
        """``arm``'s training-second marks (seconds; the arm's own ``evaluate_at_seconds`` wins; ``[]``: none)."""
        return list(arm.evaluate_at_seconds if arm.evaluate_at_seconds is not None else self.evaluate_at_seconds)

    def final_flags(self, arm: Arm) -> list[str]:
        """``evaluate`` flags for ``arm``'s final checkpoint only (the arm's own ``evaluate_final`` wins)."""
        return list(arm.evaluate_final if arm.evaluate_final is not None else self.evaluate_final)


def load_experiment(path: str | os.PathLike, results: str | os.PathLike | None = None) -> Experiment:
    """Read an experiment YAML (module docstring). ``arms`` maps names to ``{configs, overrides}``.

    Raises:
        ValueError: an unknown key (named) or a missing one; an arm's ``evaluate_final`` that is not a list.
    """
    data = yaml.safe_load(Path(path).read_text()) or {}
    known = {"name", "arms", "seeds", "checkpoint_every", "evaluate_checkpoints", "max_time", "targets", "contrasts",
             "evaluate", "evaluate_final", "teacher_kl", "keep_checkpoints", "evaluate_start", "evaluate_at_seconds",
             "validity_max_cap", "seed_keys", "results", "fit_command", "evaluate_command"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    for key in ("name", "arms", "seeds", "checkpoint_every"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r}")
    arms = []
    for name, spec in data.pop("arms").items():
        spec = spec or {}
        bad = set(spec) - {"configs", "overrides", "checkpoint_every", "evaluate_final", "evaluate_checkpoints",
                           "evaluate_at_seconds", "reuse"}
        if bad:
            raise ValueError(f"{path}: arm {name!r}: unknown key(s) {sorted(bad)}; use configs, overrides, "
                             "checkpoint_every, evaluate_final, evaluate_checkpoints, evaluate_at_seconds and reuse")
        final = spec.get("evaluate_final")
        if final is not None and not isinstance(final, list):
            raise ValueError(f"{path}: arm {name!r}: evaluate_final={final!r} must be a list of flags "
                             "(e.g. [--avg-k, \"4\"]; [] for none)")
        arms.append(Arm(str(name), [str(c) for c in spec.get("configs", [])], [str(o) for o in spec.get("overrides", [])],
                        spec.get("checkpoint_every"), None if final is None else [str(f) for f in final],
                        spec.get("evaluate_checkpoints"), spec.get("evaluate_at_seconds"), spec.get("reuse")))
    if results is not None:
        data["results"] = results
    return Experiment(arms=arms, **data)
