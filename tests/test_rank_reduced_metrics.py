"""F27 (docs/faults.md): every logged mean over episodes or tokens is the mean over **both** ranks' episodes or
tokens (sums and counts reduced, then divided), not rank 0's value and not the mean of the two ranks' means; and
F28 across ranks: a NaN loss on rank 1 only makes both ranks skip the update.

Two gloo ranks under FSDP2, spawned with a timeout. The replies are scripted so that the ranks' outcomes differ and
are known: rank 0 plays one episode of ``apple`` and wins it in 2 turns (reward 1), rank 1 plays ``cherry``, ``door``
and ``key`` and loses each at turn 1 (says "banana", reward 0). Over the 4 episodes: success 1/4, turns 5/4,
reward 1/4 (rank 0's values: 1, 2, 1; the mean of the ranks' means: 1/2, 3/2, 1/2)."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import ATODModule, OPDModule
from lightning_opd.losses import SampledTokenReverseKL
from lightning_opd.losses.freshness import FreshnessConfig
from lightning_opd.models.fsdp import FSDP2Strategy
from lightning_opd.rollout.agent_loop import EpisodeSpec
from lightning_opd.rollout.sampler import EpisodeSampler
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import KeywordEnvFactory, make_tokenizer, spawn_ranks

pytestmark = pytest.mark.timeout(600)

TASKS = (("apple",), ("cherry", "door", "key"))  # rank 0's, rank 1's
FIELDS = ("success", "num_turns", "num_tokens", "num_assistant_tokens", "total_reward", "invalid_actions")


class PerRankSampler(EpisodeSampler):
    """Every batch: rank ``r`` plays ``TASKS[r]``, one episode each, in its own GRPO group."""

    def next_episodes(self, n, max_turns=None, is_probe=False):
        first = sum(len(t) for t in TASKS[:self.rank])
        return [EpisodeSpec(task_id=t, seed=first + i, max_turns=self.max_turns, group_id=first + i)
                for i, t in enumerate(TASKS[self.rank])]


class PerRankEpisodes(RolloutDataModule):
    """A RolloutDataModule whose session plays the episodes of :class:`PerRankSampler`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self.sampler
        self.session.sampler = PerRankSampler(s.env, s.episodes_per_step, s.max_turns, s.group_size, s.seed)


def _reply(request) -> str:
    return "apple" if request.task_id == "apple" else "banana"  # wins apple; loses the others at the first turn


def _episodes(batch) -> list[dict]:
    return [{f: float(getattr(t, f)) for f in FIELDS} for t in batch.trajectories]


class RecordedOPD(OPDModule):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.played = []

    def _check_on_policy(self, batch):
        self.played.append(_episodes(batch))
        return super()._check_on_policy(batch)


class RecordedATOD(ATODModule):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.played, self.local = [], []

    def _check_on_policy(self, batch):
        self.played.append(_episodes(batch))
        return super()._check_on_policy(batch)

    def step_extras(self):  # this rank's sums and counts, before they are reduced
        self.local.append({k: [getattr(v, a) for a in ("total", "count", "value") if hasattr(v, a)]
                           for k, v in self._step_stats.items()})
        return super().step_extras()


def _local_state(module, trainer) -> dict:
    """This rank's shards of the weights and of the optimizer state, copied."""
    def local(x):
        return (x.to_local() if hasattr(x, "to_local") else torch.as_tensor(x)).detach().clone()

    opt = trainer.optimizers[0].state_dict()["state"]
    return {"weights": {n: local(p) for n, p in module.student.named_parameters()},
            "optimizer": {k: {n: local(v) for n, v in s.items()} for k, s in opt.items()}}


def _same(a: dict, b: dict) -> bool:
    weights = all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"])
    opt = a["optimizer"].keys() == b["optimizer"].keys() and all(
        torch.equal(a["optimizer"][k][n], b["optimizer"][k][n]) for k in a["optimizer"] for n in a["optimizer"][k])
    return weights and opt


