"""Held-out success after the same number of steps: synchronous OPD, forced lags 2, 4, 8 without
control, and the same lags with the f-OPD StalenessMonitor (M1 + M2 + M3).

``forced_lag=k`` makes the generator sample with the weights of version max(0, v - k) while the learner
is at v (deterministic staleness). Scaled for a 2-core CPU: ``--steps`` optimizer steps of
``--episodes`` episodes, then greedy evaluation on ``--eval-games`` held-out games. Results:
benchmarks/results/staleness_sweep.json (resumable).

Run: .venv/bin/python -m benchmarks.staleness_sweep
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from benchmarks.common import ResultFile, add_artifact_args, markdown_table
from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.learner import OPDModule


class Collect(L.Callback):
    def __init__(self):
        self.freshness, self.dropped = [], 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        if "staleness/freshness_mean" in m:
            self.freshness.append(float(m["staleness/freshness_mean"]))
            self.dropped += float(m["staleness/dropped_samples"])


def run(lag: int, monitor: bool, args) -> dict:
    L.seed_everything(0, verbose=False)
    model = OPDModule(student=args.model, teacher=args.teacher, log_text_every_n_steps=0,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.0))
    env = TextWorldEnvFactory(args.games, num_eval=args.eval_games)
    dm = RolloutDataModule(env, episodes_per_step=args.episodes, max_turns=args.turns, forced_lag=lag,
                           eval_batch_size=args.eval_games, seed=0)
    collect = Collect()
    callbacks = [collect] + ([StalenessMonitor()] if monitor else [])
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=args.steps,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, datamodule=dm)
    return {"success": float(trainer.callback_metrics["val/success"]),
            "episodes": float(trainer.callback_metrics["val/episodes"]),
            "mean_freshness": sum(collect.freshness) / len(collect.freshness) if collect.freshness else None,
            "dropped_samples": collect.dropped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-games", type=int, default=20)
    p.add_argument("--lags", type=int, nargs="+", default=[2, 4, 8])
    a = p.parse_args()
    results = ResultFile("staleness_sweep")
    configs = [(0, False)] + [(lag, False) for lag in a.lags] + [(lag, True) for lag in a.lags]
    suffix = f"s{a.steps}/e{a.episodes}/t{a.turns}/lr{a.lr}/g{a.eval_games}"
    for lag, monitor in configs:
        key = f"lag{lag}/{'monitor' if monitor else 'none'}/{suffix}"
        if key not in results:
            print(f"running {key} ...", flush=True)
            results.put(key, run(lag, monitor, a))
    rows = []
    for lag, monitor in configs:
        r = results[f"lag{lag}/{'monitor' if monitor else 'none'}/{suffix}"]
        rows.append(["sync" if lag == 0 else f"forced_lag {lag}", "StalenessMonitor" if monitor else "-",
                     f"{r['success']:.2f}", "-" if r["mean_freshness"] is None else f"{r['mean_freshness']:.2f}",
                     f"{r['dropped_samples']:.0f}"])
    print(f"\n{a.steps} steps x {a.episodes} episodes (<= {a.turns} turns), lr {a.lr}; greedy success on "
          f"{a.eval_games} held-out games")
    print(markdown_table(["rollouts", "control", "held-out success", "mean freshness", "dropped samples"], rows))


if __name__ == "__main__":
    main()
