"""Side by side with TRL on its own workload: single-turn on-policy distillation (issues 43, 61).

The workload (fixed for both): the first-turn prompts of the TextWorld training games (system message + first
observation, the chat template of each side's tokenizer), 4 prompts per optimizer step, at most 16 new tokens sampled
at temperature 1, the full-vocabulary reverse KL (TRL's ``beta=1``; ours ``FullVocabReverseKL``), AdamW lr 5e-5,
no weight decay, the SmolLM2-135M student and the demo's LoRA teacher, ``--steps`` optimizer steps.

- TRL: ``trl.DistillationTrainer`` 1.16 in its own venv (``--trl-venv``, created here when missing: ``torch==2.13.0``
  CPU and ``trl==1.16.0`` under the product's ``constraints.txt``; never a product dependency), HF ``generate`` for
  sampling (its default), gradient checkpointing off (its default is on, which only costs time at this size).
- Ours: ``lightning-opd fit --config conf/textworld/opd.yaml --data.init_args.max_turns=1 --trainer.max_steps=N``
  with that config's micro-batching (``micro_batch_tokens: 2048``: the 4 episodes in one forward/backward) and fused
  AdamW (``fused: true``; TRL gets fused AdamW too: transformers' default optimizer with torch >= 2.8)
  (vLLM sampler where it imports: ``generator: auto``), no validation, no export.

Two rows, one per ``--precision`` (default: both, fp32 first):

- ``fp32`` (issue 43's row): both sides fp32 throughout. TRL ``bf16=False``, student and teacher loaded with
  ``dtype="float32"``; ours ``--trainer.precision=32-true``, ``model.init_args.teacher_dtype=float32``.
- ``bf16``: both sides at TRL's defaults. TRL ``bf16=True`` (its ``DistillationConfig`` default: accelerate's bf16
  autocast over fp32 master weights), no ``model_init_kwargs`` / ``teacher_model_init_kwargs`` (its default:
  transformers' ``dtype="auto"``, the checkpoint's dtype, float32 for these two); ours ``--trainer.precision=
  bf16-mixed`` (Lightning's bf16 autocast over fp32 master weights) and ``model.init_args.teacher_dtype=bfloat16``
  (the frozen teacher's weights in bf16). Our sampler's dtype is left to the product: ``generator: auto`` at its
  default dtype, which follows ``trainer.precision`` where the product hands the pick to the in-process vLLM engine
  (issue 61), and stays float32 where it does not.

Each side's step time is the wall clock between consecutive optimizer-step ends (TRL: a ``TrainerCallback``'s
``on_step_end``; ours: the TensorBoard wall time of ``timing/update_s``, written at the end of each step), so sampling,
the teacher pass, the update and per-step logging are all inside it; the first step (warm-up, engine start) is not
timed: medians of steps 2..N. Rounds alternate TRL, ours, TRL, ours, ... (``--rounds``, at least 3) so both see the
same machine state. Run alone on the machine.

The ratio (> 1: we are faster) and its 95% interval (:func:`ratio_interval`): round ``i`` gives the paired ratio
``r_i = TRL's median step / ours`` of its two fits; the row prints the mean of the ``r_i`` and the Student-t interval
over rounds, ``mean ± t_{0.975, R-1} s / sqrt(R)`` (:func:`lightning_opd.analysis.bootstrap.t_interval`). Why a
t-interval over rounds and not a bootstrap over steps: what varies between measurements is the machine's state,
which moves between fits (issue 61: single steps of one fit ranged 4.6-18.6 s, and the ratio was 0.96x on one
machine, 0.60x on another), while the steps of one fit share it and are correlated; a bootstrap over steps would
treat them as independent, hold the rounds fixed and give an interval too narrow. The round is the independent unit,
the pairing within a round removes the drift both of its fits saw, and with 2-3 units the t-quantile accounts for
estimating the spread from so few (a percentile bootstrap over 3 rounds undercovers: see
:mod:`lightning_opd.analysis.bootstrap`). Hence at least 3 rounds: with 2 the interval has one degree of freedom
(t = 12.7) and says nothing.

The step's roofline (printed beside each row; the same FLOPs for both sides): the model FLOPs of one step, sampling
(prefill of every prompt, then one decode pass per new token) + the teacher's forward + the student's forward and
backward over prompt and reply (:mod:`benchmarks.roofline`; replies counted at ``--max-new-tokens``, an upper bound),
at the matmul peak of the row's dtype (fp32 or bf16) measured on this machine at the student's own ``nn.Linear``
shapes (:func:`benchmarks.roofline.measure_machine`). A step cannot take less; a speed ratio is bounded by it.

Results: ``benchmarks/results/<--name>.json`` (default ``peer_trl_rows``; ``peer_trl.json`` is issue 43's 2-round
fp32 run, kept as history), one entry per (precision, side, round), ``"<precision>/<side>_<round>"`` (e.g.
``"bf16/ours_2"``), and the roofline per precision (``"<precision>/roofline"``), each entry naming the CPU model and
cores (:func:`benchmarks.common.machine`). Resumable: finished entries are kept; ``--force`` reruns them. Prints a
docs-ready table row per precision (:func:`docs_row`) for docs/benchmarks.md.

Run: ``.venv/bin/python -m benchmarks.peer_trl [--precision fp32 bf16 --rounds 3 --steps 10]``
(needs ``make prepare teacher install-vllm``; alone on the machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ResultFile, add_artifact_args, markdown_table

TRL_VERSION = "1.16.0"
ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().parent / "peer_trl_child.py"
MIN_ROUNDS = 3
# The two rows: what each side is told (TRL: DistillationConfig fields; ours: config overrides) and the dtype the
# row's matmuls run in (its roofline's peak). The module docstring says why these are each side's settings.
PRECISIONS = {
    "fp32": {"trl": {"bf16": False, "model_init_kwargs": {"dtype": "float32"},
                     "teacher_model_init_kwargs": {"dtype": "float32"}},
             "ours": {"trainer": {"precision": "32-true"}, "model": {"init_args": {"teacher_dtype": "float32"}}},
             "dtype": "float32"},
    "bf16": {"trl": {"bf16": True, "model_init_kwargs": None, "teacher_model_init_kwargs": None},
             "ours": {"trainer": {"precision": "bf16-mixed"}, "model": {"init_args": {"teacher_dtype": "bfloat16"}}},
             "dtype": "bfloat16"},
    # not a default row: fp32 with our passes packed (lightning_opd/learner/packing.py; the 4 prompts of a step,
    # 133-247 tokens + 16 sampled, share one pass padded to the longest: packed, no padding); TRL as in fp32
    "fp32-packed": {"trl": {"bf16": False, "model_init_kwargs": {"dtype": "float32"},
                            "teacher_model_init_kwargs": {"dtype": "float32"}},
                    "ours": {"trainer": {"precision": "32-true"},
                             "model": {"init_args": {"teacher_dtype": "float32", "pack_sequences": "auto"}}},
                    "dtype": "float32"},
}
#: the rows run when ``--precision`` is not given
DEFAULT_ROWS = ("fp32", "bf16")


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


def trl_config(args, precision: str, prompts: Path, work: Path) -> dict:
    """The JSON config ``peer_trl_child.py`` turns into TRL's ``DistillationConfig`` for one fit of row
    ``precision`` (a key of :data:`PRECISIONS`: ``"fp32"``, ``"bf16"``, ``"fp32-packed"``)."""
    return {"student": args.model, "teacher": args.teacher, "prompts": str(prompts), "steps": args.steps,
            "batch": args.batch, "max_new_tokens": args.max_new_tokens, "beta": 1.0, "lr": args.lr,
            "temperature": 1.0, "seed": 0, "gradient_checkpointing": False, "output_dir": str(work / "trl_out"),
            **PRECISIONS[precision]["trl"]}


def trl_command(python: Path, cfg: dict, out: Path) -> list[str]:
    """TRL's fit as a command: ``<trl venv python> peer_trl_child.py --args <cfg JSON> --out <out>``."""
    return [str(python), str(CHILD), "--args", json.dumps(cfg), "--out", str(out)]