class Record(L.Callback):
    """Per step: the logged values (last callback, so the monitor's are in), this rank's freshness samples and M3 sums,
    and whether the update left this rank's weights and optimizer state bit-identical. At ``nan_version`` on rank
    ``nan_rank`` only, the teacher's final hidden states are NaN (F28)."""

    def __init__(self, nan_rank: int | None = None, nan_version: int | None = None) -> None:
        self.nan_rank, self.nan_version, self.handle = nan_rank, nan_version, None
        self.logged, self.samples, self.unchanged, self.before = [], [], [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = _local_state(pl_module, trainer)
        if trainer.global_rank == self.nan_rank and pl_module.policy_version == self.nan_version:
            self.handle = pl_module.teacher_model.base_model.norm.register_forward_hook(lambda m, i, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.unchanged.append(_same(self.before, _local_state(pl_module, trainer)))
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        report, ratio = outputs.get("freshness"), pl_module.weightings.truncated_ratio
        if report is not None and report.diagnostics is not None:
            d = report.diagnostics
            self.samples.append({"lag": d.lag.tolist(), "delta": d.delta.tolist(), "rho": d.rho.tolist(),
                                 "chi": d.chi.tolist(), "score": report.score.tolist(),
                                 "freshness": report.freshness.tolist(), "ratio": list(ratio.sums[:3])})


def _trainer(steps: int, callbacks) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)


def _dm() -> PerRankEpisodes:
    return PerRankEpisodes(env=KeywordEnvFactory(need=2), generator=ScriptedGenerator(make_tokenizer(), _reply),
                           episodes_per_step=1, max_turns=3, max_new_tokens=4, eval_batch_size=1, seed=0)


def _worker(rank, port, model_dirs, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    common = dict(student=model_dirs["student"], teacher=model_dirs["teacher"], log_text_every_n_steps=0,
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    # OPD with f-OPD's staleness diagnostics (M1 weights, M3 ratios; nothing dropped); a NaN on rank 1 at step 1
    opd, rec = RecordedOPD(loss=SampledTokenReverseKL(), **common), Record(nan_rank=1, nan_version=1)
    monitor = StalenessMonitor(FreshnessConfig(weighting=True, filtering=False, truncated_ratio=True, tau_rho=50.0,
                                               tau_chi=50.0), adaptive_lag=False, sample_records=False)
    _trainer(2, [monitor, rec]).fit(opd, datamodule=_dm())
    # ATOD: GRPO, T-DUR and PPO statistics (one batch, 2 updates)
    atod, atod_rec = RecordedATOD(ppo_epochs=2, tdur=True, **common), Record()
    _trainer(2, [atod_rec]).fit(atod, datamodule=_dm())
    torch.save({"opd": {"played": opd.played, "logged": rec.logged, "samples": rec.samples, "unchanged": rec.unchanged},
                "atod": {"played": atod.played, "logged": atod_rec.logged, "local": atod.local}},
               Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_metrics")
    spawn_ranks(_worker, (model_dirs, str(out)), timeout=540)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _logged(ranks, fit: str, step: int, key: str) -> float:
    """``key`` as logged at ``step``: the same value on both ranks."""
    values = [r[fit]["logged"][step][key] for r in ranks]
    assert values[0] == pytest.approx(values[1], rel=1e-12, abs=0), f"{key}: rank 0 logged {values[0]}, rank 1 {values[1]}"
    return values[0]


def test_f27_rollout_means_are_over_both_ranks_episodes(ranks):
    for fit in ("opd", "atod"):
        for step in range(len(ranks[0][fit]["played"])):
            episodes = [e for r in ranks for e in r[fit]["played"][step]]
            assert [len(r[fit]["played"][step]) for r in ranks] == [1, 3]  # different outcomes, different counts
            for key, expected in (("success", 0.25), ("turns", 1.25), ("reward", 0.25), ("invalid_actions", 0.0),
                                  ("truncated", 0.0), ("env_errors", 0.0)):
                assert _logged(ranks, fit, step, f"rollout/{key}") == pytest.approx(expected, abs=1e-7), (fit, key)
            for key, field in (("tokens", "num_tokens"), ("assistant_tokens", "num_assistant_tokens")):
                expected = sum(e[field] for e in episodes) / 4
                assert _logged(ranks, fit, step, f"rollout/{key}") == pytest.approx(expected, rel=1e-6), (fit, key)
            assert _logged(ranks, fit, step, "rollout/lag_max") == 0.0


def test_f27_staleness_means_are_over_both_ranks_samples(ranks):
    for step in range(2):
        samples = {k: [x for r in ranks for x in r["opd"]["samples"][step][k]] for k in ranks[0]["opd"]["samples"][0]
                   if k != "ratio"}
        assert len(samples["rho"]) == 4 and len(set(samples["rho"])) == 4  # four different drifts
        for key, name in (("lag_mean", "lag"), ("delta", "delta"), ("rho", "rho"), ("chi", "chi"), ("score", "score")):
            expected = sum(samples[name]) / 4
            assert _logged(ranks, "opd", step, f"staleness/{key}") == pytest.approx(expected, rel=1e-6), key
        assert _logged(ranks, "opd", step, "staleness/freshness_min") == pytest.approx(min(samples["freshness"]),
                                                                                       rel=1e-6)
        assert _logged(ranks, "opd", step, "staleness/lag_max") == 0.0
        ratio = [sum(r["opd"]["samples"][step]["ratio"][i] for r in ranks) for i in range(3)]  # sum, clipped, tokens
        assert ratio[2] > 0 and [r["opd"]["samples"][step]["ratio"][2] for r in ranks] != [ratio[2] / 2] * 2
        assert _logged(ranks, "opd", step, "train/ratio_mean") == pytest.approx(ratio[0] / ratio[2], rel=1e-6)
        assert _logged(ranks, "opd", step, "train/ratio_clip_frac") == pytest.approx(ratio[1] / ratio[2], abs=1e-7)


def test_f27_atod_means_are_over_both_ranks_episodes_and_tokens(ranks):
    assert _logged(ranks, "atod", 0, "grpo/reward_mean") == pytest.approx(0.25)  # 1 win of 4 episodes
    assert _logged(ranks, "atod", 0, "grpo/groups") == 4.0
    assert _logged(ranks, "atod", 0, "grpo/equal_reward_groups") == 4.0  # one episode per group
    assert _logged(ranks, "atod", 0, "grpo/equal_reward_share") == 1.0
    local = [r["atod"]["local"][0] for r in ranks]
    for key in ("tdur/mean_weight", "ppo/ratio_mean", "ppo/clip_frac"):
        (t0, c0), (t1, c1) = local[0][key], local[1][key]
        assert c0 > 0 and c1 > 0 and c0 != c1, key  # both ranks count, with different counts
        assert _logged(ranks, "atod", 0, key) == pytest.approx((t0 + t1) / (c0 + c1), rel=1e-6), key
    assert _logged(ranks, "atod", 0, "ppo/ratio_min") == pytest.approx(min(s["ppo/ratio_min"][0] for s in local))
    assert _logged(ranks, "atod", 0, "ppo/ratio_max") == pytest.approx(max(s["ppo/ratio_max"][0] for s in local))


def test_f28_a_nan_loss_on_one_rank_skips_the_update_on_every_rank(ranks):
    for r in ranks:
        assert r["opd"]["unchanged"] == [False, True]  # step 0 trains; step 1 (NaN on rank 1 only) is skipped here too
    assert [_logged(ranks, "opd", step, "train/nonfinite_steps_skipped") for step in range(2)] == [0.0, 1.0]
    assert _logged(ranks, "atod", 0, "train/nonfinite_steps_skipped") == 0.0
