"""The demo's OPD fit (``conf/textworld/opd.yaml``) re-run with several seeds, then every student evaluated
on all 50 held-out games and compared with a paired bootstrap 95% CI over tasks x seeds.

Each seed is one ``lightning-opd fit`` in its own process (``--seed_everything k`` and
``data.init_args.seed k``: task order and every episode's sampling seed), exporting its student to
``artifacts/models/demo-seeds/seed<k>``; in-fit validation is off (the evaluation runs afterwards in a
separate process). Resumable at the level of one seed: a seed whose ``done.json`` exists is never rerun
(written last, atomically); an interrupted one is re-run from the start.

Results: ``benchmarks/results/demo_seeds/seed<k>/`` (fit log, ``done.json`` with the wall time).

Run: .venv/bin/python -m benchmarks.demo_seeds --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS

ROOT = Path(__file__).resolve().parent.parent
LOPD = [sys.executable, "-m", "lightning_opd"]


def fit_seed(seed: int, out: Path, models: Path) -> dict:
    """Run the demo fit with ``seed`` unless ``out/done.json`` exists; returns that record."""
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    export = models / f"seed{seed}"
    cmd = LOPD + ["fit", "--config", "conf/textworld/opd.yaml", f"--seed_everything={seed}",
                  f"--data.init_args.seed={seed}", "--trainer.limit_val_batches=0",
                  f"--model.init_args.export_dir={export}", "--model.init_args.log_text_every_n_steps=0",
                  f"--trainer.logger.init_args.save_dir={out}", "--trainer.logger.init_args.name=fit"]
    t0 = time.time()
    with open(out / "fit.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    record = {"seed": seed, "student": str(export), "fit_seconds": round(time.time() - t0, 1), "command": cmd[2:]}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(done)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--models", default="artifacts/models/demo-seeds", help="where the students are exported")
    a = p.parse_args(argv)
    for seed in a.seeds:
        rec = fit_seed(seed, RESULTS / "demo_seeds" / f"seed{seed}", Path(a.models))
        print(f"seed {seed}: {rec['student']} ({rec['fit_seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
