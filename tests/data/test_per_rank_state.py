"""Per-rank state in checkpoints (F21): Lightning asks every rank for its DataModule state and module hooks
but writes rank 0's checkpoint. With 2 gloo ranks in async mode (FSDP2), each rank's buffered batches,
sampler counters and random states are saved, and on resume each rank gets back its own, trains first on
its own buffered batch, and nothing of one rank shows up on the other. Plus the rules for a checkpoint
resumed on a different number of ranks."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.distributed import gather_per_rank
from lightning_opd.models.fsdp import FSDP2Strategy
from lightning_opd.learner.policy import rng_states
from tests.helpers import KeywordEnvFactory, spawn_ranks
from tests.learner.test_training import RecordingOPD

pytestmark = pytest.mark.timeout(420)

COUNTERS = ("epoch", "cursor", "episodes_started", "train_batches", "batches_started")  # the turn cap: the controller's


def _own(state: dict, rank: int) -> dict:
    """A rank's own DataModule state, as plain values: counters and buffered (task, seed) pairs."""
    own = state["per_rank"][rank] if "per_rank" in state else state  # flat: before per-rank states
    return {**{k: own[k] for k in COUNTERS},
            "buffered": [[(t["task_id"], t["seed"]) for t in batch] for batch in own["buffered_batches"]]}


class RecordingDM(RolloutDataModule):
    """Remembers its own state as saved, and what it loaded."""

    saved: dict | None = None
    loaded: dict | None = None

    def state_dict(self) -> dict:
        state = super().state_dict()
        self.saved = _own(state, self.sampler.rank)
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        sampler, session = self.sampler, self.session
        self.loaded = {"epoch": sampler.epoch, "cursor": sampler.cursor, "episodes_started": sampler.episodes_started,
                       "train_batches": session.batches_taken,
                       "batches_started": sampler.batches_started,
                       "buffered": [[(t.task_id, t.seed) for t in batch] for batch in session.restored]}


class Recorder(RecordingOPD):
    """Also records the (task, seed) pairs of every batch and the random states at save and after load."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.played, self.rng_saved, self.rng_loaded = [], None, None

    def _check_on_policy(self, batch):
        self.played.append([(t.task_id, t.seed) for t in batch.trajectories])
        return super()._check_on_policy(batch)

    def on_save_checkpoint(self, checkpoint):
        super().on_save_checkpoint(checkpoint)
        states = checkpoint["rng_states"]  # what this rank saved: its own entry (a dict before per-rank states)
        self.rng_saved = (states[self.global_rank] if isinstance(states, list) else states)["torch"]

    def on_load_checkpoint(self, checkpoint):
        super().on_load_checkpoint(checkpoint)
        self.rng_loaded = rng_states()["torch"]


class WaitForBuffered(L.Callback):
    """Before the last step's checkpoint: wait (bounded) until this rank's producer has a finished batch."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == trainer.max_steps:
            deadline = time.monotonic() + 120
            while len(trainer.datamodule.session.producer.buffer) == 0 and time.monotonic() < deadline:
                time.sleep(0.05)


def _worker(rank, port, model_dirs, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    out = Path(out_dir)

    def fit(steps, ckpt_path=None, save=False):
        model = Recorder(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=2)
        dm = RecordingDM(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                         eval_batch_size=1, seed=0, mode="async", producer_lead=2)
        callbacks = [WaitForBuffered(), L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_last=True,
                                                                            save_top_k=0)] if save else []
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=FSDP2Strategy(), max_steps=steps, logger=False,
                            enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return model, dm

    half, saved_dm = fit(2, save=True)
    resumed, dm = fit(4, ckpt_path=str(out / "ckpt" / "last.ckpt"))
    torch.save({"saved": saved_dm.saved, "loaded": dm.loaded, "played": resumed.played,
                "rng_saved": half.rng_saved, "rng_loaded": resumed.rng_loaded}, out / f"rank{rank}.pt")



