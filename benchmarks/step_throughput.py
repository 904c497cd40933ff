"""One OPD step timed in its two parts, rollout and update, each beside its roofline (issue 17).

Runs the real step (``OPDModule`` + ``RolloutDataModule`` under a Lightning ``Trainer``, as
``lightning-opd fit --config conf/textworld/opd.yaml`` does): the SmolLM2-135M student, the TextWorld
teacher, ``--episodes`` episodes of the quest-3 games per step, on two workloads:

* ``single``: one turn per episode (``--max-new-tokens`` sampled tokens, 16 by default);
* ``multi``: up to ``--turns`` turns per episode (8, the demo's cap).

The rollout and update seconds are the module's own ``timing/rollout_s`` and ``timing/update_s`` of
each step after ``--warmup`` untimed ones. Their rooflines come from quantities counted in the same
step (:mod:`benchmarks.roofline`): the rollout's ``generate`` calls (prompt tokens prefilled after any
cache reuse, decode steps, bytes per decode step) and the update's student forward + backward and
teacher forward FLOPs over the batch's real tokens, at the matmul FLOP/s and memory bandwidth measured
in the same run. Printed: seconds and the achieved fraction of each roofline, and of the whole step.

``--backend hf`` (default) samples with the HF backend (KV cache kept between turns); ``--backend vllm``
with an in-process vLLM engine (prefix caching; the student's weights pushed before every rollout,
counted in the rollout). Results: benchmarks/results/step_throughput.json (resumable per workload).

Run: .venv/bin/python -m benchmarks.step_throughput [--backend vllm]   (needs `make prepare teacher`)
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import ResultFile, add_artifact_args, markdown_table  # noqa: E402
from benchmarks.roofline import (GenerationLog, Machine, ModelShape, fraction, measure_machine,  # noqa: E402
                                 rollout_roofline, update_flops)
from lightning_opd.data import RolloutDataModule  # noqa: E402
from lightning_opd.envs.textworld_env import TextWorldEnvFactory  # noqa: E402
from lightning_opd.learner import OPDModule  # noqa: E402
from lightning_opd.rollout.batch import RolloutBatch  # noqa: E402


def episode_sizes(batch: RolloutBatch) -> list[tuple[int, int]]:
    """``(real tokens T, supervised positions S)`` of every episode of ``batch`` (what the update computes
    on: the transformers over ``T`` tokens, the output heads on the ``S`` positions with a loss)."""
    tokens = batch.attention_mask.sum(dim=1).tolist()
    supervised = (batch.loss_mask[:, 1:] > 0).sum(dim=1).tolist()
    return [(int(t), int(s)) for t, s in zip(tokens, supervised)]


class StepRecorder(L.Callback):
    """Per step: the module's rollout and update seconds, the rollout's ``generate`` calls and the sizes
    of the batch trained on."""

    def __init__(self, log: GenerationLog, batches: list) -> None:
        self.generation, self.batches, self.steps = log, batches, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.generation.reset()  # the rollout runs inside training_step (synchronous OPD)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.steps.append({"rollout_s": float(m["timing/rollout_s"]), "update_s": float(m["timing/update_s"]),
                           "generate_s": self.generation.seconds, "calls": list(self.generation.calls),
                           "episodes": episode_sizes(self.batches[-1])})


def make_generator(backend: str, vllm_block_size: int | None = None):
    if backend == "hf":
        return None  # the DataModule's default HFGenerator (KV cache kept between turns)
    from lightning_opd.rollout.vllm import VLLMGenerator

    extra = {} if vllm_block_size is None else {"block_size": vllm_block_size}
    return VLLMGenerator(kv_cache_memory_bytes=1 << 30, max_model_len=4096, engine_kwargs=extra)


def run(workload: str, args, machine: Machine) -> dict:
    """Fit ``--warmup + --steps`` steps of ``workload``; returns the timed steps' means and rooflines."""
    L.seed_everything(0, verbose=False)
    model_kw = {} if args.micro_batch_size is None else {"micro_batch_size": args.micro_batch_size}
    if args.micro_batch_tokens is not None:
        model_kw = {"micro_batch_tokens": args.micro_batch_tokens}
    model = OPDModule(student=args.model, teacher=args.teacher, log_text_every_n_steps=0, **model_kw)
    turns = 1 if workload == "single" else args.turns
    generator = make_generator(args.backend, args.vllm_block_size)
    dm = RolloutDataModule(TextWorldEnvFactory(args.games), generator=generator,
                           episodes_per_step=args.episodes, max_turns=turns, max_new_tokens=args.max_new_tokens,
                           seed=0)
    log, batches = GenerationLog(dm.generator), []
    plan = model.plan_batch

    def plan_batch(batch, student_logprobs=None):  # keep the batch the step trains on (its sizes give the FLOPs)
        batches.append(batch)
        return plan(batch, student_logprobs)

    model.plan_batch = plan_batch
    recorder = StepRecorder(log, batches)
    L.Trainer(accelerator="cpu", max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              callbacks=[recorder]).fit(model, datamodule=dm)
    student, teacher = ModelShape.of(model.student), ModelShape.of(model.teacher_model)
    timed = recorder.steps[args.warmup:]
    out = {"steps": len(timed), "rollout_s": 0.0, "update_s": 0.0, "generate_s": 0.0, "rollout_roofline_s": 0.0,
           "update_roofline_s": 0.0, "prefill_tokens": 0, "cached_prompt_tokens": 0, "sampled_tokens": 0,
           "passes": 0, "train_tokens": 0, "update_flops": 0}
    for step in timed:
        roof = rollout_roofline(student, machine, step["calls"])
        upd = update_flops(student, teacher, step["episodes"])
        out["rollout_s"] += step["rollout_s"]
        out["update_s"] += step["update_s"]
        out["generate_s"] += step["generate_s"]
        out["rollout_roofline_s"] += roof["roofline_s"]
        out["update_roofline_s"] += upd["flops"] / machine.matmul_flops
        out["prefill_tokens"] += roof["prefill_tokens"]
        out["cached_prompt_tokens"] += roof["cached_tokens"]
        out["sampled_tokens"] += roof["sampled_tokens"]
        out["passes"] += roof["passes"]
        out["train_tokens"] += sum(t for t, _ in step["episodes"])
        out["update_flops"] += upd["flops"]
    n = max(len(timed), 1)
    for key in list(out):
        if key != "steps":
            out[key] = out[key] / n  # per step
    out["rollout_fraction"] = fraction(out["rollout_roofline_s"], out["rollout_s"])
    out["update_fraction"] = fraction(out["update_roofline_s"], out["update_s"])
    out["step_fraction"] = fraction(out["rollout_roofline_s"] + out["update_roofline_s"],
                                    out["rollout_s"] + out["update_s"])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--workloads", nargs="+", choices=["single", "multi"], default=["single", "multi"])
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--turns", type=int, default=8, help="turn cap of the multi-turn workload")
    p.add_argument("--steps", type=int, default=1, help="timed steps per workload")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="model.init_args.micro_batch_size (default: the module's)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="model.init_args.micro_batch_tokens (token budget per micro-batch; replaces --micro-batch-size)")
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="KV block size of the vLLM engine (the prefix cache reuses whole blocks; CPU default 128)")
    p.add_argument("--results", default="step_throughput", help="result file name under benchmarks/results")
    a = p.parse_args(argv)
    results = ResultFile(a.results)
    if "machine" not in results:
        from lightning_opd.models import load_causal_lm

        results.put("machine", measure_machine(load_causal_lm(a.model)))
    m = results["machine"]
    machine = Machine(m["matmul_flops"], m["bandwidth"])
    mb = "" if a.micro_batch_size is None else f"/mb{a.micro_batch_size}"
    mb = mb if a.micro_batch_tokens is None else f"/mbt{a.micro_batch_tokens}"
    mb += "" if a.vllm_block_size is None or a.backend != "vllm" else f"/bs{a.vllm_block_size}"
    keys = {w: f"{a.backend}/{w}/e{a.episodes}/n{a.max_new_tokens}/t{1 if w == 'single' else a.turns}/s{a.steps}{mb}"
            for w in a.workloads}
    for workload, key in keys.items():
        if key not in results:
            print(f"running {key} ...", flush=True)
            results.put(key, run(workload, a, machine))
    rows = []
    for workload, key in keys.items():
        r = results[key]
        rows.append([workload, a.backend, f"{r['rollout_s']:.1f}", f"{r['rollout_fraction']:.0%}",
                     f"{r['prefill_tokens']:.0f} / {r['cached_prompt_tokens']:.0f}", f"{r['update_s']:.1f}",
                     f"{r['update_fraction']:.0%}", f"{r['train_tokens']:.0f}",
                     f"{r['rollout_s'] + r['update_s']:.1f}", f"{r['step_fraction']:.0%}"])
    print(f"\nfp32 matmul peak {m['matmul_flops'] / 1e9:.0f} GFLOP/s (best of the model's shapes), memory bandwidth "
          f"{m['bandwidth'] / 1e9:.1f} GB/s, {m['threads']} threads; {a.episodes} episodes/step, per step after "
          f"{a.warmup} warm-up step(s)")
    print(markdown_table(["workload", "backend", "rollout s", "of roofline", "prefilled / cached prompt tokens",
                          "update s", "of roofline (MFU)", "tokens trained", "step s", "of roofline"], rows))
    return {w: results[k] for w, k in keys.items()}


if __name__ == "__main__":
    main()
