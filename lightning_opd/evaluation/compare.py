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
* verdict of a difference: ``"better"`` or ``"worse"`` only when the interval excludes 0 (direction
  from ``higher_is_better``), otherwise ``"no difference detected at n = N"`` with ``N`` the paired
  episodes. This is the rule for every claim in the README and docs/.

Command line: ``lightning-opd compare [LABEL=]A.json [LABEL=]B.json ...`` on ``lightning-opd evaluate``
outputs (see :func:`main`).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Hashable, Mapping, Sequence

import numpy as np

Key = tuple[str, Hashable]  # (task_id, seed)

#: metrics for which a lower value is the better one (all others: higher is better)
LOWER_IS_BETTER = frozenset({"turns", "invalid_actions", "kl", "cut_replies", "env_error", "truncated"})
TABLES = ("greedy", "sampled", "teacher_traj_kl")


@dataclass
class ArmResult:
    """One arm's mean over the paired episodes.

    Attributes:
        label: the arm's name.
        rate: mean value over the paired episodes (success rate for 0/1 values).
        ci: ``(low, high)`` percentile bootstrap interval of ``rate``.
        episodes: paired episodes the mean is over.
        tasks: distinct tasks among them.
        unpaired: keys of this arm left out because the reference arm lacks them (or, with
            ``intersect``, another arm does).
    """

    label: str
    rate: float
    ci: tuple[float, float]
    episodes: int
    tasks: int
    unpaired: int = 0


@dataclass
class Difference:
    """``arm - reference`` on the paired episodes.

    Attributes:
        label, reference: the two arms.
        difference: mean of the per-episode differences.
        ci: ``(low, high)`` percentile bootstrap interval of ``difference``.
        episodes, tasks: paired episodes and their distinct tasks.
        verdict: ``"better"``/``"worse"`` when ``ci`` excludes 0, else ``"no difference detected at n = N"``.
    """

    label: str
    reference: str
    difference: float
    ci: tuple[float, float]
    episodes: int
    tasks: int
    verdict: str


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

    def to_dict(self) -> dict:
        return asdict(self)

    def to_markdown(self, digits: int = 2) -> str:
        """Two markdown tables: each arm's mean with its interval, then each difference to the first arm."""
        pct = f"{self.level * 100:g}%"
        fmt = f"{{:.{digits}f}}"
        signed = f"{{:+.{digits}f}}"
        what = "tasks (all seeds of a drawn task)" if self.cluster == "task" else "episodes"
        lines = [f"{self.metric}: mean over paired (task, seed) episodes; {pct} percentile bootstrap CI, "
                 f"{self.resamples} resamples of {what}, generator seed {self.seed}"
                 f"{'' if self.higher_is_better else ' (lower is better)'}", "",
                 f"| arm | {self.metric} | {pct} CI | episodes (tasks) |", "|---|---|---|---|"]
        for a in self.arms:
            lines.append(f"| {a.label} | {fmt.format(a.rate)} | [{fmt.format(a.ci[0])}, {fmt.format(a.ci[1])}] | "
                         f"{a.episodes} ({a.tasks}) |")
        if self.differences:
            ref = self.differences[0].reference
            lines += ["", f"| arm - {ref} | difference | {pct} CI | paired episodes (tasks) | verdict |",
                      "|---|---|---|---|---|"]
            for d in self.differences:
                lines.append(f"| {d.label} | {signed.format(d.difference)} | [{signed.format(d.ci[0])}, "
                             f"{signed.format(d.ci[1])}] | {d.episodes} ({d.tasks}) | {d.verdict} |")
        for note in self.notes:
            lines += ["", note]
        return "\n".join(lines)


def verdict(ci: tuple[float, float], episodes: int, higher_is_better: bool = True) -> str:
    """``"better"``/``"worse"`` when ``ci`` excludes 0 (``low > 0``: the arm's value is higher), else
    ``"no difference detected at n = {episodes}"``."""
    low, high = ci
    if low > 0 or high < 0:
        return "better" if (low > 0) == higher_is_better else "worse"
    return f"no difference detected at n = {episodes}"


