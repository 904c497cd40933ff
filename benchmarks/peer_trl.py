"""Side by side with TRL on its own workload: single-turn on-policy distillation (issue 43).

The workload (fixed for both): the first-turn prompts of the TextWorld training games (system message + first
observation, the chat template of each side's tokenizer), 4 prompts per optimizer step, at most 16 new tokens sampled
at temperature 1, the full-vocabulary reverse KL (TRL's ``beta=1``; ours ``FullVocabReverseKL``), AdamW lr 5e-5,
no weight decay, fp32, the SmolLM2-135M student and the demo's LoRA teacher, ``--steps`` optimizer steps.

- TRL: ``trl.DistillationTrainer`` 1.16 in its own venv (``--trl-venv``, created here when missing: ``torch==2.13.0``
  CPU and ``trl==1.16.0`` under the product's ``constraints.txt``; never a product dependency), HF ``generate`` for
  sampling (its default), gradient checkpointing off (its default is on, which only costs time at this size).
- Ours: ``lightning-opd fit --config conf/textworld/opd.yaml --data.init_args.max_turns=1 --trainer.max_steps=N``
  with that config's micro-batching (``micro_batch_tokens: 2048``: the 4 episodes in one forward/backward) and fused
  AdamW (``fused: true``; TRL gets fused AdamW too: transformers' default optimizer with torch >= 2.8)
  (vLLM sampler where it imports: ``generator: auto``), no validation, no export.

Each side's step time is the wall clock between consecutive optimizer-step ends (TRL: a ``TrainerCallback``'s
``on_step_end``; ours: the TensorBoard wall time of ``timing/update_s``, written at the end of each step), so sampling,
the teacher pass, the update and per-step logging are all inside it; the first step (warm-up, engine start) is not
timed: medians of steps 2..N. Rounds alternate TRL, ours, TRL, ours, ... so both see the same machine state; the
ratio printed is TRL's median step / ours (> 1: we are faster). Run alone on the machine.

The step's roofline (printed beside the ratio; the same for both sides): the model FLOPs of one step, sampling
(prefill of every prompt, then one decode pass per new token) + the teacher's forward + the student's forward and
backward over prompt and reply (:mod:`benchmarks.roofline`; replies counted at ``--max-new-tokens``, an upper bound),
at the fp32 matmul peak measured on this machine. A step cannot take less; a speed ratio is bounded by it.

Resumable per (side, round): ``benchmarks/results/peer_trl.json`` keeps finished rounds; ``--force`` reruns.
Run: ``.venv/bin/python -m benchmarks.peer_trl [--rounds 2 --steps 10]``   (needs ``make prepare teacher install-vllm``)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ResultFile, add_artifact_args, markdown_table

TRL_VERSION = "1.16.0"
ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().parent / "peer_trl_child.py"


def ensure_trl_venv(venv: Path) -> Path:
    """TRL's own venv at ``venv`` (created when its python does not import ``trl`` ``TRL_VERSION``); its python.

    Raises:
        subprocess.CalledProcessError: a pip install failed (its output is on the console).
    """
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import trl, torch; assert trl.__version__ == '{TRL_VERSION}', trl.__version__; "
             "assert torch.version.cuda is None, torch.__version__"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    print(f"peer_trl: creating TRL's venv at {venv} (torch 2.13.0 CPU, trl {TRL_VERSION}; a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)  # stdlib venv of this python
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["-c", str(ROOT / "constraints.txt"), f"trl=={TRL_VERSION}"], check=True)
    subprocess.run(check, check=True)
    return python


def write_prompts(games: str, system_prompt: str | None, n: int, path: Path) -> int:
    """The first-turn prompts of the first ``n`` training games as conversational JSONL rows (``{"prompt":
    [{"role": "system", ...}, {"role": "user", ...}]}``) at ``path``; the number written."""
    from lightning_opd.envs.textworld_env import TextWorldEnvFactory

    factory = TextWorldEnvFactory(games_dir=games)
    system = factory.system_prompt if system_prompt is None else system_prompt
    with path.open("w") as f:
        for task in factory.train_tasks()[:n]:
            env = factory.make(task)
            try:
                first = env.reset()
            finally:
                env.close()
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": first}]
            f.write(json.dumps({"prompt": msgs}) + "\n")
    return n


def step_seconds(ends: list[float]) -> list[float]:
    """Seconds of steps 2..N from the wall clock at each step's end (``(N,)`` -> ``(N - 1,)``)."""
    return [b - a for a, b in zip(ends, ends[1:])]


