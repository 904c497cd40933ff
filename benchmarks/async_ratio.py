"""Issue 58's check: asynchronous OPD with the sampled-token loss and the truncated ratio on by default does not
collapse (benchmarks/experiments/async_ratio.yaml), with the off-policy indicator beside the synchronous run's.

Per run (``<root>/<arm>/seed<k>``), from its evaluation (``eval/step=N.json``, the last) and its TensorBoard logs:

* ``kl_after``: the teacher-trajectory KL of the final student (nats/token, mean over the 50 held-out games' teacher
  tokens), and ``collapsed``: ``kl_after`` not below the untrained student's (``<root>/start/evaluation.json``, the
  student named ``student before``), the collapse criterion of issue 58;
* ``success``: greedy held-out success (fraction of 50 games);
* ``gap``: mean over steps of ``train/off_policy_gap`` (exact KL minus the sampled-token estimate at learner time,
  nats/token; about 0 on-policy, docs/algorithms.md §7.1), ``gap_corrected`` (``train/off_policy_gap_corrected``, with
  the ratio), ``ratio_mean``, ``ratio_clip_frac`` (means over steps), ``lag_mean`` (mean over steps of
  ``rollout/lag_mean``, applied updates);
* ``grad_norm_max`` and ``grad_norm_median`` over steps, ``applied``: steps with an applied update.

Run: ``python -m benchmarks.async_ratio benchmarks/results/async_ratio [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from benchmarks.common import markdown_table, write_json

COLUMNS = ("arm", "seed", "steps", "applied", "lag_mean", "gap", "gap_corrected", "ratio_mean", "ratio_clip_frac",
           "grad_norm_median", "grad_norm_max", "success", "kl_after", "kl_start", "collapsed")


def _mean(values) -> float | None:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def start_kl(root: Path) -> float | None:
    """The untrained student's teacher-trajectory KL (nats/token) from ``<root>/start/evaluation.json``; ``None`` when
    it was not measured."""
    path = root / "start" / "evaluation.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    student = next(s for s in data["students"] if s["name"] == "student before")
    return float(student["summary"]["teacher_traj_kl"]["mean"])


def run_row(run_dir: Path, arm: str, seed: int, kl_start: float | None) -> dict:
    """One run's row (see the module docstring).

    Raises:
        FileNotFoundError: no evaluation under ``run_dir/eval``.
    """
    from lightning_opd.analysis.report import read_scalars

    evaluations = sorted((run_dir / "eval").glob("step=*.json"), key=lambda p: int(p.stem.split("=")[1]))
    if not evaluations:
        raise FileNotFoundError(f"{run_dir}: no eval/step=N.json yet")
    student = json.loads(evaluations[-1].read_text())["students"][0]
    series = read_scalars(run_dir)

    def values(tag: str) -> list[float]:
        return list(series.get(tag, ((), ()))[1])

    grads = [v for v in values("train/grad_norm") if not math.isnan(v)]
    kl_after = float(student["summary"]["teacher_traj_kl"]["mean"])
    return {"arm": arm, "seed": seed, "steps": len(values("train/kl")),
            "applied": sum(1 for v in values("train/applied_updates") if v > 0),
            "lag_mean": _mean(values("rollout/lag_mean")), "gap": _mean(values("train/off_policy_gap")),
            "gap_corrected": _mean(values("train/off_policy_gap_corrected")),
            "ratio_mean": _mean(values("train/ratio_mean")), "ratio_clip_frac": _mean(values("train/ratio_clip_frac")),
            "grad_norm_median": statistics.median(grads) if grads else None,
            "grad_norm_max": max(grads) if grads else None,
            "success": float(student["summary"]["greedy"]["success"]), "kl_after": kl_after, "kl_start": kl_start,
            "collapsed": None if kl_start is None else kl_after >= kl_start}


def summarise(root: str | Path) -> list[dict]:
    """A row for every finished run ``<root>/<arm>/seed<k>`` (with an evaluation), arms and seeds in order."""
    root = Path(root)
    kl_start = start_kl(root)
    rows = []
    for arm_dir in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "start"):
        for run in sorted(arm_dir.glob("seed*"), key=lambda p: int(p.name[4:])):
            if list((run / "eval").glob("step=*.json")):
                rows.append(run_row(run, arm_dir.name, int(run.name[4:]), kl_start))
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="the experiment's results, e.g. benchmarks/results/async_ratio")
    p.add_argument("--json", default=None, help="also write the rows (and the CPU model) here")
    a = p.parse_args(argv)
    rows = summarise(a.root)
    text = markdown_table(list(COLUMNS), [[_fmt(r[c]) for c in COLUMNS] for r in rows])
    print(text)
    if a.json:
        write_json(a.json, {"runs": rows})  # with the CPU model and cores (benchmarks.common.machine)
    return text


if __name__ == "__main__":
    main()
