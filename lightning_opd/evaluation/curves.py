"""Summary of an experiment over every evaluated checkpoint: learning curves against rollout iterations and
training seconds, the Same-Step and Least-Time comparisons, time to a target success, final and best.

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
* Comparisons: :func:`~.compare.paired_bootstrap` of the selected points, tasks x seeds paired by
  (task, seed), differences to the first arm. Each seed is a training run (one evaluation per run, its episodes
  keyed by its seed: ``runs="seed"``). With two or more seeds the CI is the two-level one (runs, then tasks;
  ../shared/docs/algorithms.md §7.3) and a difference is called better/worse only when both it and the t-interval
  over the per-run differences exclude 0 (:func:`~.compare.run_verdict`: the two-level bootstrap undercovers with
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import yaml

from lightning_opd.evaluation.compare import Comparison, Key, paired_bootstrap
from lightning_opd.files import json_safe

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
def _merged(chosen: dict[int, Point], attr: str) -> dict[Key, float] | None:
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
    tables = {arm: _merged(chosen, table) for arm, chosen in selection.items()}
    if any(t is None for t in tables.values()):
        return None
    return paired_bootstrap(tables, metric="success" if table == "greedy" else "Avg@k", runs="seed", **kwargs)


def compare_with_teacher(selection: dict[str, dict[int, Point]], table: str = "greedy",
                         **kwargs) -> dict[str, Comparison] | None:
    """Each arm minus the teacher's greedy success on the same (task, seed) keys; ``None`` without the
    teacher's episodes."""
    out = {}
    for arm, chosen in selection.items():
        teacher, student = _merged(chosen, "teacher"), _merged(chosen, table)
        if teacher is None or student is None:
            return None
        out[arm] = paired_bootstrap({"teacher": teacher, arm: student}, metric="success", runs="seed", **kwargs)
    return out


def _ci(value: float, ci: tuple[float, float], signed: bool = False) -> str:
    f = "{:+.2f}" if signed else "{:.2f}"
    return f"{f.format(value)} [{f.format(ci[0])}, {f.format(ci[1])}]"


def _n(cmp: Comparison) -> str:
    """``"3 runs x 50 tasks"`` with two or more training runs, else the paired episodes."""
    return f"{len(cmp.runs)} runs x {cmp.arms[0].tasks} tasks" if cmp.run_level else str(cmp.arms[0].episodes)


def _per_run_note(cmp: Comparison | None, what: str) -> str:
    """With two or more training runs: a line and ``cmp``'s differences table (each seed's difference, the t-interval
    over runs and the one-level interval, "tasks only, runs fixed"); ``""`` otherwise."""
    if cmp is None or not cmp.run_level or not cmp.differences:
        return ""
    return (f"\n\n{what} minus the first arm per training run (the CI above is the two-level one, runs then tasks; "
            f"../shared/docs/algorithms.md §7.3):\n\n" + cmp.differences_markdown())