def run_trl(python: Path, args, precision: str, prompts: Path, work: Path) -> dict:
    """One TRL fit; ``{"step_s": [...], "median_s": ..., ...}``."""
    out = work / "trl.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    subprocess.run(trl_command(python, trl_config(args, precision, prompts, work), out), check=True, env=env)
    r = json.loads(out.read_text())
    steps = step_seconds(r["step_end_s"])
    return {"step_s": steps, "median_s": statistics.median(steps), "torch_threads": r["torch_threads"],
            "version": f"trl {r['trl']}, torch {r['torch']}"}


def _merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, nested dicts key by key (``extra`` wins)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ours_overrides(args, precision: str, work: Path) -> dict:
    """The config overrides of our fit of row ``precision`` (laid over ``conf/textworld/opd.yaml``)."""
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
    return _merge(overrides, PRECISIONS[precision]["ours"])


def ours_command(cfg: Path) -> list[str]:
    """Our fit as a command: ``python -m lightning_opd fit --config conf/textworld/opd.yaml --config <cfg>``."""
    return [sys.executable, "-m", "lightning_opd", "fit", "--config", "conf/textworld/opd.yaml", "--config", str(cfg)]


def run_ours(args, precision: str, work: Path) -> dict:
    """One ``lightning-opd fit`` of the same workload; ``{"step_s": [...], "median_s": ..., ...}``."""
    from benchmarks.remote_step import read_scalars

    cfg = work / "ours.yaml"
    cfg.write_text(json.dumps(ours_overrides(args, precision, work)))  # JSON is YAML
    subprocess.run(ours_command(cfg), check=True, cwd=ROOT)
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


