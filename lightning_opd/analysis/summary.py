"""The experiment summary's tables (``summary.md`` / ``summary.json`` of the experiment runner) over the runs'
evaluated checkpoints: learning curves, Same-Step, Least-Time, marks in training seconds, time to target, final and
best checkpoints, named contrasts and the own-trajectory KL by outcome. The definitions (what each selection picks,
how runs and tasks are paired) are in :mod:`lightning_opd.analysis.curves`; :func:`summarise` writes them in that
order, one named step per section.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Sequence

from lightning_opd.analysis.bootstrap import Comparison
from lightning_opd.analysis.curves import (Point, Runs, at_mark, best, check_contrasts, compare_selection,
                                           compare_with_teacher, final, least_time, merged_table, per_turn_kl,
                                           same_step, time_to_target)
from lightning_opd.files import json_safe


def _ci(value: float, ci: tuple[float, float], signed: bool = False) -> str:
    f = "{:+.2f}" if signed else "{:.2f}"
    return f"{f.format(value)} [{f.format(ci[0])}, {f.format(ci[1])}]"


def _n(cmp: Comparison) -> str:
    """``"3 runs x 50 tasks"`` with two or more training runs, else the paired episodes."""
    return f"{len(cmp.runs)} runs x {cmp.arms[0].tasks} tasks" if cmp.run_level else str(cmp.arms[0].episodes)


def _per_run_note(cmp: Comparison | None, what: str) -> str:
    """With two or more training runs: a line and ``cmp``'s differences table (each seed's difference, the t-interval
    over runs and the one-level interval, "tasks only, runs fixed"); ``""`` otherwise."""
    if cmp is None or not cmp.run_level or not cmp.differences:
        return ""
    return (f"\n\n{what} minus the first arm per training run (the CI above is the two-level one, runs then tasks; "
            f"../shared/docs/algorithms.md §7.3):\n\n" + cmp.differences_markdown())


def selection_table(selection: dict[str, dict[int, Point]], **kwargs) -> tuple[str, dict]:
    """Markdown table of a selection (one point per run): iterations and seconds per seed, rollouts generated /
    used (episodes, summed over seeds; "-" when a point has no counts), greedy success and Avg@k with CIs and
    each arm's difference to the first arm; and its JSON form. Avg@k compares only the arms whose points all have
    sampled episodes (e.g. an experiment that samples the main arms' finals only): its reference is the first
    of those, and the other arms read "-"."""
    greedy = compare_selection(selection, "greedy", **kwargs)
    # Avg@k over the arms that have sampled episodes (an experiment may sample only some arms' finals)
    with_sampled = {arm: chosen for arm, chosen in selection.items() if merged_table(chosen, "sampled") is not None}
    sampled = compare_selection(with_sampled, "sampled", **kwargs) if with_sampled else None
    sampled_index = {arm: i for i, arm in enumerate(with_sampled)}
    lines = ["| arm | iteration per seed | training s per seed | rollouts generated / used | greedy success [95% CI] "
             "| - first arm [95% CI] | Avg@k [95% CI] | - first arm [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for i, (arm, chosen) in enumerate(selection.items()):
        its = ", ".join(str(p.iteration) for p in chosen.values())
        secs = ", ".join("-" if p.seconds is None else f"{p.seconds:.0f}" for p in chosen.values())
        counts = [p.rollouts for p in chosen.values()]
        rollouts = ("-" if any(c is None for c in counts) else
                    f"{sum(c['generated'] for c in counts)} / {sum(c['used'] for c in counts)}")
        cells = [rollouts]
        for cmp, j in ((greedy, i), (sampled, sampled_index.get(arm))):
            if cmp is None or j is None:
                cells += ["-", "-"]
                continue
            a = cmp.arms[j]
            cells.append(_ci(a.rate, a.ci) + f" (n = {_n(cmp)})")
            if j == 0:
                cells.append("reference")
                continue
            d = cmp.differences[j - 1]
            t = "" if d.t_ci is None else f", t-interval {_span(d.t_ci)}"  # with runs: the verdict needs both
            cells.append(f"{_ci(d.difference, d.ci, True)}{t} {d.verdict}")
        lines.append(f"| {arm} | {its} | {secs} | " + " | ".join(cells) + " |")
    data = {"points": {arm: {str(s): {"step": p.step, "iteration": p.iteration, "seconds": p.seconds, "path": p.path,
                                      "rollouts": p.rollouts}
                             for s, p in chosen.items()} for arm, chosen in selection.items()},
            "greedy": None if greedy is None else greedy.to_dict(),
            "sampled": None if sampled is None else sampled.to_dict()}
    return "\n".join(lines) + _per_run_note(greedy, "Greedy success") + _per_run_note(sampled, "Avg@k"), data


def teacher_table(selection: dict[str, dict[int, Point]], **kwargs) -> tuple[str, dict] | None:
    """Markdown rows ``arm - teacher`` (greedy success) for a selection; ``None`` without teacher episodes."""
    cmps = compare_with_teacher(selection, **kwargs)
    if cmps is None:
        return None
    runs = any(c.run_level for c in cmps.values())
    lines = (["| arm | teacher greedy success | arm - teacher [95% CI] | verdict |", "|---|---|---|---|"] if not runs else
             ["| arm | teacher greedy success | arm - teacher [95% CI: runs, then tasks] | 95% t-interval over runs | "
              "95% CI tasks only, runs fixed | per run | verdict |", "|---|---|---|---|---|---|---|"])
    for arm, c in cmps.items():
        d = c.differences[0]
        extra = (f" {_span(d.t_ci)} | {_span(d.task_ci)} | {_seeds(d.per_run)} |" if runs else "")
        lines.append(f"| {arm} | {c.arms[0].rate:.2f} | {_ci(d.difference, d.ci, True)} |{extra} {d.verdict} |")
    return "\n".join(lines), {arm: c.to_dict() for arm, c in cmps.items()}


def _span(ci: tuple[float, float] | None) -> str:
    return "-" if ci is None else f"[{ci[0]:+.2f}, {ci[1]:+.2f}]"


def _seeds(per_run: dict) -> str:
    return ", ".join(f"{v:+.2f} (seed {sd})" for sd, v in per_run.items())


def contrast_table(selection: dict[str, dict[int, Point]], contrasts: Sequence[Sequence[str]],
                   **kwargs) -> tuple[str, dict]:
    """Markdown rows ``a - b`` (greedy success, paired by (task, seed), 95% CI, its half-width, the verdict and
    each seed's own difference, which shows what the CI over tasks does not: whether the training runs agree)
    for each named pair of arms in ``selection``; and the JSON form ``{"a - b": Difference dict + half_width +
    per_seed}``.

    Raises:
        ValueError: a pair that is not two different arms of ``selection`` (named).
    """
    check_contrasts(contrasts, list(selection))
    cmps = [compare_selection({b: selection[b], a: selection[a]}, "greedy", **kwargs) for a, b in contrasts]
    runs = any(c.run_level for c in cmps)
    lines = (["| contrast | difference [95% CI] | CI half-width | paired episodes (tasks) | verdict | per seed |",
              "|---|---|---|---|---|---|"] if not runs else
             ["| contrast | difference [95% CI: runs, then tasks] | CI half-width | 95% t-interval over runs | 95% CI "
              "tasks only, runs fixed | paired episodes (tasks) | verdict | per seed |", "|---|---|---|---|---|---|---|---|"])
    data = {}
    for (a, b), cmp in zip(contrasts, cmps):
        d = cmp.differences[0]
        half = (d.ci[1] - d.ci[0]) / 2
        per_seed = {}
        for sd in sorted(set(selection[a]) & set(selection[b])):
            ga, gb = selection[a][sd].greedy, selection[b][sd].greedy
            keys = ga.keys() & gb.keys()
            per_seed[sd] = sum(ga[k] - gb[k] for k in keys) / len(keys) if keys else math.nan
        extra = f" {_span(d.t_ci)} | {_span(d.task_ci)} |" if runs else ""
        lines.append(f"| {a} - {b} | {_ci(d.difference, d.ci, True)} | {half:.2f} |{extra} {d.episodes} ({d.tasks}) | "
                     f"{d.verdict} | {_seeds(per_seed)} |")
        data[f"{a} - {b}"] = {**cmp.to_dict()["differences"][0], "half_width": half,
                              "per_seed": {str(sd): v for sd, v in per_seed.items()}}
    return "\n".join(lines), data


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


@dataclass
class Summary:
    """:func:`summarise` result: ``markdown`` (goes into the README as is) and ``data`` (JSON-ready)."""

    markdown: str
    data: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """``data`` as JSON text, non-finite floats (a turn without tokens) written as ``null``."""
        return json.dumps(json_safe(self.data), indent=1)


def summarise(runs: Runs, *, name: str = "experiment", budget: float | None = None,
              targets: Sequence[float] = (), contrasts: Sequence[Sequence[str]] = (), marks: Sequence[float] = (),
              resamples: int = 10_000, seed: int = 0) -> Summary:
    """The experiment's summary (:mod:`lightning_opd.analysis.curves`) over the seeds every arm has evaluated.

    Args:
        runs: :func:`~lightning_opd.analysis.curves.load_runs` output (arm order = display order; the first arm is
            the reference).
        name: title.
        budget: the experiment's training time budget (seconds) or ``None``.
        targets: greedy success rates for the time-to-target table.
        contrasts: pairs of arm names ``(a, b)``: ``a - b`` at the final checkpoints (:func:`contrast_table`) and
            at each mark.
        marks: training-second marks (seconds): a section per mark comparing the arms there
            (:func:`~lightning_opd.analysis.curves.at_mark`; "not available" while a run has no evaluation for it).
        resamples, seed: of the bootstrap.

    Raises:
        ValueError: no run, no seed that every arm has evaluated, or a contrast that names an unknown arm.
    """
    if not runs:
        raise ValueError("no evaluated checkpoint found: nothing to summarise")
    common = sorted(set.intersection(*(set(seeds) for seeds in runs.values())))
    if not common:
        raise ValueError(f"no seed is evaluated in every arm ({ {a: sorted(s) for a, s in runs.items()} })")
    left_out = sorted({(a, s) for a, seeds in runs.items() for s in seeds if s not in common})
    runs = {arm: {s: seeds[s] for s in common} for arm, seeds in runs.items()}
    kw = {"resamples": resamples, "seed": seed}
    md = [f"## {name}: held-out success over training", "",
          f"Seeds {common}; success = greedy success and Avg@k = mean success of the sampled episodes, both means "
          "over tasks x seeds; iteration = rollout batches; training s = the fit's training seconds (rollouts and "
          "updates, evaluation excluded)" + (f", budget {budget:.0f} s per run." if budget else ".")]
    if left_out:
        md.append(f"Left out (not evaluated in every arm): {', '.join(f'{a} seed {s}' for a, s in left_out)}.")
    data: dict = {"name": name, "seeds": common, "budget": budget, "curves": {}}
    # the sections in order; each appends its markdown lines to ``md`` and its JSON to ``data`` (key order kept)
    _curves_section(runs, md, data)
    _steps_done_section(runs, common, md)
    _same_step_section(runs, md, data, kw)
    _least_time_section(runs, budget, md, data, kw)
    _marks_sections(runs, marks, contrasts, md, data, kw)
    _time_to_target_section(runs, common, targets, md, data)
    _final_and_best_sections(runs, contrasts, md, data, kw)
    _own_traj_kl_section(runs, md, data)
    md += ["", "A difference is called better/worse only when its 95% CI excludes 0; otherwise no difference was "
               "detected at that n. With two or more seeds the CI is the paired two-level bootstrap over training runs, "
               "then tasks (the same drawn tasks in every drawn run; ../shared/docs/algorithms.md §7.3), n = runs x "
               "tasks, and a verdict needs the 95% t-interval over the per-run differences to exclude 0 as well (the "
               "two-level bootstrap undercovers with 2-3 runs); the one-level CI over tasks with the runs held fixed "
               "(it understates the uncertainty) is beside them; with one seed the CI is over tasks (all seeds of a "
               "drawn task)."]
    return Summary("\n".join(md), data)


def _curves_section(runs: Runs, md: list[str], data: dict) -> None:
    """The learning curves: per arm and iteration, the mean training seconds over seeds, greedy success and Avg@k
    (means over all tasks x seeds evaluated at that iteration)."""
    md += ["", "| arm | iteration | training s (mean over seeds) | seeds | greedy success | Avg@k |",
           "|---|---|---|---|---|---|"]
    for arm, seeds in runs.items():
        by_it: dict[int, list[Point]] = {}
        for points in seeds.values():
            for p in points:
                by_it.setdefault(p.iteration, []).append(p)
        curve = []
        for it in sorted(by_it):
            ps = by_it[it]
            secs = [p.seconds for p in ps if p.seconds is not None]
            sec = sum(secs) / len(secs) if secs else None
            g = sum(sum(p.greedy.values()) for p in ps) / sum(len(p.greedy) for p in ps)
            k = (None if any(p.sampled is None for p in ps)
                 else sum(sum(p.sampled.values()) for p in ps) / sum(len(p.sampled) for p in ps))
            curve.append({"iteration": it, "seconds": sec, "seeds": len(ps), "success": g, "avg_at_k": k})
            md.append(f"| {arm} | {it} | {_fmt(sec, 0)} | {len(ps)} | {g:.2f} | {_fmt(k)} |")
        data["curves"][arm] = curve


def _steps_done_section(runs: Runs, common: list[int], md: list[str]) -> None:
    """Each run's last iteration and the training seconds of its last checkpoint."""
    md += ["", "Steps done per run (iterations; training s of the last checkpoint):", "",
           "| arm | " + " | ".join(f"seed {s}" for s in common) + " |", "|---|" + "---|" * len(common)]
    for arm, seeds in runs.items():
        md.append(f"| {arm} | " + " | ".join(f"{seeds[s][-1].iteration} ({_fmt(seeds[s][-1].seconds, 0)} s)"
                                            for s in common) + " |")


def _same_step_section(runs: Runs, md: list[str], data: dict, kw: dict) -> None:
    """Same-Step (:func:`~lightning_opd.analysis.curves.same_step`), or why it is not available."""
    try:
        s, chosen, exact = same_step(runs)
    except ValueError as err:
        md += ["", f"### Same-Step: not available ({err})"]
        return
    text, data["same_step"] = selection_table(chosen, **kw)
    data["same_step"]["iteration"], data["same_step"]["exact"] = s, exact
    how = ("the largest at which every run has an evaluated checkpoint" if exact else
           "no iteration has a checkpoint in every run: the smallest last iteration, each run's latest checkpoint "
           "at or before it")
    md += ["", f"### Same-Step: iteration {s} ({how})", "", text]


def _least_time_section(runs: Runs, budget: float | None, md: list[str], data: dict, kw: dict) -> None:
    """Least-Time (:func:`~lightning_opd.analysis.curves.least_time`), or why it is not available."""
    try:
        t, chosen = least_time(runs, budget)
    except ValueError as err:
        md += ["", f"### Least-Time: not available ({err})"]
        return
    text, data["least_time"] = selection_table(chosen, **kw)
    data["least_time"]["seconds"] = t
    how = (f"; seconds read as min(seconds, budget {budget:.0f} s): a run that used its budget is compared at "
           "its final checkpoint") if budget else ""
    md += ["", f"### Least-Time: {t:.0f} training s (the largest every run reached; each run's checkpoint at or "
               f"before it{how})", "", text]


def _marks_sections(runs: Runs, marks: Sequence[float], contrasts: Sequence[Sequence[str]], md: list[str],
                    data: dict, kw: dict) -> None:
    """One section per training-second mark (:func:`~lightning_opd.analysis.curves.at_mark`), with the named
    contrasts there; a mark some run has no evaluation for says so."""
    if marks:
        data["at_seconds"] = {}
    for m in marks:
        try:
            chosen = at_mark(runs, m)
        except ValueError as err:
            md += ["", f"### At {m:g} training s: not available ({err})"]
            continue
        text, d = selection_table(chosen, **kw)
        late = [f"{arm} seed {sd} ({_fmt(p.seconds, 0)} s)" for arm, ps in chosen.items() for sd, p in ps.items()
                if not p.at_seconds[m]]
        d["not_reached"] = late
        md += ["", f"### At {m:g} training s (each run's checkpoint at the first optimizer step whose training seconds "
                   f"reached {m:g} s; its true iteration and seconds shown)", "", text]
        if late:
            md += ["", f"Not reached (the fit ended at max_steps first; its final checkpoint stands for {m:g} s): "
                       + ", ".join(late) + "."]
        if contrasts:
            text, d["contrasts"] = contrast_table(chosen, contrasts, **kw)
            md += ["", f"At {m:g} training s, named contrasts (paired on the same (task, seed) episodes):", "", text]
        data["at_seconds"][f"{m:g}"] = d


def _time_to_target_section(runs: Runs, common: list[int], targets: Sequence[float], md: list[str],
                            data: dict) -> None:
    """Per arm, target and seed: the first checkpoint at or above the target and the one before it (the crossing
    lies between them), or "not reached" with the run's best success."""
    if not targets:
        return
    md += ["", "### Time to target (first checkpoint whose greedy success >= target; the target was crossed between "
               "the previous checkpoint and it)", "",
           "| arm | target | " + " | ".join(f"seed {s}" for s in common) + " |", "|---|---|" + "---|" * len(common)]
    data["time_to_target"] = {}
    for arm, seeds in runs.items():
        for x in targets:
            cells, rec = [], {}
            for sd in common:
                p = time_to_target(seeds[sd], x)
                if p is None:
                    top = max(q.success for q in seeds[sd])
                    cells.append(f"not reached (best {top:.2f})")
                    rec[str(sd)] = None
                else:  # the crossing lies between the previous checkpoint (below target) and this one
                    before = [q for q in seeds[sd] if q.step < p.step]
                    prev = before[-1].seconds if before else None
                    cells.append("0 s (at the start)" if p.start else
                                 f"{_fmt(p.seconds, 0)} s (iteration {p.iteration}; "
                                 + ("first checkpoint)" if not before else f"below at {_fmt(prev, 0)} s)"))
                    rec[str(sd)] = {"seconds": p.seconds, "iteration": p.iteration, "success": p.success,
                                    "previous_seconds": prev, "start": p.start}
            md.append(f"| {arm} | {x:.2f} | " + " | ".join(cells) + " |")
            data["time_to_target"].setdefault(arm, {})[f"{x:g}"] = rec


def _final_and_best_sections(runs: Runs, contrasts: Sequence[Sequence[str]], md: list[str], data: dict,
                             kw: dict) -> None:
    """The final and the best checkpoints, each against the teacher when its episodes are there; the named
    contrasts at the final checkpoints."""
    for label, chosen, note in (
            ("Final checkpoint", final(runs), "each run's last checkpoint"),
            ("Best checkpoint", best(runs), "each run's checkpoint with the highest greedy success; selected on the "
                                            "same held-out games it is scored on, so it is optimistic")):
        text, d = selection_table(chosen, **kw)
        key = label.split()[0].lower()
        data[key] = d
        md += ["", f"### {label} ({note})", "", text]
        vs = teacher_table(chosen, **kw)
        if vs is not None:
            md += ["", f"{label} against the teacher's own greedy episodes (same tasks, paired):", "", vs[0]]
            data[key]["teacher"] = vs[1]
        if key == "final" and contrasts:
            text, data["final"]["contrasts"] = contrast_table(chosen, contrasts, **kw)
            md += ["", "Final checkpoint, named contrasts (paired on the same (task, seed) episodes):", "", text]


def _own_traj_kl_section(runs: Runs, md: list[str], data: dict) -> None:
    """The teacher's KL per turn on each arm's own greedy episodes at the final checkpoints, won vs failed
    (nats/token, token-weighted over the seeds that measured it); nothing when no seed measured it."""
    finals = final(runs)
    kl = {arm: per_turn_kl(list(chosen.values())) for arm, chosen in finals.items()}
    outcomes = ("won", "failed")
    if not any(k[o]["episodes"] for k in kl.values() for o in outcomes):
        return
    width = max(len(k[o]["per_turn"]) for k in kl.values() for o in outcomes)
    md += ["", "### Teacher KL per turn on the student's own greedy episodes, by outcome (final checkpoints, "
               "nats/token, token-weighted over the seeds that measured it)", "",
           "| arm | seeds measured | outcome | episodes | mean | "
           + " | ".join(f"turn {n}" for n in range(width)) + " |",
           "|---|---|---|---|---|" + "---|" * width]
    for arm, k in kl.items():
        seeds = f"{k['measured']} of {len(finals[arm])}"
        if not k["measured"]:
            md.append(f"| {arm} | {seeds} | not measured (evaluated without the own-trajectory KL) | - | - | "
                      + " | ".join("-" for _ in range(width)) + " |")
            continue
        for outcome in outcomes:
            pt = k[outcome]["per_turn"] + [math.nan] * (width - len(k[outcome]["per_turn"]))
            md.append(f"| {arm} | {seeds} | {outcome} | {k[outcome]['episodes']} | "
                      f"{_fmt(k[outcome]['mean'], 3)} | " + " | ".join(_fmt(v, 3) for v in pt) + " |")
    data["own_traj_kl"] = kl
