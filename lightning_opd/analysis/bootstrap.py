"""Paired bootstrap comparison of several evaluated policies ("arms") on the same episodes.

Each arm is a table of per-episode outcomes keyed by ``(task_id, seed)``: the value is a success (0/1)
or any per-episode number (turns, invalid actions, reward, the teacher-trajectory KL of a task). Arms
are paired on their keys, so the comparison of two arms is the mean of per-episode *differences* on
the same tasks and seeds, which removes the variance between tasks (most of it: an easy game is easy
for every arm).

Statistics (what the tests pin by hand):

* point estimates: the mean over the paired episodes (``rate``), and the mean of the per-episode
  differences ``value(arm) - value(reference)`` (``difference``; the reference is the first arm);
* confidence intervals: percentile bootstrap, ``resamples`` (default 10,000) resamples drawn from
  ``numpy.random.default_rng(seed)`` as ``rng.integers(0, C, size=(resamples, C))``, where ``C`` is the
  number of clusters. **Clusters are tasks** by default (``cluster="task"``): a resample draws ``C``
  tasks with replacement and takes *all* seeds of each drawn task, because episodes of one task are
  correlated (the same game is hard for every seed), and resampling episodes independently would give
  intervals that are too narrow. ``cluster="episode"`` resamples the paired episodes independently (for
  a table with one episode per task the two are the same). The statistic of a resample is the mean
  over the episodes it holds (``sum of values / number of episodes``), and every arm and difference
  uses the same resamples (paired). The interval is ``numpy.quantile`` (linear interpolation) of the
  resampled statistics at ``(1 - level) / 2`` and ``(1 + level) / 2``;
* intervals that count training runs (../shared/docs/algorithms.md §7.3; ``runs="seed"``): when the paired keys
  hold ``R >= 2`` seeds and each seed is one training run (the layout of the experiment runner and
  benchmarks/demo_seeds.py: one ``evaluate`` file per training seed, its episodes keyed by that seed), the run, not
  the task, is the unit that varies most. Then every arm and difference also gets its value per run (``per_run``:
  the mean over that run's paired tasks) and two run-level intervals:

  - a **two-level** percentile bootstrap: a resample draws ``R`` runs with replacement, then ``T`` tasks with
    replacement within the drawn runs, the same tasks in each drawn run (every run played the same held-out tasks,
    and a task hard for one run is hard for the others: drawing tasks anew in each run would treat those as
    independent and can give an interval narrower than the one-level one), and every arm takes the same drawn
    (task, seed) episodes (paired). Its statistic is the mean over the drawn episodes, episode ``(t, r)`` counted
    (times ``t`` drawn) x (times ``r`` drawn) (Owen's "pigeonhole" bootstrap for a runs x tasks table). Draws:
    ``rng = numpy.random.default_rng(seed)``, ``rng.integers(0, R, size=(B, R))``, then
    ``rng.integers(0, T, size=(B, T))`` (runs and tasks in sorted order);
  - the **t-interval** over the per-run values, ``mean ± t_{(1+level)/2, R-1} · s / sqrt(R)`` (``s`` their standard
    deviation, ddof 1; ``scipy.stats``), for every difference (``t_ci``) and every arm's rate.

  ``ci`` is then the two-level interval, and the one-level interval above stays as ``task_ci``, labelled "tasks
  only, runs fixed": it leaves out the variance between runs and understates the uncertainty. With one seed, or
  ``runs="none"`` (the default of :func:`paired_bootstrap`: the seeds are episode seeds of one trained student per
  arm), ``ci`` is the one-level interval and there is no t-interval;
* verdict of a difference: ``"better"`` or ``"worse"`` (direction from ``higher_is_better``) only when its
  intervals exclude 0 on the same side, otherwise ``"no difference detected at n = N"`` (``N`` the paired
  episodes, or ``"R runs x T tasks"``). With one run that is ``ci`` (the one-level interval). With ``R >= 2`` runs it
  is **both** the two-level interval **and** the t-interval over the per-run differences (:func:`run_verdict`).
  Why both: with ``R`` = 2-3 runs the two-level bootstrap undercovers. Resampling ``R`` runs with replacement
  estimates the run variance by its plug-in value, ``(R - 1) / R`` of the unbiased one (1/2 at ``R = 2``), and its
  percentiles cannot reach beyond the most extreme per-run values (at ``R = 2`` a resample holds run 0 twice, run 1
  twice or both). A reviewer's simulation, with run-to-run variance dominating, gave a true coverage of 0.81 at
  ``R = 3`` and 0.69 at ``R = 2`` for the nominal 95% two-level interval, and 0.95 for the t-interval over the per-run
  differences (its ``t_{R-1}`` quantile accounts for estimating ``s`` from ``R`` runs). The t-interval alone treats
  the tasks as fixed: every run plays the same tasks, so which tasks were drawn moves every run alike and is not in
  ``s``; the two-level interval carries that variance. A difference is called only when neither says it could be 0.
  This is the rule for every claim in the README and docs/.


The arms are read from ``lightning-opd evaluate`` outputs by :mod:`lightning_opd.analysis.compare`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

Key = tuple[str, Hashable]  # (task_id, seed)

#: metrics for which a lower value is the better one (all others: higher is better)
LOWER_IS_BETTER = frozenset({"turns", "invalid_actions", "kl", "cut_replies", "env_error", "truncated"})


@dataclass
class ArmResult:
    """One arm's mean over the paired episodes.

    Attributes:
        label: the arm's name.
        rate: mean value over the paired episodes (success rate for 0/1 values).
        ci: ``(low, high)`` percentile bootstrap interval of ``rate``: two-level (runs, then tasks within them)
            with ``runs >= 2``, else over tasks.
        episodes: paired episodes the mean is over.
        tasks: distinct tasks among them.
        unpaired: keys of this arm left out because the reference arm lacks them (or, with
            ``intersect``, another arm does).
        task_ci: the one-level interval over tasks with the runs held fixed (equal to ``ci`` with one run).
        runs: training runs (seeds) the two-level interval resamples; 1 when it does not apply.
        per_run: seed -> the mean over that run's paired episodes (empty with one run).
        t_ci: the t-interval over the per-run means (``None`` with one run).
    """

    label: str
    rate: float
    ci: tuple[float, float]
    episodes: int
    tasks: int
    unpaired: int = 0
    task_ci: tuple[float, float] | None = None
    runs: int = 1
    per_run: dict[Hashable, float] = field(default_factory=dict)
    t_ci: tuple[float, float] | None = None


@dataclass
class Difference:
    """``arm - reference`` on the paired episodes.

    Attributes:
        label, reference: the two arms.
        difference: mean of the per-episode differences.
        ci: ``(low, high)`` percentile bootstrap interval of ``difference``, the one the verdict uses: two-level
            (runs, then tasks within them) with ``runs >= 2``, else over tasks.
        episodes, tasks: paired episodes and their distinct tasks.
        verdict: ``"better"``/``"worse"`` when ``ci`` excludes 0 and, with ``runs >= 2``, ``t_ci`` too (on the
            same side; :func:`run_verdict`), else ``"no difference detected at n = N"`` (``N``: ``"R runs x T tasks"``
            with ``runs >= 2``).
        task_ci: the one-level interval over tasks with the runs held fixed (equal to ``ci`` with one run).
        t_ci: the t-interval over the per-run differences (``None`` with one run).
        runs: training runs (seeds); 1 when the run-level intervals do not apply.
        per_run: seed -> that run's paired difference (the mean over its tasks; empty with one run).
    """

    label: str
    reference: str
    difference: float
    ci: tuple[float, float]
    episodes: int
    tasks: int
    verdict: str
    task_ci: tuple[float, float] | None = None
    t_ci: tuple[float, float] | None = None
    runs: int = 1
    per_run: dict[Hashable, float] = field(default_factory=dict)


@dataclass
class Comparison:
    """Result of :func:`paired_bootstrap`; :meth:`to_markdown` prints it, :meth:`to_dict` serialises it."""

    arms: list[ArmResult]
    differences: list[Difference]
    metric: str = "value"
    higher_is_better: bool = True
    level: float = 0.95
    resamples: int = 10_000
    seed: int = 0
    cluster: str = "task"
    notes: list[str] = field(default_factory=list)
    runs: list = field(default_factory=list)

    @property
    def run_level(self) -> bool:
        """Whether the intervals count training runs (two or more seeds; module docstring)."""
        return len(self.runs) >= 2

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self, digits: int = 2) -> str:
        """The header line, then two markdown tables: each arm's mean with its interval, then each difference to the
        first arm (with two or more training runs also the t-interval, the one-level interval labelled "tasks only,
        runs fixed" and each run's value)."""
        lines = [self.header(), "", self.arms_markdown(digits)]
        if self.differences:
            lines += ["", self.differences_markdown(digits)]
        for note in self.notes:
            lines += ["", note]
        return "\n".join(lines)

    def header(self) -> str:
        """One line: what the means and intervals are."""
        pct = f"{self.level * 100:g}%"
        lower = "" if self.higher_is_better else " (lower is better)"
        if not self.run_level:
            what = "tasks (all seeds of a drawn task)" if self.cluster == "task" else "episodes"
            return (f"{self.metric}: mean over paired (task, seed) episodes; {pct} percentile bootstrap CI, "
                    f"{self.resamples} resamples of {what}, generator seed {self.seed}{lower}")
        return (f"{self.metric}: mean over paired (task, seed) episodes, {self.size} (training seeds "
                f"{', '.join(map(str, self.runs))}); {pct} percentile bootstrap CI over runs, then tasks (the same "
                f"drawn tasks in every drawn run; two-level, ../shared/docs/algorithms.md §7.3), {self.resamples} "
                f"resamples, generator seed {self.seed}; beside it the {pct} t-interval over the per-run values and "
                f"the one-level CI over tasks with the runs held fixed (it understates the uncertainty); a difference "
                f"is called better/worse only when both the two-level CI and the t-interval exclude 0{lower}")

    @property
    def size(self) -> str:
        """``"R runs x T tasks"`` (two or more runs) or ``"N episodes"``."""
        return (f"{len(self.runs)} runs x {self.arms[0].tasks} tasks" if self.run_level
                else f"{self.arms[0].episodes} episodes")

    def arms_markdown(self, digits: int = 2) -> str:
        """Each arm's mean and interval (with runs: also the t-interval over runs, the one-level interval and the mean
        per run)."""
        pct, fmt = f"{self.level * 100:g}%", f"{{:.{digits}f}}"
        if not self.run_level:
            rows = [f"| arm | {self.metric} | {pct} CI | episodes (tasks) |", "|---|---|---|---|"]
            return "\n".join(rows + [f"| {a.label} | {fmt.format(a.rate)} | {_span(a.ci, fmt)} | {a.episodes} "
                                     f"({a.tasks}) |" for a in self.arms])
        rows = [f"| arm | {self.metric} | {pct} CI (runs, then tasks) | {pct} t-interval over runs | {pct} CI tasks "
                "only, runs fixed | per run | episodes (tasks) |", "|---|---|---|---|---|---|---|"]
        return "\n".join(rows + [f"| {a.label} | {fmt.format(a.rate)} | {_span(a.ci, fmt)} | {_span(a.t_ci, fmt)} | "
                                 f"{_span(a.task_ci, fmt)} | {_per_run(a.per_run, fmt)} | {a.episodes} ({a.tasks}) |"
                                 for a in self.arms])

    def differences_markdown(self, digits: int = 2) -> str:
        """Each difference to the first arm with its interval and verdict (with runs: also the t-interval over runs,
        the one-level interval labelled "tasks only, runs fixed" and each run's difference); ``""`` without one."""
        if not self.differences:
            return ""
        pct, signed, ref = f"{self.level * 100:g}%", f"{{:+.{digits}f}}", self.differences[0].reference
        if not self.run_level:
            rows = [f"| arm - {ref} | difference | {pct} CI | paired episodes (tasks) | verdict |", "|---|---|---|---|---|"]
            return "\n".join(rows + [f"| {d.label} | {signed.format(d.difference)} | {_span(d.ci, signed)} | "
                                     f"{d.episodes} ({d.tasks}) | {d.verdict} |" for d in self.differences])
        rows = [f"| arm - {ref} | difference | {pct} CI (runs, then tasks) | {pct} t-interval over runs | "
                f"{pct} CI tasks only, runs fixed | per run | paired episodes (tasks) | verdict |",
                "|---|---|---|---|---|---|---|---|"]
        return "\n".join(rows + [f"| {d.label} | {signed.format(d.difference)} | {_span(d.ci, signed)} | "
                                 f"{_span(d.t_ci, signed)} | {_span(d.task_ci, signed)} | {_per_run(d.per_run, signed)} | "
                                 f"{d.episodes} ({d.tasks}) | {d.verdict} |" for d in self.differences])


def _span(ci: tuple[float, float], fmt: str) -> str:
    return f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def _per_run(values: Mapping[Hashable, float], fmt: str) -> str:
    """``"+0.12 (seed 0), -0.02 (seed 1)"``: a value per training run."""
    return ", ".join(f"{fmt.format(v)} (seed {r})" for r, v in values.items())


def verdict(ci: tuple[float, float], n: int | str, higher_is_better: bool = True) -> str:
    """``"better"``/``"worse"`` when ``ci`` excludes 0 (``low > 0``: the arm's value is higher), else
    ``"no difference detected at n = {n}"`` (``n``: the paired episodes, or ``"R runs x T tasks"``)."""
    low, high = ci
    if low > 0 or high < 0:
        return "better" if (low > 0) == higher_is_better else "worse"
    return f"no difference detected at n = {n}"


def run_verdict(ci: tuple[float, float], t_ci: tuple[float, float], n: int | str, higher_is_better: bool = True) -> str:
    """The verdict with two or more training runs (module docstring): ``"better"``/``"worse"`` only when the two-level
    interval ``ci`` and the t-interval over the per-run differences ``t_ci`` both exclude 0 on the same side, else
    ``"no difference detected at n = {n}"``. The two-level bootstrap undercovers with 2-3 runs; the t-interval leaves
    out the variance of the shared task draw: either one alone can call a difference that is not there."""
    one, other = verdict(ci, n, higher_is_better), verdict(t_ci, n, higher_is_better)
    return one if one == other else f"no difference detected at n = {n}"


def key_order(key: Key) -> tuple:
    """Sort key of a ``(task_id, seed)`` episode key: by task name, then numeric seeds in order before other seeds."""
    task, seed = key
    return (str(task), (0, seed, "") if isinstance(seed, (int, float)) else (1, 0, str(seed)))


def _paired_keys(tables: Mapping[str, Mapping[Key, float]], intersect: bool) -> list[Key]:
    labels = list(tables)
    first = labels[0]
    if intersect:
        keys = set(tables[first])
        for label in labels[1:]:
            keys &= set(tables[label])
    else:
        keys = set(tables[first])
        for label in labels[1:]:
            missing = keys - set(tables[label])
            if missing:
                shown = ", ".join(f"{t}/seed {s}" for t, s in sorted(missing, key=key_order)[:8])
                raise ValueError(
                    f"arm {label!r} lacks {len(missing)} of the {len(keys)} (task, seed) episodes of the first arm "
                    f"{first!r} (e.g. {shown}): evaluate every arm on the same tasks and seeds, or pass "
                    "--intersect (intersect=True) to compare on the shared episodes only")
    if not keys:
        raise ValueError(f"arms {labels} share no (task, seed) episode: nothing to compare")
    return sorted(keys, key=key_order)


def task_resample_counts(rng: np.random.Generator, unit_cluster: np.ndarray, resamples: int) -> np.ndarray:
    """One-level resamples: ``C`` clusters drawn with replacement, each with all its episodes.

    Args:
        rng: the generator (draws ``rng.integers(0, C, size=(resamples, C))``).
        unit_cluster: ``(n,)`` cluster id of each paired episode, ids ``0 .. C-1``.
        resamples: ``B``.

    Returns:
        ``(B, n)`` times each episode is in each resample.
    """
    n_clusters = int(unit_cluster.max()) + 1
    draws = rng.integers(0, n_clusters, size=(resamples, n_clusters))  # (B, C) drawn cluster ids
    counts = np.zeros((resamples, n_clusters))  # (B, C) times each cluster was drawn
    np.add.at(counts, (np.arange(resamples)[:, None], draws), 1.0)
    return counts[:, unit_cluster]


def run_index(keys: Sequence[Key]) -> tuple[list, np.ndarray]:
    """The training runs of paired keys: each distinct seed is one run (module docstring).

    Returns:
        ``(runs, run_of_key)``: the seeds in sorted order (``R`` of them) and ``(n,)`` each key's run, ``0 .. R-1``.
    """
    runs = sorted({k[1] for k in keys}, key=lambda seed: key_order(("", seed)))
    index = {r: i for i, r in enumerate(runs)}
    return runs, np.array([index[k[1]] for k in keys], dtype=np.int64)


def two_level_resample_counts(rng: np.random.Generator, run_of_key: np.ndarray, task_of_key: np.ndarray,
                              resamples: int) -> np.ndarray:
    """Two-level resamples (../shared/docs/algorithms.md §7.3): ``R`` runs drawn with replacement, then ``T`` tasks
    drawn with replacement within the drawn runs, the same tasks in each (every run played the same held-out
    tasks: a task easy for one run is easy for the others, so the task draw is shared, paired by task; module
    docstring). A resample holds episode ``(t, r)`` (times ``t`` drawn) x (times ``r`` drawn) times.

    Args:
        rng: the generator; draws ``rng.integers(0, R, size=(resamples, R))``, then
            ``rng.integers(0, T, size=(resamples, T))``.
        run_of_key: ``(n,)`` each paired episode's run, ``0 .. R-1`` (:func:`run_index`).
        task_of_key: ``(n,)`` each paired episode's task, ``0 .. T-1`` (tasks sorted).
        resamples: ``B``.

    Returns:
        ``(B, n)`` times each episode is in each resample.
    """
    n_runs, n_tasks = int(run_of_key.max()) + 1, int(task_of_key.max()) + 1
    runs_b = rng.integers(0, n_runs, size=(resamples, n_runs))  # (B, R) drawn runs
    tasks_b = rng.integers(0, n_tasks, size=(resamples, n_tasks))  # (B, T) drawn tasks
    run_counts, task_counts = np.zeros((resamples, n_runs)), np.zeros((resamples, n_tasks))
    rows = np.arange(resamples)[:, None]
    np.add.at(run_counts, (rows, runs_b), 1.0)
    np.add.at(task_counts, (rows, tasks_b), 1.0)
    return run_counts[:, run_of_key] * task_counts[:, task_of_key]


def t_interval(per_run: np.ndarray, level: float) -> tuple[float, float]:
    """Student-t interval of the mean of per-run values (../shared/docs/algorithms.md §7.3).

    Args:
        per_run: ``(R,)`` one value per training run (e.g. its paired difference), ``R >= 2``.
        level: confidence level.

    Returns:
        ``mean ± t_{(1+level)/2, R-1} · s / sqrt(R)``, ``s`` the standard deviation with ddof 1 (units of the values).
    """
    from scipy import stats

    mean = float(np.mean(per_run))
    half = float(stats.t.ppf((1 + level) / 2, df=len(per_run) - 1) * stats.sem(per_run))
    return mean - half, mean + half


def _intervals(counts: np.ndarray, values: np.ndarray, q: list[float]) -> tuple[list, list]:
    """Percentile intervals of each arm's mean and of each arm's mean difference to the first.

    Args:
        counts: ``(B, n)`` times each paired episode is in each resample; a resample without episodes (a drawn run
            lacking every drawn task: unbalanced keys only) is left out.
        values: ``(A, n)`` the arms' values.
        q: the two quantiles, e.g. ``[0.025, 0.975]``.

    Returns:
        ``(A)`` and ``(A-1)`` lists of ``(low, high)`` (``numpy.quantile``, linear interpolation).
    """
    counts = counts[counts.sum(axis=1) > 0]
    episodes_b = counts.sum(axis=1)[:, None]  # (B, 1)
    means_b = counts @ values.T / episodes_b  # (B, A)
    diffs_b = counts @ (values[1:] - values[:1]).T / episodes_b  # (B, A-1)
    span = lambda x: tuple(float(v) for v in np.quantile(x, q))  # noqa: E731
    return [span(means_b[:, a]) for a in range(values.shape[0])], [span(diffs_b[:, a]) for a in range(diffs_b.shape[1])]


def _paired_values(tables: Mapping[str, Mapping[Key, float]], keys: list[Key]) -> np.ndarray:
    """``(A, n)`` the arms' values at the paired keys; raises ValueError naming a non-finite one."""
    values = np.empty((len(tables), len(keys)), dtype=np.float64)
    for a, label in enumerate(tables):
        for j, key in enumerate(keys):
            v = float(tables[label][key])
            if not math.isfinite(v):
                raise ValueError(f"arm {label!r}: value {v} at task {key[0]!r}, seed {key[1]!r} is not finite")
            values[a, j] = v
    return values


def _check_bootstrap_args(tables: Mapping, resamples: int, level: float, cluster: str, runs: str) -> None:
    """Raises ValueError (naming the value) for :func:`paired_bootstrap`'s bad arguments."""
    if not tables:
        raise ValueError("paired_bootstrap needs at least one arm")
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be >= 1")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1), e.g. 0.95")
    if cluster not in ("task", "episode"):
        raise ValueError(f"cluster={cluster!r}: use 'task' (resample tasks with all their seeds) or 'episode'")
    if runs not in ("seed", "none"):
        raise ValueError(f"runs={runs!r}: use 'seed' (each seed is a training run) or 'none' (episode seeds only)")


