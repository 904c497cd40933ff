"""Behaviour hashes: the sha256 of the student after a 2-step fit of each shipped training config (issue 40's
"Behaviour unchanged" check: a refactor must leave every one of them bit-identical).

For each config below, one ``lightning-opd fit`` in a subprocess (``python -m lightning_opd``, so the package
that the working directory / ``PYTHONPATH`` resolves is the one measured), ``OMP_NUM_THREADS=1``, seeds fixed
(``--seed_everything=0``, ``data.init_args.seed`` as the config has it), ``--trainer.max_steps=2``, no
validation, no checkpoints, no logger; the student is exported with ``--model.init_args.export_dir`` and
hashed: sha256 over its tensors in sorted name order, each as ``name``, dtype, shape and raw bytes
(:func:`state_dict_sha256`; the file bytes are not hashed, so safetensors metadata cannot change it).

Configs (the generator is what each config chooses: ``opd.yaml`` says ``auto``, i.e. vLLM where it imports,
the others HF ``generate``):

* ``opd``: ``conf/textworld/opd.yaml``;
* ``atod``: ``conf/textworld/atod.yaml`` (2 optimizer updates = 1 rollout batch, kappa/rho schedules on);
* ``fopd``: ``conf/textworld/opd.yaml`` + ``conf/callbacks/staleness_monitor.yaml`` +
  ``--data.init_args.<forced-lag key>=2`` (f-OPD's monitor on a forced lag);
* ``turnopd``: ``conf/textworld/turnopd.yaml`` (its ``quest5`` games replaced by ``quest3`` when ``quest5`` is
  missing; recorded in the output).

Run (from the checkout to measure; ``--artifacts`` where ``make prepare teacher`` put the models and games):

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.behaviour_hashes --out benchmarks/results/behaviour_hashes/after.json
    cd /path/to/other/worktree && PYTHONPATH=$PWD /work/main/.venv/bin/python /work/main/benchmarks/behaviour_hashes.py \\
        --artifacts /work/main/artifacts --out /work/main/benchmarks/results/behaviour_hashes/base.json

Prints (and writes to ``--out``) a JSON object ``{"configs": {name: {"sha256": ..., "seconds": ..., "args": [...]}},
"package": path of the lightning_opd that ran, "commit": its git HEAD, "uncommitted": files of lightning_opd/ and
conf/ that differ from it, ...}``; a failed fit is recorded with its
return code and output tail instead of a hash, and the script exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_opd.cpu_isa import cpu_name

CONFIGS = ("opd", "atod", "fopd", "turnopd")


def state_dict_sha256(tensors: dict) -> str:
    """sha256 of a state dict: for every tensor in sorted name order, its name, dtype, shape and raw bytes
    (contiguous, native byte order). Independent of the file format that held it."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def exported_sha256(export_dir: Path) -> str:
    """:func:`state_dict_sha256` of every ``*.safetensors`` file of an exported Hugging Face directory.

    Raises:
        FileNotFoundError: the directory holds no safetensors file.
    """
    from safetensors.torch import load_file

    files = sorted(export_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{export_dir}: no *.safetensors file (did the fit export the student?)")
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return state_dict_sha256(tensors)


def config_args(name: str, artifacts: Path, forced_lag_key: str) -> tuple[list[str], list[str]]:
    """``(fit arguments, notes)`` of config ``name`` (without the common overrides of :func:`run_fit`)."""
    models, games = artifacts / "models", artifacts / "games"
    paths = [f"--model.init_args.student={models / 'smollm2-135m'}",
             f"--model.init_args.teacher={models / 'teacher-textworld'}"]
    notes: list[str] = []
    if name == "opd":
        return ["--config", "conf/textworld/opd.yaml", *paths,
                f"--data.init_args.env.init_args.games_dir={games / 'quest3'}"], notes
    if name == "atod":
        return ["--config", "conf/textworld/atod.yaml", *paths,
                f"--data.init_args.env.init_args.games_dir={games / 'quest3'}"], notes
    if name == "fopd":
        return ["--config", "conf/textworld/opd.yaml", "--config", "conf/callbacks/staleness_monitor.yaml", *paths,
                f"--data.init_args.env.init_args.games_dir={games / 'quest3'}",
                f"--data.init_args.{forced_lag_key}=2"], notes
    if name == "turnopd":
        quest = "quest5"
        if not (games / quest / "manifest.json").exists():
            quest = "quest3"
            notes.append(f"{games / 'quest5'} missing: games_dir overridden to {games / 'quest3'}")
        return ["--config", "conf/textworld/turnopd.yaml", *paths,
                f"--data.init_args.env.init_args.games_dir={games / quest}"], notes
    raise ValueError(f"config {name!r}: use one of {CONFIGS}")


def run_fit(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One 2-step fit in a subprocess (cwd: the current directory), the exported student hashed."""
    fit_args, notes = config_args(name, args.artifacts, args.forced_lag_key)
    export = workdir / name / "student"
    fit_args += [f"--trainer.max_steps={args.steps}", "--trainer.limit_val_batches=0", "--trainer.logger=false",
                 "--trainer.enable_checkpointing=false", "--seed_everything=0",
                 # fp32 on every checkout: the configs' `auto` (issue 61) picks bf16 on CPUs with bf16 units
                 "--trainer.precision=32-true",
                 f"--model.init_args.export_dir={export}", *args.extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    cmd = [sys.executable, "-m", "lightning_opd", "fit", *fit_args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=Path.cwd(), env=env, capture_output=True, text=True, timeout=args.timeout)
    seconds = round(time.perf_counter() - t0, 1)
    out = {"args": fit_args, "seconds": seconds, "notes": notes}
    if proc.returncode != 0:
        out.update(returncode=proc.returncode, output_tail=(proc.stdout + proc.stderr)[-3000:])
        return out
    out["sha256"] = exported_sha256(export)
    return out


def git_head(path: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_dirty(path: Path) -> list[str] | None:
    """Tracked files of ``lightning_opd/`` and ``conf/`` that differ from ``HEAD`` (what ran beyond the commit)."""
    try:
        out = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no", "--",
                              "lightning_opd", "conf"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [line[3:] for line in out.splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"),
                   help="folder with models/smollm2-135m, models/teacher-textworld and games/quest3 (default ./artifacts)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--steps", type=int, default=2, help="trainer.max_steps of every fit (default 2)")
    p.add_argument("--forced-lag-key", default="forced_lag",
                   help="the data.init_args key of the forced lag (default forced_lag)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per fit before it is killed")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="further fit arguments for every config")
    args = p.parse_args()
    args.artifacts = args.artifacts.resolve()
    for need in ("models/smollm2-135m", "models/teacher-textworld", "games/quest3"):
        if not (args.artifacts / need).exists():
            p.error(f"--artifacts {args.artifacts}: {need} is missing (make prepare teacher, or pass --artifacts)")
    probe = subprocess.run([sys.executable, "-c", "import lightning_opd; print(lightning_opd.__file__)"],
                           cwd=Path.cwd(), capture_output=True, text=True)
    result = {"package": probe.stdout.strip() or probe.stderr[-500:], "cwd": str(Path.cwd()),
              "commit": git_head(Path.cwd()), "uncommitted": git_dirty(Path.cwd()), "steps": args.steps,
              "omp_num_threads": 1, "configs": {},
              # benchmarks.common.machine() by hand: this file also runs against another checkout's PYTHONPATH,
              # whose benchmarks/ may predate it, so it imports only lightning_opd.cpu_isa
              "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory(prefix="behaviour_hashes_") as tmp:
        for name in args.configs:
            result["configs"][name] = run_fit(name, args, Path(tmp))
            print(f"{name}: {result['configs'][name].get('sha256', 'FAILED')} "
                  f"({result['configs'][name]['seconds']} s)", file=sys.stderr, flush=True)
            if args.out is not None:  # after every config: a crash keeps what is done
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    if any("sha256" not in v for v in result["configs"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
