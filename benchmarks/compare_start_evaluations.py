"""Are two builds of one starting student the same start? Compare their evaluations episode by episode.

Used when a student is rebuilt on another kind of CPU and its files (sha256) differ from the experiment's recorded
start (lightning_opd/cpu_isa.py): if its greedy episodes are the recorded student's on every task and the
teacher-trajectory KL agrees to rounding, the runner may be told to continue it (``equivalents`` in the
experiment's ``start/start.json``; lightning_opd/experiments/runner.py). Prints the count of tasks with identical
greedy replies and equal success, both success rates and turn means, and the largest per-task difference of the
teacher-trajectory KL (nats/token). Exit status 0 if every task's replies are identical, 1 otherwise.

    python -m benchmarks.compare_start_evaluations RECORDED.json REBUILT.json

Raises:
    ValueError: the two files do not cover the same tasks and seeds (names the difference), or a file holds no
        student or no greedy episodes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _first_student(path: Path) -> dict:
    students = json.loads(path.read_text()).get("students") or []
    if not students or not students[0].get("greedy"):
        raise ValueError(f"{path}: no student with greedy episodes; pass a `lightning-opd evaluate` output")
    return students[0]


def _by_episode(rows: list[dict] | None) -> dict[tuple[str, int], dict]:
    return {(row["task_id"], row["seed"]): row for row in rows or []}


def compare(recorded: Path, rebuilt: Path) -> tuple[int, list[str]]:
    """Returns (the number of (task, seed) episodes whose greedy replies differ, report lines; KL in nats/token).

    Raises:
        ValueError: the files cover different (task, seed) episodes, or one holds no greedy episodes.
    """
    a, b = _first_student(recorded), _first_student(rebuilt)
    ga, gb = _by_episode(a["greedy"]), _by_episode(b["greedy"])
    if ga.keys() != gb.keys():
        raise ValueError(f"the files cover different (task, seed) episodes: {sorted(ga.keys() ^ gb.keys())[:5]}...")
    same_replies = sum(ga[k]["replies"] == gb[k]["replies"] for k in ga)
    same_success = sum(ga[k]["success"] == gb[k]["success"] for k in ga)
    lines = [f"(task, seed) episodes {len(ga)}; identical greedy replies in {same_replies}; "
             f"same success in {same_success}",
             f"greedy success {a['summary']['greedy']['success']} vs {b['summary']['greedy']['success']}; "
             f"turns {a['summary']['greedy']['turns']} vs {b['summary']['greedy']['turns']}"]
    ka = {k: row["kl"] for k, row in _by_episode(a.get("teacher_traj_kl")).items()}
    kb = {k: row["kl"] for k, row in _by_episode(b.get("teacher_traj_kl")).items()}
    if ka and ka.keys() == kb.keys():
        worst = max(abs(ka[k] - kb[k]) for k in ka)
        lines.append(f"teacher-trajectory KL mean {a['summary']['teacher_traj_kl']['mean']:.6f} vs "
                     f"{b['summary']['teacher_traj_kl']['mean']:.6f} nats/token; max per-task |difference| {worst:.2e}")
    return len(ga) - same_replies, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recorded", type=Path, help="the recorded student's start evaluation (step=0.json)")
    parser.add_argument("rebuilt", type=Path, help="the rebuilt student's, with the same evaluate flags")
    args = parser.parse_args(argv)
    differ, lines = compare(args.recorded, args.rebuilt)
    print("\n".join(lines))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