def _sort_key(key: Key) -> tuple:
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
                shown = ", ".join(f"{t}/seed {s}" for t, s in sorted(missing, key=_sort_key)[:8])
                raise ValueError(
                    f"arm {label!r} lacks {len(missing)} of the {len(keys)} (task, seed) episodes of the first arm "
                    f"{first!r} (e.g. {shown}): evaluate every arm on the same tasks and seeds, or pass "
                    "--intersect (intersect=True) to compare on the shared episodes only")
    if not keys:
        raise ValueError(f"arms {labels} share no (task, seed) episode: nothing to compare")
    return sorted(keys, key=_sort_key)


def paired_bootstrap(tables: Mapping[str, Mapping[Key, float]], *, resamples: int = 10_000, level: float = 0.95,
                     seed: int = 0, cluster: str = "task", intersect: bool = False, higher_is_better: bool = True,
                     metric: str = "value") -> Comparison:
    """Each arm's mean and every arm's difference to the first, with paired percentile bootstrap
    intervals (algorithm and conventions: module docstring).

    Args:
        tables: arm label -> ``{(task_id, seed): value}``, in display order; the first arm is the
            reference of the differences.
        resamples: bootstrap resamples ``B``.
        level: confidence level of the intervals (0.95: 2.5% and 97.5% percentiles).
        seed: seed of the ``numpy.random.default_rng`` that draws the resamples (fixed: the same
            tables always give the same intervals).
        cluster: ``"task"`` (resample tasks with all their seeds) or ``"episode"``.
        intersect: pair on the keys every arm has (default: the first arm's keys, which every arm must have).
        higher_is_better: direction of the verdicts (False for turns, invalid actions, KL).
        metric: name of the value, for printing.

    Returns:
        :class:`Comparison` (arms in the order given; one difference per arm after the first).

    Raises:
        ValueError: no arm, an arm lacking keys of the first arm (names them; see ``intersect``), no
            shared key, a non-finite value (names the arm and key), ``resamples < 1``, ``level`` outside
            (0, 1) or an unknown ``cluster``.
    """
    if not tables:
        raise ValueError("paired_bootstrap needs at least one arm")
    if resamples < 1:
        raise ValueError(f"resamples={resamples} must be >= 1")
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1), e.g. 0.95")
    if cluster not in ("task", "episode"):
        raise ValueError(f"cluster={cluster!r}: use 'task' (resample tasks with all their seeds) or 'episode'")
    labels = list(tables)
    keys = _paired_keys(tables, intersect)
    values = np.empty((len(labels), len(keys)), dtype=np.float64)  # (A, n)
    for a, label in enumerate(labels):
        for j, key in enumerate(keys):
            v = float(tables[label][key])
            if not math.isfinite(v):
                raise ValueError(f"arm {label!r}: value {v} at task {key[0]!r}, seed {key[1]!r} is not finite")
            values[a, j] = v
    tasks = sorted({k[0] for k in keys}, key=str)
    if cluster == "task":
        index = {t: i for i, t in enumerate(tasks)}
        unit_cluster = np.array([index[k[0]] for k in keys])  # (n,)
    else:
        unit_cluster = np.arange(len(keys))
    n_clusters = int(unit_cluster.max()) + 1
    sums = np.zeros((len(labels), n_clusters))  # (A, C) per-cluster sums of values
    np.add.at(sums.T, unit_cluster, values.T)
    sizes = np.bincount(unit_cluster, minlength=n_clusters).astype(np.float64)  # (C,) episodes per cluster

    rng = np.random.default_rng(seed)
    draws = rng.integers(0, n_clusters, size=(resamples, n_clusters))  # (B, C) drawn cluster ids
    counts = np.zeros((resamples, n_clusters))  # (B, C) times each cluster was drawn
    np.add.at(counts, (np.arange(resamples)[:, None], draws), 1.0)
    episodes_b = counts @ sizes  # (B,) episodes in each resample
    means_b = (counts @ sums.T) / episodes_b[:, None]  # (B, A)
    # differences from the summed per-episode differences (exact when they are all equal)
    diffs_b = (counts @ (sums[1:] - sums[:1]).T) / episodes_b[:, None]  # (B, A-1)
    q = [(1 - level) / 2, (1 + level) / 2]

    def interval(samples: np.ndarray) -> tuple[float, float]:
        low, high = np.quantile(samples, q)
        return float(low), float(high)

    n = len(keys)
    arms = [ArmResult(label=label, rate=float(values[a].mean()), ci=interval(means_b[:, a]), episodes=n,
                      tasks=len(tasks), unpaired=len(set(tables[label]) - set(keys))) for a, label in enumerate(labels)]
    differences = []
    for a, label in enumerate(labels[1:], start=1):
        ci = interval(diffs_b[:, a - 1])
        differences.append(Difference(label=label, reference=labels[0], difference=float((values[a] - values[0]).mean()),
                                      ci=ci, episodes=n, tasks=len(tasks), verdict=verdict(ci, n, higher_is_better)))
    notes = [f"{a.label}: {a.unpaired} episodes without a pair left out" for a in arms if a.unpaired]
    return Comparison(arms=arms, differences=differences, metric=metric, higher_is_better=higher_is_better,
                      level=level, resamples=resamples, seed=seed, cluster=cluster, notes=notes)


