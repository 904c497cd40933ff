"""F28 (docs/faults.md): an optimizer update whose loss or gradient is not finite is skipped, with the weights and the
optimizer state (AdamW's moments and step count) and the LR bit-identical, counted (``train/nonfinite_steps_skipped``),
and ``max_nonfinite_steps`` such updates in a row stop the run with an error naming the step and the quantity.

The NaN is injected into the teacher's log-probs of one rollout batch by a forward hook that multiplies the teacher's
final hidden states by NaN (a real tiny teacher; it stands for one that overflows), or into one student parameter's
gradient by a tensor hook. Real Lightning fits on CPU. The two-rank case (a NaN on one rank only makes every rank skip)
is in tests/test_rank_reduced_metrics.py. ``SFTModule`` (automatic optimization, the teacher recipe) is guarded too: the
NaN is then put into the student's own final hidden states, so its cross-entropy loss is NaN."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.data.expert import ExpertDataModule
from lightning_opd.learner import ATODModule, OPDModule, SFTModule
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)

PARAM = "model.layers.1.mlp.down_proj.weight"


class NaNAt(L.Callback):
    """At the listed policy versions (rollout batches): the teacher's final hidden states are NaN (``"teacher"``), or
    the student's (``"student"``), or the gradient of student parameter :data:`PARAM` is (``"grad"``)."""

    def __init__(self, versions, where: str = "teacher") -> None:
        self.versions, self.where, self.handle = set(versions), where, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.policy_version not in self.versions:
            return
        if self.where in ("teacher", "student"):
            model = pl_module.teacher_model if self.where == "teacher" else pl_module.student
            self.handle = model.base_model.norm.register_forward_hook(lambda m, i, out: out * float("nan"))
        else:
            self.handle = dict(pl_module.student.named_parameters())[PARAM].register_hook(lambda g: g * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _snapshot(trainer, module) -> dict:
    """Weights, optimizer state and LR scheduler state, copied."""
    sched = trainer.lr_scheduler_configs[0].scheduler.state_dict() if trainer.lr_scheduler_configs else None
    return {"weights": {n: p.detach().clone() for n, p in module.student.named_parameters()},
            "optimizer": copy.deepcopy(trainer.optimizers[0].state_dict()), "scheduler": copy.deepcopy(sched)}


class Snapshots(L.Callback):
    """The state before and after every rollout batch, what it logged, and what it returned."""

    def __init__(self) -> None:
        self.before, self.after, self.skipped_logged, self.turn_stats = [], [], [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before.append(_snapshot(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(_snapshot(trainer, pl_module))
        self.skipped_logged.append(float(trainer.callback_metrics.get("train/nonfinite_steps_skipped", float("nan"))))
        self.turn_stats.append(outputs.get("turn_stats") is not None)  # SFTModule: {"loss"} only


def _identical(a: dict, b: dict) -> bool:
    """Bit-identical weights, optimizer state (every tensor and number) and scheduler state."""
    if a["weights"].keys() != b["weights"].keys() or not all(torch.equal(a["weights"][k], b["weights"][k])
                                                              for k in a["weights"]):
        return False
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    if sa.keys() != sb.keys():
        return False
    for k in sa:
        if sa[k].keys() != sb[k].keys() or not all(torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n]))
                                                   for n in sa[k]):
            return False
    return a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"] and a["scheduler"] == b["scheduler"]


def _fit(model, callbacks, max_steps: int):
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(model, datamodule=dm)
    return trainer


def _opd(model_dirs, **kw) -> OPDModule:
    return OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], log_text_every_n_steps=0,
                     optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.5, total_iters=4), **kw)


def test_f28_a_nan_teacher_step_is_skipped_with_weights_and_optimizer_state_bit_identical(model_dirs):
    model, snaps = _opd(model_dirs), Snapshots()
    with pytest.warns(UserWarning, match=r"trainer.global_step=1\): the loss \(rank\(s\) \[0\]\) is not finite; "
                                         r"update skipped"):
        trainer = _fit(model, [NaNAt({1}), snaps], max_steps=3)
    assert trainer.global_step == 3 and model.policy_version == 3  # the skipped update still counts as a step
    assert not _identical(snaps.before[0], snaps.after[0])  # a normal step trains
    assert _identical(snaps.before[1], snaps.after[1])  # the NaN step: weights, AdamW moments + step, LR untouched
    assert snaps.after[1]["optimizer"]["state"][0]["step"] == 1.0
    assert not _identical(snaps.before[2], snaps.after[2])  # and training goes on from there
    assert all(bool(torch.isfinite(p).all()) for p in model.student.parameters())
    assert snaps.skipped_logged == [0.0, 1.0, 1.0]
    assert (model.nonfinite.skipped, model.nonfinite.in_a_row) == (1, 0)
    assert snaps.turn_stats == [True, False, True]  # the NaN step's per-turn KL is not handed to controllers


