"""Read logged scalars back from TensorBoard event files (for result tables)."""

from __future__ import annotations

from pathlib import Path


def last_scalar(run_dir: str | Path, tag: str) -> tuple[int, float] | None:
    """``(step, value)`` of the last logged step of ``tag`` under ``run_dir`` (event files merged by
    :func:`lightning_opd.report.read_scalars`), or None when the tag or the event files are missing."""
    from lightning_opd.report import read_scalars

    try:
        steps, values = read_scalars(run_dir)[tag]
    except (FileNotFoundError, KeyError):
        return None
    return steps[-1], values[-1]


def print_results(runs: list[str], metric: str = "val/success") -> None:
    """Print a table with the last ``metric`` of each run (``LABEL=DIR`` or ``DIR``), the number of
    episodes behind it (``<prefix>/episodes``) and the step it was logged at."""
    count_tag = metric.rsplit("/", 1)[0] + "/episodes"
    rows = []
    for item in runs:
        label, _, path = item.partition("=") if "=" in item else (item, "", item)
        res, count = last_scalar(path, metric), last_scalar(path, count_tag)
        rows.append((label, "-" if res is None else f"{res[1]:.3f}", "-" if count is None else f"{count[1]:.0f}",
                     "-" if res is None else str(res[0])))
    width = max(len(r[0]) for r in rows + [("run",)])
    print(f"{'run'.ljust(width)} | {metric} | episodes | step")
    for label, value, count, step in rows:
        print(f"{label.ljust(width)} | {value.rjust(len(metric))} | {count.rjust(8)} | {step}")