# ------------------------------------------------------------------------------------ evaluate files
def tables_from_evaluation(data: dict, table: str = "greedy", metric: str = "success") -> dict[str, dict[Key, float]]:
    """Per-student tables from one ``lightning-opd evaluate`` output (a parsed JSON).

    Args:
        data: the JSON object (``students`` list, see :mod:`lightning_opd.evaluation.evaluate`).
        table: ``"greedy"`` (one episode per task and seed), ``"sampled"`` (the mean of the ``k``
            sampled episodes of each task and seed: Avg@k) or ``"teacher_traj_kl"`` (the student's
            reverse KL on the teacher's trajectory of each task, nats/token, that task's own token mean;
            recorded under each seed). So ``compare`` weighs every task equally, while evaluate's summary
            ``teacher_traj_kl.mean`` weighs every token equally.
        metric: episode field (``success``, ``turns``, ``invalid_actions``, ``reward``, ...); ``kl`` for
            ``teacher_traj_kl``.

    Returns:
        student name -> ``{(task_id, seed): value}``, in the file's order.

    Raises:
        ValueError: unknown table, a student without that table, a record without ``metric``.
    """
    if table not in TABLES:
        raise ValueError(f"table={table!r}: use one of {TABLES}")
    out: dict[str, dict[Key, float]] = {}
    for student in data.get("students", []):
        name = student["name"]
        records = student.get(table)
        if records is None:
            raise ValueError(f"student {name!r} has no {table!r} records (evaluate ran without it: "
                             f"{'--teacher' if table == 'teacher_traj_kl' else '--avg-k'})")
        rows: dict[Key, list[float]] = {}
        for r in records:
            if metric not in r:
                raise ValueError(f"student {name!r}: {table} records have no {metric!r} (fields: {sorted(r)})")
            rows.setdefault((r["task_id"], r["seed"]), []).append(float(r[metric]))
        out[name] = {k: sum(v) / len(v) for k, v in rows.items()}
    return out