def test_f28_max_nonfinite_steps_in_a_row_stop_the_run_naming_step_and_loss(model_dirs):
    from lightning_opd.learner.nonfinite import NonFiniteUpdateError

    model, snaps = _opd(model_dirs, max_nonfinite_steps=2), Snapshots()
    with pytest.warns(UserWarning, match="update skipped"), pytest.raises(NonFiniteUpdateError) as err:
        _fit(model, [NaNAt({1, 2, 3}), snaps], max_steps=5)
    message = str(err.value)
    assert message.startswith("optimizer step 2 (trainer.global_step=2): the loss (rank(s) [0]) is not finite; 2 "
                              "optimizer updates in a row had a non-finite loss or gradient "
                              "(model.init_args.max_nonfinite_steps=2), the first at optimizer step 1 "
                              "(trainer.global_step=1): the loss (rank(s) [0])")
    assert _identical(snaps.after[0], snaps.before[1]) and _identical(snaps.before[1], snaps.after[1])
    weights = {n: p.detach() for n, p in model.student.named_parameters()}  # stopped before applying anything
    assert all(torch.equal(weights[n], snaps.after[0]["weights"][n]) for n in weights)


def test_f28_a_nonfinite_gradient_is_named_by_its_parameter(model_dirs):
    from lightning_opd.learner.nonfinite import NonFiniteUpdateError

    model = _opd(model_dirs, max_nonfinite_steps=1)
    with pytest.raises(NonFiniteUpdateError, match=rf"^optimizer step 0 \(trainer.global_step=0\): the gradient of "
                                                   rf"{PARAM} is not finite; 1 optimizer updates in a row"):
        _fit(model, [NaNAt({0}, where="grad")], max_steps=2)
    assert all(bool(torch.isfinite(p).all()) for p in model.student.parameters())


def test_f28_every_ppo_update_of_a_nan_batch_is_skipped_and_counted(model_dirs):
    """ATOD with 2 PPO epochs: the NaN batch's 2 updates are both skipped (2 in a row, below the default 3)."""
    model = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], ppo_epochs=2, tdur=True,
                       log_text_every_n_steps=0, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    snaps = Snapshots()
    with pytest.warns(UserWarning, match="update skipped"):
        trainer = _fit(model, [NaNAt({1}), snaps], max_steps=6)
    assert trainer.global_step == 6 and model.policy_version == 3
    assert _identical(snaps.before[1], snaps.after[1]) and not _identical(snaps.before[2], snaps.after[2])
    assert snaps.skipped_logged == [0.0, 2.0, 2.0] and model.nonfinite.in_a_row == 0


@pytest.mark.parametrize("cls", [OPDModule, ATODModule])
def test_f28_max_nonfinite_steps_is_checked_at_construction(model_dirs, cls):
    with pytest.raises(ValueError, match=r"model.init_args.max_nonfinite_steps=0 must be >= 1"):
        cls(student=model_dirs["student"], teacher=model_dirs["teacher"], max_nonfinite_steps=0)


def test_f28_counts_are_saved_in_checkpoints(model_dirs):
    saved = _opd(model_dirs)
    saved.nonfinite.skipped, saved.nonfinite.in_a_row = 5, 2
    checkpoint = {}
    saved.on_save_checkpoint(checkpoint)
    assert checkpoint["nonfinite_steps"] == {"skipped": 5, "in_a_row": 2}
    restored = _opd(model_dirs)
    restored.on_load_checkpoint(checkpoint)
    assert (restored.nonfinite.skipped, restored.nonfinite.in_a_row) == (5, 2)
    restored.on_load_checkpoint({})  # a checkpoint from before F28
    assert (restored.nonfinite.skipped, restored.nonfinite.in_a_row) == (0, 0)


