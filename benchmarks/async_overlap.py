"""End-to-end optimizer steps per hour: synchronous vs asynchronous rollouts at lag 1, 2, 4.

Real SmolLM2-135M student and the TextWorld teacher, HF generate backend, on the same cores. Each
configuration runs ``--steps`` optimizer steps after one warm-up step; reported: seconds per step,
steps per hour, the speed-up over sync, and the fraction of step time the trainer waits for data
(time blocked in ``next(dataloader_iter)`` / step time). Results: benchmarks/results/async_overlap.json
(resumable: finished configurations are skipped).

The producer is a thread in the trainer process (see docs/methods.md, "Asynchronous rollouts, vLLM and f-OPD", for why).
Run: .venv/bin/python -m benchmarks.async_overlap
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

from benchmarks.common import ResultFile, add_artifact_args, markdown_table
from lightning_opd.data import RolloutDataModule
from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.learner import OPDModule


class StepClock(L.Callback):
    """Wall time of every step (end to end, data included) and the seconds spent waiting for data."""

    def __init__(self):
        self.ends, self.waits = [], []

    def on_train_start(self, trainer, pl_module):
        self.ends.append(time.perf_counter())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        self.waits.append(float(trainer.callback_metrics["timing/rollout_s"]))


def run(mode: str, lag: int, steps: int, args) -> dict:
    torch.manual_seed(0)
    model = OPDModule(student=args.model, teacher=args.teacher, log_text_every_n_steps=0)
    kw = dict(mode="async", producer_lead=lag) if mode == "async" else {}
    dm = RolloutDataModule(TextWorldEnvFactory(args.games), episodes_per_step=args.episodes, max_turns=args.turns,
                           seed=0, **kw)
    clock = StepClock()
    L.Trainer(accelerator="cpu", max_steps=steps + 1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              callbacks=[clock]).fit(model, datamodule=dm)
    durations = [b - a for a, b in zip(clock.ends[1:], clock.ends[2:])]  # skip the warm-up step
    waits = clock.waits[1:]
    per_step = sum(durations) / len(durations)
    return {"seconds_per_step": per_step, "steps_per_hour": 3600 / per_step,
            "wait_fraction": sum(waits) / sum(durations), "steps": len(durations)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--lags", type=int, nargs="+", default=[1, 2, 4])
    a = p.parse_args()
    results = ResultFile("async_overlap")
    configs = [("sync", 0)] + [("async", lag) for lag in a.lags]
    for mode, lag in configs:
        key = f"{mode}/lag{lag}/s{a.steps}/e{a.episodes}/t{a.turns}"
        if key not in results:
            print(f"running {key} ...", flush=True)
            results.put(key, run(mode, lag, a.steps, a))
    base = results[f"sync/lag0/s{a.steps}/e{a.episodes}/t{a.turns}"]["steps_per_hour"]
    rows = []
    for mode, lag in configs:
        r = results[f"{mode}/lag{lag}/s{a.steps}/e{a.episodes}/t{a.turns}"]
        rows.append([mode if mode == "sync" else f"async, producer_lead {lag}", f"{r['seconds_per_step']:.1f}",
                     f"{r['steps_per_hour']:.0f}", f"{r['steps_per_hour'] / base:.2f}x", f"{r['wait_fraction']:.2f}"])
    print(f"\n{a.episodes} episodes/step, <= {a.turns} turns, {a.steps} timed steps after 1 warm-up step")
    print(markdown_table(["rollouts", "s/step", "steps/hour", "vs sync", "waiting for data"], rows))


if __name__ == "__main__":
    main()
