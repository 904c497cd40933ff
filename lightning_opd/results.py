"""Read logged scalars back from TensorBoard event files (for result tables)."""

from __future__ import annotations

from pathlib import Path


def last_scalar(run_dir: str | Path, tag: str) -> tuple[int, float] | None:
    """``(step, value)`` of the last event of ``tag`` under ``run_dir`` (newest event file last), or None."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = None
    for f in sorted(Path(run_dir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags().get("scalars", []):
            ev = acc.Scalars(tag)[-1]
            found = (ev.step, ev.value)
    return found


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
