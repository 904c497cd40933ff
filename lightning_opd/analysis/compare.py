"""``lightning-opd compare``: arms read from ``lightning-opd evaluate`` outputs and compared with the paired bootstrap
of :mod:`lightning_opd.analysis.bootstrap` (the statistics, what the tests pin by hand, are described there).

Command line: ``lightning-opd compare [LABEL=]A.json [LABEL=]B.json ...`` on ``lightning-opd evaluate``
outputs (see :func:`main`). It counts seeds as training runs only when an arm merges two or more files
(``LABEL=A0.json,A1.json,...``: one per training run) or with ``--runs seed``; an arm from one file (e.g.
``evaluate --seeds 0 1 2`` of one student) is one trained student, its seeds episode seeds, compared one-level over
its (task, seed) episodes (``--runs auto``, the default; :func:`runs_for_files`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from lightning_opd.analysis.bootstrap import LOWER_IS_BETTER, Comparison, Key, key_order, paired_bootstrap
from lightning_opd.files import write_text_atomic

TABLES = ("greedy", "sampled", "teacher_traj_kl")


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


Sources = dict[str, list[tuple[str, list]]]  # arm -> [(file, the seeds of its episodes in that file)]


def load_arm_sources(specs: Sequence[str], table: str = "greedy",
                     metric: str = "success") -> tuple[dict[str, dict[Key, float]], Sources]:
    """:func:`load_arms`, and which files each arm came from with the seeds of each (for :func:`runs_for_files`)."""
    arms: dict[str, dict[Key, float]] = {}
    sources: Sources = {}
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
        seeds_of = lambda t: sorted({k[1] for k in t}, key=lambda sd: key_order(("", sd)))  # noqa: E731
        if len(parts) == 1 and len(parts[0][1]) != 1:
            path = parts[0][0]
            new = {(f"{label}/{name}" if label else name): (t, [(path, seeds_of(t))])
                   for name, t in parts[0][1].items()}
        else:
            merged: dict[Key, float] = {}
            origin = []
            for path, students in parts:
                if len(students) != 1:
                    raise ValueError(f"{path}: holds {len(students)} students; files merged into one arm must hold one each")
                (name, t), = students.items()
                clash = set(merged) & set(t)
                if clash:
                    task, seed = sorted(clash, key=key_order)[0]
                    raise ValueError(f"{path}: task {task!r}, seed {seed!r} is already in another file of arm "
                                     f"{label or name!r}; merged files must hold different seeds")
                merged.update(t)
                origin.append((path, seeds_of(t)))
            new = {label or name: (merged, origin)}
        for name, (t, origin) in new.items():
            if name in arms:
                raise ValueError(f"arm label {name!r} used twice; name arms with LABEL=PATH")
            arms[name], sources[name] = t, origin
    return arms, sources


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
    return load_arm_sources(specs, table, metric)[0]


def runs_for_files(sources: Sources) -> str:
    """``runs`` for :func:`paired_bootstrap` from where the arms came from (``--runs auto``): ``"seed"`` when an arm
    merges two or more files (one ``evaluate`` file per training run, each file's episodes keyed by its training
    seed), else ``"none"``: an arm from one file is one trained student, and the seeds of its episodes are episode
    seeds (``lightning-opd evaluate --seeds 0 1 2``), not training runs.

    Raises:
        ValueError: a merged file whose episodes carry several seeds (its seeds cannot stand for its training run).
    """
    merged = {arm: files for arm, files in sources.items() if len(files) >= 2}
    for arm, files in merged.items():
        for path, seeds in files:
            if len(seeds) != 1:
                raise ValueError(
                    f"arm {arm!r} merges {len(files)} files (one per training run), but {path} holds episodes of "
                    f"seeds {', '.join(map(str, seeds))}: to count training runs, each file's episodes must carry its "
                    "training seed only; pass --runs none to compare over (task, seed) episodes, or --runs seed to "
                    "count every seed as a training run")
    return "seed" if merged else "none"


def main(argv: list[str] | None = None) -> Comparison:
    """``lightning-opd compare``: print the comparison table (markdown) and optionally write it as JSON."""
    p = argparse.ArgumentParser(
        prog="lightning-opd compare",
        description="Paired bootstrap comparison of `lightning-opd evaluate` outputs: each arm's mean with its 95%% "
                    "CI over tasks x seeds and each arm's difference to the first, paired by (task, seed); with two "
                    "or more training runs (an arm merged from one file per training seed), each run's difference, "
                    "a two-level interval (runs, then tasks) and the t-interval over runs. A difference is called "
                    "better/worse only when its CI excludes 0 (with runs: both the two-level CI and the t-interval).")
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
    p.add_argument("--runs", default="auto", choices=("auto", "seed", "none"),
                   help="auto (default): count training runs when an arm merges two or more files (one evaluate file "
                        "per training run, its episodes keyed by its training seed), else none; seed: each seed is a "
                        "training run, and with two or more the two-level interval (runs, then tasks within them) and "
                        "the t-interval over runs, both needed for a verdict, with the one-level interval (tasks only, "
                        "runs fixed) beside them; none: the seeds are episode seeds of one trained policy per arm")
    p.add_argument("--intersect", action="store_true", help="compare on the (task, seed) episodes all arms share")
    p.add_argument("--json", default=None, help="also write the comparison to this JSON file")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    a = p.parse_args(argv)
    if a.json and Path(a.json).exists() and not a.force:
        p.error(f"--json {a.json} exists; pass --force to replace it (or choose another --json)")
    metric = a.metric or ("kl" if a.table == "teacher_traj_kl" else "success")
    tables, sources = load_arm_sources(a.arms, a.table, metric)
    runs = runs_for_files(sources) if a.runs == "auto" else a.runs
    result = paired_bootstrap(tables, resamples=a.resamples, level=a.level, seed=a.seed, cluster=a.cluster,
                              intersect=a.intersect, higher_is_better=metric not in LOWER_IS_BETTER, runs=runs,
                              metric=metric if a.table == "greedy" else f"{a.table} {metric}")
    seeds = {k[1] for t in tables.values() for k in t}
    if a.runs == "auto" and runs == "none" and len(seeds) >= 2:
        result.notes.append(f"Each arm comes from one evaluation file, so its {len(seeds)} seeds are read as episode "
                            "seeds of one trained student: the interval is over tasks (all seeds of a drawn task). To "
                            "count training runs, give an arm one file per training run, comma-joined "
                            "(LABEL=run0.json,run1.json,...), or pass --runs seed.")
    print(result.to_markdown(digits=3 if metric == "kl" else 2))
    if a.json:
        write_text_atomic(a.json, json.dumps(result.to_dict(), indent=1))
    return result
