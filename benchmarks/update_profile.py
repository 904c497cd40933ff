"""Where a synchronous OPD step's time goes, phase by phase, under ``torch.profiler`` (issue 43).

The workload is ``benchmarks/peer_trl.py``'s (TRL's single-turn distillation): the SmolLM2-135M student, the demo's
LoRA teacher, ``--episodes`` first-turn TextWorld prompts per step, ``--max-new-tokens`` sampled at temperature 1, the
full-vocabulary reverse KL, AdamW lr 5e-5, fp32; ``--turns 8`` gives the demo's multi-turn step instead. The real
step runs (``OPDModule`` + ``RolloutDataModule`` under a Lightning ``Trainer``, the in-process vLLM sampler where it
imports); after ``--warmup`` steps, ``--steps`` steps run under ``torch.profiler`` and the module's own
``record_function`` labels give each phase's wall seconds per step:

=====================  =====================================================================================
``opd.rollout``        the rollout batch (sampling, environment, tokenisation), less the weight push below
``rollout.weight_push`` loading the student's weights into the vLLM engine before sampling
``opd.teacher``        the teacher's forward (no grad) on every micro-batch
``opd.student_trunk``  the student's transformer forward on every micro-batch
head + loss            ``opd.forward`` less the two above: the output heads on supervised positions and the loss
``opd.backward``       the backward pass of every micro-batch
``opd.optimizer``      ``optimizer.step()``
=====================  =====================================================================================

and the update's remainder (gradient norm and clipping, metrics, logging). Also printed: forward passes per step (micro-
batches) and tokens per pass (rows x padded length, and real tokens), and the profiler's top operators.

Variants (each a key of ``benchmarks/results/update_profile.json``, resumable): ``--micro-batch-size`` /
``--micro-batch-tokens`` (the module's micro-batching), ``--precision`` (the Trainer's: ``bf16-mixed`` also loads the
teacher and the vLLM engine in bfloat16, as a fit does; issue 61) and ``--no-fused`` (AdamW's ``foreach`` implementation instead
of ``fused``). Profiler overhead inflates every phase a little; compare variants measured the same way.

Run: ``.venv/bin/python -m benchmarks.update_profile [--micro-batch-size 1] [--no-fused]``   (needs ``make prepare
teacher``; ``make install-vllm`` for the vLLM sampler)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.common import ResultFile, add_artifact_args, markdown_table  # noqa: E402
from lightning_opd.cpu_isa import cpu_name  # noqa: E402

PHASES = ("opd.rollout", "rollout.weight_push", "opd.forward", "opd.teacher", "opd.student_trunk", "opd.backward",
          "opd.optimizer", "opd.policy_push")


class StepProfiler(L.Callback):
    """Profiles training steps ``warmup + 1 .. warmup + steps`` (1-based) with ``torch.profiler`` (CPU activities);
    records every step's ``timing/rollout_s`` and ``timing/update_s`` and the profiled wall seconds."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.prof, self.wall, self.timing = None, 0.0, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.warmup:
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.timing.append({k: float(m[k]) for k in ("timing/rollout_s", "timing/update_s") if k in m})
        if self.prof is not None and trainer.global_step == self.warmup + self.steps:
            self.prof.__exit__(None, None, None)
            self.wall = time.perf_counter() - self._t0


def phase_table(events, steps: int) -> dict[str, float]:
    """Seconds per step of each phase (see the module docstring) from the profiler's ``key_averages()``; the
    labels' CPU totals include their children, so head + loss is ``opd.forward`` less teacher and trunk.

    Assumes the synchronous mode this benchmark runs: the vLLM push (``rollout.weight_push``) happens inside the
    rollout, so it is taken out of ``opd.rollout``, and ``opd.policy_push`` (the learner's report to the weight sync,
    ~0 s here) holds no push of its own. In async mode a push nested in ``opd.policy_push`` would be counted twice."""
    total = {e.key: e.cpu_time_total / 1e6 / steps for e in events if e.key in PHASES}
    count = {e.key: e.count / steps for e in events if e.key in PHASES}
    get = total.get
    out = {
        "rollout (sampling, env)": get("opd.rollout", 0.0) - get("rollout.weight_push", 0.0),
        "weight push": get("rollout.weight_push", 0.0) + get("opd.policy_push", 0.0),
        "teacher forward": get("opd.teacher", 0.0),
        "student trunk forward": get("opd.student_trunk", 0.0),
        "heads + loss (forward)": get("opd.forward", 0.0) - get("opd.teacher", 0.0) - get("opd.student_trunk", 0.0),
        "backward": get("opd.backward", 0.0),
        "optimizer step": get("opd.optimizer", 0.0),
    }
    return {"seconds": out, "forward_passes": count.get("opd.forward", 0.0)}


