"""Reusing a finished (arm, seed) pair of another experiment instead of fitting it again (an arm's ``reuse:``)::

    arms:
      sampled:
        configs: [conf/textworld/opd.yaml, conf/model/opd_sampled.yaml, conf/model/lr_warmup2.yaml]
        overrides: [--trainer.precision=32-true, ...]
        reuse: fopd_answer/sync      # <results>/fopd_answer/sync/seed<k>, for each seed it has finished

Several experiments share an arm (a placebo control's reference is another experiment's main arm; a pilot's runs are
the arms' first seeds). Refitting costs hours on a 2-core machine; copying by hand trusts that the recipes are the
same. Here the sameness is checked, per seed, before anything is copied (:func:`check_reusable`):

1. the source pair is finished (its ``done.json``);
2. its resolved fit configuration (``fit_config.yaml``, ``fit --print_config`` with the runner's overlay) equals
   this pair's once the source's run folder is read as this one (the logs, checkpoints and export live under it): the
   same configs, overrides, seed, step budget, checkpoint cadence and marks; the keys that differ are named;
3. it evaluated what this arm evaluates (the final checkpoint; every checkpoint with ``evaluate_checkpoints: all``;
   the ``evaluate_at_seconds`` marks' checkpoints) with this experiment's ``evaluate`` arguments (each evaluation's
   command line in the source's ``eval.log``, from ``--base`` on, must be the one this runner would run);
4. with ``evaluate_start``, it continued the same starting student (``start_sha256`` in the two ``done.json``);
5. with ``trainer.precision: auto``, both experiments picked the same precision (their ``precision.json``).

Not compared (stated, not checked): the code version, ``evaluate_command``, and the weights behind a teacher or base
path (rebuilt at the same path they pass), and a start accepted only as an ``equivalents`` entry is refused.

Then :func:`copy_pair` empties this pair's folder (but its own resolved config and overlay) and copies the
source folder (TensorBoard logs, fit and evaluation logs, the checkpoints where they were kept, and only the evaluations
this arm makes) and writes this pair's ``done.json``, its evaluation paths under this folder and
``"reused_from"`` naming the source. A seed the source has not finished is fitted as usual. PROPOSED here (runner
plumbing, not an algorithm).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from lightning_opd.files import write_text_atomic

_STEP_FILE = re.compile(r"^step=(\d+)\.json$")


def config_differences(a, b, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two parsed YAML trees (``a`` this pair's, ``b`` the source's), with
    both values: ``"model.init_args.optimizer.init_args.lr: 0.0001 here, 2e-05 in the source"``; ``[]`` when equal.
    Lists are compared item by item (``trainer.callbacks[1]....``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            where = f"{prefix}.{key}" if prefix else str(key)
            if key not in a or key not in b:
                out.append(f"{where}: {'missing here' if key not in a else repr(a[key]) + ' here'}, "
                           f"{'missing in the source' if key not in b else repr(b[key]) + ' in the source'}")
            else:
                out += config_differences(a[key], b[key], where)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in config_differences(x, y, f"{prefix}[{i}]")]
    same = a == b and type(a) is type(b)  # 1 (one batch) is not 1.0 (all batches)
    return [] if same else [f"{prefix}: {a!r} here, {b!r} in the source"]


def evaluated_steps(done: dict) -> list[int]:
    """Optimizer steps of the evaluations a ``done.json`` lists (``eval/step=N.json``), in its order."""
    return [int(m.group(1)) for p in done.get("evaluations", []) if (m := _STEP_FILE.match(Path(p).name))]


def needed_steps(final: int, every: int, evaluated: str, marks: list[int]) -> list[int]:
    """Checkpoint steps whose evaluations an arm needs: ``final`` (optimizer steps), every multiple of ``every``
    below it with ``evaluated == "all"``, and the steps standing for training-second ``marks``; sorted."""
    steps = {final, *marks}
    if evaluated == "all":
        steps |= set(range(every, final, every))
    return sorted(steps)


def evaluation_command(log: Path, out: Path) -> str | None:
    """The arguments from ``--base`` on of the last command in ``log`` (the runner's ``eval.log``: ``$ <command>``
    lines) that wrote ``out``; ``None`` when no command there wrote it."""
    if not log.is_file():
        return None
    found = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("$ ") and f" --out {out} " in line + " " and " --base " in line:
            found = line[line.index(" --base ") + 1:]
    return found


def check_reusable(source: Path, target: Path, config: dict, expected: dict[int, list[str]],
                   start_sha256: str | None, precision: str | None = None) -> dict:
    """Check that the finished pair in ``source`` is the pair this runner would make in ``target`` (module
    docstring, checks 2-5) and return the source's ``done.json``.

    Args:
        source: the source pair's folder (``<results>/<experiment>/<arm>/seed<k>``), with ``done.json``.
        target: this pair's folder, whose ``fit_config.yaml`` is ``config``.
        config: this pair's resolved fit configuration (parsed ``fit_config.yaml``).
        expected: ``{step: evaluate arguments from --base on}`` for every checkpoint step this arm evaluates
            (:meth:`Runner.evaluate_args` plus the final flags on the final step).
        start_sha256: this experiment's starting student's sha256 (``evaluate_start``), or ``None``.
        precision: this experiment's pick for ``trainer.precision: auto`` (its ``precision.json``), or ``None`` when
            the configuration names a precision (then compared as part of it).

    Raises:
        ValueError: the recipes differ: the configuration keys that differ (up to 8, and how many), an evaluation
            the source lacks or made with other arguments (both command lines), another starting student, or another
            pick for ``precision: auto``; each
            message names the source and says what to do (fit this pair: remove the arm's ``reuse``).
        FileNotFoundError: the source has no ``done.json`` or ``fit_config.yaml``.
    """
    done = json.loads((source / "done.json").read_text())
    resolved_in = str(done.get("run_dir") or source)  # the folder its fit_config.yaml was resolved for
    ran_in = str((done.get("reused_from") or {}).get("run_dir") or resolved_in)  # where it ran: its eval.log's paths
    fix = "fit this pair instead (remove `reuse` from the arm), or reuse a pair of the same recipe"
    text = (source / "fit_config.yaml").read_text().replace(resolved_in, str(target))
    differ = config_differences(config, yaml.safe_load(text) or {})
    if differ:
        more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
        raise ValueError(f"{target} cannot reuse {source}: the resolved fit configurations differ in "
                         f"{'; '.join(differ[:8])}{more}: {fix}")
    have = set(evaluated_steps(done))
    for step, args in sorted(expected.items()):
        if step not in have:
            raise ValueError(f"{target} cannot reuse {source}: it has no evaluation of step {step} (it evaluated "
                             f"steps {sorted(have)}): {fix}")
        made = evaluation_command(source / "eval.log", Path(ran_in) / "eval" / f"step={step}.json")
        want = " ".join(args)
        if made is None or made.replace(ran_in, str(target)) != want:
            raise ValueError(f"{target} cannot reuse {source}: step {step} was evaluated with other arguments:\n"
                             f"  source: {made}\n  here:   {want}\n{fix}")
    theirs = done.get("start_sha256")
    if start_sha256 is not None and theirs != start_sha256:
        raise ValueError(f"{target} cannot reuse {source}: it continued another starting student (sha256 "
                         f"{str(theirs)[:12]}..., this experiment's {start_sha256[:12]}...): {fix}")
    if precision is not None:
        picked = source.parents[1] / "precision.json"
        theirs = json.loads(picked.read_text())["precision"] if picked.is_file() else None
        if theirs != precision:
            raise ValueError(f"{target} cannot reuse {source}: trainer.precision=auto picked {theirs!r} there "
                             f"({picked}), {precision!r} here: {fix}")
    return done


def copy_pair(source: Path, target: Path, done: dict, steps: list[int]) -> dict:
    """Empty ``target`` but its own ``fit_config.yaml`` and ``runner_overlay.yaml``, copy the source pair's files
    into it (of its evaluations only those of ``steps``; ``fit.done`` last) and write ``target/done.json`` last
    (atomically): the source's record with ``run_dir``, ``evaluations`` under ``target``: those of ``steps``
    (optimizer steps, the checkpoints this arm evaluates), and ``"reused_from":
    {"run_dir": <where it ran, through any earlier copies>, "copied_from": <source>}``. Returns the record."""
    keep = {"fit_config.yaml", "runner_overlay.yaml"}
    for item in target.iterdir():  # a partial fit or an interrupted copy: nothing of it may mix with the source's
        if item.name not in keep:
            shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
    for item in source.iterdir():
        if item.name in keep | {"done.json", "fit.done", "eval"}:
            continue
        if item.is_dir():
            shutil.copytree(item, target / item.name, symlinks=True)
        else:
            shutil.copy2(item, target / item.name, follow_symlinks=False)
    (target / "eval").mkdir()
    for s in steps:  # only this arm's evaluations (the summary reads every eval/step=N.json it finds)
        shutil.copy2(source / "eval" / f"step={s}.json", target / "eval" / f"step={s}.json")
    shutil.copy2(source / "fit.done", target / "fit.done")  # last but done.json: an interrupted copy is redone
    record = {**done, "arm": target.parent.name, "run_dir": str(target),
              "evaluations": [str(target / "eval" / f"step={s}.json") for s in sorted(steps)],
              "reused_from": {"run_dir": str((done.get("reused_from") or {}).get("run_dir") or done.get("run_dir")
                                             or source), "copied_from": str(source)}}
    write_text_atomic(target / "done.json", json.dumps(record, indent=1))
    return record