def test_two_ranks_resume_with_their_own_buffers_counters_and_random_states(model_dirs, tmp_path):
    spawn_ranks(_worker, (model_dirs, str(tmp_path)), timeout=360)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    saved = [r["saved"] for r in ranks]
    assert all(s["buffered"] for s in saved) and saved[0]["buffered"] != saved[1]["buffered"]  # they differ
    for r, rank in enumerate(ranks):
        assert rank["loaded"] == rank["saved"], f"rank {r} did not get its own state back"
        assert rank["played"][0] == rank["saved"]["buffered"][0]  # trained first on its own buffered batch
        torch.testing.assert_close(rank["rng_loaded"], rank["rng_saved"], rtol=0, atol=0)
    assert not ({p for b in ranks[0]["played"] for p in b} & {p for b in ranks[1]["played"] for p in b})
    meta = torch.load(tmp_path / "ckpt" / "last.ckpt" / "meta.pt", weights_only=True)  # F15: plain values only
    assert meta["RecordingDM"]["world_size"] == 2 and len(meta["rng_states"]) == 2


# ------------------------------------------------------------------------------------ single process
def _state(buffered: bool) -> dict:
    """A checkpoint of 2 ranks: the same counters, rank 1 with or without a buffered batch."""
    rank = {"epoch": 1, "cursor": 2, "episodes_started": 12, "train_batches": 3, "batches_started": 3}
    batch = [{"task_id": "door", "seed": 13, "turn_versions": [2]}]
    return {"world_size": 2, "per_rank": [{**rank, "buffered_batches": []},
                                          {**rank, "batches_started": 3 + buffered,
                                           "buffered_batches": [batch] if buffered else []}]}


def test_a_checkpoint_of_two_ranks_on_one_rank():
    """Without buffered batches the sampler state is global: one rank resumes from it. With a rank's buffered
    batches it cannot be split: an error naming the ranks and the fix."""
    dm = RolloutDataModule(env=KeywordEnvFactory(), mode="async")
    dm.load_state_dict(_state(buffered=False))
    assert (dm.sampler.epoch, dm.sampler.cursor, dm.sampler.episodes_started, dm.session.batches_taken, dm.session.restored) == (1, 2, 12, 3, [])
    with pytest.raises(ValueError, match=r"saved by 2 ranks.*this run has 1.*Resume with 2 ranks"):
        dm.load_state_dict(_state(buffered=True))
    dm.sampler.set_rank(1, 2)
    dm.load_state_dict(_state(buffered=True))
    assert dm.sampler.batches_started == 4 and [[t.task_id for t in b] for b in dm.session.restored] == [["door"]]


def test_a_flat_checkpoint_from_before_per_rank_states_loads():
    dm = RolloutDataModule(env=KeywordEnvFactory())
    dm.load_state_dict({"epoch": 1, "cursor": 3, "episodes_started": 10, "train_batches": 5})
    assert (dm.sampler.epoch, dm.sampler.cursor, dm.sampler.episodes_started, dm.session.batches_taken, dm.sampler.batches_started) == (1, 3, 10, 5, 5)
    assert dm.state_dict() == {"world_size": 1, "per_rank": [
        {"epoch": 1, "cursor": 3, "episodes_started": 10, "train_batches": 5, "batches_started": 5}]}


def test_the_turn_cap_is_not_the_datamodules_state():
    """One owner: a checkpoint's (old) max_turns is ignored; the depth controller's state restores the cap."""
    dm = RolloutDataModule(env=KeywordEnvFactory(), max_turns=8)
    dm.load_state_dict({"world_size": 1, "per_rank": [{"epoch": 0, "max_turns": 3}]})
    assert dm.max_turns == 8 and "max_turns" not in dm.state_dict()["per_rank"][0]


def test_gathering_several_ranks_needs_a_process_group():
    assert gather_per_rank({"a": 1}, 1) == [{"a": 1}]
    with pytest.raises(RuntimeError, match="process group of 2 processes"):
        gather_per_rank({"a": 1}, 2)
