"""``lightning-opd report RUN_DIR``: one picture of a run from its TensorBoard event files.

Five panels, drawn with matplotlib (Agg, no display needed) into ``report.png`` and an HTML page
(``report.html``: the picture inline plus a table of every scalar's last value):

1. per-turn reverse KL (``kl/turn_NN``, nats/token) as a heat map, turns x logged steps;
2. success rate: held-out ``val/success`` and training ``rollout/success``;
3. rollout-depth controller (TurnOPD): ``controller/cap``, ``h_eff``, ``h_cov``, ``h_bar`` (turns);
4. staleness (f-OPD): ``staleness/freshness_mean``, ``freshness_min`` and ``rollout/lag`` (versions);
5. schedules: ``schedule/*`` (annealing) and ``turn_blend/alpha``.

A panel whose tags the run did not log says so instead of failing: every method logs a different
subset. Events are read with TensorBoard's ``EventAccumulator`` from every event file under the run
directory (several versions or resumed runs: later files win at equal steps).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

Series = dict[str, tuple[list[int], list[float]]]

PANELS = (
    ("Success rate", ("val/success", "rollout/success"), "fraction"),
    ("Rollout-depth controller", ("controller/cap", "controller/h_eff", "controller/h_cov", "controller/h_bar"), "turns"),
    ("Staleness", ("staleness/freshness_mean", "staleness/freshness_min", "rollout/lag"), "freshness / versions"),
    ("Schedules", ("schedule/", "turn_blend/alpha"), "value"),
)


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
    tags = sorted(t for t in series if t.startswith("kl/turn_"))
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
    return [t for w in wanted for t in sorted(series) if (t.startswith(w) if w.endswith("/") else t == w)]


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``report.png`` and ``report.html`` for the run in ``run_dir`` (into ``out_dir``, default
    ``run_dir``); returns their paths.

    Raises:
        FileNotFoundError: no event files under ``run_dir``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series = read_scalars(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(PANELS) + 1, 1, figsize=(9, 3.2 * (len(PANELS) + 1)), constrained_layout=True)
    turns, steps, matrix = kl_matrix(series)
    ax = axes[0]
    if matrix:
        image = ax.imshow(np.array(matrix, dtype=float), aspect="auto", origin="lower", cmap="viridis",
                          interpolation="nearest", extent=(-0.5, len(steps) - 0.5, min(turns) - 0.5, max(turns) + 0.5))
        ticks = np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        fig.colorbar(image, ax=ax, label="reverse KL (nats/token)")
        ax.set_ylabel("turn")
    else:
        ax.text(0.5, 0.5, "no kl/turn_* logged in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Per-turn reverse KL")
    ax.set_xlabel("step")
    for ax, (title, wanted, unit) in zip(axes[1:], PANELS):
        tags = _tags(series, wanted)
        for tag in tags:
            xs, ys = series[tag]
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=tag)
        if tags:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, f"not logged in this run ({', '.join(wanted)})", ha="center", va="center",
                    transform=ax.transAxes, fontsize=9)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(unit)
    fig.suptitle(f"lightning-opd run: {run_dir}")
    png = out / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    rows = "".join(f"<tr><td>{html.escape(t)}</td><td>{xs[-1]}</td><td>{ys[-1]:.4g}</td></tr>"
                   for t, (xs, ys) in sorted(series.items()))
    page = out / "report.html"
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>lightning-opd report</title></head><body>"
        f"<h1>{html.escape(str(run_dir))}</h1>"
        f"<img alt='run report' src='data:image/png;base64,{base64.b64encode(png.read_bytes()).decode()}'>"
        f"<h2>Last value of every scalar</h2><table border='1'><tr><th>tag</th><th>step</th><th>value</th></tr>"
        f"{rows}</table></body></html>")
    return png, page