def run(args) -> dict:
    """One profiled fit of the workload; the phase seconds per step, passes, tokens per pass and top operators."""
    from lightning_opd.data import RolloutDataModule
    from lightning_opd.envs.textworld_env import TextWorldEnvFactory
    from lightning_opd.learner import OPDModule

    L.seed_everything(0, verbose=False)
    fused = not args.no_fused

    def optimizer(params):
        return torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, **({"fused": True} if fused else {}))

    kw = {"micro_batch_size": args.micro_batch_size}
    if args.micro_batch_tokens is not None:
        kw = {"micro_batch_size": None, "micro_batch_tokens": args.micro_batch_tokens}
    model = OPDModule(student=args.model, teacher=args.teacher, optimizer=optimizer, log_text_every_n_steps=0, **kw)
    dm = RolloutDataModule(TextWorldEnvFactory(args.games), generator=args.generator, episodes_per_step=args.episodes,
                           max_turns=args.turns, max_new_tokens=args.max_new_tokens, temperature=1.0, seed=0)
    passes = []  # (rows, padded length, real tokens) of every micro-batch trained on
    split = model.agreed_micro_batches

    def agreed_micro_batches(batch):
        micro, n_real = split(batch)
        passes.extend((*mb.input_ids.shape, int(mb.attention_mask.sum())) for mb in micro)
        return micro, n_real

    model.agreed_micro_batches = agreed_micro_batches
    prof = StepProfiler(args.warmup, args.steps)
    L.Trainer(accelerator="cpu", max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
              precision=args.precision,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              callbacks=[prof]).fit(model, datamodule=dm)
    events = prof.prof.key_averages()
    table = phase_table(events, args.steps)
    per_step = len(passes) // (args.warmup + args.steps)  # the same number of micro-batches every step here
    shapes = [(b, t) for b, t, _ in passes[-per_step * args.steps:]]
    real = [n for _, _, n in passes[-per_step * args.steps:]]
    top = sorted((e for e in events if not e.key.startswith(("opd.", "rollout.", "enumerate", "Optimizer",
                                                              "autograd::", "ProfilerStep"))),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    timed = prof.timing[args.warmup:]
    return {**table, "profiled_wall_s": prof.wall / args.steps,
            "rollout_s": sum(t["timing/rollout_s"] for t in timed) / len(timed),
            "update_s": sum(t["timing/update_s"] for t in timed) / len(timed),
            "pass_shapes": shapes, "pass_real_tokens": real,
            "top_ops": [[e.key, e.self_cpu_time_total / 1e6 / args.steps, e.count / args.steps] for e in top],
            "torch_threads": torch.get_num_threads(), "fused_adamw": fused, "precision": args.precision,
            "cpu": cpu_name()}


def report(key: str, r: dict) -> str:
    """The phase table and the top operators of one variant, as markdown."""
    wall = r["rollout_s"] + r["update_s"]
    rows = [[name, f"{s:.2f}", f"{s / wall:.0%}"] for name, s in r["seconds"].items()]
    rest = r["update_s"] - sum(v for k, v in r["seconds"].items() if not k.startswith(("rollout", "weight")))
    rows.append(["rest of the update (clip, metrics, logging)", f"{rest:.2f}", f"{rest / wall:.0%}"])
    rows.append(["**step** (timing/rollout_s + timing/update_s)", f"{wall:.2f}", "100%"])
    shapes = r["pass_shapes"][:round(r["forward_passes"])]  # the first profiled step's
    lines = [f"### {key}", "",
             markdown_table(["phase", "s/step", "share"], rows), "",
             f"{r['forward_passes']:.0f} forward passes per step (student and teacher each); tokens per pass: "
             + ", ".join(f"{b}x{t}" for b, t in shapes[:8]) + (" ..." if len(shapes) > 8 else "")
             + f" ({sum(r['pass_real_tokens']) / max(1, sum(b * t for b, t in r['pass_shapes'])):.0%} real tokens)", "",
             markdown_table(["top operator (self time)", "s/step", "calls/step"],
                            [[k, f"{s:.2f}", f"{c:.0f}"] for k, s, c in r["top_ops"]])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--generator", default="auto", help="data.init_args.generator: auto (vLLM if it imports), hf, vllm")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--turns", type=int, default=1, help="turn cap (1: the peer_trl workload; 8: the demo's)")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--micro-batch-size", type=int, default=None, help="model.init_args.micro_batch_size")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="model.init_args.micro_batch_tokens")
    p.add_argument("--no-fused", action="store_true", help="AdamW's foreach implementation (torch's default)")
    p.add_argument("--precision", default="32-true", choices=("32-true", "bf16-mixed", "bf16-true"),
                   help="the Trainer's precision (bf16-*: teacher and vLLM engine in bfloat16 too)")
    p.add_argument("--force", action="store_true", help="rerun a finished variant")
    p.add_argument("--results", default="update_profile",
                   help="result file benchmarks/results/<name>.json (another machine: another file)")
    a = p.parse_args(argv)
    if a.micro_batch_size is None and a.micro_batch_tokens is None:
        a.micro_batch_size = a.episodes
    results = ResultFile(a.results)
    key = (f"t{a.turns}/e{a.episodes}/n{a.max_new_tokens}/"
           + (f"mbt{a.micro_batch_tokens}" if a.micro_batch_tokens is not None else f"mb{a.micro_batch_size}")
           + ("/foreach" if a.no_fused else "/fused") + ("" if a.precision == "32-true" else f"/{a.precision}"))
    if key not in results or a.force:
        results.put(key, run(a))
    print(report(key, results[key]))
    return results[key]


if __name__ == "__main__":
    main()
