"""Read a run's TensorBoard logs for what issue 44's experiments report beside the held-out table.

``validity``: f-OPD in real async (benchmarks/experiments/fopd_async.yaml). Per run (``<root>/<arm>/seed<k>``) and per
arm (all its seeds): the steps trained at lag >= 1, the steps run in the synchronous fallback, the producer's lead
and the rollouts generated / used, then the validity line of issue 44: an arm's parity with synchronous OPD counts
only if at least half of its steps were trained at lag >= 1 ("parity only by running mostly in the sync fallback"
refutes)::

    python -m benchmarks.run_logs validity benchmarks/results/fopd_async --arms async_plain async_fopd

A step is "at lag >= 1" when its update was applied and every episode it trained on was played by a policy at least
one version older than the learner: ``rollout/lag_min >= 1`` (policy versions). Runs logged before ``rollout/lag_min``
existed fall back to the step's largest lag (``rollout/lag_max``, before that ``rollout/lag``), said in the output.
A step whose update was skipped (non-finite loss or gradient, every sample dropped by the lag bound or the freshness
filter, an empty step) trained on nothing and is not a step at lag >= 1 (issue 58, ../shared/docs/algorithms.md §7.2: a
version is an applied update): ``train/applied_updates`` (optimizer updates applied in the step, 0 when skipped)
tells it where logged; older runs fall back to the cumulative counters ``staleness/skipped_steps`` and
``train/nonfinite_steps_skipped`` (the step skipped when either rose at it). Fallback steps: the last
``staleness/sync_fallback_steps`` (a run without the staleness monitor has no fallback: 0).

``iterations``: one row per rollout iteration of a run (TensorBoard step + 1), e.g. ATOD's T-DUR mean weight
(``tdur/mean_weight``) beside ``schedule/kappa``, ``schedule/rho`` and ``grpo/equal_reward_share``::

    python -m benchmarks.run_logs iterations benchmarks/results/atod_quest3/atod/seed0

``depth``: what TurnOPD's rollout-depth controller did in each run (issue 63, design 1, "the cap moved"): the cap
trajectory, whether the cap moved, the cap it settled on, and the share of the capped steps whose cap came from a
decision where the success-coverage rule was binding (:mod:`benchmarks.depth_logs`)::

    python -m benchmarks.run_logs depth benchmarks/results/turnopd_mix_pilot --arms turnopd
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

#: the step's lag tags, the preferred first: the smallest lag of the step's episodes, then (older runs) the largest
LAG_TAGS = ("rollout/lag_min", "rollout/lag_max", "rollout/lag")
#: ``iterations``' default columns
#: optimizer updates applied in the step (0: its update was skipped); logged per step by the learner from issue 58 on
APPLIED_TAG = "train/applied_updates"
#: cumulative counts of skipped updates, read when a step has no :data:`APPLIED_TAG`: the step skipped when one rose
SKIP_COUNTERS = ("staleness/skipped_steps", "train/nonfinite_steps_skipped")
ITERATION_TAGS = ("tdur/mean_weight", "schedule/kappa", "schedule/rho", "grpo/equal_reward_share", "grpo/reward_mean",
                  "rollout/success", "train/kl", "train/lr")


@dataclass
class RunValidity:
    """What one run's logs say about its asynchrony.

    Attributes:
        run: the run directory.
        steps: training steps logged (rollout iterations = optimizer steps here).
        lag_tag: the tag the per-step lag was read from (:data:`LAG_TAGS`).
        at_lag: steps with an applied update whose lag (``lag_tag``) is >= 1 (policy versions).
        skipped: steps whose update was skipped (:func:`skipped_steps`).
        skip_source: where ``skipped`` was read from: :data:`APPLIED_TAG`, the counters (:data:`SKIP_COUNTERS`),
            both (older steps from the counters), or ``"none logged"`` (every step counted as applied).
        no_lag: steps without a lag (no episode had a reply: NaN).
        mean_lag: mean over steps of ``rollout/lag_mean`` (policy versions), ``None`` when not logged.
        fallback_steps: steps run in the synchronous fallback (``staleness/sync_fallback_steps``); ``None``: the run
            has no staleness monitor with producer-side control (no fallback exists).
        mean_lead: mean over steps of ``rollout/producer_lead`` (policy versions), ``None`` when not logged (sync).
        generated, used: episodes generated for / used by the steps (``rollouts/*_total``, last value).
    """

    run: str
    steps: int
    lag_tag: str
    at_lag: int
    no_lag: int
    mean_lag: float | None
    fallback_steps: int | None
    mean_lead: float | None
    generated: int
    used: int
    skipped: int = 0
    skip_source: str = "none logged"

    @property
    def share_at_lag(self) -> float:
        """Fraction of the steps trained at lag >= 1 (0 without steps)."""
        return self.at_lag / self.steps if self.steps else 0.0


def _last(series, tag: str) -> float | None:
    return series[tag][1][-1] if tag in series and series[tag][1] else None


def _mean(series, tag: str) -> float | None:
    values = [v for v in series.get(tag, ((), ()))[1] if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _rises(series, tag: str) -> set[int]:
    """Steps at which the cumulative counter ``tag`` rose above its previous value (0 before the first)."""
    steps, values = series.get(tag, ((), ()))
    rose, last = set(), 0.0
    for step, v in zip(steps, values):
        if v > last:
            rose.add(step)
        last = v
    return rose


def skipped_steps(series, steps: Sequence[int]) -> tuple[set[int], str]:
    """Which of ``steps`` (TensorBoard steps) made no optimizer update, and what said so.

    A step with a :data:`APPLIED_TAG` value is skipped when that value is 0 (updates applied in the step); a step
    without one is skipped when a counter of :data:`SKIP_COUNTERS` (cumulative skipped updates) rose at it.

    Returns:
        ``(skipped steps, source)``; source :data:`APPLIED_TAG`, ``"counters"``, ``"<APPLIED_TAG> and counters"``
        or ``"none logged"``.
    """
    applied = dict(zip(*series.get(APPLIED_TAG, ((), ()))))
    rose = set().union(*(_rises(series, t) for t in SKIP_COUNTERS))
    skipped = {s for s in steps if (applied[s] <= 0 if s in applied else s in rose)}
    by_tag = any(s in applied for s in steps)
    by_counters = any(s not in applied for s in steps) and any(t in series for t in SKIP_COUNTERS)
    source = ({(True, False): APPLIED_TAG, (False, True): "counters", (True, True): f"{APPLIED_TAG} and counters"}
              .get((by_tag, by_counters), "none logged"))
    return skipped, source


def run_validity(run_dir: str | Path) -> RunValidity:
    """:class:`RunValidity` of one run from its TensorBoard event files (anywhere under ``run_dir``).

    Raises:
        FileNotFoundError: no event file under ``run_dir``.
        KeyError: the logs hold no per-step lag (none of :data:`LAG_TAGS`) or no rollout totals.
    """
    from lightning_opd.analysis.report import read_scalars

    series = read_scalars(run_dir)
    tag = next((t for t in LAG_TAGS if t in series), None)
    if tag is None or "rollouts/generated_total" not in series:
        raise KeyError(f"{run_dir}: no per-step lag ({', '.join(LAG_TAGS)}) or no rollouts/generated_total in its "
                       "TensorBoard logs; is it an OPD training run?")
    steps, lags = series[tag]
    skipped, source = skipped_steps(series, steps)
    fallback = _last(series, "staleness/sync_fallback_steps")
    return RunValidity(run=str(run_dir), steps=len(lags), lag_tag=tag,
                       at_lag=sum(1 for s, v in zip(steps, lags) if not math.isnan(v) and v >= 1 and s not in skipped),
                       no_lag=sum(1 for v in lags if math.isnan(v)), mean_lag=_mean(series, "rollout/lag_mean"),
                       fallback_steps=None if fallback is None else int(fallback),
                       mean_lead=_mean(series, "rollout/producer_lead"),
                       generated=int(_last(series, "rollouts/generated_total")),
                       used=int(_last(series, "rollouts/used_total") or 0), skipped=len(skipped), skip_source=source)


def verdict(runs: Sequence[RunValidity]) -> str:
    """The validity line over ``runs`` (one arm's seeds): valid when at least half of all their steps applied an update
    trained at lag >= 1, with the skipped steps (no update) and the steps run in the synchronous fallback named."""
    steps = sum(r.steps for r in runs)
    at_lag = sum(r.at_lag for r in runs)
    skipped = sum(r.skipped for r in runs)
    fallback = sum(r.fallback_steps or 0 for r in runs)
    share = at_lag / steps if steps else 0.0
    head = (f"{at_lag} of {steps} steps ({share:.0%}) at lag >= 1 with an update applied, {skipped} of {steps} "
            f"skipped (no update), {fallback} of {steps} in the synchronous fallback")
    if steps and 2 * at_lag >= steps:
        return f"valid: {head} (at least half at lag >= 1)"
    return f"NOT valid: {head}: it ran mostly at lag 0, so parity with sync says nothing about async"


def _row(name: str, r: RunValidity) -> str:
    opt = (lambda x, d=2: "-" if x is None else f"{x:.{d}f}")
    fallback = "- (not logged)" if r.fallback_steps is None else str(r.fallback_steps)
    note = "" if r.lag_tag == LAG_TAGS[0] else f" (lag from {r.lag_tag}: the step's largest)"
    skipped = f"{r.skipped}" + ("" if r.skip_source == APPLIED_TAG else f" ({r.skip_source})")
    return (f"| {name} | {r.steps} | {skipped} | {r.at_lag} ({r.share_at_lag:.0%}){note} | {opt(r.mean_lag)} | "
            f"{fallback} | {opt(r.mean_lead)} | {r.generated} / {r.used} |")


def validity_report(root: str | Path, arms: Sequence[str], seeds: Sequence[int] | None = None) -> str:
    """Markdown: one row per run ``<root>/<arm>/seed<k>`` with logs (``seeds``: all ``seed*`` folders when ``None``)
    and each arm's :func:`verdict`.

    Raises:
        FileNotFoundError: an arm has no run with TensorBoard logs.
    """
    lines = ["| run | steps | steps skipped (no update) | steps at lag >= 1, update applied | mean lag (versions) | "
             "fallback steps | mean producer lead (versions) | rollouts generated / used |",
             "|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for arm in arms:
        folders = ([Path(root) / arm / f"seed{s}" for s in seeds] if seeds is not None
                   else sorted((Path(root) / arm).glob("seed*")))
        runs = []
        for d in folders:
            if not any(d.rglob("events.out.tfevents.*")):
                continue
            r = run_validity(d)
            runs.append(r)
            lines.append(_row(f"{arm} {d.name}", r))
        if not runs:
            raise FileNotFoundError(f"{Path(root) / arm}: no run with TensorBoard logs")
        verdicts.append(f"- {arm}: {verdict(runs)}")
    return "\n".join(lines + [""] + verdicts)


def iteration_table(run_dir: str | Path, tags: Sequence[str] = ITERATION_TAGS) -> str:
    """Markdown: one row per rollout iteration (1-based: TensorBoard step + 1) with ``tags``' values (the tags the
    run logged; ``-`` where a tag has no value at that iteration).

    Raises:
        FileNotFoundError: no event file under ``run_dir``.
        KeyError: the run logged none of ``tags``.
    """
    from lightning_opd.analysis.report import read_scalars

    series = read_scalars(run_dir)
    present = [t for t in tags if t in series]
    if not present:
        raise KeyError(f"{run_dir}: none of {list(tags)} logged")
    by_tag = {t: dict(zip(*series[t])) for t in present}
    steps = sorted({s for t in present for s in by_tag[t]})
    lines = ["| iteration | " + " | ".join(present) + " |", "|---|" + "---|" * len(present)]
    for s in steps:
        cells = [f"{by_tag[t][s]:.4g}" if s in by_tag[t] else "-" for t in present]
        lines.append(f"| {s + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    """``python -m benchmarks.run_logs validity ROOT --arms A ... [--seeds K ...]``, ``iterations RUN [--tags ...]`` or
    ``depth ROOT --arms A ... [--seeds K ...]``; prints and returns the markdown."""
    p = argparse.ArgumentParser(prog="benchmarks.run_logs", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validity", help="steps at lag >= 1 with an update applied, skipped and fallback steps, "
                                        "rollouts generated/used per run and arm")
    v.add_argument("root", help="an experiment's results folder, e.g. benchmarks/results/fopd_async")
    v.add_argument("--arms", nargs="+", required=True)
    v.add_argument("--seeds", nargs="+", type=int, default=None, help="default: every seed* folder")
    it = sub.add_parser("iterations", help="per-iteration values of a run (e.g. T-DUR's mean weight)")
    it.add_argument("run", help="a run folder (its TensorBoard logs anywhere below)")
    it.add_argument("--tags", nargs="+", default=list(ITERATION_TAGS))
    dp = sub.add_parser("depth", help="TurnOPD's cap per run: trajectory, moved or not, settled cap, share of capped "
                                      "steps where the coverage rule was binding")
    dp.add_argument("root", help="an experiment's results folder, e.g. benchmarks/results/turnopd_mix_pilot")
    dp.add_argument("--arms", nargs="+", required=True)
    dp.add_argument("--seeds", nargs="+", type=int, default=None, help="default: every seed* folder")
    a = p.parse_args(argv)
    if a.command == "depth":
        from benchmarks.depth_logs import depth_report

        text = depth_report(a.root, a.arms, a.seeds)
    else:
        text = (validity_report(a.root, a.arms, a.seeds) if a.command == "validity" else iteration_table(a.run, a.tags))
    print(text)
    return text


if __name__ == "__main__":
    main()
