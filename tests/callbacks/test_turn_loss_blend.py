"""TurnLossBlend (TurnOPD §5.2, docs/algorithms.md §2.4): the α schedule, the weighting it installs and the α it
hands over before each batch (weights on a hand-built micro-batch at α = 0, 0.5, 1), the max_steps check and
state. ``blend_weights`` and ``TurnBlendWeighting`` live in lightning_opd.losses.turn_blend."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.callbacks.turn_loss_blend import TurnLossBlend
from lightning_opd.losses.turn_blend import TurnBlendWeighting, blend_weights
from lightning_opd.rollout.batch import RolloutBatch

# positions 0..9 of four samples: P prompt, O observation, _ padding, digits = turn of a supervised token
LAYOUT = [
    "PP000O1O22",  # N 6, T 3, n = [3, 1, 2]
    "PPP0000___",  # N 4, T 1
    "PP0OOO222_",  # N 4, T 2 (turn 1 has no supervised token), n = [1, -, 3]
    "PP00O1____",  # dropped by another scheme: all-zero loss mask
]


def _micro_batch() -> RolloutBatch:
    b, t = len(LAYOUT), len(LAYOUT[0])
    turns = torch.tensor([[int(c) if c.isdigit() else -1 for c in s] for s in LAYOUT])
    mask = (turns >= 0).float()
    mask[3] = 0
    return RolloutBatch(input_ids=torch.zeros(b, t, dtype=torch.long), attention_mask=torch.ones(b, t, dtype=torch.long),
                        loss_mask=mask, turn_index=turns, behaviour_logprobs=torch.zeros(b, t),
                        behaviour_version=torch.zeros(b, dtype=torch.long), rewards=torch.zeros(b), success=torch.zeros(b),
                        num_turns=torch.tensor([3, 1, 3, 2]), group_id=torch.arange(b),
                        is_probe=torch.zeros(b, dtype=torch.bool), rollout_cap=torch.full((b,), 4))


def _expected(ratio_by_sample: list[dict[int, float]], alpha: float) -> torch.Tensor:
    """Full-length expected weights from the per-turn ratios N / (T n_t), then the target positions."""
    out = torch.ones(len(LAYOUT), len(LAYOUT[0]))
    for i, s in enumerate(LAYOUT):
        for j, c in enumerate(s):
            if c.isdigit() and int(c) in ratio_by_sample[i]:
                out[i, j] = (1 - alpha) + alpha * ratio_by_sample[i][int(c)]
    return out[:, 1:]


# sample 0: 6/(3*3), 6/(3*1), 6/(3*2); sample 1: 4/(1*4); sample 2: 4/(2*1), 4/(2*3); sample 3: dropped
RATIOS = [{0: 2 / 3, 1: 2.0, 2: 1.0}, {0: 1.0}, {0: 2.0, 2: 2 / 3}, {}]


class FakeModule:
    def __init__(self, version=0):
        self.policy_version, self.turn_blend, self.logged = version, None, {}

    def configure_turn_blend(self, weighting):
        self.turn_blend = weighting

    def log(self, key, value, batch_size):
        self.logged[key] = value


class FakeTrainer:
    def __init__(self, max_steps, callbacks=()):
        self.max_steps, self.callbacks = max_steps, list(callbacks)


def _blend(k, total=10, **kw):
    """The weights the module gets at rollout batch ``k``: the callback installs its weighting at setup and sets
    α before the batch; the module passes the micro-batch's target positions."""
    cb, module = TurnLossBlend(total_steps=total, **kw), FakeModule()
    cb.setup(FakeTrainer(-1), module, "fit")
    module.policy_version = k
    cb.on_train_batch_start(None, module, None, k)
    mb = _micro_batch()
    return module.turn_blend.token_weights(mb.loss_mask[:, 1:], mb.turn_index[:, 1:], torch.float32)


def test_alpha_zero_is_exactly_all_ones():
    mb = _micro_batch()
    w = blend_weights(mb.loss_mask[:, 1:], mb.turn_index[:, 1:], 0.0)
    assert w.shape == (4, 9) and torch.equal(w, torch.ones(4, 9))
    assert _blend(0) is None  # k = 0: the module uses weight 1 (vanilla OPD)


@pytest.mark.parametrize(("k", "alpha"), [(5, 0.5), (10, 1.0)])
def test_weights_by_hand(k, alpha):
    w = _blend(k)
    torch.testing.assert_close(w, _expected(RATIOS, alpha), rtol=0, atol=1e-6)
    assert torch.isfinite(w).all()
    mb = _micro_batch()
    per_sample = (w * mb.loss_mask[:, 1:]).sum(1)
    torch.testing.assert_close(per_sample, mb.loss_mask[:, 1:].sum(1))  # Σ_i w_i = N: normalisation unchanged