def test_f28_guard_decides_from_every_ranks_flags():
    """The decision is the all-reduced flags: a finite loss here, a NaN loss on another rank -> skip, naming it."""
    from lightning_opd.learner.nonfinite import NonFiniteGuard

    guard = NonFiniteGuard(3)
    other_rank_nan = lambda flags: flags + torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=flags.dtype)  # noqa: E731
    assert guard.check(torch.tensor(0.5), torch.tensor(2.0), lambda: [], lambda f: f, 0, 2) is None
    assert guard.check(torch.tensor(0.5), torch.tensor(2.0), lambda: [], other_rank_nan, 0, 2) == "the loss (rank(s) [1])"
    assert guard.check(torch.tensor(0.5), torch.tensor(float("inf")), lambda: [], lambda f: f, 0, 2) == \
        "the gradient norm (inf)"


# ----------------------------------------------------------------------------------------- SFTModule (F28)
def _sft(model_dirs, **kw) -> SFTModule:
    return SFTModule(student=model_dirs["student"], optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                     lr_scheduler=lambda opt: torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.5, total_iters=4), **kw)


def _fit_sft(model, callbacks, max_steps: int, **trainer_kw):
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=callbacks, **trainer_kw)
    trainer.fit(model, datamodule=ExpertDataModule(KeywordEnvFactory(need=2), batch_size=2))
    return trainer


def test_f28_sft_a_nan_loss_step_is_skipped_with_weights_optimizer_and_scheduler_bit_identical(model_dirs):
    model, snaps = _sft(model_dirs), Snapshots()
    with pytest.warns(UserWarning, match=r"trainer.global_step=1\): the loss \(rank\(s\) \[0\]\) is not finite; "
                                         r"update skipped"):
        trainer = _fit_sft(model, [NaNAt({1}, where="student"), snaps], max_steps=3)
    assert trainer.global_step == 3 and model.policy_version == 3  # the skipped update still counts as a step
    assert not _identical(snaps.before[0], snaps.after[0])  # a normal step trains
    assert _identical(snaps.before[1], snaps.after[1])  # the NaN step: weights, AdamW moments + step, LR untouched
    assert snaps.after[1]["optimizer"]["state"][0]["step"] == 1.0
    assert snaps.after[1]["scheduler"]["last_epoch"] == 1  # the per-step LR scheduler was held back too
    assert not _identical(snaps.before[2], snaps.after[2])  # and training goes on from there
    assert snaps.after[2]["optimizer"]["state"][0]["step"] == 2.0 and snaps.after[2]["scheduler"]["last_epoch"] == 2
    assert all(bool(torch.isfinite(p).all()) for p in model.student.parameters())
    assert snaps.skipped_logged == [0.0, 1.0, 1.0]
    assert (model.nonfinite.skipped, model.nonfinite.in_a_row) == (1, 0)


def test_f28_sft_max_nonfinite_steps_stops_the_run_naming_the_step(model_dirs):
    from lightning_opd.learner.nonfinite import NonFiniteUpdateError

    model, snaps = _sft(model_dirs, max_nonfinite_steps=1), Snapshots()
    with pytest.raises(NonFiniteUpdateError, match=r"^optimizer step 1 \(trainer.global_step=1\): the loss \(rank\(s\) "
                                                   r"\[0\]\) is not finite; 1 optimizer updates in a row"):
        _fit_sft(model, [NaNAt({1}, where="student"), snaps], max_steps=3)
    weights = {n: p.detach() for n, p in model.student.named_parameters()}  # stopped before applying anything
    assert all(torch.equal(weights[n], snaps.after[0]["weights"][n]) for n in weights)
    with pytest.raises(NonFiniteUpdateError, match=rf"^optimizer step 0 \(trainer.global_step=0\): the gradient of "
                                                   rf"{PARAM} is not finite"):
        _fit_sft(_sft(model_dirs, max_nonfinite_steps=1), [NaNAt({0}, where="grad")], max_steps=2)


