"""Validity checks of a TurnOPD comparison, read from each fit's TensorBoard log (issue 44, design 1).

A TurnOPD arm can only show what it claims if its rollout-depth controller
(:class:`~lightning_opd.callbacks.rollout_depth.RolloutDepthController`) did what it is for:

1. **truncation happened**: the mean turn cap over the non-probe steps is at most ``max_cap`` turns (issue 44:
   7 of 12); a cap that stays near the horizon makes TurnOPD vanilla OPD with extra probes;
2. **wins were not cut**: the training success over the non-probe steps (played at the cap) is not below the
   success over the probe steps (played at full depth): a cap below the depth the student needs to win would
   show as fewer wins in the capped batches.

Per run (one (arm, seed)), over its logged optimizer steps, from ``<root>/<arm>/seed<k>/logs/``:

| quantity | tag | fallback (logs written before ``rollout/cap`` existed) |
|---|---|---|
| probe step | ``rollout/is_probe`` (fraction of the step's episodes that were full-depth probes) >= 0.5 | ``controller/probe`` |
| cap of the step | ``rollout/cap`` (turns: the cap the step's batch was played at) | ``controller/cap`` (the cap after the step; at a non-probe step in sync mode the cap its batch played at) |
| training success | ``rollout/success`` (fraction of the step's episodes won) | - |

Means are over steps (each step's batch has the same number of episodes). A resumed fit writes a new event file
that repeats the steps after its checkpoint: files are read oldest first and each drops the earlier files'
values from its own first step on (those steps' values are the resumed fit's). Runs without a probe step (no
controller: vanilla OPD, the blend alone) are listed as not applicable.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

#: (tag, fallback tag) of each quantity (module docstring)
TAGS = {"probe": ("rollout/is_probe", "controller/probe"), "cap": ("rollout/cap", "controller/cap"),
        "success": ("rollout/success", None)}
_STAMP = re.compile(r"events\.out\.tfevents\.(\d+)")


def _order(path: Path) -> tuple[int, int, str]:
    m = _STAMP.match(path.name)
    return (int(m.group(1)) if m else 0, path.stat().st_mtime_ns, path.name)


def read_step_scalars(log_dir: str | Path, tags: Sequence[str]) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of the scalar ``tags`` in every TensorBoard event file under ``log_dir``; a later
    file (by the time stamp in its name, then modification time) replaces every earlier value from its own first
    logged step (of these tags) on, so a resumed fit's repeated steps count once, with the resumed values. A tag
    never logged maps to ``{}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    merged: dict[str, dict[int, float]] = {t: {} for t in tags}
    for f in sorted(Path(log_dir).rglob("events.out.tfevents.*"), key=_order):
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        have = set(acc.Tags().get("scalars", []))
        this = {t: {int(e.step): float(e.value) for e in acc.Scalars(t)} for t in tags if t in have}
        steps = [s for values in this.values() for s in values]
        if steps:
            first = min(steps)
            merged = {t: {s: v for s, v in values.items() if s < first} for t, values in merged.items()}
        for t, values in this.items():
            merged[t].update(values)
    return merged


@dataclass
class RunValidity:
    """One run's controller statistics (module docstring).

    Attributes:
        arm, seed: the run.
        probe_steps, other_steps: logged optimizer steps with a probe batch / a capped (non-probe) batch.
        mean_cap: mean turn cap over the non-probe steps (turns; NaN without one).
        success_probe, success_other: mean training success over the probe / non-probe steps (fraction; NaN
            without such steps).
        tags: the tags read for the probe flag and the cap (``rollout/*``, or the ``controller/*`` fallback).
    """

    arm: str
    seed: int
    probe_steps: int
    other_steps: int
    mean_cap: float
    success_probe: float
    success_other: float
    tags: tuple[str, str]

    def cap_ok(self, max_cap: float | None) -> bool | None:
        """Truncation happened: ``mean_cap <= max_cap`` (``None``: no bound or no non-probe step)."""
        return None if max_cap is None or math.isnan(self.mean_cap) else self.mean_cap <= max_cap + 1e-12

    def success_ok(self) -> bool | None:
        """Wins were not cut: non-probe training success ``>=`` the probes' (``None``: a kind of step missing)."""
        if math.isnan(self.success_probe) or math.isnan(self.success_other):
            return None
        return self.success_other >= self.success_probe - 1e-12


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def run_validity(log_dir: str | Path, arm: str, seed: int) -> RunValidity | None:
    """The controller statistics of the run logged under ``log_dir``; ``None`` when it logged no probe step
    (no rollout-depth controller) or no step with the probe flag, the cap and the training success."""
    wanted = [t for pair in TAGS.values() for t in pair if t is not None]
    series = read_step_scalars(log_dir, wanted)
    pick = {k: (main if series[main] or fallback is None else fallback) for k, (main, fallback) in TAGS.items()}
    probe, cap, success = (series[pick[k]] for k in ("probe", "cap", "success"))
    steps = sorted(set(probe) & set(cap) & set(success))
    probes = [s for s in steps if probe[s] >= 0.5]
    if not probes:
        return None
    others = [s for s in steps if probe[s] < 0.5]
    return RunValidity(arm, seed, len(probes), len(others), _mean([cap[s] for s in others]),
                       _mean([success[s] for s in probes]), _mean([success[s] for s in others]),
                       (pick["probe"], pick["cap"]))


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("pass" if ok else "FAIL")


def validity_table(root: str | Path, arms: Sequence[str], seeds: Sequence[int],
                   max_cap: float | None = None) -> tuple[str, dict] | None:
    """The validity checks of every (arm, seed) with a log under ``root`` (``<root>/<arm>/seed<k>/logs``): a
    Markdown section and its JSON form; ``None`` when no run logged a probe step (no TurnOPD controller: nothing
    to check, the summary is unchanged).

    Args:
        root: the experiment's results folder.
        arms, seeds: the runs to read (order kept).
        max_cap: the bound of the truncation check (turns); ``None``: the mean cap is shown without a verdict.
    """
    checked: list[RunValidity] = []
    without: list[str] = []
    for arm in arms:
        for seed in seeds:
            logs = Path(root) / arm / f"seed{seed}" / "logs"
            if not any(logs.rglob("events.out.tfevents.*")):
                continue
            run = run_validity(logs, arm, seed)
            if run is None:
                without.append(f"{arm} seed {seed}")
            else:
                checked.append(run)
    if not checked:
        return None
    bound = "-" if max_cap is None else f"{max_cap:g}"
    md = ["### Rollout-depth validity (TurnOPD's controller, from each fit's TensorBoard log)", "",
          "Per run, over its logged optimizer steps: probe = a full-depth probe batch, cap = the turn cap the step's "
          "batch was played at, training success = the fraction of the step's episodes won (means over steps). "
          f"Checks: truncation happened (mean cap over non-probe steps <= {bound} turns) and wins were not cut "
          "(training success over non-probe steps not below the probes').", "",
          f"| arm | seed | steps: probe / non-probe | mean cap, non-probe steps (turns) | training success, probe steps "
          f"| training success, non-probe steps | cap <= {bound} | non-probe success >= probe |",
          "|---|---|---|---|---|---|---|---|"]
    data: dict = {"max_cap": max_cap, "runs": {}, "no_probe_steps": without}
    for r in checked:
        cap, won = r.cap_ok(max_cap), r.success_ok()
        fallback = "" if r.tags == ("rollout/is_probe", "rollout/cap") else f" ({r.tags[1]})"
        md.append(f"| {r.arm} | {r.seed} | {r.probe_steps} / {r.other_steps} | {_num(r.mean_cap)}{fallback} | "
                  f"{_num(r.success_probe)} | {_num(r.success_other)} | {_verdict(cap)} | {_verdict(won)} |")
        data["runs"].setdefault(r.arm, {})[str(r.seed)] = {
            "probe_steps": r.probe_steps, "non_probe_steps": r.other_steps, "mean_cap_non_probe": r.mean_cap,
            "success_probe": r.success_probe, "success_non_probe": r.success_other, "tags": list(r.tags),
            "cap_ok": cap, "success_ok": won}
    if without:
        md += ["", "No probe steps (no rollout-depth controller; not applicable): " + ", ".join(without) + "."]
    return "\n".join(md), data


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"