@pytest.mark.parametrize(("k", "alpha"), [(0, 0.0), (2, 0.0), (4, 0.5), (6, 1.0), (9, 1.0)])
def test_alpha_schedule_window(k, alpha):
    cb = TurnLossBlend(start=0.2, end=0.6, total_steps=10)
    assert cb.alpha_at(k) == pytest.approx(alpha)


def test_setup_installs_the_weighting_and_needs_max_steps():
    cb, module = TurnLossBlend(), FakeModule()
    cb.setup(FakeTrainer(8), module, "fit")
    assert module.turn_blend is cb.weighting and isinstance(cb.weighting, TurnBlendWeighting)
    assert cb.alpha_at(2) == 0.25 and cb.alpha_at(8) == 1.0
    with pytest.raises(ValueError, match="trainer.max_steps=-1 is unset"):
        TurnLossBlend().setup(FakeTrainer(-1), FakeModule(), "fit")
    with pytest.raises(TypeError, match="configure_turn_blend"):
        TurnLossBlend().setup(FakeTrainer(8), object(), "fit")
    for kw, bad in (({"start": 0.5, "end": 0.5}, "start=0.5, end=0.5"), ({"total_steps": 0}, "total_steps=0")):
        with pytest.raises(ValueError, match=bad):
            TurnLossBlend(**kw)


def test_logs_the_alpha_of_the_step_just_trained_and_state_round_trip():
    cb, module = TurnLossBlend(), FakeModule()
    cb.setup(FakeTrainer(8), module, "fit")
    module.policy_version = 3  # after the optimizer step of step 2
    cb.on_train_batch_end(None, module, None, None, 0)
    assert module.logged == {"turn_blend/alpha": 0.25}
    assert cb.state_key == "TurnLossBlend{'start': 0.0, 'end': 1.0}"
    resumed = TurnLossBlend()
    resumed.setup(FakeTrainer(8), FakeModule(), "fit")
    resumed.load_state_dict(cb.state_dict())
    assert [resumed.alpha_at(k) for k in range(9)] == [cb.alpha_at(k) for k in range(9)]


def test_k_counts_rollout_iterations_with_several_updates_per_batch():
    module = FakeModule()
    module.updates_per_batch = 2  # e.g. ATOD's PPO mini-batches: max_steps counts optimizer updates
    cb = TurnLossBlend()
    cb.setup(FakeTrainer(8), module, "fit")
    assert cb.horizon == 4 and cb.alpha_at(2) == 0.5


def test_time_horizon_reads_progress_from_the_timer_budget(monkeypatch):
    """horizon='time': progress = training seconds / the Timer's budget, whatever the step count: with a 100 s
    budget and a window s = 0.2, e = 0.6, 25 s spent gives (0.25 - 0.2) / 0.4 = 0.125, 50 s 0.75, 70 s 1."""
    from datetime import timedelta

    from lightning.pytorch.callbacks import Timer

    timer = Timer(duration=timedelta(seconds=100))
    cb, module = TurnLossBlend(start=0.2, end=0.6, horizon="time"), FakeModule(version=1)
    cb.setup(FakeTrainer(-1, [timer]), module, "fit")  # no max_steps needed
    assert module.turn_blend is cb.weighting and cb.timer is timer
    for spent, alpha in ((0.0, 0.0), (25.0, 0.125), (50.0, 0.75), (70.0, 1.0), (130.0, 1.0)):
        monkeypatch.setattr(timer, "time_elapsed", lambda stage="train", s=spent: s)
        cb.on_train_batch_start(None, module, None, 0)
        assert cb.weighting.alpha == pytest.approx(alpha)
        cb.on_train_batch_end(None, module, None, None, 0)
        assert module.logged["turn_blend/alpha"] == pytest.approx(alpha)  # the α the batch trained with
    with pytest.raises(ValueError, match=r"horizon='time'\) needs a lightning.pytorch.callbacks.Timer with a duration"):
        TurnLossBlend(horizon="time").setup(FakeTrainer(8, [Timer()]), FakeModule(), "fit")  # Timer without budget
    with pytest.raises(ValueError, match="horizon='hours'"):
        TurnLossBlend(horizon="hours")
    with pytest.raises(ValueError, match="total_steps=5 with horizon='time'"):
        TurnLossBlend(total_steps=5, horizon="time")


def test_weighting_refuses_alpha_outside_unit_interval():
    w = TurnBlendWeighting()
    assert w.alpha == 0.0
    with pytest.raises(ValueError, match=r"alpha=1.5 must be in \[0, 1\]"):
        w.set_alpha(1.5)