def run_trl(python: Path, args, prompts: Path, work: Path) -> dict:
    """One TRL fit; ``{"step_s": [...], "median_s": ..., ...}``."""
    cfg = {"student": args.model, "teacher": args.teacher, "prompts": str(prompts), "steps": args.steps,
           "batch": args.batch, "max_new_tokens": args.max_new_tokens, "beta": 1.0, "lr": args.lr,
           "temperature": 1.0, "seed": 0, "gradient_checkpointing": False, "output_dir": str(work / "trl_out")}
    out = work / "trl.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    subprocess.run([str(python), str(CHILD), "--args", json.dumps(cfg), "--out", str(out)], check=True, env=env)
    r = json.loads(out.read_text())
    steps = step_seconds(r["step_end_s"])
    return {"step_s": steps, "median_s": statistics.median(steps), "torch_threads": r["torch_threads"],
            "version": f"trl {r['trl']}, torch {r['torch']}"}


def run_ours(args, work: Path) -> dict:
    """One ``lightning-opd fit`` of the same workload; ``{"step_s": [...], "median_s": ..., ...}``."""
    from benchmarks.remote_step import read_scalars

    overrides = {"trainer": {"max_steps": args.steps, "val_check_interval": None, "limit_val_batches": 0,
                             "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                        "init_args": {"save_dir": str(work), "name": "ours"}}},
                 "model": {"init_args": {"student": args.model, "teacher": args.teacher, "export_dir": None,
                                         "optimizer": {"class_path": "torch.optim.AdamW",
                                                       "init_args": {"lr": args.lr, "weight_decay": 0.0,
                                                                     "fused": True}}}},
                 "data": {"init_args": {"env": {"class_path": "lightning_opd.envs.textworld_env.TextWorldEnvFactory",
                                                "init_args": {"games_dir": args.games}},
                                        "max_turns": 1, "episodes_per_step": args.batch,
                                        "max_new_tokens": args.max_new_tokens, "temperature": 1.0}}}
    cfg = work / "ours.yaml"
    cfg.write_text(json.dumps(overrides))  # JSON is YAML
    subprocess.run([sys.executable, "-m", "lightning_opd", "fit", "--config", "conf/textworld/opd.yaml",
                    "--config", str(cfg)], check=True, cwd=ROOT)
    scalars = read_scalars(work, "ours")
    ends = [w for _, w, _ in sorted(scalars["timing/update_s"])]
    steps = step_seconds(ends)
    import lightning
    import torch
    import vllm  # noqa: F401  (the sampler `generator: auto` picks when it imports)

    return {"step_s": steps, "median_s": statistics.median(steps),
            "rollout_s_median": statistics.median(v for _, _, v in sorted(scalars["timing/rollout_s"])[1:]),
            "update_s_median": statistics.median(v for _, _, v in sorted(scalars["timing/update_s"])[1:]),
            "version": f"lightning {lightning.__version__}, torch {torch.__version__}, vllm {vllm.__version__}"}


def step_roofline(prompt_tokens: list[int], batch: int, new_tokens: int, model: str, teacher: str) -> dict:
    """The roofline of one step of the workload: ``{"flops", "seconds", "matmul_flops", "prompt_tokens_mean"}``.

    FLOPs per step, averaged over the steps' prompts (``prompt_tokens``, in order, ``batch`` per step): per episode of
    ``P`` prompt and ``C = new_tokens`` reply tokens, sampling (a prefill of ``P`` and ``C - 1`` decode passes, the head
    on one position each), the teacher's forward and the student's forward + backward over ``P + C`` tokens (heads on
    the ``C`` supervised positions) (:func:`benchmarks.roofline.update_flops`); seconds at the measured fp32 matmul peak
    (:func:`benchmarks.roofline.measure_machine`, this process's torch threads)."""
    from benchmarks.roofline import ModelShape, Row, generation_passes, measure_machine, pass_flops, update_flops
    from lightning_opd.models import load_causal_lm

    student_model = load_causal_lm(model)
    student, teach = ModelShape.of(student_model), ModelShape.of(load_causal_lm(teacher))
    sample = sum(pass_flops(student, rows) for p in prompt_tokens
                 for rows in generation_passes([Row(0, p, new_tokens)]))
    update = update_flops(student, teach, [(p + new_tokens, new_tokens) for p in prompt_tokens])["flops"]
    per_step = (sample + update) * batch / len(prompt_tokens)
    peak = measure_machine(student_model)["matmul_flops"]
    return {"flops": per_step, "seconds": per_step / peak, "matmul_flops": peak,
            "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens)}


def prompt_lengths(prompts: Path, tokenizer_dir: str, n: int) -> list[int]:
    """Tokens of the first ``n`` prompts of ``prompts`` under the student's chat template (generation prompt added)."""
    from lightning_opd.models.loading import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[:n]]
    texts = [tok.apply_chat_template(r, add_generation_prompt=True, tokenize=False) for r in rows]
    return [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def report(results: ResultFile) -> str:
    """The markdown table of every finished round, the ratio of the medians (TRL / ours) and, when measured, the step's
    roofline with each side's fraction of it."""
    rows, medians = [], {"trl": [], "ours": []}
    for key in sorted(results.data):
        if key.rsplit("_", 1)[0] not in medians:
            continue
        side, rnd = key.rsplit("_", 1)
        r = results[key]
        medians[side].append(r["median_s"])
        rows.append([side, rnd, f"{r['median_s']:.2f}", " ".join(f"{s:.2f}" for s in r["step_s"])])
    lines = [markdown_table(["side", "round", "median s/step (steps 2..N)", "every step s"], rows)]
    if medians["trl"] and medians["ours"]:
        trl, ours = statistics.median(medians["trl"]), statistics.median(medians["ours"])
        lines.append(f"\nTRL {trl:.2f} s/step, ours {ours:.2f} s/step (medians over rounds): ours is "
                     f"{trl / ours:.2f}x TRL's speed")
        if "roofline" in results:
            roof = results["roofline"]
            lines.append(f"step roofline {roof['seconds']:.2f} s ({roof['flops'] / 1e12:.2f} TFLOP at "
                         f"{roof['matmul_flops'] / 1e9:.0f} GFLOP/s, prompts {roof['prompt_tokens_mean']:.0f} tokens on "
                         f"average): TRL at {roof['seconds'] / trl:.0%} of it, ours at {roof['seconds'] / ours:.0%}; "
                         f"1.5x TRL's speed would be {trl / 1.5:.2f} s/step = "
                         f"{roof['seconds'] / (trl / 1.5):.0%} of the roofline")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact_args(ap)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (TRL then ours in each)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per fit (the first is not timed)")
    ap.add_argument("--batch", type=int, default=4, help="prompts (episodes) per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--trl-venv", default=str(ROOT / ".venv-trl"), help="TRL's own venv (created when missing)")
    ap.add_argument("--name", default="peer_trl", help="result file benchmarks/results/<name>.json")
    ap.add_argument("--force", action="store_true", help="rerun finished rounds")
    args = ap.parse_args()
    if args.steps < 3:
        raise SystemExit(f"--steps {args.steps}: need >= 3 (the first step is not timed; a median needs 2)")
    python = ensure_trl_venv(Path(args.trl_venv))
    results = ResultFile(args.name)
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(args.games, None, 200, prompts)
        if "roofline" not in results or args.force:
            lengths = prompt_lengths(prompts, args.model, args.steps * args.batch)
            results.put("roofline", step_roofline(lengths, args.batch, args.max_new_tokens, args.model, args.teacher))
        for rnd in range(args.rounds):
            for side in ("trl", "ours"):
                key = f"{side}_{rnd}"
                if key in results and not args.force:
                    continue
                work = Path(tmp) / key
                work.mkdir()
                r = run_trl(python, args, prompts, work) if side == "trl" else run_ours(args, work)
                r.update(cpu=platform.processor() or platform.machine(), cores=len(os.sched_getaffinity(0)))
                results.put(key, r)
                print(f"{key}: median {r['median_s']:.2f} s/step", flush=True)
    print(report(results))


if __name__ == "__main__":
    main()
