"""Greedy success per quest length of a mixed game set (issue 63, design 1), from ``lightning-opd evaluate`` outputs:
per policy (each student, and the teacher's own greedy episodes where the file has them) and per quest length, the
episodes, the greedy success and the mean turns of the won episodes (the depth the wins needed).

The quest length of a task is the ``q<L>-`` prefix ``lightning-opd merge-games`` gives its task ids
(:func:`lightning_opd.envs.textworld_mix.quest_length_of`); tasks without it are counted under ``-``. Means over
(task, seed) episodes, no interval: 25 held-out games per length is too few for a verdict per length, and the
experiments' verdicts are on all games (benchmarks/experiments/turnopd_mix.yaml).

Run: ``.venv/bin/python -m benchmarks.by_quest_length [LABEL=]EVAL.json[,EVAL.json...] ...``: one row group per
argument. With a LABEL, the files (e.g. one per training seed of an arm) are merged, each with one student; without
one, each student of the one file is its own row group under its name. The teacher's episodes of every file are
merged into one "teacher" group (its greedy episodes do not depend on the student).
Source: PROPOSED, docs/algorithms.md is silent on it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from lightning_opd.envs.textworld_mix import quest_length_of

Key = tuple[str, int]  # (task id, seed)


def read_groups(spec: str) -> tuple[dict[str, dict[Key, dict]], dict[Key, dict]]:
    """``[LABEL=]PATH[,PATH...]`` (a LABEL has no ``/``; a spec that is an existing file is a path, so
    ``eval/step=14.json`` alone needs no label) -> ``({group: {(task, seed): greedy record}}, teacher {(task, seed):
    record})``.

    Raises:
        ValueError: several files without a LABEL, a labelled file with other than one student, or a (task, seed)
            twice in one group (names the file).
    """
    label, sep, paths = spec.partition("=")
    if not sep or "/" in label or Path(spec).is_file():  # no label: a path (maybe with "=", like eval/step=14.json)
        label, paths = "", spec
    files = [Path(p) for p in paths.split(",") if p]
    if not label and len(files) > 1:
        raise ValueError(f"{spec}: name the merged group (LABEL={paths})")
    groups: dict[str, dict[Key, dict]] = {}
    teacher: dict[Key, dict] = {}
    for path in files:
        data = json.loads(path.read_text())
        students = data.get("students") or []
        if label and len(students) != 1:
            raise ValueError(f"{path}: {len(students)} students; a LABEL merges files of one student each")
        for student in students:
            group = groups.setdefault(label or student["name"], {})
            for r in student["greedy"]:
                key = (r["task_id"], r["seed"])
                if key in group:
                    raise ValueError(f"{path}: task {key[0]!r}, seed {key[1]} is already in group "
                                     f"{label or student['name']!r} (the same episode in two files)")
                group[key] = r
        for r in (data.get("teacher") or {}).get("episodes") or []:
            teacher[(r["task_id"], r["seed"])] = r
    return groups, teacher


def _stats(records: list[dict]) -> dict[str, float | int | None]:
    """``{"episodes", "success", "won_turns"}`` of ``records``: mean greedy success, mean turns of the won ones
    (``None``: no win)."""
    won = [r["turns"] for r in records if r["success"]]
    return {"episodes": len(records), "success": sum(float(r["success"]) for r in records) / len(records),
            "won_turns": sum(won) / len(won) if won else None}


def by_length(records: dict[Key, dict]) -> dict[int | None | str, dict[str, float | int | None]]:
    """``{quest length: stats}`` (:func:`_stats`), lengths in increasing order, ``None`` (ids without ``q<L>-``) after
    them, then ``"all"`` (every episode)."""
    lengths = {k: quest_length_of(k[0]) for k in records}
    out: dict[int | None | str, dict[str, float | int | None]] = {}
    for length in sorted(set(lengths.values()), key=lambda x: (x is None, x or 0)):
        out[length] = _stats([records[k] for k, n in lengths.items() if n == length])
    if records:
        out["all"] = _stats(list(records.values()))
    return out


def table(groups: dict[str, dict[Key, dict]]) -> str:
    """Markdown: one row per group and quest length, then the group over all lengths ("all")."""
    lines = ["| policy | quest length | episodes | greedy success | won episodes: mean turns |",
             "|---|---|---|---|---|"]
    for name, records in groups.items():
        for length, v in by_length(records).items():
            turns = "-" if v["won_turns"] is None else f"{v['won_turns']:.2f}"
            lines.append(f"| {name} | {'-' if length is None else length} | {v['episodes']} | {v['success']:.2f} | "
                         f"{turns} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> str:
    """Print and return the table for the evaluate files named on the command line (module docstring)."""
    p = argparse.ArgumentParser(prog="benchmarks.by_quest_length", description=__doc__.split("\n\n")[0])
    p.add_argument("groups", nargs="+", help="[LABEL=]EVAL.json[,EVAL.json...]: an evaluate output, or a labelled "
                                             "group of them (one student each, e.g. one per training seed)")
    a = p.parse_args(argv)
    groups: dict[str, dict[Key, dict]] = {}
    teacher: dict[Key, dict] = {}
    for spec in a.groups:
        g, t = read_groups(spec)
        clash = set(g) & set(groups)
        if clash:
            p.error(f"group name(s) {sorted(clash)} given twice; label the arguments (LABEL=...)")
        groups.update(g)
        teacher.update(t)
    if teacher:
        groups["teacher"] = teacher
    text = table(groups)
    print(text)
    return text


if __name__ == "__main__":
    main()
