"""Learning curves of an experiment over every evaluated checkpoint, and the checkpoint selections the summary
compares (:mod:`lightning_opd.analysis.summary` writes the tables): curves against rollout iterations and training
seconds, the Same-Step and Least-Time selections, time to a target success, final and best.

Input: the runner's folders ``<root>/<arm>/seed<k>/eval/step=N.json`` (one ``lightning-opd evaluate`` output
per checkpoint, one student each) and ``fit_config.yaml`` (for the optimizer updates per rollout batch).
A *run* is one (arm, seed); a *point* one evaluated checkpoint of a run (:class:`Point`). Definitions
(PROPOSED, docs/algorithms.md §2.5's protocol made concrete; the tests pin them by hand):

* **iteration**: rollout batches done, ``global_step // updates_per_batch`` (``ppo_epochs x ppo_mini_batches``
  for ATOD/GRPO, 1 for OPD), so arms with several updates per batch are compared at equal rollouts.
* **seconds**: training seconds of the checkpoint (the runner's ``Timer``; :mod:`.checkpointing`).
* **success** of a point: mean greedy success over its (task, seed) episodes; **Avg@k** the mean of the
  sampled episodes. An arm's value at a selection of points (one per seed) is the mean over all their
  episodes, tasks x seeds.
* **Same-Step**: ``S`` = the largest iteration at which every run has an evaluated checkpoint; each run
  contributes its point at ``S``, so all arms are compared after exactly the same rollout iterations. (Taking
  ``S`` as the smallest last iteration, a budget-stopped run's off-grid final, and the other runs at their
  latest point at or before it would give the runs with longer steps up to ``checkpoint_every - 1`` fewer
  iterations.) Without such an iteration (checkpoint grids that never meet), the fallback is that rule: ``S``
  = the smallest last iteration, each run's latest point at or before it, and the table says so.
* **Least-Time**: ``T`` = the largest training time every run reached (min over runs of their last
  point's seconds); each run contributes its latest point at or before ``T``. With a time budget ``B``
  (the experiment's ``max_time``) seconds are read as ``min(seconds, B)``: every fit stops at the first
  step end after ``B`` (overshooting by less than one step), so a run that used its budget counts as at
  ``B`` and its final checkpoint is compared; the table shows the true seconds.
* Comparisons: :func:`~.bootstrap.paired_bootstrap` of the selected points, tasks x seeds paired by
  (task, seed), differences to the first arm. Each seed is a training run (one evaluation per run, its episodes
  keyed by its seed: ``runs="seed"``). With two or more seeds the CI is the two-level one (runs, then tasks;
  ../shared/docs/algorithms.md §7.3) and a difference is called better/worse only when both it and the t-interval
  over the per-run differences exclude 0 (:func:`~.bootstrap.run_verdict`: the two-level bootstrap undercovers with
  2-3 runs); each table is followed by each seed's difference, the t-interval and the one-level CI over tasks with
  the runs held fixed (labelled "tasks only, runs fixed"). With one seed the CI is over tasks and decides alone.
* **time to target** ``x``: per run, the seconds (and iteration) of its first point with success ``>= x``, and
  the seconds of the point before it (below ``x``): the crossing lies between the two, so an arm with sparser
  checkpoints is not read as slower than it is; "not reached" otherwise (with the run's best success).
* **contrasts**: named pairs ``(a, b)`` besides "each arm minus the first": ``a - b`` at the final checkpoints
  (same pairing and CI), with the CI's half-width (what a "no difference detected" verdict can rule out) and
  each seed's own difference.
* **start**: with the runner's ``evaluate_start``, the arms' common starting student evaluated once per seed
  (``<root>/start/seed<k>/eval/step=0.json``) is every run's first point, iteration 0 at 0 s (in the curves,
  Same-Step, Least-Time and time to target: a target the start already meets is reached "at the start").
* **at a mark** ``m`` (the runner's ``evaluate_at_seconds``, training seconds): each run's point whose evaluation
  the runner marked as standing for ``m`` (``"at_seconds"`` in its JSON): the checkpoint of the first optimizer
  step whose training seconds reached ``m``, or, for a run that ended before ``m`` (its ``max_steps``), its final
  (flagged "not reached"); the tables show each point's true iteration and seconds. Compared like Same-Step
  (each arm minus the first, and the named contrasts).
* **final**: each run's last point; **best**: each run's trained point (not the start) with the highest greedy
  success (earliest on ties). Best is selected on the same held-out games it is scored on, so it is optimistic.
* **own-trajectory KL by outcome**: the student's reverse KL to the teacher (nats/token) per turn on its
  own greedy episodes, won vs failed (``evaluate --teacher``), token-weighted over the seeds' final points.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import yaml

from lightning_opd.analysis.bootstrap import Comparison, Key, paired_bootstrap

_EVAL = re.compile(r"^step=(\d+)\.json$")


@dataclass
class Point:
    """One evaluated checkpoint of a run.

    Attributes:
        arm, seed: the run.
        step: optimizer steps of the checkpoint; ``iteration`` rollout batches (``step // updates_per_batch``).
        seconds: training seconds (``None`` when the checkpoint carries none).
        greedy: ``{(task, seed): success}`` of the greedy episodes.
        sampled: ``{(task, seed): Avg@k}`` or ``None`` (no sampled episodes).
        own_kl: the student's ``summary.own_traj_kl`` (per-turn KL by outcome) or ``None``.
        teacher: ``{(task, seed): success}`` of the teacher's greedy episodes, or ``None``.
        path: the evaluate JSON.
        rollouts: ``{"generated", "used"}`` episodes up to the checkpoint (``OPDModule.log_rollout_counts``),
            or ``None`` (a file without them).
        start: the experiment's starting student (iteration 0, 0 s; module docstring), not a checkpoint.
        at_seconds: ``{mark: reached}``: the training-second marks (seconds) this checkpoint stands for (module
            docstring; ``reached`` False: the run's final, which ended before the mark), or ``None`` (no marks).
    """

    arm: str
    seed: int
    step: int
    iteration: int
    seconds: float | None
    greedy: dict[Key, float]
    sampled: dict[Key, float] | None = None
    own_kl: dict | None = None
    teacher: dict[Key, float] | None = None
    path: str = ""
    rollouts: dict[str, int] | None = None
    start: bool = False
    at_seconds: dict[float, bool] | None = None

    @property
    def success(self) -> float:
        return sum(self.greedy.values()) / len(self.greedy)

    @property
    def avg_at_k(self) -> float | None:
        return None if self.sampled is None else sum(self.sampled.values()) / len(self.sampled)


Runs = dict[str, dict[int, list[Point]]]  # arm -> seed -> points by step


def point_from_evaluation(data: dict, arm: str, seed: int, step: int, updates_per_batch: int = 1,
                          path: str = "") -> Point:
    """A :class:`Point` from one ``lightning-opd evaluate`` output holding one student.

    Raises:
        ValueError: the file holds no student or several, or ``updates_per_batch < 1``.
    """
    if updates_per_batch < 1:
        raise ValueError(f"updates_per_batch={updates_per_batch} must be >= 1")
    students = data.get("students") or []
    if len(students) != 1:
        raise ValueError(f"{path or 'evaluation'}: holds {len(students)} students; one checkpoint per file expected")
    (s,) = students

    def table(records):
        if records is None:
            return None
        rows: dict[Key, list[float]] = {}
        for r in records:
            rows.setdefault((r["task_id"], r["seed"]), []).append(float(r["success"]))
        return {k: sum(v) / len(v) for k, v in rows.items()}

    teacher = (data.get("teacher") or {}).get("episodes")
    marks = data.get("at_seconds")  # written by the experiment runner (lightning_opd/experiments/marks.py)
    return Point(arm=arm, seed=seed, step=step, iteration=step // updates_per_batch, seconds=s.get("train_seconds"),
                 greedy=table(s["greedy"]), sampled=table(s.get("sampled")),
                 own_kl=(s.get("summary") or {}).get("own_traj_kl"), teacher=table(teacher), path=path,
                 rollouts=s.get("rollouts"),
                 at_seconds=None if marks is None else {float(m["mark"]): bool(m["reached"]) for m in marks})


def updates_per_batch(config: dict) -> int:
    """Optimizer updates per rollout batch of a resolved fit configuration: ``ppo_epochs x ppo_mini_batches``
    when the model has them (ATOD/GRPO), else 1."""
    init = ((config.get("model") or {}).get("init_args") or {})
    epochs, minis = init.get("ppo_epochs"), init.get("ppo_mini_batches")
    return int(epochs) * int(minis) if isinstance(epochs, int) and isinstance(minis, int) else 1


def load_runs(root: str | Path, arms: Sequence[str], seeds: Sequence[int]) -> Runs:
    """Every evaluated checkpoint under ``<root>/<arm>/seed<k>/eval/`` (runs without one are left out), each run
    preceded by the starting student's evaluation ``<root>/start/seed<k>/eval/step=0.json`` when there is one
    (iteration 0 at 0 s, ``start=True``)."""
    runs: Runs = {}
    for arm in arms:
        for seed in seeds:
            d = Path(root) / arm / f"seed{seed}"
            cfg = d / "fit_config.yaml"
            per_batch = updates_per_batch(yaml.safe_load(cfg.read_text()) or {}) if cfg.is_file() else 1
            found = sorted((int(m.group(1)), p) for p in (d / "eval").glob("step=*.json") if (m := _EVAL.match(p.name)))
            points = [point_from_evaluation(json.loads(p.read_text()), arm, seed, step, per_batch, str(p))
                      for step, p in found]
            start = Path(root) / "start" / f"seed{seed}" / "eval" / "step=0.json"
            if points and start.is_file():
                first = point_from_evaluation(json.loads(start.read_text()), arm, seed, 0, 1, str(start))
                points.insert(0, replace(first, seconds=0.0, start=True))
            if points:
                runs.setdefault(arm, {})[seed] = points
    return runs


# ---------------------------------------------------------------------------------------------- selection
def _latest(points: list[Point], ok) -> Point | None:
    chosen = [p for p in points if ok(p)]
    return max(chosen, key=lambda p: p.step) if chosen else None


def _select(runs: Runs, ok, where: str) -> dict[str, dict[int, Point]]:
    out: dict[str, dict[int, Point]] = {}
    for arm, seeds in runs.items():
        for seed, points in seeds.items():
            p = _latest(points, ok)
            if p is None:
                raise ValueError(f"{arm} seed {seed} has no evaluated checkpoint at or before {where} (its first is at "
                                 f"iteration {points[0].iteration}): evaluate earlier checkpoints (evaluate_checkpoints: all)")
            out.setdefault(arm, {})[seed] = p
    return out


def same_step(runs: Runs) -> tuple[int, dict[str, dict[int, Point]], bool]:
    """``(S, {arm: {seed: point}}, exact)``: the largest iteration at which every run has a point and each run's
    point there (``exact``); without a common iteration, the smallest last iteration and each run's latest point
    at or before it (``exact`` False). Module docstring.

    Raises:
        ValueError: (fallback) a run without a point at or before ``S`` (names it).
    """
    common = set.intersection(*({p.iteration for p in points if not p.start}  # the shared start compares nothing
                                for seeds in runs.values() for points in seeds.values()))
    if common:
        s = max(common)
        return s, _select(runs, lambda p: p.iteration == s, f"iteration {s}"), True
    s = min(points[-1].iteration for seeds in runs.values() for points in seeds.values())
    return s, _select(runs, lambda p: p.iteration <= s, f"iteration {s}"), False


def least_time(runs: Runs, budget: float | None = None) -> tuple[float, dict[str, dict[int, Point]]]:
    """``(T, {arm: {seed: point}})``: the largest training time every run reached (seconds read as
    ``min(seconds, budget)``) and each run's latest point at or before it (module docstring).

    Raises:
        ValueError: a point without training seconds (names its file), or a run without a point at or
            before ``T``.
    """
    for seeds in runs.values():
        for points in seeds.values():
            for p in points:
                if p.seconds is None:
                    raise ValueError(f"{p.path}: no training seconds (a checkpoint written without the runner's "
                                     "Timer): Least-Time needs them")

    def clock(p: Point) -> float:
        return p.seconds if budget is None else min(p.seconds, budget)

    t = min(max(clock(p) for p in points) for seeds in runs.values() for points in seeds.values())
    return t, _select(runs, lambda p: clock(p) <= t, f"{t:.0f} training s")


def time_to_target(points: list[Point], target: float) -> Point | None:
    """The first point (by step) whose greedy success is ``>= target``; ``None``: not reached."""
    return next((p for p in points if p.success >= target - 1e-12), None)


def at_mark(runs: Runs, mark: float) -> dict[str, dict[int, Point]]:
    """Each run's point standing for the training-second mark ``mark`` (module docstring).

    Raises:
        ValueError: a run without one (named: not yet evaluated, or the arm does not have the mark).
    """
    out: dict[str, dict[int, Point]] = {}
    for arm, seeds in runs.items():
        for seed, points in seeds.items():
            chosen = [p for p in points if p.at_seconds and mark in p.at_seconds]
            if not chosen:
                raise ValueError(f"{arm} seed {seed} has no checkpoint evaluated for the {mark:g} s mark")
            out.setdefault(arm, {})[seed] = chosen[-1]
    return out


def final(runs: Runs) -> dict[str, dict[int, Point]]:
    """Each run's last point."""
    return {arm: {seed: points[-1] for seed, points in seeds.items()} for arm, seeds in runs.items()}


def best(runs: Runs) -> dict[str, dict[int, Point]]:
    """Each run's trained point (the start left out, unless it is the only one) with the highest greedy
    success, the earliest on ties (optimistic: chosen on the games it is scored on)."""
    return {arm: {seed: max([p for p in points if not p.start] or points, key=lambda p: (p.success, -p.step))
                  for seed, points in seeds.items()} for arm, seeds in runs.items()}


def per_turn_kl(points: Sequence[Point]) -> dict:
    """Token-weighted per-turn KL by outcome over ``points`` (their ``own_kl``): ``{"won"|"failed":
    {"per_turn": [nats/token or NaN], "tokens_per_turn": [...], "episodes": n, "mean": nats/token},
    "measured": runs}``, ``runs`` the number of points that measured it (an evaluation run with
    ``--no-own-traj-kl`` or without ``--teacher`` has ``own_kl`` ``None`` and is not counted)."""
    out: dict = {"measured": sum(p.own_kl is not None for p in points)}
    for outcome in ("won", "failed"):
        sums: list[float] = []
        tokens: list[int] = []
        episodes = 0
        for p in points:
            part = (p.own_kl or {}).get(outcome)
            if not part:
                continue
            episodes += int(part.get("episodes", 0))
            for n, (kl, tok) in enumerate(zip(part["per_turn"], part["tokens_per_turn"])):
                while len(sums) <= n:
                    sums.append(0.0)
                    tokens.append(0)
                if tok:
                    sums[n] += float(kl) * tok
                    tokens[n] += int(tok)
        total = sum(tokens)
        out[outcome] = {"per_turn": [s / c if c else math.nan for s, c in zip(sums, tokens)],
                        "tokens_per_turn": tokens, "episodes": episodes,
                        "mean": sum(sums) / total if total else math.nan}
    return out


# --------------------------------------------------------------------------------------------- comparison
def merged_table(chosen: dict[int, Point], attr: str) -> dict[Key, float] | None:
    """One table ``{(task_id, seed): value}`` of the chosen points' ``attr`` (``greedy``, ``sampled``, ``teacher``),
    every seed's episodes together; ``None`` when a point lacks it."""
    merged: dict[Key, float] = {}
    for p in chosen.values():
        t = getattr(p, attr)
        if t is None:
            return None
        merged.update(t)
    return merged


def compare_selection(selection: dict[str, dict[int, Point]], table: str = "greedy", **kwargs) -> Comparison | None:
    """Paired bootstrap of the selected points, each arm's seeds merged and each seed counted as a training run
    (``table``: ``greedy`` or ``sampled``); ``None`` when an arm lacks the table."""
    tables = {arm: merged_table(chosen, table) for arm, chosen in selection.items()}
    if any(t is None for t in tables.values()):
        return None
    return paired_bootstrap(tables, metric="success" if table == "greedy" else "Avg@k", runs="seed", **kwargs)


def compare_with_teacher(selection: dict[str, dict[int, Point]], table: str = "greedy",
                         **kwargs) -> dict[str, Comparison] | None:
    """Each arm minus the teacher's greedy success on the same (task, seed) keys; ``None`` without the
    teacher's episodes."""
    out = {}
    for arm, chosen in selection.items():
        teacher, student = merged_table(chosen, "teacher"), merged_table(chosen, table)
        if teacher is None or student is None:
            return None
        out[arm] = paired_bootstrap({"teacher": teacher, arm: student}, metric="success", runs="seed", **kwargs)
    return out


def check_contrasts(contrasts: Sequence, arms: Sequence[str]) -> None:
    """Each contrast must be a pair ``[a, b]`` of two different names in ``arms``.

    Raises:
        ValueError: the first bad contrast, named with the arms it may use.
    """
    for pair in contrasts:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or pair[0] == pair[1] or \
                any(a not in arms for a in pair):
            raise ValueError(f"contrast {pair!r}: give two different arm names of {list(arms)}")
