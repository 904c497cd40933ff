"""Held-out TextWorld success after the same number of rollout iterations: OPD, GRPO and ATOD, built from the
same parts (``ClippedSurrogate``), with the same student, teacher, seeds and update budget; the teacher's
own held-out success for reference.

Arms (docs/algorithms.md §3):

* ``opd``: kappa = 1, rho = 0 (the sampled-token OPD advantage in the clipped surrogate);
* ``grpo``: kappa = 0, rho = 1 (group-normalised episode reward only);
* ``atod``: kappa 1 -> 0.1 and rho 1 -> 2 annealed over the first 80/150 of training, T-DUR on the OPD term;
* ``teacher``: no training, the teacher evaluated like the students;
* ``opd_full`` (not in the default list): the repo's default analytic full-vocabulary reverse KL.

Scaled for a 2-core CPU (the paper: G = 8, 150 steps of 16 tasks, lr 1e-6 on GPUs): ``--steps`` rollout
iterations of ``--tasks`` tasks x ``--group`` episodes (G = 4 over two tasks by default), each batch split into
``--mini-batches`` optimizer updates (every arm the same), then greedy evaluation on ``--eval-games``
held-out games. Budget: about 8 steps x 80 s + 3 min evaluation per trained arm, ~40 min for the default
arms. Results: benchmarks/results/atod_vs_opd.json (resumable: finished arms are skipped).

Run: .venv/bin/python -m benchmarks.atod_vs_opd
"""

from __future__ import annotations

import argparse

import lightning as L
import torch

from benchmarks.common import ResultFile, add_artifact_args, markdown_table
from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.data import RolloutDataModule
from lightning_opd.envs.textworld_env import TextWorldEnvFactory
from lightning_opd.losses import ClippedSurrogate, EpisodeReward, FullVocabReverseKL
from lightning_opd.learner import ATODModule, OPDModule

ARMS = ("opd", "grpo", "atod", "teacher")
HYBRID = {"opd": dict(kappa=1.0, rho=0.0), "grpo": dict(kappa=0.0, rho=1.0), "atod": dict(kappa=1.0, rho=1.0, tdur=True)}


class Collect(L.Callback):
    """Per-step means of the hybrid-loss diagnostics."""

    KEYS = ("ppo/clip_frac", "grpo/equal_reward_groups", "grpo/groups", "grpo/reward_mean", "tdur/mean_weight",
            "train/kl", "rollout/success")

    def __init__(self):
        self.values: dict[str, list[float]] = {k: [] for k in self.KEYS}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for key in self.KEYS:
            if key in trainer.callback_metrics:
                self.values[key].append(float(trainer.callback_metrics[key]))

    def mean(self, key: str) -> float | None:
        v = self.values[key]
        return sum(v) / len(v) if v else None


def datamodule(args) -> RolloutDataModule:
    env = TextWorldEnvFactory(args.games, num_eval=args.eval_games)
    return RolloutDataModule(env, episodes_per_step=args.tasks * args.group, group_size=args.group,
                             max_turns=args.turns, eval_batch_size=args.eval_games, seed=args.seed)


def trainer_for(args, callbacks, max_steps: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, val_check_interval=args.steps,
                     check_val_every_n_epoch=None, num_sanity_val_steps=0, callbacks=callbacks)


def run(arm: str, args) -> dict:
    L.seed_everything(args.seed, verbose=False)
    dm = datamodule(args)
    if arm == "teacher":
        model = OPDModule(student=args.teacher, teacher=args.teacher, log_text_every_n_steps=0)
        trainer = trainer_for(args, [], 1)
        trainer.validate(model, datamodule=dm, verbose=False)
        return {"success": float(trainer.callback_metrics["val/success"]),
                "episodes": float(trainer.callback_metrics["val/episodes"])}
    optimizer = lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.0)  # noqa: E731
    common = dict(student=args.model, teacher=args.teacher, log_text_every_n_steps=0, optimizer=optimizer)
    callbacks: list[L.Callback] = [Collect()]
    if arm == "opd_full":  # plain OPD: one update per rollout batch (PPO mini-batches are ATODModule's)
        model = OPDModule(loss=FullVocabReverseKL(), **common)
    else:
        model = ATODModule(loss=ClippedSurrogate(clip_eps=args.clip_eps), reward=EpisodeReward(1.0, args.score_weight),
                           ppo_mini_batches=args.mini_batches, **HYBRID[arm], **common)
    if arm == "atod":
        horizon = dict(fraction=args.anneal_fraction)
        callbacks += [AnnealingSchedule("kappa", 1.0, 0.1, **horizon), AnnealingSchedule("rho", 1.0, 2.0, **horizon)]
    trainer = trainer_for(args, callbacks, args.steps * model.updates_per_batch)
    trainer.fit(model, datamodule=dm)
    collect = callbacks[0]
    out = {"success": float(trainer.callback_metrics["val/success"]),
           "episodes": float(trainer.callback_metrics["val/episodes"]),
           "policy_version": int(model.policy_version)}
    out.update({key.replace("/", "_"): collect.mean(key) for key in Collect.KEYS})
    return out


def fmt(value, spec=".2f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--steps", type=int, default=8, help="rollout iterations per arm")
    p.add_argument("--tasks", type=int, default=2, help="tasks per rollout batch")
    p.add_argument("--group", type=int, default=4, help="G: episodes per task")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer updates per rollout batch (every arm)")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--score-weight", type=float, default=0.0, help="reward per TextWorld point (success is 1)")
    p.add_argument("--anneal-fraction", type=float, default=80 / 150)
    p.add_argument("--eval-games", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS) + ["opd_full"])
    a = p.parse_args()
    results = ResultFile("atod_vs_opd")
    suffix = (f"s{a.steps}/t{a.tasks}xg{a.group}/mb{a.mini_batches}/turns{a.turns}/lr{a.lr}/clip{a.clip_eps}/"
              f"sw{a.score_weight}/af{a.anneal_fraction:.4f}/e{a.eval_games}/seed{a.seed}")
    for arm in a.arms:
        key = f"{arm}/{suffix}"
        if key not in results:
            print(f"running {key} ...", flush=True)
            results.put(key, run(arm, a))
    rows = []
    for arm in a.arms:
        r = results[f"{arm}/{suffix}"]
        groups = r.get("grpo_groups")
        equal = None if not groups else r["grpo_equal_reward_groups"] / groups
        rows.append([arm, f"{r['success']:.2f}", f"{r['episodes']:.0f}", fmt(r.get("rollout_success")),
                     fmt(r.get("train_kl"), ".3f"), fmt(equal), fmt(r.get("ppo_clip_frac"), ".3f"),
                     fmt(r.get("tdur_mean_weight"))])
    print(f"\n{a.steps} rollout iterations x {a.tasks} tasks x G={a.group} (<= {a.turns} turns), {a.mini_batches} "
          f"updates per batch, lr {a.lr}, seed {a.seed}; greedy success on {a.eval_games} held-out games")
    print(markdown_table(["arm", "held-out success", "episodes", "train success (mean)", "train KL (nats/token)",
                          "equal-reward groups", "clip fraction", "mean T-DUR weight"], rows))


if __name__ == "__main__":
    main()
