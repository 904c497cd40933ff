"""Tutorial 1 - quickstart: on-policy distillation (OPD) on TextWorld, and per-turn KL in TensorBoard.

What it teaches:

* An OPD run is one LightningCLI command, ``lightning-opd fit --config conf/textworld/opd.yaml``. This
  script calls the same entry point from Python, ``lightning_opd.cli.main([...])``, with a few
  command-line overrides (``--trainer.max_steps=...``, ``--data.init_args.max_turns=...``): any key
  of the YAML can be overridden the same way on the command line.
* Every training step logs the per-turn reverse KL between student and teacher, ``kl/turn_00``,
  ``kl/turn_01``, ... (nats/token, token-weighted over the step's episodes; turns are zero-based).
  The script reads them back from the run's TensorBoard event files with
  ``lightning_opd.analysis.report.read_scalars`` and prints the first and the last step side by side: OPD
  drives the KL down, turn by turn.
* Where to look next: ``tensorboard --logdir OUT`` and ``lightning-opd report RUN_DIR`` (a PNG/HTML
  picture of the run: KL heat map, success, controllers).

Prerequisites (the Makefile builds them; seconds to minutes)::

    make model games teacher    # artifacts/models/smollm2-135m, artifacts/games/quest3,
                                # artifacts/models/teacher-textworld

Run::

    .venv/bin/python tutorials/01_quickstart.py            # real short run: conf/textworld/opd.yaml as is,
                                                           # 20 steps x 4 episodes (about 40 s per step on
                                                           # 2 CPU cores, docs/results.md; plus two held-out evaluations)
    .venv/bin/python tutorials/01_quickstart.py --tiny     # CI smoke run: 2 steps x 2 episodes, 3 turns,
                                                           # 4 held-out games (8 min measured while the 2 cores
                                                           # were shared with other jobs; less alone)
    options: --out DIR (log directory; default runs/tutorials, with --tiny a temporary directory),
             --steps N (optimizer steps)

The same run from the shell::

    lightning-opd fit --config conf/textworld/opd.yaml --trainer.logger.init_args.save_dir=runs/tutorials \\
        --trainer.logger.init_args.name=quickstart
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from prerequisites import check_artifacts  # tutorials/prerequisites.py (this folder)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "conf" / "textworld" / "opd.yaml"
RUN_NAME = "quickstart"
TINY = [  # CI settings: every knob is an ordinary command-line override of the YAML
    "--trainer.max_steps=2",
    "--trainer.val_check_interval=2",  # held-out success once, at the end
    "--data.init_args.episodes_per_step=2",
    "--data.init_args.max_turns=3",  # also sets model.init_args.max_logged_turns (linked by the CLI)
    "--data.init_args.max_new_tokens=8",
    "--data.init_args.env.init_args.num_eval=4",  # 4 held-out games instead of 50
    "--data.init_args.eval_batch_size=4",
]


def fit_args(out: Path, tiny: bool, steps: int | None) -> list[str]:
    """``lightning-opd fit`` arguments: the experiment YAML plus overrides (later ones win)."""
    args = ["fit", "--config", str(CONFIG),
            # absolute paths, so the script runs from any working directory
            f"--model.init_args.student={ROOT / 'artifacts/models/smollm2-135m'}",
            f"--model.init_args.teacher={ROOT / 'artifacts/models/teacher-textworld'}",
            f"--data.init_args.env.init_args.games_dir={ROOT / 'artifacts/games/quest3'}",
            f"--trainer.logger.init_args.save_dir={out}",
            f"--trainer.logger.init_args.name={RUN_NAME}",
            f"--model.init_args.export_dir={out / 'student-quickstart'}"]  # the trained student (HF directory)
    if tiny:
        args += TINY
    if steps is not None:
        args += [f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={min(steps, 10)}"]
    return args


def latest_run(out: Path) -> Path:
    """The newest ``OUT/quickstart/version_N`` directory (TensorBoardLogger numbers the runs)."""
    runs = sorted((out / RUN_NAME).glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    if not runs:
        raise SystemExit(f"no run directory under {out / RUN_NAME}")
    return runs[-1]


def kl_table(series: dict) -> list[str]:
    """Rows ``kl/turn_NN  <first step>  <last step>`` (nats/token; ``-`` where no episode reached the turn)."""
    tags = sorted(t for t in series if t.startswith("kl/turn_"))
    steps = sorted({s for t in tags for s in series[t][0]})
    if not steps:
        return ["no kl/turn_* logged"]
    first, last = steps[0], steps[-1]

    def at(tag: str, step: int) -> str:
        values = dict(zip(*series[tag]))
        v = values.get(step)
        return "-" if v is None or math.isnan(v) else f"{v:.3f}"

    rows = [f"{'tag':<12} {'step ' + str(first):>10} {'step ' + str(last):>10}"]
    rows += [f"{tag:<12} {at(tag, first):>10} {at(tag, last):>10}" for tag in tags]
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CI settings: 2 steps x 2 episodes, 3 turns, 4 held-out games")
    p.add_argument("--out", type=Path, default=None, help="log directory (default runs/tutorials; --tiny: a temp dir)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the YAML's 20, --tiny: 2)")
    a = p.parse_args(argv)
    check_artifacts()
    out = (a.out or (Path(tempfile.mkdtemp(prefix="opd-quickstart-")) if a.tiny else ROOT / "runs/tutorials")).resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is fetched from a model hub

    from lightning_opd.cli import main as lightning_opd
    from lightning_opd.analysis.report import read_scalars

    args = fit_args(out, a.tiny, a.steps)
    print("lightning-opd " + " ".join(args), flush=True)
    lightning_opd(args)  # == `lightning-opd fit --config conf/textworld/opd.yaml ...`

    run_dir = latest_run(out)
    series = read_scalars(run_dir)
    print(f"\nrun directory: {run_dir}")
    print("per-turn reverse KL(student || teacher), nats/token, first vs last logged step:")
    for row in kl_table(series):
        print("  " + row)
    for tag in ("train/kl", "rollout/success", "rollout/turns", "val/success"):
        if tag in series:
            steps, values = series[tag]
            print(f"  {tag:<16} {values[-1]:.3f}  (step {steps[-1]})")
    print("\nnext:")
    print(f"  tensorboard --logdir {out}        # kl/turn_NN, train/*, rollout/*, val/success")
    print(f"  lightning-opd report {run_dir}    # report.png + report.html")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
