"""The resolved fit configuration of every arm of a shipped experiment, as the runner builds it."""

from __future__ import annotations

import json
from pathlib import Path

from lightning_opd.experiments.experiment import Experiment, load_experiment
from lightning_opd.experiments.runner import Runner

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


def without_controllers(config: dict) -> dict:
    """A copy of a resolved fit config with what legitimately differs between an experiment's arms removed: every
    trainer callback but the runner's ``Timer`` and ``StepCheckpoint`` (the arms' controllers), the run's own paths
    (``default_root_dir``, ``logger``, the callbacks' ``dirpath`` and ``marks_file``, the model's ``export_dir``).
    Two arms with equal results share one recipe."""
    config = json.loads(json.dumps(config))
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"]
                                      if c["class_path"].rsplit(".", 1)[-1] in ("Timer", "StepCheckpoint")]
    for key in ("default_root_dir", "logger"):
        config["trainer"].pop(key)
    for c in config["trainer"]["callbacks"]:
        for key in ("dirpath", "marks_file"):
            c["init_args"].pop(key, None)
    config["model"]["init_args"].pop("export_dir")
    return config
