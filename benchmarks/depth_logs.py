"""What TurnOPD's rollout-depth controller did in each run, read from the fits' TensorBoard logs (issue 63, design 1:
"the cap moved: report its trajectory per run and the share of steps where the coverage rule was binding").

Per run (``<root>/<arm>/seed<k>/logs``; a resumed fit's repeated steps count once, with the resumed values:
:func:`lightning_opd.analysis.rollout_validity.read_step_scalars`):

| quantity | tag | fallback (older logs) |
|---|---|---|
| probe step | ``rollout/is_probe`` >= 0.5 (a full-depth probe batch) | ``controller/probe`` |
| cap of the step | ``rollout/cap`` (turns the step's batch was played at) | ``controller/cap`` |
| H_eff, H_cov in force (turn indices) | ``controller/h_eff``, ``controller/h_cov`` | - |

The controller logs H_eff and H_cov every step once they are set, so a step's values are those of the last probe
decision (for a capped step, the decision that set its cap); H_cov is absent until its first refresh.

Reported per run (:class:`RunDepth`; ``capped`` steps = the non-probe steps, played at the controller's cap):

- **trajectory**: runs of equal caps, ``"0-2 P16; 3-7 5; 8 P16; 9-11 7"`` (step range, then the cap in turns;
  ``P``: a full-depth probe batch);
- the capped steps' cap range and **moved**: range >= 2 turns (PROPOSED: the turnopd_cold runs, read as "the cap
  never adapted", held caps of 4-5 turns, a range of 1);
- **settled cap**: the upper median of the capped steps' caps over the second half of the run's logged steps (by
  step index), the value turnopd_mix.yaml's fixed-cap arm takes from the pilot (PROPOSED);
- the first step with H_cov (the success-coverage rule's first refresh);
- **coverage binding**: capped steps whose cap came from a decision with H_cov > H_eff (the success quantile, not the
  KL centroid, set H_ctrl = max(H_eff, H_cov)), as a count and a share of the capped steps; ties (H_cov = H_eff) are
  counted apart; and the probe decisions with H_cov > H_eff. The cap is round(EMA of H_ctrl) + 1 (docs/algorithms.md
  §2.3), so a binding decision moves the cap by its EMA share, not at once.

Run: ``python -m benchmarks.run_logs depth benchmarks/results/turnopd_mix_pilot --arms turnopd``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from lightning_opd.analysis.rollout_validity import TAGS, read_step_scalars

H_TAGS = ("controller/h_eff", "controller/h_cov")
MOVED_RANGE = 2  # turns: the capped steps' cap range at which the cap "moved" (module docstring)


@dataclass
class RunDepth:
    """One run's cap per logged step and the controller's decision in force (module docstring).

    Attributes:
        arm, seed: the run.
        caps: step -> cap the step's batch was played at (turns).
        probes: the probe steps (full depth).
        h_eff, h_cov: step -> the decision's H_eff / H_cov in force at that step (turn indices; absent before set).
        tags: the tags read for the probe flag and the cap.
    """

    arm: str
    seed: int
    caps: dict[int, float]
    probes: set[int]
    h_eff: dict[int, float] = field(default_factory=dict)
    h_cov: dict[int, float] = field(default_factory=dict)
    tags: tuple[str, str] = (TAGS["probe"][0], TAGS["cap"][0])

    @property
    def capped(self) -> list[int]:
        """The non-probe steps, in order."""
        return [s for s in sorted(self.caps) if s not in self.probes]

    def cap_range(self) -> tuple[int, int] | None:
        """``(lowest, highest)`` cap over the capped steps (turns); ``None`` without one."""
        caps = [self.caps[s] for s in self.capped]
        return (int(min(caps)), int(max(caps))) if caps else None

    def moved(self) -> bool | None:
        """The capped steps' cap range is at least :data:`MOVED_RANGE` turns (``None``: no capped step)."""
        r = self.cap_range()
        return None if r is None else r[1] - r[0] >= MOVED_RANGE

    def settled(self) -> int | None:
        """The upper median of the capped steps' caps over the second half of the logged steps (turns)."""
        steps = sorted(self.caps)
        late = sorted(self.caps[s] for s in steps[len(steps) // 2:] if s not in self.probes)
        return int(late[len(late) // 2]) if late else None

    def first_coverage(self) -> int | None:
        """The first step at which H_cov was set (``None``: never)."""
        return min(self.h_cov) if self.h_cov else None

    def coverage(self, steps: Sequence[int]) -> tuple[int, int]:
        """``(binding, ties)`` among ``steps``: H_cov in force and above H_eff, or equal to it."""
        set_ = [s for s in steps if s in self.h_cov and s in self.h_eff]
        return (sum(self.h_cov[s] > self.h_eff[s] for s in set_), sum(self.h_cov[s] == self.h_eff[s] for s in set_))

    def trajectory(self) -> str:
        """Runs of equal caps over consecutive steps, ``"0-2 P16; 3-7 5"`` (``P``: probe)."""
        parts: list[list] = []  # [first step, last step, label]
        for s in sorted(self.caps):
            label = f"{'P' if s in self.probes else ''}{self.caps[s]:g}"
            if parts and parts[-1][2] == label and parts[-1][1] == s - 1:
                parts[-1][1] = s
            else:
                parts.append([s, s, label])
        return "; ".join(f"{a}{'' if a == b else f'-{b}'} {label}" for a, b, label in parts)


def run_depth(log_dir: str | Path, arm: str, seed: int) -> RunDepth | None:
    """The cap trajectory and decisions of the run logged under ``log_dir``; ``None`` when it logged no probe step
    (no rollout-depth controller: vanilla OPD, a fixed cap)."""
    wanted = [t for key in ("probe", "cap") for t in TAGS[key]] + list(H_TAGS)
    series = read_step_scalars(log_dir, wanted)
    probe_tag, cap_tag = (main if series[main] else fallback for main, fallback in (TAGS["probe"], TAGS["cap"]))
    probe, cap = series[probe_tag], series[cap_tag]
    steps = sorted(set(probe) & set(cap))
    probes = {s for s in steps if probe[s] >= 0.5}
    if not probes:
        return None
    finite = (lambda values: {s: v for s, v in values.items() if not math.isnan(v)})
    return RunDepth(arm, seed, {s: cap[s] for s in steps}, probes, finite(series[H_TAGS[0]]),
                    finite(series[H_TAGS[1]]), (probe_tag, cap_tag))


def _dash(x) -> str:
    return "-" if x is None else str(x)


def depth_report(root: str | Path, arms: Sequence[str], seeds: Sequence[int] | None = None) -> str:
    """Markdown: one row per run ``<root>/<arm>/seed<k>`` with logs (``seeds``: every ``seed*`` folder when
    ``None``), then each run's cap trajectory; runs without probe steps are listed as not applicable.

    Raises:
        FileNotFoundError: an arm has no run with TensorBoard logs.
    """
    rows = ["| run | steps: probe / capped | cap over capped steps, min-max (turns) | moved (range >= "
            f"{MOVED_RANGE} turns) | settled cap (turns; upper median, capped steps of the 2nd half) | first step "
            "with H_cov | coverage binding (H_cov > H_eff): capped steps (share) | ties H_cov = H_eff: capped steps | "
            "probe decisions with H_cov > H_eff |", "|---|---|---|---|---|---|---|---|---|"]
    paths, without = [], []
    for arm in arms:
        folders = ([Path(root) / arm / f"seed{s}" for s in seeds] if seeds is not None
                   else sorted((Path(root) / arm).glob("seed*")))
        found = [d for d in folders if any(d.rglob("events.out.tfevents.*"))]
        if not found:
            raise FileNotFoundError(f"{Path(root) / arm}: no run with TensorBoard logs")
        for d in found:
            run = run_depth(d, arm, int(d.name.removeprefix("seed")))
            name = f"{arm} {d.name}"
            if run is None:
                without.append(name)
                continue
            capped = run.capped
            binding, ties = run.coverage(capped)
            decided, _ = run.coverage(sorted(run.probes))
            r, moved = run.cap_range(), run.moved()
            share = f"{binding / len(capped):.0%}" if capped else "-"
            rows.append(f"| {name} | {len(run.probes)} / {len(capped)} | {'-' if r is None else f'{r[0]}-{r[1]}'} | "
                        f"{'-' if moved is None else ('yes' if moved else 'no')} | {_dash(run.settled())} | "
                        f"{'never' if run.first_coverage() is None else run.first_coverage()} | {binding} ({share}) | "
                        f"{ties} | {decided} of {len(run.probes)} |")
            fallback = "" if run.tags == (TAGS["probe"][0], TAGS["cap"][0]) else f" (from {', '.join(run.tags)})"
            paths.append(f"- {name}{fallback}: {run.trajectory()}")
    lines = ["### TurnOPD's cap per run (rollout-depth controller, from each fit's TensorBoard log)", "", *rows]
    if paths:
        lines += ["", "Cap trajectories (step range, then the cap in turns; P = a full-depth probe batch):", "", *paths]
    if without:
        lines += ["", "No probe steps (no rollout-depth controller; not applicable): " + ", ".join(without) + "."]
    return "\n".join(lines)
