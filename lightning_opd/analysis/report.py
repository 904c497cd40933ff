"""``lightning-opd report RUN_DIR``: one picture of a run from its TensorBoard event files.

Panels, drawn with matplotlib (Agg, no display needed) into ``report.png`` and an HTML page
(``report.html``: the picture inline plus a table of every scalar's last value):

1. per-turn reverse KL (``kl/turn_NN``, nats/token) as a heat map, turns x logged steps (integer turn ticks);
2. training reverse KL ``train/kl`` (nats/token, mean over supervised tokens), or ``train/loss`` for SFT;
3. success rate: held-out ``val/success`` and training ``rollout/success``, on a fixed 0-1 axis, with the
   given baselines (e.g. the student before and the teacher) as horizontal dashed lines;
4. rollout-depth controller (TurnOPD): ``controller/cap``, ``h_eff``, ``h_cov``, ``h_bar`` (integer turns);
5. staleness (f-OPD): ``staleness/freshness_mean``, ``freshness_min`` and ``rollout/lag_max`` (versions);
6. schedules: ``schedule/*`` (annealing) and ``turn_blend/alpha``.

Panels 2-6 are drawn only when the run logged one of their tags (a synchronous run's ``rollout/lag_max`` is
always 0 and does not count): every method logs a different subset, and a plain OPD run gets the heat
map, the KL and the success panels. Events are read with TensorBoard's ``EventAccumulator`` from every
event file under the run directory (several versions or resumed runs: later files win at equal steps).
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

Series = dict[str, tuple[list[int], list[float]]]

# (title, wanted tags (a trailing "/" is a prefix), y label, y axis kind: None, "fraction" or "integer")
PANELS = (
    ("Training reverse KL", ("train/kl",), "nats/token", None),
    ("Success rate", ("val/success", "rollout/success"), "fraction of episodes", "fraction"),
    ("Rollout-depth controller", ("controller/cap", "controller/h_eff", "controller/h_cov", "controller/h_bar"),
     "turns", "integer"),
    ("Staleness", ("staleness/freshness_mean", "staleness/freshness_min", "rollout/lag_max"), "freshness / versions",
     None),
    ("Schedules", ("schedule/", "turn_blend/alpha"), "value", None),
)
SFT_PANEL = ("Training loss", ("train/loss",), "nats/token", None)  # instead of the KL panel when no train/kl
#: instead of the KL panel with a teacher without the full vocabulary (a served teacher): the k1 estimate
SAMPLED_KL_PANEL = ("Training reverse KL (k1 estimate at the sampled tokens)", ("train/kl_sampled",), "nats/token", None)


def kl_prefix(series: Series) -> str:
    """``"kl"`` when the run logged the exact per-turn KL (``kl/turn_NN``), else ``"kl_sampled"`` (its k1 estimate,
    logged with a teacher without the full vocabulary, docs/algorithms.md §6.5)."""
    return "kl" if any(t.startswith("kl/turn_") for t in series) or "train/kl" in series else "kl_sampled"


def read_scalars(run_dir: str | Path) -> Series:
    """Every scalar tag under ``run_dir``: ``{tag: (steps, values)}`` sorted by step.

    Raises:
        FileNotFoundError: no TensorBoard event file under ``run_dir``.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(Path(run_dir).rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {str(run_dir)!r}; pass the run's log directory "
                                "(e.g. runs/opd or runs/opd/version_0)")
    merged: dict[str, dict[int, float]] = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            merged.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return {tag: (sorted(points), [points[s] for s in sorted(points)]) for tag, points in merged.items()}


def kl_matrix(series: Series) -> tuple[list[int], list[int], list[list[float]]]:
    """Per-turn KL as ``(turns, steps, matrix)`` with ``matrix[turn][step]`` (nats/token, NaN where a turn
    was not logged at that step, e.g. no episode reached it)."""
    prefix = f"{kl_prefix(series)}/turn_"
    tags = sorted(t for t in series if t.startswith(prefix))
    steps = sorted({s for t in tags for s in series[t][0]})
    col = {s: j for j, s in enumerate(steps)}
    matrix = []
    for t in tags:
        row = [float("nan")] * len(steps)
        for s, v in zip(*series[t]):
            row[col[s]] = v
        matrix.append(row)
    return [int(t.rsplit("_", 1)[1]) for t in tags], steps, matrix


def _tags(series: Series, wanted: tuple[str, ...]) -> list[str]:
    tags = [t for w in wanted for t in sorted(series) if (t.startswith(w) if w.endswith("/") else t == w)]
    return [t for t in tags if not (t == "rollout/lag_max" and not any(series[t][1]))]  # sync run: always 0


