"""``lightning-opd results | report | compare | calibrate-freshness``: the commands over a run's logs and evaluation
files (:mod:`lightning_opd.analysis`)."""

from __future__ import annotations

from pathlib import Path

from lightning_opd.cli.args import command_parser


def results_command(argv: list[str]) -> None:
    """``lightning-opd results``: the last value of ``--metric`` per run (exit status 1: no such run or metric)."""
    from lightning_opd.analysis.results import print_results

    p = command_parser("results",
                       "Print the last logged value of a metric for each run directory.")
    p.add_argument("runs", nargs="+", help="LABEL=DIR pairs or DIRs holding TensorBoard event files")
    p.add_argument("--metric", default="val/success")
    a = p.parse_args(argv)
    try:
        print_results(a.runs, a.metric)
    except (FileNotFoundError, KeyError) as err:
        p.exit(1, f"lightning-opd results: error: {err.args[0]}\n")


def report_command(argv: list[str]) -> None:
    """``lightning-opd report``: report.png + report.html of one run (exit status 1: no events or metrics)."""
    from lightning_opd.analysis.report import render_report

    p = command_parser("report",
                       "Draw a run's per-turn KL heat map, success, controller depth, freshness "
                       "and schedules from its TensorBoard events (PNG + HTML).")
    p.add_argument("run_dir", help="run log directory (e.g. runs/demo/opd)")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR)")
    p.add_argument("--baseline", action="append", default=[], metavar="LABEL=VALUE|RUN_DIR",
                   help="a success level drawn as a horizontal line on the success panel: a number in [0, 1] or a "
                        "run directory (its last val/success), e.g. 'student before=0.0' 'teacher=runs/x/teacher'")
    p.add_argument("--force", action="store_true", help="replace an existing report.png / report.html")
    a = p.parse_args(argv)
    for name in ("report.png", "report.html"):
        path = Path(a.out or a.run_dir) / name
        if path.exists() and not a.force:
            p.error(f"{path} exists; pass --force to replace it (or choose another --out)")
    baselines = {}
    for item in a.baseline:
        label, sep, value = item.partition("=")
        if not sep or not label or not value:
            p.error(f"--baseline {item!r}: expected LABEL=VALUE or LABEL=RUN_DIR")
        baselines[label] = value
    try:
        paths = render_report(a.run_dir, a.out, baselines=baselines)
    except (FileNotFoundError, KeyError, ValueError) as err:
        p.exit(1, f"lightning-opd report: error: {err.args[0]}\n")
    for path in paths:
        print(path)


def compare_command(argv: list[str]) -> None:
    """``lightning-opd compare``: :func:`lightning_opd.analysis.compare.main`."""
    from lightning_opd.analysis.compare import main as compare_main

    compare_main(argv)


def calibrate_freshness_command(argv: list[str]) -> None:
    """``lightning-opd calibrate-freshness``: :func:`lightning_opd.analysis.freshness_calibration.main`."""
    from lightning_opd.analysis.freshness_calibration import main as calibrate_main

    calibrate_main(argv)

