"""The demo's OPD fit (``conf/textworld/opd.yaml``) re-run with several seeds, then every student evaluated
on all 50 held-out games, the seeds' success with a 95% CI that counts the training runs (a two-level bootstrap over
seeds, then tasks; ../shared/docs/algorithms.md §7.3) and, labelled, the one over tasks with the seeds held fixed.

Each seed is one ``lightning-opd fit`` in its own process (``--seed_everything k`` and
``data.init_args.seed k``: task order and every episode's sampling seed), exporting its student to
``artifacts/models/demo-seeds/seed<k>``; in-fit validation is off (the evaluation runs afterwards in a
separate process). Resumable at the level of one seed: a seed whose ``done.json`` exists is never rerun
(written last, atomically); an interrupted one is re-run from the start.

Then each student is evaluated greedily on all 50 held-out games in its own ``lightning-opd evaluate``
process, with episode seed ``k`` (the pairing key, so the three students merge into one arm of 50 x 3
episodes); evaluation is
resumable per JSON (one that exists is never rerun). Last, ``lightning-opd compare`` prints the student
after over 50 games x 3 seeds with its 95% CI (runs resampled, then tasks; beside it each seed's success and the
interval over tasks with the seeds held fixed), and a per-seed table follows. The student before and the teacher are in ``make demo``'s table (greedy decoding
on these games is deterministic, so repeating them per seed would add time and no information).

Results: ``benchmarks/results/demo_seeds/seed<k>/`` (fit log, ``done.json`` with the wall time),
``benchmarks/results/demo_seeds/eval/*.json`` (evaluate outputs, with seconds), ``table.md``.

Precision (issue 61): ``--precision 32-true|bf16-mixed|bf16-true|auto`` trains every seed at that
``trainer.precision`` into ``benchmarks/results/demo_seeds_<precision>/`` (students under ``<--models>-<precision>``);
without it the recorded run of 2026-12-01 (``demo_seeds/``, the config's precision then: fp32) is read and resumed.
Every student is evaluated at ``--eval-dtype`` (default float32, the same for every arm, so a difference is the
training precision's). ``--against P`` then prints the paired difference (this precision minus ``P``, both arms
over the same seeds and tasks): the two-level interval over runs then tasks, and the t-interval over runs
(``lightning-opd compare``), written to ``demo_seeds_<precision>/vs_<P>.md``.

Run: .venv/bin/python -m benchmarks.demo_seeds --seeds 0 1 2 [--precision bf16-mixed --against 32-true]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, write_json
from lightning_opd.cpu_isa import cpu_name

ROOT = Path(__file__).resolve().parent.parent
LOPD = [sys.executable, "-m", "lightning_opd"]
GAMES = "artifacts/games/quest3"
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "auto")


def fit_seed(seed: int, out: Path, models: Path, precision: str | None = None) -> dict:
    """Run the demo fit with ``seed`` (at ``trainer.precision=precision`` when given, else the config's) unless
    ``out/done.json`` exists; returns that record."""
    done = out / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    export = models / f"seed{seed}"
    cmd = LOPD + ["fit", "--config", "conf/textworld/opd.yaml", f"--seed_everything={seed}",
                  f"--data.init_args.seed={seed}", "--trainer.limit_val_batches=0",
                  f"--model.init_args.export_dir={export}", "--model.init_args.log_text_every_n_steps=0",
                  f"--trainer.logger.init_args.save_dir={out}", "--trainer.logger.init_args.name=fit"]
    if precision is not None:
        cmd.append(f"--trainer.precision={precision}")
    t0 = time.time()
    with open(out / "fit.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    record = {"seed": seed, "student": str(export), "fit_seconds": round(time.time() - t0, 1), "command": cmd[2:],
              "cpu": cpu_name()}
    write_json(done, record)
    return record


def evaluate_student(label: str, path: str, seeds: list[int], out: Path, teacher: str,
                     dtype: str = "float32") -> Path:
    """``lightning-opd evaluate`` one student greedily on the 50 held-out games with episode ``seeds`` at parameter
    ``dtype`` (and the teacher-trajectory KL against ``teacher``) unless ``out`` exists; returns ``out``."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = LOPD + ["evaluate", "--students", f"{label}={path}", "--games", GAMES, "--seeds", *map(str, seeds),
                  "--avg-k", "0", "--teacher", teacher, "--dtype", dtype, "--out", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    return out


def arm_dir(precision: str | None) -> Path:
    """Where the seeds of ``precision`` keep their results: ``demo_seeds_<precision>``, or the recorded
    ``demo_seeds`` (2026-12-01, fp32) for ``None``."""
    return RESULTS / ("demo_seeds" if precision is None else f"demo_seeds_{precision}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--models", default="artifacts/models/demo-seeds", help="where the students are exported")
    p.add_argument("--teacher", default="artifacts/models/teacher-textworld")
    p.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="trainer.precision of every fit (default: the recorded 2026-12-01 run, fp32)")
    p.add_argument("--eval-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter dtype of every evaluation (the same for all arms)")
    p.add_argument("--against", default=None, choices=PRECISIONS,
                   help="after the seeds: this precision's success minus that one's (its seeds must be done)")
    a = p.parse_args(argv)
    if a.against is not None and a.against == a.precision:
        p.error(f"--against {a.against} is --precision itself; name the other arm (e.g. 32-true)")
    root = arm_dir(a.precision)
    models = Path(a.models) if a.precision is None else Path(f"{a.models}-{a.precision}")
    evals = []
    for seed in a.seeds:
        rec = fit_seed(seed, root / f"seed{seed}", models, a.precision)
        print(f"seed {seed}: {rec['student']} ({rec['fit_seconds']:.0f} s)", flush=True)
        evals.append(evaluate_student(f"seed{seed}", rec["student"], [seed], root / "eval" / f"seed{seed}.json",
                                      a.teacher, a.eval_dtype))
    merged = ",".join(map(str, evals))
    from lightning_opd.analysis.compare import main as compare
    label = f"OPD, {a.precision or 'fp32, 2026-12-01'}, {len(a.seeds)} seeds"
    # the seeds as one arm: rate + CI over seeds (training runs), then tasks; the tasks-only CI beside it
    table = ["### greedy success, 50 held-out games x training seeds " + " ".join(map(str, a.seeds)),
             compare([f"student after ({label})={merged}"]).to_markdown()]
    runs = [json.loads(Path(e).read_text())["students"][0] for e in evals]
    rows = ["| seed | success | turns | invalid actions | teacher-traj KL | fit seconds | evaluate seconds |",
            "|---|---|---|---|---|---|---|"]
    for seed, r in zip(a.seeds, runs):
        g = r["summary"]["greedy"]
        fit_s = json.loads((root / f"seed{seed}" / "done.json").read_text())["fit_seconds"]
        rows.append(f"| {seed} | {g['success']:.2f} | {g['turns']:.2f} | {g['invalid_actions']:.2f} | "
                     f"{r['summary']['teacher_traj_kl']['mean']:.3f} | {fit_s:.0f} | {r['seconds']:.0f} |")
    table += ["### per seed (greedy success; teacher-trajectory reverse KL in nats/token)", "\n".join(rows)]
    text = "\n\n".join(table) + "\n"
    (root / "table.md").write_text(text)
    print(text)
    if a.against is not None:
        other = [arm_dir(a.against) / "eval" / f"seed{seed}.json" for seed in a.seeds]
        missing = [str(o) for o in other if not o.exists()]
        if missing:
            raise SystemExit(f"--against {a.against}: no evaluation of {missing}; run --precision {a.against} "
                             f"--seeds {' '.join(map(str, a.seeds))} first")
        diff = compare([f"{a.against}=" + ",".join(map(str, other)), f"{a.precision}={merged}", "--runs", "seed"])
        text = (f"### {a.precision} minus {a.against}: greedy success, 50 held-out games x training seeds "
                + " ".join(map(str, a.seeds)) + f" (CPU: {cpu_name()})\n\n" + diff.to_markdown() + "\n")
        (root / f"vs_{a.against}.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
