"""Exact resume: N uninterrupted steps == N/2 steps + checkpoint + resume + N/2 steps, in synchronous and
``forced_lag`` modes, on the tiny models: per-step losses, the games and seeds of every batch, their
behaviour versions, every callback's state and the final weights. Checkpoints load with
``torch.load(weights_only=True)`` (F15) and a crash while writing one leaves the previous one loadable (F16)."""

from __future__ import annotations

import random
import time

import fsspec.implementations.local as fs_local
import lightning as L
import numpy as np
import pytest
import torch

from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.callbacks.turn_loss_blend import TurnLossBlend
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner.policy import rng_states, set_rng_states
from lightning_opd.losses.freshness import FreshnessConfig
from lightning_opd.rollout.hf import HFGenerator
from tests.helpers import KeywordEnvFactory
from tests.learner.test_training import RecordingOPD

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")]
STEPS = 4


class Recorder(RecordingOPD):
    """Records, per step: the loss, and the (task, seed, behaviour version) of every sample."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = []

    def _check_on_policy(self, batch):
        self.steps.append([(t.task_id, t.seed) for t in batch.trajectories])
        return super()._check_on_policy(batch)

    def training_step(self, dataloader_iter):
        out = super().training_step(dataloader_iter)  # {"loss", "turn_stats"}
        self.steps[-1] = (self.steps[-1], float(out["loss"]))
        return out


def _callbacks(mode):
    if mode == "sync":
        return [RolloutDepthController(h_min=1, warmup=1, probe_interval=2), TurnLossBlend(total_steps=STEPS)]
    return [StalenessMonitor(FreshnessConfig(lag_cap=4))]


def _fit(model_dirs, path, steps, mode, ckpt_path=None, save=False):
    L.seed_everything(0, verbose=False)
    model = Recorder(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=4,
                     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = RolloutDataModule(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=4, max_new_tokens=4,
                           eval_batch_size=2, seed=0, forced_lag=2 if mode == "forced_lag" else 0)
    callbacks = _callbacks(mode)
    ckpt = [L.pytorch.callbacks.ModelCheckpoint(dirpath=path, save_last=True, save_top_k=0)] if save else []
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, deterministic=True,
                        enable_checkpointing=save, callbacks=[*callbacks, *ckpt])
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model, callbacks, dm


@pytest.mark.parametrize("mode", ["sync", "forced_lag"])
def test_resume_continues_as_if_never_stopped(model_dirs, tmp_path, mode):
    full, full_cbs, full_dm = _fit(model_dirs, tmp_path / "full", STEPS, mode)
    half, _, _ = _fit(model_dirs, tmp_path / "half", STEPS // 2, mode, save=True)
    ckpt = tmp_path / "half" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)  # F15: plain tensors and numbers only
    assert state["policy_version"] == STEPS // 2
    if mode == "forced_lag":  # the old weight copies forced_lag needs travel with the checkpoint
        assert sorted(state["RolloutDataModule"]["weight_snapshots"]) == ["0", "1", "2"]
    resumed, cbs, dm = _fit(model_dirs, tmp_path / "resumed", STEPS, mode, ckpt_path=str(ckpt))

    assert half.steps == full.steps[:STEPS // 2]
    assert [s[0] for s in resumed.steps] == [s[0] for s in full.steps[STEPS // 2:]]  # games and seeds
    assert [s[1] for s in resumed.steps] == pytest.approx([s[1] for s in full.steps[STEPS // 2:]], rel=1e-5, abs=1e-6)
    assert resumed.seen == full.seen[STEPS // 2:]  # (learner version, behaviour versions)
    for cb, full_cb in zip(cbs, full_cbs):
        assert cb.state_dict() == full_cb.state_dict(), type(cb).__name__
    assert dm.state_dict().keys() == full_dm.state_dict().keys()
    for key, value in full_dm.state_dict().items():
        if key != "weight_snapshots":
            assert dm.state_dict()[key] == value, key
    for (name, p), q in zip(full.student.state_dict().items(), resumed.student.state_dict().values()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    torch.save({"rng": rng_states()}, tmp_path / "rng.pt")
    want = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == want


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(model_dirs, tmp_path, monkeypatch):
    """F16: Lightning writes through an fsspec transaction (temporary file, then a move); an exception in
    the middle of the write leaves ``last.ckpt`` from the previous save loadable and unchanged."""
    _fit(model_dirs, tmp_path, 1, "sync", save=True)
    ckpt = tmp_path / "last.ckpt"
    before = ckpt.read_bytes()
    real_write = fs_local.LocalFileOpener.write

    def crash_half_way(self, data):
        real_write(self, bytes(data)[: len(data) // 2])
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(fs_local.LocalFileOpener, "write", crash_half_way)
    with pytest.raises(OSError, match="simulated"):
        _fit(model_dirs, tmp_path, 2, "sync", ckpt_path=str(ckpt), save=True)
    monkeypatch.undo()
    assert ckpt.read_bytes() == before
    assert torch.load(ckpt, weights_only=True)["policy_version"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]  # no partial file left behind


class WaitForBuffered(L.Callback):
    """Before the checkpoint of the last step: wait (bounded) until the producer has a finished batch in its
    buffer, so the test does not depend on how far the thread got on a busy machine."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:
            deadline = time.monotonic() + 120
            while len(trainer.datamodule.session.producer.buffer) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)


