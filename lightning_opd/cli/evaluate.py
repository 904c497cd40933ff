"""``lightning-opd evaluate``: the command line of :func:`lightning_opd.evaluation.evaluate.evaluate` (the module
docstring there says what is measured and what the output JSON holds) and the summary table it prints."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from lightning_opd.cli.args import command_parser


def evaluate_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-opd evaluate``."""
    from lightning_opd.evaluation.evaluate import DEFAULT_ENV
    from lightning_opd.rollout.vllm import DEFAULT_BLOCK_SIZE

    p = command_parser(
        "evaluate",
        "Evaluate exported students or OPDModule checkpoints on a task split: greedy success, Avg@k "
        "at a temperature, turns, invalid actions and the teacher-trajectory reverse KL; one JSON "
        "with per-episode outcomes keyed by (task, seed), for `lightning-opd compare`.")
    p.add_argument("--students", nargs="+", required=True,
                   help="[LABEL=]PATH: Hugging Face directories or checkpoints of OPDModule runs (.ckpt files or "
                        "an FSDP run's folders of shards; those need --base)")
    p.add_argument("--games", default=None,
                   help="the environment's data directory (first argument of --env: games_dir of TextWorld)")
    p.add_argument("--env", default=DEFAULT_ENV, help="environment factory class path")
    p.add_argument("--env-args", default="{}", help="JSON object of further factory arguments")
    p.add_argument("--split", default="eval", choices=("eval", "train"))
    p.add_argument("--limit", type=int, default=None, help="only the first N tasks of the split (smoke runs)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="episode seeds (keys for pairing)")
    p.add_argument("--avg-k", type=int, default=4, help="sampled episodes per task and seed (0: none)")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled episodes")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16, help="reply limit per turn (tokens)")
    p.add_argument("--max-context-tokens", type=int, default=2048, help="context limit per episode (tokens)")
    p.add_argument("--batch-size", type=int, default=50, help="episodes played together")
    p.add_argument("--backend", default="auto", choices=("auto", "hf", "vllm"),
                   help="generator: vLLM if importable (auto), or HF")
    p.add_argument("--teacher", default=None, help="teacher directory: adds the teacher-trajectory KL")
    p.add_argument("--base", default=None, help="student directory a .ckpt's run started from (architecture, tokenizer)")
    p.add_argument("--cache-dir", default="artifacts/cache/teacher_trajectories",
                   help="where the teacher's trajectories are cached")
    p.add_argument("--device", default="auto", help="device of the HF models (auto: cuda if available)")
    p.add_argument("--dtype", default="float32",
                   help="parameter dtype of every model (HF and vLLM): float32 (default: a checkpoint scores the same on "
                        "every machine), bfloat16, or auto (bfloat16 where the precision probe at the first student's "
                        "shapes finds bf16 matmuls faster on this machine, as `--trainer.precision=auto`; the probe is "
                        "printed, the picked dtype stored in the output JSON's config)")
    p.add_argument("--vllm-kv-cache-bytes", type=int, default=None,
                   help="KV cache of the vLLM engine (bytes); default: room for every episode of a batch at the "
                        "context limit (--batch-size x --max-context-tokens tokens), at least 1 GiB")
    p.add_argument("--vllm-block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per vLLM KV block (the prefix cache reuses whole blocks; default: the training "
                        "rollouts' block, lightning_opd.rollout.vllm.DEFAULT_BLOCK_SIZE); 0: vLLM's default (128 on CPU)")
    p.add_argument("--no-own-traj-kl", dest="own_traj_kl", action="store_false",
                   help="skip the teacher's KL on each student's own greedy episodes (by outcome); it costs a student "
                        "and a teacher forward over every greedy episode")
    p.add_argument("--own-traj-kl", dest="own_traj_kl", action="store_true",
                   help="compute it (the default; after --no-own-traj-kl, e.g. the runner's evaluate_final turning "
                        "it back on for the final checkpoint)")
    p.add_argument("--privileged-context", action="store_true",
                   help="the policies see each task's privileged text before its first observation (the environment's "
                        "privileged_context, e.g. TextWorld's walkthrough): the privileged-context teacher as a policy")
    p.add_argument("--out", required=True, help="output JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    return p


def evaluation_dtype(dtype: str, students: list[str], base: str | None, device: str) -> str:
    """``--dtype`` as a dtype name: ``auto`` resolved by the precision probe at the first student's ``nn.Linear``
    shapes (:func:`~lightning_opd.models.precision.resolve_student_precision`: ``"bfloat16"`` where bf16 matmuls
    probe faster on this machine, CUDA with bf16 support included, else ``"float32"``; printed with the probe's
    numbers), anything else unchanged.

    Raises:
        ValueError: ``auto`` and the first student's config cannot be read (names the path).
    """
    if dtype != "auto":
        return dtype
    import torch

    from lightning_opd.evaluation.evaluate import parse_student
    from lightning_opd.models.precision import resolve_student_precision

    path = parse_student(students[0])[1]
    config_dir = base if base is not None and not Path(path, "config.json").exists() else path
    target = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    choice = resolve_student_precision("auto", config_dir, target)
    picked = choice.as_dict()["weights_dtype"]  # the dtype's name, e.g. "bfloat16"
    print(f"--dtype auto: {picked} ({choice.reason})", flush=True)
    return picked


def evaluate_command(argv: list[str] | None = None) -> dict:
    """``lightning-opd evaluate``: parse, :func:`~lightning_opd.evaluation.evaluate.evaluate` every student, print
    :func:`format_summary`; returns the result written to ``--out``.

    Raises:
        SystemExit: 2 for bad arguments or an existing ``--out`` without ``--force`` (before any model loads).
        ValueError: ``--env-args`` that is not a JSON object.
    """
    from lightning_opd.evaluation import evaluate as ev

    p = evaluate_parser()
    a = p.parse_args(argv)
    if Path(a.out).exists() and not a.force:
        p.error(f"--out {a.out} exists; pass --force to replace it (or choose another --out)")
    try:
        env_args = json.loads(a.env_args)
    except ValueError as err:
        raise ValueError(f"--env-args {a.env_args!r} is not JSON: {err}") from None
    if not isinstance(env_args, dict):
        raise ValueError(f"--env-args {a.env_args!r} must be a JSON object")
    settings = ev.EvalSettings(seeds=a.seeds, avg_k=a.avg_k, temperature=a.temperature, max_turns=a.max_turns,
                               max_new_tokens=a.max_new_tokens, max_context_tokens=a.max_context_tokens,
                               batch_size=a.batch_size, backend=a.backend, device=a.device,
                               dtype=evaluation_dtype(a.dtype, a.students, a.base, a.device),
                               vllm_kv_cache_bytes=a.vllm_kv_cache_bytes, vllm_block_size=a.vllm_block_size or None,
                               own_traj_kl=a.own_traj_kl, privileged_context=a.privileged_context)
    t0 = time.perf_counter()
    result = ev.evaluate(a.students, env_class=a.env, env_args=env_args, games=a.games, split=a.split, limit=a.limit,
                         settings=settings, teacher=a.teacher, base=a.base, cache_dir=a.cache_dir, out=a.out)
    print(format_summary(result))
    print(f"{len(result['tasks'])} {a.split} tasks x seeds {a.seeds}, backend {result['config']['backend']}, "
          f"{time.perf_counter() - t0:.0f} s; wrote {a.out}")
    return result


def format_summary(result: dict) -> str:
    """A markdown table of each student's summary (and the teacher's greedy success)."""
    k = result["config"]["avg_k"]
    header = ["student", "greedy success", "turns", "invalid actions"] + ([f"Avg@{k}"] if k else []) + \
             (["teacher-traj KL (nats/token)"] if result["teacher"] else []) + ["seconds"]
    rows = []
    if result["teacher"]:
        g = result["teacher"]["greedy"]
        rows.append(["teacher (own trajectories)", f"{g['success']:.2f}", f"{g['turns']:.2f}",
                     f"{g['invalid_actions']:.2f}"] + (["-"] if k else []) + ["0"] + [str(result["teacher"]["seconds"])])
    for s in result["students"]:
        g = s["summary"]["greedy"]
        row = [s["name"], f"{g['success']:.2f}", f"{g['turns']:.2f}", f"{g['invalid_actions']:.2f}"]
        if k:
            row.append(f"{s['summary']['sampled']['avg_at_k']:.2f}")
        if result["teacher"]:
            row.append(f"{s['summary']['teacher_traj_kl']['mean']:.4f}")
        rows.append(row + [str(s["seconds"])])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    text = "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    own = [(s["name"], s["summary"]["own_traj_kl"]) for s in result["students"] if "own_traj_kl" in s["summary"]]
    if own:
        width = max(len(part["per_turn"]) for _, k in own for part in k.values())
        text += ("\n\nTeacher KL per turn on each student's own greedy episodes, by outcome (nats/token):\n\n"
                 "| student | outcome | episodes | mean | " + " | ".join(f"turn {n}" for n in range(width)) + " |\n"
                 "|---|---|---|---|" + "---|" * width)
        for name, k in own:
            for outcome in ("won", "failed"):
                part = k[outcome]
                cells = [_kl(v) for v in part["per_turn"]] + ["-"] * (width - len(part["per_turn"]))
                text += f"\n| {name} | {outcome} | {part['episodes']} | {_kl(part['mean'])} | " + " | ".join(cells) + " |"
    return text


def _kl(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"
