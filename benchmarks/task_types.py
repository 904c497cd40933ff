"""A benchmark's table by task type, with its own score: success and score per policy of one ``evaluate`` JSON,
overall with paired 95% CIs and per task type (issue 45: ScienceWorld's 8 task types, TextWorldExpress games).

The benchmark score of an episode is its summed reward (the environment's score change per turn, so the final
score: ScienceWorld's score / 100, TextWorldExpress's normalised score) with a failed episode counted as 0, as the
benchmarks' papers report it (ScienceWorld sets -100 when the agent focuses on a wrong object and ends the task);
``--scale 100`` prints ScienceWorld's 0-100 scale. The task type is the task id before ``-test-`` / ``-dev-`` /
``-train-`` (``find-living-thing-test-v225`` -> ``find-living-thing``). Intervals: the paired bootstrap of
``lightning-opd compare`` (tasks resampled, 10,000 resamples, seed 0), every policy against the first and the last
against the second (student after - teacher).

Run: .venv/bin/python -m benchmarks.task_types runs/sciworld/evaluation.json --scale 100 [--json out.json]
Source: PROPOSED, docs/algorithms.md is silent on it (ScienceWorld's scoring: Wang et al. 2022, section 3).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import markdown_table
from lightning_opd.analysis.bootstrap import paired_bootstrap

SPLIT = re.compile(r"-(test|dev|train)-[^-]+$")


def task_type(task_id: str) -> str:
    """``find-living-thing-test-v225`` -> ``find-living-thing``; an id without a split suffix is its own type."""
    return SPLIT.sub("", task_id)


def episode_score(record: dict) -> float:
    """The benchmark score of one greedy record: its summed reward, 0 for a failed episode (reward units)."""
    return 0.0 if record["failure"] else float(record["reward"])


def tables(result: dict, scale: float) -> dict[str, dict[str, dict]]:
    """``{"success" | "score": {policy: {(task_id, seed): value}}}`` from an ``evaluate`` result's greedy records."""
    out: dict[str, dict[str, dict]] = {"success": {}, "score": {}}
    for student in result["students"]:
        out["success"][student["name"]] = {(r["task_id"], r["seed"]): float(r["success"]) for r in student["greedy"]}
        out["score"][student["name"]] = {(r["task_id"], r["seed"]): scale * episode_score(r) for r in student["greedy"]}
    return out


def summarise(result: dict, scale: float = 1.0, resamples: int = 10_000) -> dict:
    """Overall means with CIs and differences, and per task type means, for success and score.

    Returns:
        ``{"overall": {metric: {"arms": [...], "differences": [...], "after_minus_teacher": {...} | None}},
        "by_type": {type: {policy: {"episodes", "success", "score"}}}}``.

    Raises:
        ValueError: a result without students.
    """
    if not result.get("students"):
        raise ValueError("the evaluate result holds no students")
    per_metric = tables(result, scale)
    overall = {}
    for metric, arms in per_metric.items():
        cmp = paired_bootstrap(arms, resamples=resamples, metric=metric)
        names = list(arms)
        last_two = None
        if len(names) >= 3:
            pair = paired_bootstrap({names[1]: arms[names[1]], names[-1]: arms[names[-1]]}, resamples=resamples)
            d = pair.differences[0]
            last_two = {"label": f"{names[-1]} - {names[1]}", "diff": d.difference, "ci": list(d.ci), "verdict": d.verdict}
        overall[metric] = {"arms": [{"label": a.label, "mean": a.rate, "ci": list(a.ci), "episodes": a.episodes}
                                    for a in cmp.arms],
                           "differences": [{"label": f"{d.label} - {d.reference}", "diff": d.difference, "ci": list(d.ci),
                                            "verdict": d.verdict} for d in cmp.differences],
                           "after_minus_teacher": last_two}
    by_type: dict[str, dict[str, dict]] = {}
    for name in per_metric["success"]:
        for (task, _seed), ok in per_metric["success"][name].items():
            cell = by_type.setdefault(task_type(task), {}).setdefault(name, {"episodes": 0, "success": 0.0, "score": 0.0})
            cell["episodes"] += 1
            cell["success"] += ok
            cell["score"] += per_metric["score"][name][(task, _seed)]
    for cells in by_type.values():
        for cell in cells.values():
            cell["success"] /= cell["episodes"]
            cell["score"] /= cell["episodes"]
    return {"overall": overall, "by_type": by_type, "scale": scale}


def report(summary: dict) -> str:
    """Markdown: the overall table (success and score with CIs) and the per-type table."""
    lines = []
    for metric, part in summary["overall"].items():
        rows = [[a["label"], f"{a['mean']:.2f} [{a['ci'][0]:.2f}, {a['ci'][1]:.2f}]", a["episodes"]] for a in part["arms"]]
        lines.append(markdown_table(["policy", f"{metric} [95% CI]", "episodes"], rows))
        diffs = part["differences"] + ([part["after_minus_teacher"]] if part["after_minus_teacher"] else [])
        lines.append("\n".join(f"- {metric}, {d['label']}: {d['diff']:+.2f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}], "
                               f"{d['verdict']}" for d in diffs))
    names = list(next(iter(summary["by_type"].values())))
    digits = 1 if summary["scale"] >= 10 else 2
    rows = [[t, next(iter(cells.values()))["episodes"]] + [f"{cells[n]['success']:.2f} / {cells[n]['score']:.{digits}f}" for n in names]
            for t, cells in sorted(summary["by_type"].items())]
    lines.append(markdown_table(["task type", "episodes"] + [f"{n}: success / score" for n in names], rows))
    return "\n\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("evaluation", help="an `lightning-opd evaluate` JSON")
    p.add_argument("--scale", type=float, default=1.0, help="score multiplier (100: ScienceWorld's 0-100 scale)")
    p.add_argument("--resamples", type=int, default=10_000)
    p.add_argument("--json", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    summary = summarise(json.loads(Path(args.evaluation).read_text()), args.scale, args.resamples)
    print(report(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