def panels(series: Series) -> list[tuple[str, list[str], str, str | None]]:
    """The panels after the heat map that ``series`` has data for: ``(title, tags, y label, y kind)``."""
    chosen = []
    for title, wanted, unit, kind in PANELS:
        if wanted == ("train/kl",) and "train/kl" not in series:
            title, wanted, unit, kind = SAMPLED_KL_PANEL if "train/kl_sampled" in series else SFT_PANEL
        tags = _tags(series, wanted)
        if tags:
            chosen.append((title, tags, unit, kind))
    return chosen


def baseline_value(label: str, value: str | float) -> float:
    """A baseline success level: a number in [0, 1], or a run directory whose last ``val/success`` is used.

    Raises:
        ValueError: a number outside [0, 1].
        FileNotFoundError: neither a number nor a run directory with event files.
        KeyError: the run directory logged no ``val/success``.
    """
    try:
        number = float(value)
    except (TypeError, ValueError):
        series = read_scalars(value)
        if "val/success" not in series:
            raise KeyError(f"baseline {label!r}: {str(value)!r} logged no val/success") from None
        return series["val/success"][1][-1]
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"baseline {label!r}={number}: a success rate must be in [0, 1]")
    return number


def render_report(run_dir: str | Path, out_dir: str | Path | None = None,
                  baselines: dict[str, str | float] | None = None) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` for the run in ``run_dir`` (into ``out_dir``, default
    ``run_dir``); returns their paths.

    Args:
        baselines: ``{label: value}`` success levels drawn on the success panel (:func:`baseline_value`),
            e.g. ``{"student before": 0.0, "teacher": "runs/demo/teacher"}``.

    Raises:
        FileNotFoundError: no event files under ``run_dir`` (or under a baseline's run directory).
        ValueError, KeyError: a baseline is not a success level (:func:`baseline_value`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_scalars(run_dir)
    levels = {label: baseline_value(label, v) for label, v in (baselines or {}).items()}  # fail before drawing
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = panels(series)
    fig, axes = plt.subplots(len(chosen) + 1, 1, figsize=(9, 3.2 * (len(chosen) + 1)), constrained_layout=True,
                             squeeze=False)
    axes = axes[:, 0]
    _draw_kl_heat_map(fig, axes[0], series)
    for ax, panel in zip(axes[1:], chosen):
        _draw_panel(ax, panel, series, levels)
    fig.suptitle(f"lightning-opd run: {run_dir}")
    png = out / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    page = out / "report.html"
    page.write_text(_html_page(run_dir, png, series, levels))
    return png, page


def _draw_kl_heat_map(fig, ax, series: dict) -> None:
    """The per-turn reverse KL (nats/token) as a turns x steps heat map on ``ax`` (a note when none is logged)."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    turns, steps, matrix = kl_matrix(series)
    if matrix:
        image = ax.imshow(np.array(matrix, dtype=float), aspect="auto", origin="lower", cmap="viridis",
                          interpolation="nearest", extent=(-0.5, len(steps) - 0.5, min(turns) - 0.5, max(turns) + 0.5))
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # turns are whole numbers
        fig.colorbar(image, ax=ax, label="reverse KL (nats/token)")
        ax.set_ylabel("turn")
    else:
        ax.text(0.5, 0.5, "no kl/turn_* logged in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Per-turn reverse KL" if kl_prefix(series) == "kl" else "Per-turn reverse KL (k1 estimate)")
    ax.set_xlabel("step")


def _draw_panel(ax, panel: tuple, series: dict, levels: dict[str, float]) -> None:
    """One :func:`panels` entry ``(title, tags, unit, kind)`` on ``ax``; the baselines as dashed lines on a
    ``fraction`` panel (success)."""
    from matplotlib.ticker import MaxNLocator

    title, tags, unit, kind = panel
    for tag in tags:
        xs, ys = series[tag]
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=tag)
    if kind == "fraction":
        ax.set_ylim(-0.02, 1.02)
        for i, (label, level) in enumerate(levels.items()):
            ax.axhline(level, linestyle="--", linewidth=1, color=f"C{len(tags) + i}", label=f"{label} ({level:.2f})")
    if kind == "integer":
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="best")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(unit)


def _html_page(run_dir: str | Path, png: Path, series: dict, levels: dict[str, float]) -> str:
    """The HTML report: the PNG inlined, then the last value of every scalar and the baselines."""
    rows = "".join(f"<tr><td>{html.escape(t)}</td><td>{xs[-1]}</td><td>{_num(ys[-1])}</td></tr>"
                   for t, (xs, ys) in sorted(series.items()))
    rows += "".join(f"<tr><td>baseline: {html.escape(label)}</td><td></td><td>{_num(level)}</td></tr>"
                    for label, level in levels.items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>lightning-opd report</title></head><body>"
            f"<h1>{html.escape(str(run_dir))}</h1>"
            f"<img alt='run report' src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'>"
            f"<h2>Last value of every scalar</h2><table border='1'><tr><th>tag</th><th>step</th><th>value</th></tr>"
            f"{rows}</table></body></html>")


def _num(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"