def test_f28_sft_applied_updates_are_still_clipped_by_the_trainer(model_dirs):
    """``trainer.gradient_clip_val`` still clips an applied update: with plain SGD (lr 1) the step moves the weights
    by exactly the clipped gradient, whose global L2 norm is the clip value."""
    model = SFTModule(student=model_dirs["student"], optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    snaps = Snapshots()
    _fit_sft(model, [snaps], max_steps=1, gradient_clip_val=1e-3)
    before, after = snaps.before[0]["weights"], snaps.after[0]["weights"]
    moved = torch.sqrt(sum(((after[n] - before[n]).double() ** 2).sum() for n in before))
    assert float(moved) == pytest.approx(1e-3, rel=1e-3)  # float32 rounding of the weights only; unclipped: >> 1e-3


def test_f28_sft_knob_and_checkpointed_counts(model_dirs):
    with pytest.raises(ValueError, match=r"model.init_args.max_nonfinite_steps=0 must be >= 1"):
        SFTModule(student=model_dirs["student"], max_nonfinite_steps=0)
    saved = SFTModule(student=model_dirs["student"], max_nonfinite_steps=5)
    assert saved.nonfinite.max_in_a_row == 5
    saved.nonfinite.skipped, saved.nonfinite.in_a_row = 4, 1
    checkpoint = {}
    saved.on_save_checkpoint(checkpoint)
    assert checkpoint["nonfinite_steps"] == {"skipped": 4, "in_a_row": 1}
    restored = SFTModule(student=model_dirs["student"])
    restored.on_load_checkpoint(checkpoint)
    assert (restored.nonfinite.skipped, restored.nonfinite.in_a_row) == (4, 1)


class _RecordedSFT(SFTModule):
    """Records this rank's loss (nats/token) and reply tokens of each step, before they are reduced over ranks."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.local = []

    def _log_step(self, loss, tokens, episodes):
        self.local.append((float(loss), float(tokens)))
        super()._log_step(loss, tokens, episodes)


class _RankState(L.Callback):
    """Per step: whether this rank's weights and optimizer state stayed bit-identical, and what was logged. At policy
    version 1 on rank 1 only, the student's final hidden states are NaN."""

    def __init__(self) -> None:
        self.unchanged, self.logged, self.before, self.handle = [], [], None, None

    @staticmethod
    def _state(trainer, module) -> list:
        opt = trainer.optimizers[0].state_dict()["state"]
        return [p.detach().clone() for p in module.student.parameters()] + \
            [torch.as_tensor(v).clone() for s in opt.values() for v in s.values()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = self._state(trainer, pl_module)
        if trainer.global_rank == 1 and pl_module.policy_version == 1:
            self.handle = pl_module.student.base_model.norm.register_forward_hook(lambda m, i, o: o * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        after = self._state(trainer, pl_module)
        self.unchanged.append(len(after) == len(self.before) and all(map(torch.equal, after, self.before)))
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _sft_rank_worker(rank, port, student, out_dir):
    import os
    from pathlib import Path

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    module, rec = _RecordedSFT(student=student, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2)), _RankState()
    L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
              callbacks=[rec], gradient_clip_val=1.0).fit(module, datamodule=ExpertDataModule(KeywordEnvFactory(need=2),
                                                                                            batch_size=2))
    torch.save({"unchanged": rec.unchanged, "logged": rec.logged, "local": module.local},
               Path(out_dir) / f"rank{rank}.pt")


def test_f28_sft_a_nan_loss_on_one_rank_skips_the_update_on_every_rank(model_dirs, tmp_path):
    """Two gloo ranks (DDP): a NaN loss on rank 1 only at step 1 makes both ranks skip it (one all-reduce of the
    flags); ``train/loss`` is the mean over both ranks' reply tokens (F27), logged alike on both."""
    from tests.helpers import spawn_ranks

    spawn_ranks(_sft_rank_worker, (model_dirs["student"], str(tmp_path)), timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["unchanged"] == [False, True, False]  # step 1 skipped on rank 0 too, whose own loss was finite
        assert [step["train/nonfinite_steps_skipped"] for step in r["logged"]] == [0.0, 1.0, 1.0]
    assert math.isfinite(ranks[0]["local"][1][0]) and math.isnan(ranks[1]["local"][1][0])  # NaN on rank 1 only
    for step in (0, 2):
        (l0, n0), (l1, n1) = ranks[0]["local"][step], ranks[1]["local"][step]
        assert l0 != l1 and n0 != n1  # different batches: a mean of the ranks' means would differ
        expected = (l0 * n0 + l1 * n1) / (n0 + n1)
        for r in ranks:
            assert r["logged"][step]["train/loss"] == pytest.approx(expected, rel=1e-6)
            assert r["logged"][step]["train/supervised_tokens"] == n0 + n1
