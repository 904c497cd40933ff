"""A stand-in for ``lightning-opd fit`` / ``evaluate`` in the runner tests: it follows the command-line
contract the runner relies on (``--print_config``, ``--ckpt_path``, the runner overlay's checkpoint
folder and interval, ``--out``) without a model, and appends every call to ``$FAKE_CALLS``.

    python tests/experiments/fake_lopd.py fit --config ... [--trainer.max_steps=N] [--ckpt_path=...]
    python tests/experiments/fake_lopd.py evaluate --students LABEL=CKPT --seeds K --out FILE ...
        (LABEL ``start``: the runner's starting student, a model folder that is not read: step 0, no seconds)

Fit: one step every ``$FAKE_STEP_SECONDS`` seconds up to ``trainer.max_steps`` (default 4), a checkpoint
(JSON text ``{"step": N, "train_seconds": s}``) and ``last.ckpt`` every ``every_n_train_steps`` and at the
last step, each written atomically. Training seconds are counted, not measured: ``$FAKE_SECONDS_PER_STEP``
(default 10) per step, continued from the resumed checkpoint; the overlay's Timer ``duration`` (DD:HH:MM:SS)
stops the fit at the first step whose count reaches it, like Lightning's Timer. With the overlay's
``at_seconds`` (``evaluate_at_seconds``) the first step whose count reaches each mark is checkpointed too (once)
and the marks reached are kept in the checkpoints and written to ``marks_file``, like ``StepCheckpoint``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml


def log_call(record: dict) -> None:
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps(record) + "\n")


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def fit(argv: list[str]) -> None:
    configs = [argv[i + 1] for i, a in enumerate(argv) if a == "--config"]
    opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    steps = int(opts.get("trainer.max_steps", 4))
    if "--print_config" in argv:
        trainer = {"max_steps": steps, "limit_val_batches": float(opts.get("trainer.limit_val_batches", 1.0)),
                   "max_time": opts.get("trainer.max_time"), "precision": opts.get("trainer.precision")}
        print(yaml.safe_dump({"seed_everything": int(opts["seed_everything"]), "trainer": trainer,
                              "model": {"init_args": {"student": opts.get("model.init_args.student", "base-dir"),
                                                        "teacher": "teacher-dir"}},
                              "data": {"init_args": {"env": {"class_path": "envs.Fake", "init_args": {"games_dir": "g"}},
                                                     "max_turns": 3, "eval_max_turns": None, "max_new_tokens": 5}}}))
        return
    overlay = yaml.safe_load(Path(configs[-1]).read_text())
    callbacks = {c["class_path"].rsplit(".", 1)[-1]: c["init_args"] for c in overlay["trainer"]["callbacks+"]}
    ckpt, duration = callbacks["StepCheckpoint"], callbacks["Timer"]["duration"]
    budget = None if duration is None else sum(int(x) * f for x, f in zip(duration.split(":"), (86400, 3600, 60, 1)))
    folder, every = Path(ckpt["dirpath"]), int(ckpt["every_n_train_steps"])
    resumed = json.loads(Path(opts["ckpt_path"]).read_text()) if "ckpt_path" in opts else {"step": 0, "train_seconds": 0}
    start, seconds = resumed["step"], resumed["train_seconds"]
    marks, reached = [float(m) for m in ckpt.get("at_seconds") or []], dict(resumed.get("reached", []))

    def write_marks():
        if ckpt.get("marks_file"):
            write(Path(ckpt["marks_file"]), json.dumps({"marks": [
                {"mark": m, "step": reached[m][0] if m in reached else None,
                 "seconds": reached[m][1] if m in reached else None} for m in marks]}))
    log_call({"cmd": "fit", "dir": str(folder.parent), "seed": opts["seed_everything"], "data_seed":
              opts.get("data.init_args.seed"), "ckpt_path": opts.get("ckpt_path"), "start": start, "seconds": seconds,
              "precision": opts.get("trainer.precision")})
    folder.mkdir(parents=True, exist_ok=True)
    write_marks()
    step = start
    while step < steps and (budget is None or seconds < budget):
        time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0")))
        step, seconds = step + 1, seconds + float(os.environ.get("FAKE_SECONDS_PER_STEP", "10"))
        last = step == steps or (budget is not None and seconds >= budget)
        new = [m for m in marks if m not in reached and seconds >= m]
        reached.update({m: (step, seconds) for m in new})
        if step % every == 0 or last or new:
            state = json.dumps({"step": step, "train_seconds": seconds, "reached": list(reached.items())})
            write(folder / f"step={step}.ckpt", state)
            write(folder / "last.ckpt", state)
            log_call({"cmd": "save", "dir": str(folder.parent), "step": step})
        if new:
            write_marks()
    write_marks()


def evaluate(argv: list[str]) -> None:
    out = Path(argv[argv.index("--out") + 1])
    label, _, ckpt = argv[argv.index("--students") + 1].partition("=")
    seed = int(argv[argv.index("--seeds") + 1])
    log_call({"cmd": "evaluate", "out": str(out), "ckpt": ckpt, "argv": argv})
    time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0")))
    state = {"step": 0, "train_seconds": None} if label == "start" else json.loads(Path(ckpt).read_text())
    good = {"a": 2, "start": 1}.get(label, 4)  # arm b wins every task, arm a half of them, the start one
    greedy = [{"task_id": f"t{i}", "seed": seed, "success": int(i < good), "turns": 3} for i in range(4)]
    out.parent.mkdir(parents=True, exist_ok=True)
    write(out, json.dumps({"config": {"step": state["step"]}, "students": [
        {"name": label, "greedy": greedy, "global_step": state["step"], "train_seconds": state["train_seconds"]}]}))


if __name__ == "__main__":
    {"fit": fit, "evaluate": evaluate}[sys.argv[1]](sys.argv[2:])
