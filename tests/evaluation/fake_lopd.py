"""A stand-in for ``lightning-opd fit`` / ``evaluate`` in the runner tests: it follows the command-line
contract the runner relies on (``--print_config``, ``--ckpt_path``, the runner overlay's checkpoint
folder and interval, ``--out``) without a model, and appends every call to ``$FAKE_CALLS``.

    python tests/evaluation/fake_lopd.py fit --config ... [--trainer.max_steps=N] [--ckpt_path=...]
    python tests/evaluation/fake_lopd.py evaluate --students LABEL=CKPT --seeds K --out FILE ...

Fit: one step every ``$FAKE_STEP_SECONDS`` seconds up to ``trainer.max_steps`` (default 4), a checkpoint
(JSON text ``{"step": N}``) and ``last.ckpt`` every ``every_n_train_steps``, each written atomically.
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
        print(yaml.safe_dump({"seed_everything": int(opts["seed_everything"]), "trainer": {"max_steps": steps},
                              "model": {"init_args": {"student": "base-dir", "teacher": "teacher-dir"}},
                              "data": {"init_args": {"env": {"class_path": "envs.Fake", "init_args": {"games_dir": "g"}},
                                                     "max_turns": 3, "eval_max_turns": None, "max_new_tokens": 5}}}))
        return
    overlay = yaml.safe_load(Path(configs[-1]).read_text())
    ckpt = overlay["trainer"]["callbacks+"][0]["init_args"]
    folder, every = Path(ckpt["dirpath"]), int(ckpt["every_n_train_steps"])
    start = json.loads(Path(opts["ckpt_path"]).read_text())["step"] if "ckpt_path" in opts else 0
    log_call({"cmd": "fit", "dir": str(folder.parent), "seed": opts["seed_everything"], "data_seed":
              opts.get("data.init_args.seed"), "ckpt_path": opts.get("ckpt_path"), "start": start})
    folder.mkdir(parents=True, exist_ok=True)
    for step in range(start + 1, steps + 1):
        time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0")))
        if step % every == 0:
            write(folder / f"step={step}.ckpt", json.dumps({"step": step}))
            write(folder / "last.ckpt", json.dumps({"step": step}))


def evaluate(argv: list[str]) -> None:
    out = Path(argv[argv.index("--out") + 1])
    label, _, ckpt = argv[argv.index("--students") + 1].partition("=")
    seed = int(argv[argv.index("--seeds") + 1])
    log_call({"cmd": "evaluate", "out": str(out), "ckpt": ckpt, "argv": argv})
    time.sleep(float(os.environ.get("FAKE_STEP_SECONDS", "0")))
    step = json.loads(Path(ckpt).read_text())["step"]
    good = 2 if label == "a" else 4  # arm b wins every task, arm a half of them
    greedy = [{"task_id": f"t{i}", "seed": seed, "success": int(i < good), "turns": 3} for i in range(4)]
    out.parent.mkdir(parents=True, exist_ok=True)
    write(out, json.dumps({"config": {"step": step}, "students": [{"name": label, "greedy": greedy}]}))


if __name__ == "__main__":
    {"fit": fit, "evaluate": evaluate}[sys.argv[1]](sys.argv[2:])
