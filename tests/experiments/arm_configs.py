"""The resolved fit configuration of every arm of a shipped experiment, as the runner builds it."""

from __future__ import annotations

from pathlib import Path

from lightning_opd.experiments.runner import Experiment, Runner, load_experiment

ROOT = Path(__file__).resolve().parents[2]


def resolved_arms(path: Path, results: Path) -> tuple[Experiment, dict[str, dict]]:
    """Load the experiment at ``path`` (results under ``results``) and resolve each arm's ``lightning-opd fit
    --print_config`` with the runner's overlay for the experiment's first seed (``--seed_everything`` and
    ``--data.init_args.seed`` as the runner passes them), checked by the runner's ``_check_steps``.

    Returns ``(experiment, {arm name: resolved config dict})``; raises what the runner raises on a bad arm."""
    exp = load_experiment(path, results=results)
    runner = Runner(exp, cwd=ROOT, echo=lambda *_: None)
    seed = exp.seeds[0]
    configs = {}
    for arm in exp.arms:
        d = exp.run_dir(arm, seed)
        d.mkdir(parents=True)
        cmd = (exp.fit_command + [a for c in arm.configs for a in ("--config", c)]
               + ["--config", str(runner._write_overlay(d, arm))] + arm.overrides
               + [f"--seed_everything={seed}", f"--data.init_args.seed={seed}"])
        configs[arm.name] = runner._resolved_config(d, cmd)
        runner._check_steps(configs[arm.name], arm)
    return exp, configs
