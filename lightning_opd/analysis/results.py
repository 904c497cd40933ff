"""``lightning-opd results``: the last logged value of a metric per run, read back from its TensorBoard event
files (:func:`lightning_opd.analysis.report.read_scalars`)."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path


def print_results(runs: list[str], metric: str = "val/success") -> None:
    """Print a table with the last ``metric`` of each run (``LABEL=DIR`` or ``DIR``), the number of
    episodes behind it (``<prefix>/episodes``) and the step it was logged at. A run that has not logged
    the metric yet shows ``-`` (and a note on stderr).

    Raises:
        FileNotFoundError: a run directory is missing or holds no event files (before anything is printed).
        KeyError: no run logged ``metric`` (misspelled?); the message lists the closest logged tags.
    """
    from lightning_opd.analysis.report import read_scalars

    count_tag = metric.rsplit("/", 1)[0] + "/episodes"
    parsed = []
    for item in runs:
        label, _, path = item.partition("=") if "=" in item else (item, "", item)
        if not Path(path).is_dir():
            raise FileNotFoundError(f"run directory {path!r} does not exist" + (f" (label {label!r})" if label != path else ""))
        parsed.append((label, path, read_scalars(path)))  # FileNotFoundError names a folder without events
    if not any(metric in series for _, _, series in parsed):
        tags = sorted({t for _, _, series in parsed for t in series})
        close = difflib.get_close_matches(metric, tags, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"logged tags: {', '.join(tags[:20])}"
        raise KeyError(f"no run logged metric {metric!r}; {hint}")
    rows = []
    for label, path, series in parsed:
        res = (series[metric][0][-1], series[metric][1][-1]) if metric in series else None
        count = series[count_tag][1][-1] if count_tag in series else None
        if res is None:
            print(f"note: {path} has not logged {metric} yet", file=sys.stderr)
        rows.append((label, "-" if res is None else f"{res[1]:.3f}", "-" if count is None else f"{count:.0f}",
                     "-" if res is None else str(res[0])))
    width = max(len(r[0]) for r in rows + [("run",)])
    print(f"{'run'.ljust(width)} | {metric} | episodes | step")
    for label, value, count, step in rows:
        print(f"{label.ljust(width)} | {value.rjust(len(metric))} | {count.rjust(8)} | {step}")
