"""Training-second marks (``evaluate_at_seconds``): which checkpoints stand for given training seconds.

An experiment may name marks, e.g. ``evaluate_at_seconds: [600, 1200]`` (training seconds of the runner's
``Timer``; a resumed fit continues the saved count). :class:`~.checkpointing.StepCheckpoint` then writes a
checkpoint at the first optimizer step whose training seconds reach each mark (at the end of that step) and
records, in ``<run dir>/at_seconds.json`` (:data:`MARKS_FILE`)::

    {"marks": [{"mark": 600.0, "step": 14, "seconds": 611.3},      # reached: step=14.ckpt stands for 600 s
               {"mark": 1200.0, "step": null, "seconds": null}]}   # not reached before the fit ended

The runner evaluates those checkpoints and the final one (a mark the fit never reached, because it stopped at
``max_steps`` first, is stood for by the final checkpoint: the nearest to it), and writes into each evaluation
JSON ``"at_seconds": [{"mark": 600.0, "reached": true}]`` (:func:`mark_steps`); the summary compares the arms at
each mark. Pure Python (no torch, no Lightning): the runner and the callback share it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

#: the marks a fit reached, in the (arm, seed) folder (module docstring)
MARKS_FILE = "at_seconds.json"


def check_at_seconds(marks: Any, where: str = "", budget: float | None = None) -> list[float]:
    """``marks`` as floats after checking them: a list of positive, finite, strictly increasing training seconds,
    none above the time ``budget`` (seconds; ``None``: no budget), which the Timer would stop the fit at first.

    Args:
        marks: the ``evaluate_at_seconds`` value (seconds).
        where: prefix of the error message (e.g. ``"arm 'turnopd': "``).
        budget: the experiment's ``max_time`` (seconds) or ``None``.

    Raises:
        ValueError: not a list, or an entry that is not a positive finite number, does not increase, or lies
            beyond ``budget``; the message names the bad value.
    """
    if not isinstance(marks, (list, tuple)):
        raise ValueError(f"{where}evaluate_at_seconds={marks!r} must be a list of training seconds (e.g. [600, 1200])")
    out: list[float] = []
    for m in marks:
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ValueError(f"{where}evaluate_at_seconds: {m!r} is not a positive number of training seconds")
        if out and m <= out[-1]:
            raise ValueError(f"{where}evaluate_at_seconds: {m!r} does not increase (it follows {out[-1]:g}); give "
                             "each mark once, in increasing order")
        if budget is not None and m > budget:
            raise ValueError(f"{where}evaluate_at_seconds: {m!r} is beyond max_time={budget} s: the fit stops at "
                             "the budget first (a mark at the budget itself is the final checkpoint)")
        out.append(float(m))
    return out


def read_marks(run_dir: str | Path) -> list[dict]:
    """The ``marks`` list of ``<run_dir>/at_seconds.json``: ``[{"mark", "step", "seconds"}]`` (``step`` and
    ``seconds`` ``None`` for a mark not reached).

    Raises:
        FileNotFoundError: the file is missing (names it).
    """
    path = Path(run_dir) / MARKS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; the fit's StepCheckpoint writes it when it has at_seconds "
                                "(evaluate_at_seconds; a fit started by an older runner overlay has none)")
    return json.loads(path.read_text())["marks"]


def mark_steps(marks: Sequence[float], recorded: Sequence[dict], steps: Sequence[int]) -> dict[int, list[dict]]:
    """Which checkpoint stands for each mark: ``{step: [{"mark": m, "reached": bool}, ...]}``.

    A reached mark is its recorded step; a mark not reached is the final checkpoint (the last of ``steps``, the
    nearest to it: the fit ended before it).

    Args:
        marks: the marks the arm asks for (seconds, increasing).
        recorded: :func:`read_marks` of the fit.
        steps: the steps of the checkpoints on disk, increasing (the last is the final).

    Raises:
        ValueError: the recorded marks differ from ``marks`` (the experiment changed after the fit), or no
            checkpoint.
        FileNotFoundError: a reached mark's checkpoint is not on disk.
    """
    if not steps:
        raise ValueError("no checkpoint to stand for the marks")
    have = [float(r["mark"]) for r in recorded]
    if have != [float(m) for m in marks]:
        raise ValueError(f"the fit recorded marks {have} but the experiment asks for {list(marks)}: the "
                         "evaluate_at_seconds of this arm changed after its fit; restore them or refit the pair")
    out: dict[int, list[dict]] = {}
    for r in recorded:
        reached = r.get("step") is not None
        step = int(r["step"]) if reached else steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"the checkpoint step={step}.ckpt of the {r['mark']:g} s mark is missing")
        out.setdefault(step, []).append({"mark": float(r["mark"]), "reached": reached})
    return out
