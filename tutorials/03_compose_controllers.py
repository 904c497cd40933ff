"""Tutorial 3 - composing controllers: run tutorials/03_compose_controllers.yaml and read what each controller did.

What it teaches:

* Controllers are Lightning callbacks, composed in YAML: ``03_compose_controllers.yaml`` appends
  (``trainer.callbacks+:``) ATOD's two ``AnnealingSchedule`` callbacks (kappa, rho), TurnOPD's
  ``RolloutDepthController`` and f-OPD's ``StalenessMonitor`` to the base experiment
  ``conf/textworld/grpo.yaml`` (hybrid loss), and switches rollouts to asynchronous mode. The YAML's
  header says which combinations are valid and why.
* Each controller logs under its own prefix: ``schedule/*`` (kappa, rho), ``controller/*`` (turn cap,
  H_eff, H_cov, H_bar, probe), ``staleness/*`` (lag, drifts, freshness, drops, lag bound). The
  script prints the last value of each from the TensorBoard events (``lightning_opd.analysis.report.read_scalars``)
  and draws the run with ``lightning_opd.analysis.report.render_report`` (the same as ``lightning-opd report RUN_DIR``).

Prerequisites: ``make model games teacher``.

Run::

    .venv/bin/python tutorials/03_compose_controllers.py          # the YAML as is: 20 rollout iterations x 8
                                                                  # episodes (not timed: estimated 30-40 min
                                                                  # on 2 CPU cores; only --tiny is timed)
    .venv/bin/python tutorials/03_compose_controllers.py --tiny   # CI: 2 rollout iterations x 4 episodes
                                                                  # (2 groups of 2), 3 turns (2.3 min measured on
                                                                  # 2 shared CPU cores)
    options: --out DIR (log directory; default runs/tutorials, --tiny: a temporary directory)

The same run from the shell::

    lightning-opd fit --config conf/textworld/grpo.yaml --config tutorials/03_compose_controllers.yaml
    lightning-opd report runs/composed/version_0

Your own intervention policy (teacher intervention, issue 64; docs/usage.md "Teacher intervention"): a policy decides
before each turn of a training episode whether the teacher plays it. Subclass ``InterventionPolicy`` and answer
``teacher_plays(traj, turn)`` from the episode so far (``traj.rewards``, ``traj.invalid_actions``, ``traj.turn_roles``,
``traj.seed``; draw randomness from a generator seeded on ``traj.seed`` and ``turn``, never a global one, so runs
replay and resume exactly). This one lets the teacher open every episode and the student play on from there::

    from lightning_opd.rollout.intervention import InterventionPolicy


    class FirstTurnsTeacher(InterventionPolicy):
        # The teacher plays the first `turns` turns of every training episode; the student the rest.

        def __init__(self, turns: int = 1) -> None:
            if turns < 0:
                raise ValueError(f"turns={turns} must be >= 0 (teacher turns at the start of an episode)")
            self.turns = turns

        def teacher_plays(self, traj, turn: int) -> bool:
            return turn < self.turns

Save it as ``my_policies.py`` on the Python path and choose it in an overlay on ``conf/textworld/opd.yaml``
(``teacher_generator: hf`` samples the teacher's turns from the teacher the module scores with)::

    data:
      init_args:
        intervention:
          class_path: my_policies.FirstTurnsTeacher
          init_args: {turns: 2}
        teacher_generator: hf

A knob that a controller moves during training gets a setter and a state: ``set_intervention_prob`` (the
``AnnealingSchedule(attribute: intervention_prob)`` controller calls it through the DataModule) and
``state_dict`` / ``load_state_dict`` returning plain numbers, as ``AnnealedIntervention`` does. The student trains on
its own turns; ``model.init_args.teacher_turn_loss: {kind: ce}`` also trains it on the teacher's.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from prerequisites import check_artifacts  # tutorials/prerequisites.py (this folder)

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "conf" / "textworld" / "grpo.yaml"
OVERLAY = ROOT / "tutorials" / "03_compose_controllers.yaml"
RUN_NAME = "composed"
PREFIXES = ("schedule/", "controller/", "staleness/")
TINY = [
    "--trainer.max_steps=4",  # optimizer updates: 2 rollout iterations x 2 PPO mini-batches
    "--trainer.limit_val_batches=0",  # no held-out evaluation
    "--data.init_args.episodes_per_step=4",
    "--data.init_args.group_size=2",  # 2 tasks x 2 episodes per step
    "--data.init_args.max_turns=3",  # H_max of the depth controller
    "--data.init_args.max_new_tokens=8",
    "--data.init_args.env.init_args.num_eval=4",
]


def fit_args(out: Path, tiny: bool) -> list[str]:
    args = ["fit", "--config", str(BASE), "--config", str(OVERLAY),
            f"--model.init_args.student={ROOT / 'artifacts/models/smollm2-135m'}",
            f"--model.init_args.teacher={ROOT / 'artifacts/models/teacher-textworld'}",
            f"--data.init_args.env.init_args.games_dir={ROOT / 'artifacts/games/quest3'}",
            f"--trainer.logger.init_args.save_dir={out}",
            f"--trainer.logger.init_args.name={RUN_NAME}",
            f"--model.init_args.export_dir={out / 'student-composed'}"]
    return args + (TINY if tiny else [])


def latest_run(out: Path) -> Path:
    runs = sorted((out / RUN_NAME).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    if not runs:
        raise SystemExit(f"no run directory under {out / RUN_NAME}")
    return runs[-1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CI settings: 2 rollout iterations x 4 episodes, 3 turns")
    p.add_argument("--out", type=Path, default=None, help="log directory (default runs/tutorials; --tiny: a temp dir)")
    a = p.parse_args(argv)
    check_artifacts()
    out = (a.out or (Path(tempfile.mkdtemp(prefix="opd-compose-")) if a.tiny else ROOT / "runs/tutorials")).resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from lightning_opd.cli import main as lightning_opd
    from lightning_opd.analysis.report import read_scalars, render_report

    args = fit_args(out, a.tiny)
    print("lightning-opd " + " ".join(args), flush=True)
    lightning_opd(args)

    run_dir = latest_run(out)
    series = read_scalars(run_dir)
    print(f"\nrun directory: {run_dir}")
    print("last value logged by each controller:")
    for prefix in PREFIXES:
        tags = sorted(t for t in series if t.startswith(prefix))
        if not tags:
            print(f"  {prefix}*  (nothing logged)")
        for tag in tags:
            steps, values = series[tag]
            print(f"  {tag:<30} {values[-1]:>10.4g}  (step {steps[-1]})")
    png, page = render_report(run_dir)  # == lightning-opd report RUN_DIR
    print(f"\nreport: {png}\n        {page}")
    print(f"redraw from the shell: lightning-opd report {run_dir} --force")  # --force: it replaces these two
    print(f"tensorboard --logdir {out}")


if __name__ == "__main__":
    main()