def load_arms(specs: Sequence[str], table: str = "greedy", metric: str = "success") -> dict[str, dict[Key, float]]:
    """Arms from command-line specs ``[LABEL=]PATH[,PATH...]``.

    A file holding one student is one arm (label ``LABEL``, default the student's name). Several files
    joined with commas are merged into one arm (e.g. the evaluations of one training recipe run with
    seeds 0, 1, 2, whose episodes carry those seeds); each must hold one student and no (task, seed) may
    repeat. A file holding several students gives one arm per student, labelled ``LABEL/name``.

    Raises:
        FileNotFoundError: a path does not exist.
        ValueError: a label used twice, a merged file with several students, a (task, seed) in two merged files.
    """
    arms: dict[str, dict[Key, float]] = {}
    for spec in specs:
        label, sep, paths = spec.partition("=")
        if not sep:
            label, paths = "", spec
        files = [p for p in paths.split(",") if p]
        parts = []
        for path in files:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"no evaluation file {path!r} (write one with `lightning-opd evaluate --out`)")
            parts.append((path, tables_from_evaluation(json.loads(p.read_text()), table, metric)))
        if len(parts) == 1 and len(parts[0][1]) != 1:
            new = {(f"{label}/{name}" if label else name): t for name, t in parts[0][1].items()}
        else:
            merged: dict[Key, float] = {}
            for path, students in parts:
                if len(students) != 1:
                    raise ValueError(f"{path}: holds {len(students)} students; files merged into one arm must hold one each")
                (name, t), = students.items()
                clash = set(merged) & set(t)
                if clash:
                    task, seed = sorted(clash, key=_sort_key)[0]
                    raise ValueError(f"{path}: task {task!r}, seed {seed!r} is already in another file of arm "
                                     f"{label or name!r}; merged files must hold different seeds")
                merged.update(t)
            new = {label or name: merged}
        for name, t in new.items():
            if name in arms:
                raise ValueError(f"arm label {name!r} used twice; name arms with LABEL=PATH")
            arms[name] = t
    return arms


def main(argv: list[str] | None = None) -> Comparison:
    """``lightning-opd compare``: print the comparison table (markdown) and optionally write it as JSON."""
    p = argparse.ArgumentParser(
        prog="lightning-opd compare",
        description="Paired bootstrap comparison of `lightning-opd evaluate` outputs: each arm's mean with its 95%% "
                    "CI over tasks x seeds and each arm's difference to the first, paired by (task, seed). A "
                    "difference is called better/worse only when its CI excludes 0.")
    p.add_argument("arms", nargs="+", help="[LABEL=]PATH[,PATH...]: an evaluate JSON (several, comma-joined, are "
                                           "merged into one arm: e.g. one per training seed); the first is the reference")
    p.add_argument("--table", default="greedy", choices=TABLES,
                   help="greedy episodes, sampled episodes (Avg@k per task and seed) or the teacher-trajectory KL")
    p.add_argument("--metric", default=None,
                   help="episode field: success (default), turns, invalid_actions, reward; kl for teacher_traj_kl")
    p.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples")
    p.add_argument("--level", type=float, default=0.95, help="confidence level")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap generator")
    p.add_argument("--cluster", default="task", choices=("task", "episode"),
                   help="resample tasks with all their seeds (default) or episodes independently")
    p.add_argument("--intersect", action="store_true", help="compare on the (task, seed) episodes all arms share")
    p.add_argument("--json", default=None, help="also write the comparison to this JSON file")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    a = p.parse_args(argv)
    if a.json and Path(a.json).exists() and not a.force:
        p.error(f"--json {a.json} exists; pass --force to replace it (or choose another --json)")
    metric = a.metric or ("kl" if a.table == "teacher_traj_kl" else "success")
    tables = load_arms(a.arms, a.table, metric)
    result = paired_bootstrap(tables, resamples=a.resamples, level=a.level, seed=a.seed, cluster=a.cluster,
                              intersect=a.intersect, higher_is_better=metric not in LOWER_IS_BETTER,
                              metric=metric if a.table == "greedy" else f"{a.table} {metric}")
    print(result.to_markdown(digits=3 if metric == "kl" else 2))
    if a.json:
        out = Path(a.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result.to_dict(), indent=1))
        tmp.replace(out)
    return result
