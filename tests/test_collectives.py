"""F19: every collective of a training step is reached the same number of times on every rank, whatever
a rank lost (an environment that failed, samples a filter dropped, an empty batch). Two gloo ranks under
FSDP2, spawned with a timeout so that a hang fails the test instead of blocking it."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.losses.freshness import FreshnessConfig, FreshnessWeighting
from lightning_opd.data import RolloutDataModule
from lightning_opd.rollout.batch import RolloutBatch, collate_trajectories
from lightning_opd.losses import ClippedSurrogate, FullVocabReverseKL
from lightning_opd.models.fsdp import FSDP2Strategy, shard_causal_lm
from lightning_opd.learner import ATODModule, OPDModule
from tests.helpers import KeywordEnvFactory, make_tokenizer, spawn_ranks
from tests.learner.test_module import make_batch, make_module, step_grads

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------- RolloutBatch.masked_rows
def test_masked_rows_keep_the_batch_fields_and_train_nothing(tokenizer):
    batch = make_batch(tokenizer)
    batch = replace(batch, advantage=torch.ones(batch.size), old_logprobs=torch.zeros_like(batch.behaviour_logprobs))
    pad = batch.masked_rows(3)
    assert pad.size == 3 and pad.input_ids.shape == (3, 2)
    assert pad.loss_mask.sum() == 0 and bool((pad.attention_mask == 1).all()) and bool((pad.turn_index == -1).all())
    assert pad.advantage is not None and pad.old_logprobs is not None and pad.turn_weight is None
    assert pad.sample_weight.tolist() == [1.0, 1.0, 1.0] and pad.sampling == batch.sampling
    empty = make_batch(tokenizer).select(slice(0, 0))
    assert empty.masked_rows(1).input_ids.shape == (1, 2)


# ---------------------------------------------------------------------- backward_step with uneven ranks
def _stale_batch(module: OPDModule, tokenizer) -> RolloutBatch:
    """The 4 scripted episodes as one stale async batch: lags 0..3, behaviour log-probs off the learner's by
    per-sample drifts, one group per episode. With lag bound 2 the filter drops episode 3 (lag 3)."""
    batch = make_batch(tokenizer)
    module.policy_version = 3
    lp = module.student_logprobs(batch)  # unsharded here: no collective
    drift = torch.tensor([0.0, 0.02, 0.05, 0.1])[:, None]
    blp = batch.behaviour_logprobs.clone()
    blp[:, 1:] = torch.where(batch.loss_mask[:, 1:] > 0, lp - drift, blp[:, 1:])
    return replace(batch, behaviour_logprobs=blp, behaviour_version=torch.tensor([3, 2, 1, 0]),
                   group_id=torch.arange(4))


def _monitor() -> FreshnessWeighting:
    return FreshnessWeighting(FreshnessConfig(filtering=True, weighting=True, truncated_ratio=True), lag_bound=2)


def _uneven_worker(rank, port, model_dirs, rows, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    module = make_module(model_dirs, FullVocabReverseKL, 1)
    batch = _stale_batch(module, make_tokenizer())
    monitor = _monitor()
    module.configure_freshness(monitor)
    shard_causal_lm(module.student, init_device_mesh("cpu", (2,), mesh_dim_names=("data_parallel",)))
    local = batch.select(torch.tensor(rows[rank], dtype=torch.long))
    turn_stats = []
    sums, _ = step_grads(module, local, world_size=2, stats_out=turn_stats)  # plan (student log-probs, filter), backward
    grads = {n: p.grad.full_tensor() for n, p in module.student.named_parameters()}
    loss = sums["loss"].clone()
    dist.all_reduce(loss)
    logprobs = module.student_logprobs(local)
    torch.save({"loss": loss, "grads": grads, "logprobs": logprobs, "rows": turn_stats[0].kl_sum.shape[0],
                "staleness": monitor.report().stats}, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("rows", [pytest.param(([3], [0, 1, 2]), id="one-filtered-row-vs-three"),
                                  pytest.param(([], [0, 1, 2, 3]), id="empty-rank")])
def test_uneven_ranks_give_the_single_process_gradient(model_dirs, tokenizer, tmp_path, rows):
    """Rank 0 holds 1 row (that the staleness filter drops) or none, rank 1 the rest: both ranks run the same
    number of student forwards (log-probs, backward) and the freshness reductions, and the sharded gradient,
    loss and log-probs equal the single-process ones on all rows."""
    spawn_ranks(_uneven_worker, (model_dirs, rows, str(tmp_path)))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    module = make_module(model_dirs, FullVocabReverseKL, 4)
    batch = _stale_batch(module, tokenizer)
    monitor = _monitor()
    module.configure_freshness(monitor)
    sums, grads = step_grads(module, batch)
    assert monitor.report().stats["dropped_samples"] == 1.0  # the filter dropped episode 3 (lag 3 > bound 2)
    f_bar = monitor.report().stats["freshness_mean"]  # f̄ over all ranks: the same everywhere (drives the bound)
    assert [r["staleness"]["freshness_mean"] for r in ranks] == pytest.approx([f_bar, f_bar], rel=1e-6)
    if not rows[0]:  # a rank without samples: its own statistics are undefined
        assert torch.isnan(torch.tensor(ranks[0]["staleness"]["lag_mean"]))
    assert [r["rows"] for r in ranks] == [len(rows[0]), len(rows[1])]  # turn stats hold real rows only
    torch.testing.assert_close(ranks[0]["loss"], sums["loss"])
    for name, g in grads.items():
        torch.testing.assert_close(ranks[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    lp = module.student_logprobs(batch)
    torch.testing.assert_close(torch.cat([ranks[0]["logprobs"], ranks[1]["logprobs"]]), lp[rows[0] + rows[1]],
                               atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ Trainer.fit, FSDP2
class FailingTaskFactory(KeywordEnvFactory):
    """``make`` raises for the tasks in ``fail`` (all tasks when ``fail_rank`` is this process's rank)."""

    def __init__(self, fail: tuple[str, ...] = (), fail_rank: int | None = None) -> None:
        super().__init__(need=2)
        self.fail, self.fail_rank = fail, fail_rank

    def make(self, task_id: str):
        if task_id in self.fail or (self.fail_rank is not None and dist.get_rank() == self.fail_rank):
            raise OSError(f"cannot start task {task_id}")
        return super().make(task_id)


class Recording:
    """Keeps every step's trajectories and the first update's gradients (gathered); mixed into a module."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.played, self.first_grads = [], None

    def _check_on_policy(self, batch):
        self.played.append((batch.size, batch.trajectories, batch.sampling))
        return super()._check_on_policy(batch)

    def on_before_optimizer_step(self, optimizer):
        if self.first_grads is None:  # a collective: every rank
            self.first_grads = {n: p.grad.full_tensor() for n, p in self.student.named_parameters()}


class Recorder(Recording, OPDModule):
    pass


class ATODRecorder(Recording, ATODModule):
    pass


def _fit_worker(rank, port, model_dirs, case, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    callbacks, kwargs, cls = [], {}, Recorder
    if case == "failed-env":  # one task fails on make(): 1 row on one rank, 2 on the other
        env, max_steps, error_rate = FailingTaskFactory(fail=("apple",)), 2, 0.5
    else:  # every site of the step: staleness filter, hybrid preparation (T-DUR), 2 PPO mini-batches
        env, max_steps, error_rate = FailingTaskFactory(fail_rank=0), 4, 1.0
        callbacks = [StalenessMonitor(FreshnessConfig(filtering=True), initial_lag_bound=2)]
        kwargs, cls = dict(loss=ClippedSurrogate(), tdur=True, ppo_mini_batches=2), ATODRecorder
    model = cls(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=4,
                     grad_clip_norm=None, optimizer=lambda p: torch.optim.SGD(p, lr=1e-2), **kwargs)
    dm = RolloutDataModule(env=env, episodes_per_step=2, max_turns=2, max_new_tokens=4, max_env_error_rate=error_rate,
                           seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, datamodule=dm)
    torch.save({"played": model.played, "grads": model.first_grads, "version": model.policy_version,
                "loss": float(trainer.callback_metrics["train/loss"])}, Path(out_dir) / f"rank{rank}.pt")


def _load(tmp_path):
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_fsdp_fit_with_a_failed_environment_on_one_rank(model_dirs, tokenizer, tmp_path):
    """Issue 14 case 4: ``episodes_per_step=2``, one task raises on ``make()``; the ranks hold 1 and 2 rows,
    the fit finishes its steps, and the first update's gradient is the single-process gradient of the
    surviving rows."""
    spawn_ranks(_fit_worker, (model_dirs, "failed-env", str(tmp_path)))
    ranks = _load(tmp_path)
    assert [r["version"] for r in ranks] == [2, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in ranks)
    sizes = [sorted(r["played"][step][0] for r in ranks) for step in range(2)]
    assert sizes == [[1, 2], [1, 2]]
    trajs = [t for r in ranks for t in r["played"][0][1]]
    assert sum(t.env_error for t in trajs) == 1
    batch = collate_trajectories(trajs, ranks[0]["played"][0][2], pad_id=tokenizer.pad_token_id)
    assert batch.size == 3
    module = make_module(model_dirs, FullVocabReverseKL, 3)
    _, grads = step_grads(module, batch)
    for name, g in grads.items():
        torch.testing.assert_close(ranks[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_fsdp_fit_with_an_empty_rank_through_every_site(model_dirs, tmp_path):
    """Rank 0's environments all fail (an empty batch every step) under the staleness filter, the hybrid
    objective with T-DUR and 2 PPO mini-batches: the fit finishes (2 batches, 4 updates) and the gradient is
    rank 1's alone."""
    spawn_ranks(_fit_worker, (model_dirs, "empty-rank", str(tmp_path)))
    ranks = _load(tmp_path)
    assert [r["version"] for r in ranks] == [2, 2]
    assert [[p[0] for p in r["played"]] for r in ranks] == [[0, 0], [2, 2]]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in ranks)
    assert any(g.abs().max() > 0 for g in ranks[0]["grads"].values())
