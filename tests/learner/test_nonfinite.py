"""F28 (docs/faults.md): an optimizer update whose loss or gradient is not finite is skipped, with the weights and the
optimizer state (AdamW's moments and step count) and the LR bit-identical, counted (``train/nonfinite_steps_skipped``),
and ``max_nonfinite_steps`` such updates in a row stop the run with an error naming the step and the quantity.

The NaN is injected into the teacher's log-probs of one rollout batch by a forward hook that multiplies the teacher's
final hidden states by NaN (a real tiny teacher; it stands for one that overflows), or into one student parameter's
gradient by a tensor hook. Real Lightning fits on CPU. The two-rank case (a NaN on one rank only makes every rank skip)
is in tests/test_rank_reduced_metrics.py."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import ATODModule, OPDModule
from tests.helpers import KeywordEnvFactory

pytestmark = pytest.mark.timeout(300)

PARAM = "model.layers.1.mlp.down_proj.weight"


class NaNAt(L.Callback):
    """At the listed policy versions (rollout batches): the teacher's final hidden states are NaN (``"teacher"``),
    or the gradient of student parameter :data:`PARAM` is (``"grad"``)."""

    def __init__(self, versions, where: str = "teacher") -> None:
        self.versions, self.where, self.handle = set(versions), where, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.policy_version not in self.versions:
            return
        if self.where == "teacher":
            self.handle = pl_module.teacher.base_model.norm.register_forward_hook(lambda m, i, out: out * float("nan"))
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
        self.turn_stats.append(outputs["turn_stats"] is not None)


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