def selection_table(selection: dict[str, dict[int, Point]], **kwargs) -> tuple[str, dict]:
    """Markdown table of a selection (one point per run): iterations and seconds per seed, rollouts generated /
    used (episodes, summed over seeds; "-" when a point has no counts), greedy success and Avg@k with CIs and
    each arm's difference to the first arm; and its JSON form. Avg@k compares only the arms whose points all have
    sampled episodes (e.g. an experiment that samples the main arms' finals only): its reference is the first
    of those, and the other arms read "-"."""
    greedy = compare_selection(selection, "greedy", **kwargs)
    # Avg@k over the arms that have sampled episodes (an experiment may sample only some arms' finals)
    with_sampled = {arm: chosen for arm, chosen in selection.items() if _merged(chosen, "sampled") is not None}
    sampled = compare_selection(with_sampled, "sampled", **kwargs) if with_sampled else None
    sampled_index = {arm: i for i, arm in enumerate(with_sampled)}
    lines = ["| arm | iteration per seed | training s per seed | rollouts generated / used | greedy success [95% CI] "
             "| - first arm [95% CI] | Avg@k [95% CI] | - first arm [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for i, (arm, chosen) in enumerate(selection.items()):
        its = ", ".join(str(p.iteration) for p in chosen.values())
        secs = ", ".join("-" if p.seconds is None else f"{p.seconds:.0f}" for p in chosen.values())
        counts = [p.rollouts for p in chosen.values()]
        rollouts = ("-" if any(c is None for c in counts) else
                    f"{sum(c['generated'] for c in counts)} / {sum(c['used'] for c in counts)}")
        cells = [rollouts]
        for cmp, j in ((greedy, i), (sampled, sampled_index.get(arm))):
            if cmp is None or j is None:
                cells += ["-", "-"]
                continue
            a = cmp.arms[j]
            cells.append(_ci(a.rate, a.ci) + f" (n = {_n(cmp)})")
            if j == 0:
                cells.append("reference")
                continue
            d = cmp.differences[j - 1]
            t = "" if d.t_ci is None else f", t-interval {_span(d.t_ci)}"  # with runs: the verdict needs both
            cells.append(f"{_ci(d.difference, d.ci, True)}{t} {d.verdict}")
        lines.append(f"| {arm} | {its} | {secs} | " + " | ".join(cells) + " |")
    data = {"points": {arm: {str(s): {"step": p.step, "iteration": p.iteration, "seconds": p.seconds, "path": p.path,
                                      "rollouts": p.rollouts}
                             for s, p in chosen.items()} for arm, chosen in selection.items()},
            "greedy": None if greedy is None else greedy.to_dict(),
            "sampled": None if sampled is None else sampled.to_dict()}
    return "\n".join(lines) + _per_run_note(greedy, "Greedy success") + _per_run_note(sampled, "Avg@k"), data


def teacher_table(selection: dict[str, dict[int, Point]], **kwargs) -> tuple[str, dict] | None:
    """Markdown rows ``arm - teacher`` (greedy success) for a selection; ``None`` without teacher episodes."""
    cmps = compare_with_teacher(selection, **kwargs)
    if cmps is None:
        return None
    runs = any(c.run_level for c in cmps.values())
    lines = (["| arm | teacher greedy success | arm - teacher [95% CI] | verdict |", "|---|---|---|---|"] if not runs else
             ["| arm | teacher greedy success | arm - teacher [95% CI: runs, then tasks] | 95% t-interval over runs | "
              "95% CI tasks only, runs fixed | per run | verdict |", "|---|---|---|---|---|---|---|"])
    for arm, c in cmps.items():
        d = c.differences[0]
        extra = (f" {_span(d.t_ci)} | {_span(d.task_ci)} | {_seeds(d.per_run)} |" if runs else "")
        lines.append(f"| {arm} | {c.arms[0].rate:.2f} | {_ci(d.difference, d.ci, True)} |{extra} {d.verdict} |")
    return "\n".join(lines), {arm: c.to_dict() for arm, c in cmps.items()}


def _span(ci: tuple[float, float] | None) -> str:
    return "-" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _seeds(per_run: dict) -> str:
    return ", ".join(f"{v:+.2f} (seed {sd})" for sd, v in per_run.items())


def check_contrasts(contrasts: Sequence, arms: Sequence[str]) -> None:
    """Each contrast must be a pair ``[a, b]`` of two different names in ``arms``.

    Raises:
        ValueError: the first bad contrast, named with the arms it may use.
    """
    for pair in contrasts:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or pair[0] == pair[1] or \
                any(a not in arms for a in pair):
            raise ValueError(f"contrast {pair!r}: give two different arm names of {list(arms)}")


def contrast_table(selection: dict[str, dict[int, Point]], contrasts: Sequence[Sequence[str]],
                   **kwargs) -> tuple[str, dict]:
    """Markdown rows ``a - b`` (greedy success, paired by (task, seed), 95% CI, its half-width, the verdict and
    each seed's own difference, which shows what the CI over tasks does not: whether the training runs agree)
    for each named pair of arms in ``selection``; and the JSON form ``{"a - b": Difference dict + half_width +
    per_seed}``.

    Raises:
        ValueError: a pair that is not two different arms of ``selection`` (named).
    """
    check_contrasts(contrasts, list(selection))
    cmps = [compare_selection({b: selection[b], a: selection[a]}, "greedy", **kwargs) for a, b in contrasts]
    runs = any(c.run_level for c in cmps)
    lines = (["| contrast | difference [95% CI] | CI half-width | paired episodes (tasks) | verdict | per seed |",
              "|---|---|---|---|---|---|"] if not runs else
             ["| contrast | difference [95% CI: runs, then tasks] | CI half-width | 95% t-interval over runs | 95% CI "
              "tasks only, runs fixed | paired episodes (tasks) | verdict | per seed |", "|---|---|---|---|---|---|---|---|"])
    data = {}
    for (a, b), cmp in zip(contrasts, cmps):
        d = cmp.differences[0]
        half = (d.ci[1] - d.ci[0]) / 2
        per_seed = {}
        for sd in sorted(set(selection[a]) & set(selection[b])):
            ga, gb = selection[a][sd].greedy, selection[b][sd].greedy
            keys = ga.keys() & gb.keys()
            per_seed[sd] = sum(ga[k] - gb[k] for k in keys) / len(keys) if keys else math.nan
        extra = f" {_span(d.t_ci)} | {_span(d.task_ci)} |" if runs else ""
        lines.append(f"| {a} - {b} | {_ci(d.difference, d.ci, True)} | {half:.2f} |{extra} {d.episodes} ({d.tasks}) | "
                     f"{d.verdict} | {_seeds(per_seed)} |")
        data[f"{a} - {b}"] = {**cmp.to_dict()["differences"][0], "half_width": half,
                              "per_seed": {str(sd): v for sd, v in per_seed.items()}}
    return "\n".join(lines), data


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


@dataclass
class Summary:
    """:func:`summarise` result: ``markdown`` (goes into the README as is) and ``data`` (JSON-ready)."""

    markdown: str
    data: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """``data`` as JSON text, non-finite floats (a turn without tokens) written as ``null``."""
        return json.dumps(json_safe(self.data), indent=1)


def summarise(runs: Runs, *, name: str = "experiment", budget: float | None = None,
              targets: Sequence[float] = (), contrasts: Sequence[Sequence[str]] = (), marks: Sequence[float] = (),
              resamples: int = 10_000, seed: int = 0) -> Summary:
    """The experiment's summary (module docstring) over the seeds every arm has evaluated.

    Args:
        runs: :func:`load_runs` output (arm order = display order; the first arm is the reference).
        name: title.
        budget: the experiment's training time budget (seconds) or ``None``.
        targets: greedy success rates for the time-to-target table.
        contrasts: pairs of arm names ``(a, b)``: ``a - b`` at the final checkpoints (:func:`contrast_table`) and
            at each mark.
        marks: training-second marks (seconds): a section per mark comparing the arms there (:func:`at_mark`;
            "not available" while a run has no evaluation for it).
        resamples, seed: of the bootstrap.

    Raises:
        ValueError: no run, no seed that every arm has evaluated, or a contrast that names an unknown arm.
    """
    if not runs:
        raise ValueError("no evaluated checkpoint found: nothing to summarise")
    common = sorted(set.intersection(*(set(seeds) for seeds in runs.values())))
    if not common:
        raise ValueError(f"no seed is evaluated in every arm ({ {a: sorted(s) for a, s in runs.items()} })")
    left_out = sorted({(a, s) for a, seeds in runs.items() for s in seeds if s not in common})
    runs = {arm: {s: seeds[s] for s in common} for arm, seeds in runs.items()}
    kw = {"resamples": resamples, "seed": seed}
    md = [f"## {name}: held-out success over training", "",
          f"Seeds {common}; success = greedy success and Avg@k = mean success of the sampled episodes, both means "
          "over tasks x seeds; iteration = rollout batches; training s = the fit's training seconds (rollouts and "
          "updates, evaluation excluded)" + (f", budget {budget:.0f} s per run." if budget else ".")]
    if left_out:
        md.append(f"Left out (not evaluated in every arm): {', '.join(f'{a} seed {s}' for a, s in left_out)}.")
    data: dict = {"name": name, "seeds": common, "budget": budget, "curves": {}}

    md += ["", "| arm | iteration | training s (mean over seeds) | seeds | greedy success | Avg@k |",
           "|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        by_it: dict[int, list[Point]] = {}
        for points in seeds.values():
            for p in points:
                by_it.setdefault(p.iteration, []).append(p)
        curve = []
        for it in sorted(by_it):
            ps = by_it[it]
            secs = [p.seconds for p in ps if p.seconds is not None]
            sec = sum(secs) / len(secs) if secs else None
            g = sum(sum(p.greedy.values()) for p in ps) / sum(len(p.greedy) for p in ps)
            k = (None if any(p.sampled is None for p in ps)
                 else sum(sum(p.sampled.values()) for p in ps) / sum(len(p.sampled) for p in ps))
            curve.append({"iteration": it, "seconds": sec, "seeds": len(ps), "success": g, "avg_at_k": k})
            md.append(f"| {arm} | {it} | {_fmt(sec, 0)} | {len(ps)} | {g:.2f} | {_fmt(k)} |")
        data["curves"][arm] = curve

    md += ["", "Steps done per run (iterations; training s of the last checkpoint):", "",
           "| arm | " + " | ".join(f"seed {s}" for s in common) + " |", "|---|" + "---|" * len(common)]
    for arm, seeds in runs.items():
        md.append(f"| {arm} | " + " | ".join(f"{seeds[s][-1].iteration} ({_fmt(seeds[s][-1].seconds, 0)} s)"
                                            for s in common) + " |")

    try:
        s, chosen, exact = same_step(runs)
    except ValueError as err:
        md += ["", f"### Same-Step: not available ({err})"]
    else:
        text, data["same_step"] = selection_table(chosen, **kw)
        data["same_step"]["iteration"], data["same_step"]["exact"] = s, exact
        how = ("the largest at which every run has an evaluated checkpoint" if exact else
               "no iteration has a checkpoint in every run: the smallest last iteration, each run's latest checkpoint "
               "at or before it")
        md += ["", f"### Same-Step: iteration {s} ({how})", "", text]
    try:
        t, chosen = least_time(runs, budget)
    except ValueError as err:
        md += ["", f"### Least-Time: not available ({err})"]
    else:
        text, data["least_time"] = selection_table(chosen, **kw)
        data["least_time"]["seconds"] = t
        how = (f"; seconds read as min(seconds, budget {budget:.0f} s): a run that used its budget is compared at "
               "its final checkpoint") if budget else ""
        md += ["", f"### Least-Time: {t:.0f} training s (the largest every run reached; each run's checkpoint at or "
                   f"before it{how})", "", text]

    if marks:
        data["at_seconds"] = {}
    for m in marks:
        try:
            chosen = at_mark(runs, m)
        except ValueError as err:
            md += ["", f"### At {m:g} training s: not available ({err})"]
            continue
        text, d = selection_table(chosen, **kw)
        late = [f"{arm} seed {sd} ({_fmt(p.seconds, 0)} s)" for arm, ps in chosen.items() for sd, p in ps.items()
                if not p.at_seconds[m]]
        d["not_reached"] = late
        md += ["", f"### At {m:g} training s (each run's checkpoint at the first optimizer step whose training seconds "
                   f"reached {m:g} s; its true iteration and seconds shown)", "", text]
        if late:
            md += ["", f"Not reached (the fit ended at max_steps first; its final checkpoint stands for {m:g} s): "
                       + ", ".join(late) + "."]
        if contrasts:
            text, d["contrasts"] = contrast_table(chosen, contrasts, **kw)
            md += ["", f"At {m:g} training s, named contrasts (paired on the same (task, seed) episodes):", "", text]
        data["at_seconds"][f"{m:g}"] = d

    if targets:
        md += ["", "### Time to target (first checkpoint whose greedy success >= target; the target was crossed between "
                   "the previous checkpoint and it)", "",
               "| arm | target | " + " | ".join(f"seed {s}" for s in common) + " |", "|---|---|" + "---|" * len(common)]
        data["time_to_target"] = {}
        for arm, seeds in runs.items():
            for x in targets:
                cells, rec = [], {}
                for sd in common:
                    p = time_to_target(seeds[sd], x)
                    if p is None:
                        top = max(q.success for q in seeds[sd])
                        cells.append(f"not reached (best {top:.2f})")
                        rec[str(sd)] = None
                    else:  # the crossing lies between the previous checkpoint (below target) and this one
                        before = [q for q in seeds[sd] if q.step < p.step]
                        prev = before[-1].seconds if before else None
                        cells.append("0 s (at the start)" if p.start else
                                     f"{_fmt(p.seconds, 0)} s (iteration {p.iteration}; "
                                     + ("first checkpoint)" if not before else f"below at {_fmt(prev, 0)} s)"))
                        rec[str(sd)] = {"seconds": p.seconds, "iteration": p.iteration, "success": p.success,
                                        "previous_seconds": prev, "start": p.start}
                md.append(f"| {arm} | {x:.2f} | " + " | ".join(cells) + " |")
                data["time_to_target"].setdefault(arm, {})[f"{x:g}"] = rec

    for label, chosen, note in (
            ("Final checkpoint", final(runs), "each run's last checkpoint"),
            ("Best checkpoint", best(runs), "each run's checkpoint with the highest greedy success; selected on the "
                                            "same held-out games it is scored on, so it is optimistic")):
        text, d = selection_table(chosen, **kw)
        key = label.split()[0].lower()
        data[key] = d
        md += ["", f"### {label} ({note})", "", text]
        vs = teacher_table(chosen, **kw)
        if vs is not None:
            md += ["", f"{label} against the teacher's own greedy episodes (same tasks, paired):", "", vs[0]]
            data[key]["teacher"] = vs[1]
        if key == "final" and contrasts:
            text, data["final"]["contrasts"] = contrast_table(chosen, contrasts, **kw)
            md += ["", "Final checkpoint, named contrasts (paired on the same (task, seed) episodes):", "", text]

    finals = final(runs)
    kl = {arm: per_turn_kl(list(chosen.values())) for arm, chosen in finals.items()}
    outcomes = ("won", "failed")
    if any(k[o]["episodes"] for k in kl.values() for o in outcomes):
        width = max(len(k[o]["per_turn"]) for k in kl.values() for o in outcomes)
        md += ["", "### Teacher KL per turn on the student's own greedy episodes, by outcome (final checkpoints, "
                   "nats/token, token-weighted over the seeds that measured it)", "",
               "| arm | seeds measured | outcome | episodes | mean | "
               + " | ".join(f"turn {n}" for n in range(width)) + " |",
               "|---|---|---|---|---|" + "---|" * width]
        for arm, k in kl.items():
            seeds = f"{k['measured']} of {len(finals[arm])}"
            if not k["measured"]:
                md.append(f"| {arm} | {seeds} | not measured (evaluated without the own-trajectory KL) | - | - | "
                          + " | ".join("-" for _ in range(width)) + " |")
                continue
            for outcome in outcomes:
                pt = k[outcome]["per_turn"] + [math.nan] * (width - len(k[outcome]["per_turn"]))
                md.append(f"| {arm} | {seeds} | {outcome} | {k[outcome]['episodes']} | "
                          f"{_fmt(k[outcome]['mean'], 3)} | " + " | ".join(_fmt(v, 3) for v in pt) + " |")
        data["own_traj_kl"] = kl
    md += ["", "A difference is called better/worse only when its 95% CI excludes 0; otherwise no difference was "
               "detected at that n. With two or more seeds the CI is the paired two-level bootstrap over training runs, "
               "then tasks (the same drawn tasks in every drawn run; ../shared/docs/algorithms.md §7.3), n = runs x "
               "tasks, and a verdict needs the 95% t-interval over the per-run differences to exclude 0 as well (the "
               "two-level bootstrap undercovers with 2-3 runs); the one-level CI over tasks with the runs held fixed "
               "(it understates the uncertainty) is beside them; with one seed the CI is over tasks (all seeds of a "
               "drawn task)."]
    return Summary("\n".join(md), data)