def test_async_checkpoint_keeps_the_buffered_batches(model_dirs, tmp_path):
    """Async mode: the producer is parked while saving; the batches it had finished and the learner had
    not taken go into the checkpoint with their versions, and the resumed run trains on them first, so
    the sequence of games and seeds is the uninterrupted one."""

    def fit(path, steps, ckpt_path=None, save=False):
        L.seed_everything(0, verbose=False)
        model = Recorder(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=4)
        dm = RolloutDataModule(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                               eval_batch_size=2, seed=0, mode="async", producer_lead=2)
        ckpt = [WaitForBuffered(), L.pytorch.callbacks.ModelCheckpoint(dirpath=path, save_last=True, save_top_k=0)
                ] if save else []
        trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_checkpointing=save, callbacks=ckpt)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model

    full = fit(tmp_path / "full", 5)
    fit(tmp_path / "half", 2, save=True)
    state = torch.load(tmp_path / "half" / "last.ckpt", weights_only=True)["RolloutDataModule"]["per_rank"][0]
    buffered = state["buffered_batches"]
    assert len(buffered) >= 1 and state["batches_started"] == 2 + len(buffered)  # the producer ran ahead
    assert all(0 <= v <= 2 for batch in buffered for t in batch for v in t["turn_versions"])
    resumed = fit(tmp_path / "resumed", 5, ckpt_path=str(tmp_path / "half" / "last.ckpt"))
    assert [s[0] for s in resumed.steps] == [s[0] for s in full.steps[2:]]  # nothing lost, nothing repeated
    first = [(t["task_id"], t["seed"]) for t in buffered[0]]
    assert resumed.steps[0][0] == first
    assert resumed.seen[0][1] == [min(t["turn_versions"]) for t in buffered[0]]  # trained with its versions


class RecordingHF(HFGenerator):
    """Records, in order, its pushes ``("push", version)`` and ``generate`` calls ``("generate", version of its
    own copy or None for the live student)``, and the weights of its first push."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int | None]] = []
        self.first_push: dict | None = None

    def push_weights(self, state, version):
        with self._lock:
            if self.first_push is None:
                self.first_push = {k: v.clone() for k, v in state.items()}
            self.events.append(("push", int(version)))
            return super().push_weights(state, version)

    def _generate(self, requests, sampling):
        self.events.append(("generate", self._own_version if self._own_model is not None else None))
        return super()._generate(requests, sampling)


@pytest.mark.timeout(300)
def test_async_resume_between_pushes_samples_with_the_restored_weights(model_dirs, tmp_path):
    """F18: async, a push every 2 versions, resumed at version 3. Before its first rollout the generator gets
    its own copy of exactly the checkpoint's student, stamped 3 (not the live student the learner is
    training); later pushes land at 4 and 6, and the run finishes."""

    def fit(path, steps, ckpt_path=None, save=False):
        model = Recorder(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=4)
        dm = RolloutDataModule(env=KeywordEnvFactory(need=9), generator=RecordingHF(), episodes_per_step=2,
                               max_turns=2, max_new_tokens=4, eval_batch_size=2, seed=0, mode="async", producer_lead=1,
                               weight_sync_interval=2)
        ckpt = [L.pytorch.callbacks.ModelCheckpoint(dirpath=path, save_last=True, save_top_k=0)] if save else []
        trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_checkpointing=save, callbacks=ckpt)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model, dm

    fit(tmp_path / "half", 3, save=True)
    ckpt = torch.load(tmp_path / "half" / "last.ckpt", weights_only=True)
    assert ckpt["policy_version"] == 3
    model, dm = fit(tmp_path / "resumed", 6, ckpt_path=str(tmp_path / "half" / "last.ckpt"))
    events = dm.generator.events
    assert events[0] == ("push", 3)
    assert [e for e in events if e[0] == "push"] == [("push", 3), ("push", 4), ("push", 6)]
    assert all(v is not None and v >= 3 for kind, v in events if kind == "generate")  # never the live student
    for name, w in dm.generator.first_push.items():
        torch.testing.assert_close(w, ckpt["state_dict"]["student." + name], rtol=0, atol=0, msg=name)
    assert [v for v, _ in model.seen] == [3, 4, 5]
    for v, behaviour in model.seen:
        assert all(b <= v and v - b <= dm.max_allowed_lag for b in behaviour), (v, behaviour)