def paired_bootstrap(tables: Mapping[str, Mapping[Key, float]], *, resamples: int = 10_000, level: float = 0.95,
                     seed: int = 0, cluster: str = "task", intersect: bool = False, higher_is_better: bool = True,
                     metric: str = "value", runs: str = "none") -> Comparison:
    """Each arm's mean and every arm's difference to the first, with paired percentile bootstrap
    intervals (algorithm and conventions: module docstring).

    Args:
        tables: arm label -> ``{(task_id, seed): value}``, in display order; the first arm is the
            reference of the differences.
        resamples: bootstrap resamples ``B``.
        level: confidence level of the intervals (0.95: 2.5% and 97.5% percentiles).
        seed: seed of the ``numpy.random.default_rng`` that draws the resamples (fixed: the same
            tables always give the same intervals).
        cluster: ``"task"`` (resample tasks with all their seeds) or ``"episode"``: the one-level interval.
        intersect: pair on the keys every arm has (default: the first arm's keys, which every arm must have).
        higher_is_better: direction of the verdicts (False for turns, invalid actions, KL).
        metric: name of the value, for printing.
        runs: ``"none"`` (default): the seeds are episode seeds of one trained policy per arm (one-level interval
            only); ``"seed"``: each seed of the keys is a training run (one evaluation per training run, its episodes
            keyed by its seed: what the caller must know, e.g. from the files, :func:`runs_for_files`), and with two or
            more the intervals and the verdict count runs (two-level bootstrap and t-interval, the verdict needing
            both; ../shared/docs/algorithms.md §7.3).

    Returns:
        :class:`Comparison` (arms in the order given; one difference per arm after the first).

    Raises:
        ValueError: no arm, an arm lacking keys of the first arm (names them; see ``intersect``), no
            shared key, a non-finite value (names the arm and key), ``resamples < 1``, ``level`` outside
            (0, 1), an unknown ``cluster`` or ``runs``.
    """
    # long for its docstring (the arguments); the code is ~40 lines, in the order of the module docstring
    _check_bootstrap_args(tables, resamples, level, cluster, runs)
    labels = list(tables)
    keys = _paired_keys(tables, intersect)
    values = _paired_values(tables, keys)  # (A, n)
    tasks = sorted({k[0] for k in keys}, key=str)
    index = {t: i for i, t in enumerate(tasks)}
    task_of_key = np.array([index[k[0]] for k in keys])  # (n,)
    unit_cluster = task_of_key if cluster == "task" else np.arange(len(keys))
    q = [(1 - level) / 2, (1 + level) / 2]
    one = _intervals(task_resample_counts(np.random.default_rng(seed), unit_cluster, resamples), values, q)
    run_ids, run_of_key = run_index(keys) if runs == "seed" else ([], np.zeros(len(keys), dtype=np.int64))
    if len(run_ids) < 2:  # one run: the one-level interval decides
        run_ids, run_of_key = [], np.zeros(len(keys), dtype=np.int64)
    two = one if not run_ids else _intervals(
        two_level_resample_counts(np.random.default_rng(seed), run_of_key, task_of_key, resamples), values, q)
    size: int | str = f"{len(run_ids)} runs x {len(tasks)} tasks" if run_ids else len(keys)
    per_run = np.stack([values[:, run_of_key == r].mean(axis=1) for r in range(len(run_ids))], axis=1) \
        if run_ids else np.zeros((len(labels), 0))  # (A, R) each arm's mean per run
    by_run = lambda row: {r: float(v) for r, v in zip(run_ids, row)}  # noqa: E731
    common = dict(episodes=len(keys), tasks=len(tasks), runs=max(1, len(run_ids)))
    arms = [ArmResult(label=label, rate=float(values[a].mean()), ci=two[0][a], task_ci=one[0][a],
                      unpaired=len(set(tables[label]) - set(keys)), per_run=by_run(per_run[a]),
                      t_ci=t_interval(per_run[a], level) if run_ids else None, **common)
            for a, label in enumerate(labels)]
    differences = []
    for a, label in enumerate(labels[1:], start=1):
        run_diffs = per_run[a] - per_run[0]  # (R,)
        t_ci = t_interval(run_diffs, level) if run_ids else None
        differences.append(Difference(
            label=label, reference=labels[0], difference=float((values[a] - values[0]).mean()), ci=two[1][a - 1],
            verdict=(run_verdict(two[1][a - 1], t_ci, size, higher_is_better) if run_ids
                     else verdict(two[1][a - 1], size, higher_is_better)),
            task_ci=one[1][a - 1], t_ci=t_ci, per_run=by_run(run_diffs), **common))
    notes = [f"{a.label}: {a.unpaired} episodes without a pair left out" for a in arms if a.unpaired]
    return Comparison(arms=arms, differences=differences, metric=metric, higher_is_better=higher_is_better,
                      level=level, resamples=resamples, seed=seed, cluster=cluster, notes=notes, runs=run_ids)