def step_roofline(prompt_tokens: list[int], batch: int, new_tokens: int, model: str, teacher: str,
                  dtype: str = "float32") -> dict:
    """The roofline of one step of the workload computing in ``dtype`` (``"float32"`` or ``"bfloat16"``):
    ``{"flops", "seconds", "matmul_flops", "dtype", "prompt_tokens_mean"}``.

    FLOPs per step, averaged over the steps' prompts (``prompt_tokens``, in order, ``batch`` per step): per episode of
    ``P`` prompt and ``C = new_tokens`` reply tokens, sampling (a prefill of ``P`` and ``C - 1`` decode passes, the head
    on one position each), the teacher's forward and the student's forward + backward over ``P + C`` tokens (heads on
    the ``C`` supervised positions) (:func:`benchmarks.roofline.update_flops`); seconds at the ``dtype`` matmul peak
    measured at the student's shapes (:func:`benchmarks.roofline.measure_machine`, this process's torch threads)."""
    import torch

    from benchmarks.roofline import ModelShape, Row, generation_passes, measure_machine, pass_flops, update_flops
    from lightning_opd.models import load_causal_lm

    student_model = load_causal_lm(model)
    student, teach = ModelShape.of(student_model), ModelShape.of(load_causal_lm(teacher))
    sample = sum(pass_flops(student, rows) for p in prompt_tokens
                 for rows in generation_passes([Row(0, p, new_tokens)]))
    update = update_flops(student, teach, [(p + new_tokens, new_tokens) for p in prompt_tokens])["flops"]
    per_step = (sample + update) * batch / len(prompt_tokens)
    peak = measure_machine(student_model, dtypes=(getattr(torch, dtype),))["matmul_flops"]
    return {"flops": per_step, "seconds": per_step / peak, "matmul_flops": peak, "dtype": dtype,
            "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens)}


def prompt_lengths(prompts: Path, tokenizer_dir: str, n: int) -> list[int]:
    """Tokens of the first ``n`` prompts of ``prompts`` under the student's chat template (generation prompt added)."""
    from lightning_opd.models.loading import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()[:n]]
    texts = [tok.apply_chat_template(r, add_generation_prompt=True, tokenize=False) for r in rows]
    return [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


def ratio_interval(trl_s: list[float], ours_s: list[float], level: float = 0.95) -> dict:
    """The speed ratio over paired rounds and its Student-t interval (the module docstring says why this one).

    Args:
        trl_s, ours_s: ``(R,)`` TRL's and our median step seconds, round ``i`` at index ``i`` of both.
        level: confidence level.

    Returns:
        ``{"per_round": [r_i], "ratio": mean r_i, "low", "high", "rounds": R, "level"}`` with ``r_i = trl_s[i] /
        ours_s[i]`` (> 1: we are faster) and ``[low, high] = mean ± t_{(1+level)/2, R-1} s / sqrt(R)``
        (:func:`lightning_opd.analysis.bootstrap.t_interval`); ``low``/``high`` are ``None`` for ``R = 1``.

    Raises:
        ValueError: the lists differ in length, are empty, or hold a step time <= 0 (names them).
    """
    if len(trl_s) != len(ours_s) or not trl_s or min(trl_s + ours_s) <= 0:
        raise ValueError(f"ratio_interval: need one positive median per round on each side, got TRL {trl_s} and "
                         f"ours {ours_s}")
    import numpy as np

    from lightning_opd.analysis.bootstrap import t_interval

    per_round = [t / o for t, o in zip(trl_s, ours_s)]
    low, high = t_interval(np.array(per_round), level) if len(per_round) >= 2 else (None, None)
    return {"per_round": per_round, "ratio": statistics.mean(per_round), "low": low, "high": high,
            "rounds": len(per_round), "level": level}


def paired_rounds(results: ResultFile, precision: str) -> list[tuple[int, dict, dict]]:
    """``(round, TRL entry, our entry)`` of every round of row ``precision`` where both sides finished, in order."""
    out, rnd = [], 0
    while f"{precision}/trl_{rnd}" in results or f"{precision}/ours_{rnd}" in results:
        if f"{precision}/trl_{rnd}" in results and f"{precision}/ours_{rnd}" in results:
            out.append((rnd, results[f"{precision}/trl_{rnd}"], results[f"{precision}/ours_{rnd}"]))
        rnd += 1
    return out


def _cpus(entries: list[dict]) -> str:
    """The machines of ``entries``: ``"<cpu model> (<n> cores)"``, several joined by ``" + "`` (a resumed run that
    changed machine: its rounds do not compare)."""
    return " + ".join(dict.fromkeys(f"{e.get('cpu', 'unknown CPU')} ({e.get('cores', '?')} cores)" for e in entries))


def report(results: ResultFile, precision: str) -> str:
    """Row ``precision``: the markdown table of its paired rounds, the medians over rounds, the ratio with its 95%
    interval over paired rounds (:func:`ratio_interval`) and, when measured, the step's roofline at the row's
    dtype with each side's fraction of it."""
    pairs = paired_rounds(results, precision)
    rows = [[side, rnd, f"{r['median_s']:.2f}", " ".join(f"{s:.2f}" for s in r["step_s"]), _cpus([r])]
            for rnd, trl, ours in pairs for side, r in (("trl", trl), ("ours", ours))]
    lines = [f"### {precision}",
             markdown_table(["side", "round", "median s/step (steps 2..N)", "every step s", "CPU"], rows)]
    if not pairs:
        return "\n".join(lines + ["(no round with both sides finished)"])
    trl_s, ours_s = [t["median_s"] for _, t, _ in pairs], [o["median_s"] for _, _, o in pairs]
    trl, ours = statistics.median(trl_s), statistics.median(ours_s)
    ci = ratio_interval(trl_s, ours_s)
    span = f"95% t-interval [{ci['low']:.2f}, {ci['high']:.2f}]" if ci["low"] is not None else "no interval"
    lines += [f"\nTRL {trl:.2f} s/step, ours {ours:.2f} s/step (medians over rounds): ours is "
              f"{trl / ours:.2f}x TRL's speed",
              f"ratio per round {' '.join(f'{r:.2f}' for r in ci['per_round'])}: mean {ci['ratio']:.2f}x, {span} "
              f"over {ci['rounds']} rounds"]
    roof = results.data.get(f"{precision}/roofline")
    if roof is not None:
        lines.append(f"step roofline {roof['seconds']:.2f} s ({roof['flops'] / 1e12:.2f} TFLOP at "
                     f"{roof['matmul_flops'] / 1e9:.0f} GFLOP/s {roof['dtype']}, prompts "
                     f"{roof['prompt_tokens_mean']:.0f} tokens on average): TRL at {roof['seconds'] / trl:.0%} of it, "
                     f"ours at {roof['seconds'] / ours:.0%}; 1.5x TRL's speed would be {trl / 1.5:.2f} s/step = "
                     f"{roof['seconds'] / (trl / 1.5):.0%} of the roofline")
    return "\n".join(lines)


DOCS_HEADER = ["precision", "CPU", "rounds x steps", "TRL s/step", "ours s/step", "ours / TRL speed (95% CI)",
               "step roofline", "TRL / ours of the roofline"]


def docs_row(results: ResultFile, precision: str) -> list[str] | None:
    """Row ``precision`` for docs/benchmarks.md (columns :data:`DOCS_HEADER`; step times are medians over rounds,
    the speed the mean of the per-round ratios with its interval); ``None`` before a round with both sides."""
    pairs = paired_rounds(results, precision)
    if not pairs:
        return None
    trl_s, ours_s = [t["median_s"] for _, t, _ in pairs], [o["median_s"] for _, _, o in pairs]
    ci = ratio_interval(trl_s, ours_s)
    span = f" ({ci['low']:.2f}-{ci['high']:.2f})" if ci["low"] is not None else " (no interval)"
    entries = [e for _, t, o in pairs for e in (t, o)]
    steps = "/".join(dict.fromkeys(str(e.get("steps", "?")) for e in entries))
    trl, ours = statistics.median(trl_s), statistics.median(ours_s)
    roof = results.data.get(f"{precision}/roofline")
    if roof is None:
        roofline, at = "not measured", "-"
    else:
        roofline = f"{roof['seconds']:.2f} s at {roof['matmul_flops'] / 1e9:.0f} GFLOP/s {roof['dtype']}"
        at = f"{roof['seconds'] / trl:.0%} / {roof['seconds'] / ours:.0%}"
    return [precision, _cpus(entries), f"{len(pairs)} x {steps}", f"{trl:.2f}", f"{ours:.2f}",
            f"{ci['ratio']:.2f}x{span}", roofline, at]


def check_args(args) -> None:
    """Refuse settings that cannot give a result, before anything is installed or run.

    Raises:
        SystemExit: ``--rounds`` < 3 or ``--steps`` < 3 (the message names the value and why).
    """
    if args.rounds < MIN_ROUNDS:
        raise SystemExit(f"--rounds {args.rounds}: a results run needs >= {MIN_ROUNDS} alternating rounds (the "
                         "ratio's 95% interval is a t-interval over rounds: 2 rounds give 1 degree of freedom, "
                         "t = 12.7, an interval that says nothing); for a quicker try lower --steps, not --rounds")
    if args.steps < 3:
        raise SystemExit(f"--steps {args.steps}: need >= 3 (the first step is not timed; a median needs 2)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (:func:`check_args` applied)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_artifact_args(ap)
    ap.add_argument("--precision", nargs="+", choices=list(PRECISIONS), default=list(DEFAULT_ROWS),
                    help="rows to run: fp32 (both sides fp32), bf16 (both at TRL's defaults), fp32-packed (fp32 with "
                         "our passes packed, lightning_opd/learner/packing.py); default fp32 and bf16")
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                    help=f"alternating rounds per row (TRL then ours in each), >= {MIN_ROUNDS}")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per fit (the first is not timed)")
    ap.add_argument("--batch", type=int, default=4, help="prompts (episodes) per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--trl-venv", default=str(ROOT / ".venv-trl"), help="TRL's own venv (created when missing)")
    ap.add_argument("--name", default="peer_trl_rows", help="result file benchmarks/results/<name>.json")
    ap.add_argument("--force", action="store_true", help="rerun finished rounds")
    args = ap.parse_args(argv)
    check_args(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    python = ensure_trl_venv(Path(args.trl_venv))
    results = ResultFile(args.name)
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        prompts = Path(tmp) / "prompts.jsonl"
        write_prompts(args.games, None, 200, prompts)
        lengths = prompt_lengths(prompts, args.model, args.steps * args.batch)
        for precision in args.precision:
            if f"{precision}/roofline" not in results or args.force:
                results.put(f"{precision}/roofline", step_roofline(lengths, args.batch, args.max_new_tokens,
                                                                   args.model, args.teacher,
                                                                   PRECISIONS[precision]["dtype"]))
            for rnd in range(args.rounds):
                for side in ("trl", "ours"):
                    key = f"{precision}/{side}_{rnd}"
                    if key in results and not args.force:
                        continue
                    work = Path(tmp) / precision / f"{side}_{rnd}"
                    work.mkdir(parents=True)
                    r = (run_trl(python, args, precision, prompts, work) if side == "trl"
                         else run_ours(args, precision, work))
                    results.put(key, {**r, "precision": precision, "steps": args.steps})  # put adds cpu, cores
                    print(f"{key}: median {r['median_s']:.2f} s/step", flush=True)
    for precision in args.precision:
        print("\n" + report(results, precision))
    rows = [row for row in (docs_row(results, p) for p in args.precision) if row is not None]
    print("\ndocs/benchmarks.md rows:\n" + markdown_table(DOCS_HEADER, rows))


if __name__ == "__main__":
    main()
