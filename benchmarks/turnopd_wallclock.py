"""Vanilla OPD vs TurnOPD on longer quests: training wall-clock to reach the same held-out success, and
held-out success at equal wall-clock.

Both arms train the SmolLM2 student from the same seed on the quest-5 TextWorld games
(``make games-long``) with the same loss (top-50 student-support reverse KL, docs/algorithms.md §2.6),
episodes per step and optimizer; TurnOPD adds the RolloutDepthController (§2.3) and TurnLossBlend
(§2.4). Held-out success (greedy, ``--eval-games`` games) is measured every ``--eval-every`` steps;
the clock counts training steps only (rollouts + updates, not the evaluations). Scaled for a 2-core
CPU: ``--steps`` steps per arm. Results: benchmarks/results/turnopd_wallclock.json (resumable per arm).

Run: .venv/bin/python -m benchmarks.turnopd_wallclock   (needs `make prepare teacher games-long`)
"""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

from benchmarks.common import ResultFile, add_artifact_args, markdown_table
from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.callbacks.turn_loss_blend import TurnLossBlend
from lightning_opd.data import RolloutDataModule
from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.losses import StudentTopKRenormalizedReverseKL
from lightning_opd.learner import OPDModule


class Curve(L.Callback):
    """Training seconds (rollout + update, evaluation excluded), rollout turns and held-out success."""

    def __init__(self):
        self.train_seconds, self.points, self.turns, self._t0 = 0.0, [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_seconds += time.perf_counter() - self._t0
        self.turns.append(float(trainer.callback_metrics["rollout/turns"]))

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self.points.append({"step": int(pl_module.policy_version), "seconds": self.train_seconds,
                            "success": float(trainer.callback_metrics["val/success"])})


def run(arm: str, args) -> dict:
    L.seed_everything(0, verbose=False)
    model = OPDModule(student=args.model, teacher=args.teacher, log_text_every_n_steps=0,
                      loss=StudentTopKRenormalizedReverseKL(k=50), max_logged_turns=args.turns,
                      optimizer=lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.0))
    env = TextWorldEnvFactory(args.games, num_eval=args.eval_games)
    dm = RolloutDataModule(env, episodes_per_step=args.episodes, max_turns=args.turns, max_context_tokens=3072,
                           eval_batch_size=args.eval_games, seed=0)
    curve = Curve()
    callbacks = [curve]
    if arm == "turnopd":
        callbacks += [RolloutDepthController(), TurnLossBlend()]
    trainer = L.Trainer(accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, val_check_interval=args.eval_every,
                        check_val_every_n_epoch=None, num_sanity_val_steps=0, callbacks=callbacks)
    start = {"step": 0, "seconds": 0.0, "success": None}
    if args.eval_start:
        trainer.validate(model, datamodule=dm, verbose=False)
        start["success"] = float(trainer.callback_metrics["val/success"])
    trainer.fit(model, datamodule=dm)
    return {"points": ([start] if start["success"] is not None else []) + curve.points,
            "train_seconds": curve.train_seconds, "mean_turns": sum(curve.turns) / len(curve.turns)}


def first_reaching(points: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation with success >= target (None: never)."""
    return next((p["seconds"] for p in points if p["success"] is not None and p["success"] >= target), None)


def success_at(points: list[dict], seconds: float) -> float | None:
    """Success of the last evaluation made within ``seconds`` of training (None: none yet)."""
    done = [p["success"] for p in points if p["seconds"] <= seconds + 1e-9 and p["success"] is not None]
    return done[-1] if done else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p, games="artifacts/games/quest5")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-games", type=int, default=20)
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-start", action="store_true", help="also evaluate the untrained student (slow)")
    a = p.parse_args()
    results = ResultFile("turnopd_wallclock")
    suffix = f"s{a.steps}/e{a.episodes}/t{a.turns}/lr{a.lr}/g{a.eval_games}/v{a.eval_every}"
    for arm in ("vanilla", "turnopd"):
        key = f"{arm}/{suffix}"
        if key not in results:
            print(f"running {key} ...", flush=True)
            results.put(key, run(arm, a))
    van, top = results[f"vanilla/{suffix}"], results[f"turnopd/{suffix}"]
    target = max(pt["success"] for pt in van["points"])
    t_van, t_top = first_reaching(van["points"], target), first_reaching(top["points"], target)
    equal = min(van["train_seconds"], top["train_seconds"])
    rows = [[name, f"{r['train_seconds'] / 60:.1f}", f"{r['mean_turns']:.1f}",
             " ".join(f"{pt['success']:.2f}@{pt['seconds'] / 60:.1f}" for pt in r["points"]),
             "-" if t is None else f"{t / 60:.1f}",
             "-" if success_at(r["points"], equal) is None else f"{success_at(r['points'], equal):.2f}"]
            for name, r, t in (("vanilla OPD", van, t_van), ("TurnOPD", top, t_top))]
    print(f"\n{a.steps} steps x {a.episodes} episodes, <= {a.turns} turns, quest length 5; greedy success on "
          f"{a.eval_games} held-out games every {a.eval_every} steps; target = vanilla's best ({target:.2f})")
    print(markdown_table(["arm", "train min", "turns/episode", "success@train-min", "min to target",
                          f"success at {equal / 60:.1f} min"], rows))
    if t_van and t_top:
        print(f"\nTurnOPD reaches the target {t_van / t_top:.2f}x {'faster' if t_top < t_van else 'slower'}")


if __name__ == "__main__":
    main()
