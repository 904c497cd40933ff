"""Run (or continue) an experiment: arms x seeds of ``lightning-opd fit``, every (arm, seed) in its own
process with checkpoints every N steps, the checkpoints evaluated afterwards by ``lightning-opd evaluate``
in a separate process, and the arms compared with paired bootstrap CIs at the end. Stop it at any
moment and run the same command again to continue; finished (arm, seed) pairs are never rerun.

The same command as ``lightning-opd experiment`` (:func:`lightning_opd.cli.experiment.experiment_command`), kept
under this name. The experiment file format: lightning_opd/experiments/experiment.py; the folder layout:
lightning_opd/experiments/runner.py. Example: benchmarks/experiments/opd_seeds.yaml (the demo's OPD, 3 seeds, all
50 held-out games).

Run: .venv/bin/python -m benchmarks.experiment benchmarks/experiments/opd_seeds.yaml
Summary so far (no fit, no evaluate): .venv/bin/python -m benchmarks.experiment EXPERIMENT.yaml --summary
Results: benchmarks/results/<name>/<arm>/seed<k>/, benchmarks/results/<name>/compare.md (final checkpoints) and
benchmarks/results/<name>/summary.md (learning curves against rollout iterations and training seconds,
Same-Step, Least-Time, time to target, final and best checkpoint, per-turn KL by outcome;
lightning_opd/analysis/summary.py)
"""

from __future__ import annotations

from lightning_opd.cli.experiment import experiment_command

if __name__ == "__main__":
    experiment_command(prog="python -m benchmarks.experiment")
