"""The demo's multi-turn OPD step, this commit against the main of issue 61's start, side by side in one run (issue 61).

Every arm is the real step, ``python -m lightning_opd fit --config conf/textworld/opd.yaml`` (SmolLM2-135M student,
the TextWorld teacher, 4 episodes of up to 8 turns per step, the vLLM sampler where it imports), run from a git
worktree of the arm's commit (its own code and config, this checkout's ``.venv`` and ``artifacts/``) with
``--trainer.max_steps=--steps``, no validation and no export:

- ``main-fp32``: ``--base`` (default ``d994177``, main when issue 61 was filed), fp32 (its only precision);
- ``head-fp32``: ``--head`` (default ``HEAD``) at ``--trainer.precision=32-true``;
- ``head-fp32-packed``: the same with ``--model.init_args.pack_sequences=auto`` (:mod:`lightning_opd.learner.packing`);
- ``head-auto``: ``--head`` at ``--trainer.precision=auto`` (the probe's pick on this machine, printed by the fit).

A step's time is the wall clock between consecutive step ends (the TensorBoard wall time of ``timing/update_s``), so
the rollout (weight push, sampling, environment), the teacher pass and the update are inside it; step 1 (engine start,
warm-up) is not timed. Rounds run the arms in turn (``--rounds``; main, head, ... then again) so every arm sees the
same machine states; round ``r`` runs every arm at seed ``r``, so the arms of a round play the same episodes while
their sampling agrees (fp32: the first steps, until a kernel's rounding changes a sampled token) and the rounds
vary the episodes. The speed-up of an arm over ``main-fp32``: per round ``r_i = median step(main) / median
step(arm)``, the mean over rounds and its Student-t 95% interval (:func:`benchmarks.peer_trl.ratio_interval`, whose
docstring says why the round is the unit). Each entry keeps the supervised tokens of every timed step
(``train/supervised_tokens``), to check how alike the arms' work was. Run alone.

Results: benchmarks/results/step_vs_main.json (resumable per arm x round), each entry naming its CPU.

Run: .venv/bin/python -m benchmarks.step_vs_main [--rounds 3 --steps 4]   (needs `make prepare teacher`)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ResultFile, markdown_table
from benchmarks.peer_trl import ratio_interval, step_seconds
from benchmarks.remote_step import read_scalars

ROOT = Path(__file__).resolve().parent.parent

#: arm -> (which commit: "base" or "head", extra fit arguments)
ARMS = {"main-fp32": ("base", []),
        "head-fp32": ("head", ["--trainer.precision=32-true"]),
        "head-fp32-packed": ("head", ["--trainer.precision=32-true", "--model.init_args.pack_sequences=auto"]),
        "head-auto": ("head", ["--trainer.precision=auto"])}


def worktree(commit: str, work: Path) -> Path:
    """A detached git worktree of ``commit`` under ``work`` (made once per resolved commit), with this checkout's
    ``artifacts`` linked in; returns its path."""
    sha = subprocess.run(["git", "rev-parse", commit], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    path = work / f"tree_{sha[:10]}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha], cwd=ROOT, check=True)
        (path / "artifacts").symlink_to(ROOT / "artifacts")
    return path


def fit_command(steps: int, logs: Path, extra: list[str], seed: int = 0) -> list[str]:
    """The arm's fit: the demo's config, ``steps`` steps, no validation, no export, TensorBoard under ``logs``, seed
    ``seed`` (Lightning's ``seed_everything`` and the rollouts' ``data.init_args.seed``; 0 is the config's)."""
    return [sys.executable, "-m", "lightning_opd", "fit", "--config", "conf/textworld/opd.yaml",
            f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
            f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
            f"--trainer.logger.init_args.save_dir={logs}", "--trainer.logger.init_args.name=fit",
            "--model.init_args.export_dir=null", *extra]


def run_arm(tree: Path, steps: int, logs: Path, extra: list[str], seed: int) -> dict:
    """One fit of an arm from ``tree`` (its code first on ``PYTHONPATH``); its timed steps and phase seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(fit_command(steps, logs, extra, seed), cwd=tree, env=env, check=True)
    scalars = read_scalars(logs, "fit")
    ends = [w for _, w, _ in sorted(scalars["timing/update_s"])]
    if len(ends) != steps:  # e.g. a killed earlier fit still writing into the same folder
        raise RuntimeError(f"{logs}: {len(ends)} step ends logged for a fit of {steps} steps; remove the folder, rerun")
    series = {tag: [v for _, _, v in sorted(scalars[tag])] for tag in ("timing/rollout_s", "timing/update_s")}
    tokens = [v for _, _, v in sorted(scalars.get("train/supervised_tokens", []))]
    return {"step_s": step_seconds(ends), "median_s": statistics.median(step_seconds(ends)),
            "rollout_s": series["timing/rollout_s"][1:], "update_s": series["timing/update_s"][1:],
            "tokens": tokens[1:]}


def speedup(results: ResultFile, rounds: int, base_arm: str, arm: str) -> str:
    """``arm``'s speed-up over ``base_arm``: the mean over rounds of ``median step(base) / median step(arm)`` with
    its Student-t 95% interval (rounds where both ran), formatted; ``-`` when no round has both."""
    pairs = [(results.data[f"{base_arm}/{r}"]["median_s"], results.data[f"{arm}/{r}"]["median_s"])
             for r in range(rounds) if f"{base_arm}/{r}" in results.data and f"{arm}/{r}" in results.data]
    if not pairs:
        return "-"
    ratio = ratio_interval(*map(list, zip(*pairs)))
    return f"{ratio['ratio']:.3f}" + (f" [{ratio['low']:.3f}, {ratio['high']:.3f}]" if ratio["low"] is not None else "")


def report(results: ResultFile, rounds: int) -> str:
    """Per arm: the median step of each round, the rollout and update medians, and the speed-up over ``main-fp32``
    and over the same commit's ``head-fp32`` (the issue's bf16 line), each with its interval over rounds."""
    rows = []
    for arm in ARMS:
        done = [x for x in (results.data.get(f"{arm}/{r}") for r in range(rounds)) if x]
        if not done:
            continue
        rows.append([arm, done[0].get("commit", "?"), " / ".join(f"{x['median_s']:.1f}" for x in done),
                     f"{statistics.median(v for x in done for v in x['rollout_s']):.1f}",
                     f"{statistics.median(v for x in done for v in x['update_s']):.1f}",
                     speedup(results, rounds, "main-fp32", arm), speedup(results, rounds, "head-fp32", arm),
                     done[0]["cpu"]])
    return markdown_table(["arm", "commit", "median s/step per round (steps 2..N)", "rollout s (median)",
                           "update s (median)", "speed-up over main-fp32 (mean over rounds [95% t])",
                           "speed-up over head-fp32 (same commit)", "CPU"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="d994177", help="today's main of issue 61 (default d994177)")
    p.add_argument("--head", default="HEAD")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per fit; step 1 is not timed")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--work", default="runs/step_vs_main")
    p.add_argument("--results", default="step_vs_main")
    args = p.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        raise SystemExit(f"--steps {args.steps} / --rounds {args.rounds}: need --steps >= 3 (step 1 is not timed; "
                         "a median needs two) and --rounds >= 1")
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    trees = {side: worktree(commit, work) for side, commit in (("base", args.base), ("head", args.head))}
    results = ResultFile(args.results)
    for rnd in range(args.rounds):
        for arm in args.arms:
            key = f"{arm}/{rnd}"
            if key in results:
                continue
            side, extra = ARMS[arm]
            logs = work / f"{arm}_{rnd}"
            shutil.rmtree(logs, ignore_errors=True)
            entry = run_arm(trees[side], args.steps, logs, extra, seed=rnd)
            results.put(key, {**entry, "commit": trees[side].name.removeprefix("tree_"), "args": extra, "seed": rnd})
            print(report(results, args.rounds), flush=True)
    print(report(results, args.rounds))


if __name__ == "__main__":
    main()
