"""The demo's held-out table through servers (issue 41): the same recipe with the teacher in-process and served.

Both arms fit ``conf/textworld/opd.yaml`` (20 steps x 4 episodes, lr 5e-5, seed 0) with the teacher-top-50 loss
(``TeacherTopKRenormalizedReverseKL``, which a served teacher can feed; the demo's analytic loss needs the in-process
teacher), exporting each student; the ``remote_teacher`` arm scores on a ``vllm serve`` process of the same teacher
directory (``RemoteTeacher``) started here. Then one ``lightning-opd evaluate`` plays both students (greedy, all 50
held-out games, at most 8 turns) and ``lightning-opd compare`` gives each one's success with its 95% CI and the paired
difference served - in-process (the claim: no worse, i.e. the CI of the difference includes 0 or is above it).

Resumable per arm (an exported student is kept); timings are not claims (the fits may share the cores).
Run: .venv/bin/python -m benchmarks.remote_heldout   (needs ``make prepare teacher install-vllm``)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_json
from benchmarks.remote_step import STUDENT, TEACHER

ROOT = Path("runs/remote_heldout")
GAMES = "artifacts/games/quest3"
LABELS = {"in_process": "student after (OPD, in-process teacher, top-50)",
          "remote_teacher": "student after (OPD, served teacher, top-50)"}


def fit(arm: str, export: Path) -> float:
    """Fit ``arm`` (starting its teacher server when served) and export the student to ``export``; seconds."""
    from lightning_opd.serving import VLLMServer

    model = {"loss": {"class_path": "lightning_opd.losses.TeacherTopKRenormalizedReverseKL", "init_args": {"k": 50}},
             "export_dir": str(export)}
    server = None
    try:
        if arm == "remote_teacher":
            server = VLLMServer(TEACHER, threads=1, kv_cache_memory_bytes=1 << 29, max_model_len=2048).start()
            model["teacher"] = {"class_path": "lightning_opd.teachers.RemoteTeacher", "init_args": {"urls": [server.url]}}
        overrides = {"trainer": {"limit_val_batches": 0,
                                 "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                            "init_args": {"save_dir": str(ROOT), "name": arm}}},
                     "model": {"init_args": model}}
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            json.dump(overrides, f)
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "lightning_opd", "fit", "--config", "conf/textworld/opd.yaml",
                        "--config", f.name], check=True)
        return time.monotonic() - t0
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    log = ROOT / "timings.json"
    timings = json.loads(log.read_text()) if log.exists() else {}
    for arm in LABELS:
        export = ROOT / arm / "student"
        if (export / "config.json").exists():
            print(f"{arm}: student exported already ({export})")
            continue
        timings[f"fit_{arm}_s"] = fit(arm, export)
        write_json(log, timings)
    evaluation = ROOT / "evaluation.json"
    if not evaluation.exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "lightning_opd", "evaluate", "--students",
                        *[f"{LABELS[a]}={ROOT / a / 'student'}" for a in LABELS], "--games", GAMES, "--avg-k", "0",
                        "--out", str(evaluation)], check=True)
        timings["evaluate_s"] = time.monotonic() - t0
        write_json(log, timings)
    subprocess.run([sys.executable, "-m", "lightning_opd", "compare", str(evaluation), "--json",
                    str(ROOT / "comparison.json"), "--force"], check=True)
    print(json.dumps(timings))


if __name__ == "__main__":
    main()
