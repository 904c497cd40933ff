"""``lightning-opd experiment EXPERIMENT.yaml``: run (or continue) an experiment, arms x seeds of ``lightning-opd
fit``, each checkpoint evaluated afterwards by ``lightning-opd evaluate`` and the arms compared at the end
(:mod:`lightning_opd.experiments.runner`: the file format and the folder layout). ``python -m benchmarks.experiment``
is the same command (it calls :func:`experiment_command`)."""

from __future__ import annotations

from pathlib import Path

from lightning_opd.cli.args import command_parser


def experiment_command(argv: list[str] | None = None, prog: str = "lightning-opd experiment") -> dict:
    """``lightning-opd experiment EXPERIMENT.yaml [--results DIR] [--summary] [--arms ARM ...]``; ``prog``: the
    name the help and errors show. Returns the runner's ``{(arm, seed): done record}``, or ``{"summary": markdown}``
    with ``--summary``.

    Raises:
        SystemExit: 2 for bad arguments.
        ValueError, RuntimeError: as :meth:`~lightning_opd.experiments.runner.Runner.run` (a bad experiment file,
            ``--arms`` naming an unknown arm, a held lock, a failed fit or evaluation).
    """
    from lightning_opd.experiments.experiment import load_experiment
    from lightning_opd.experiments.runner import Runner

    p = command_parser("experiment",
                       "Run (or continue) an experiment: arms x seeds of `lightning-opd fit`, checkpoints evaluated "
                       "afterwards, compared at the end.")
    p.prog = prog
    p.add_argument("experiment", help="experiment YAML (see lightning_opd/experiments/experiment.py)")
    p.add_argument("--results", default=None, help="results root (default: benchmarks/results)")
    p.add_argument("--summary", action="store_true",
                   help="only write summary.md/summary.json from the checkpoints evaluated so far (no fit, no evaluate)")
    p.add_argument("--arms", nargs="+", default=None, metavar="ARM",
                   help="with --summary: only these arms and the contrasts between them, over the seeds they all have "
                        "(written to summary-<arm>+<arm>....md); with a run: only these arms' (arm, seed) pairs")
    a = p.parse_args(argv)
    runner = Runner(load_experiment(a.experiment, a.results), cwd=Path.cwd())
    if a.summary:
        return {"summary": runner.summarise_curves(a.arms)}
    return runner.run(a.arms)
