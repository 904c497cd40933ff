"""DepthSchedule (TCOD arXiv 2604.24005; the probe-free baseline of TurnOPD's cap): the cap at hand-worked
steps (round half up), fraction horizons in rollout iterations, the default end = max_turns, argument
checks, the refusal next to RolloutDepthController, state, and a real fit resumed from a checkpoint."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_opd.callbacks.depth_schedule import DepthSchedule
from lightning_opd.callbacks.rollout_depth import RolloutDepthController
from lightning_opd.data import RolloutDataModule
from tests.callbacks.test_turnopd_fit import Batches
from tests.helpers import KeywordEnvFactory
from tests.test_configs import CONF, build, games_dir, search_qa_dir  # noqa: F401 (fixtures)


class FakeDataModule:
    def __init__(self, max_turns=8):
        self.max_turns, self.calls = max_turns, []

    def set_max_turns(self, cap):
        self.calls.append(cap)
        self.max_turns = cap


class FakeTrainer:
    def __init__(self, dm=None, max_steps=-1, callbacks=()):
        self.datamodule, self.max_steps, self.callbacks = dm or FakeDataModule(), max_steps, list(callbacks)


class FakeModule:
    def __init__(self, version=0, updates_per_batch=1):
        self.policy_version, self.updates_per_batch, self.logged = version, updates_per_batch, {}

    def log(self, key, value, batch_size):
        self.logged[key] = value


def _ready(cb, max_turns=8, max_steps=-1, **kw):
    trainer, module = FakeTrainer(FakeDataModule(max_turns), max_steps), FakeModule(**kw)
    cb.setup(trainer, module, "fit")
    return trainer, module


def test_cap_by_hand_start_2_end_8_horizon_6():
    cb = DepthSchedule(start=2, end=8, horizon=6)
    assert [cb.cap_at(s) for s in range(8)] == [2, 3, 4, 5, 6, 7, 8, 8]


@pytest.mark.parametrize(("kw", "caps"), [
    # 2 + 3 s / 4: 2, 2.75 -> 3, 3.5 -> 4 (half up), 4.25 -> 4, 5, 5
    (dict(start=2, end=5, horizon=4), [2, 3, 4, 4, 5, 5]),
    # 1 + s / 2: 1, 1.5 -> 2, 2, 2.5 -> 3, 3, 3
    (dict(start=1, end=3, horizon=4), [1, 2, 2, 3, 3, 3]),
    (dict(start=4, end=4, horizon=2), [4, 4, 4, 4, 4, 4]),  # a constant cap
])
def test_rounds_half_up(kw, caps):
    assert [DepthSchedule(**kw).cap_at(s) for s in range(6)] == caps


def test_floor_rounding_is_tcod_f2b_staircase():
    """TCOD-f2b: min(1 + floor(s / checkpoint_steps), max_env_steps) with checkpoint_steps 6, max_env_steps 4."""
    cb = DepthSchedule(start=1, end=4, horizon=3 * 6, rounding="floor")
    assert [cb.cap_at(s) for s in range(0, 30, 3)] == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    assert all(cb.cap_at(s) == min(1 + s // 6, 4) for s in range(40))


def test_end_defaults_to_the_datamodules_max_turns():
    cb = DepthSchedule(start=2, horizon=6)
    _ready(cb, max_turns=8)
    assert cb.end == 8 and [cb.cap_at(s) for s in (0, 3, 6, 9)] == [2, 5, 8, 8]


def test_fraction_of_max_steps_counts_rollout_iterations():
    cb = DepthSchedule(start=2, end=8, fraction=0.5)
    _ready(cb, max_steps=24, updates_per_batch=2)  # 24 updates = 12 rollout iterations; H = 6
    assert cb.horizon == 6 and [cb.cap_at(s) for s in range(8)] == [2, 3, 4, 5, 6, 7, 8, 8]
    cb = DepthSchedule(start=1, end=3, fraction=0.25)
    _ready(cb, max_steps=10)  # round(2.5) = 2 iterations
    assert cb.horizon == 2 and [cb.cap_at(s) for s in range(3)] == [1, 2, 3]
    with pytest.raises(ValueError, match="max_steps=-1"):
        _ready(DepthSchedule(start=1, fraction=0.5))


def test_hands_the_cap_to_the_datamodule_before_each_batch_and_logs_the_next_cap():
    cb = DepthSchedule(start=2, end=8, horizon=6)
    trainer, module = _ready(cb)
    for version in range(3):
        module.policy_version = version
        cb.on_train_batch_start(trainer, module, None, 0)
        module.policy_version = version + 1  # the step trained
        cb.on_train_batch_end(trainer, module, {}, None, 0)
        assert module.logged["controller/cap"] == float(cb.cap_at(version + 1))
    assert trainer.datamodule.calls == [2, 3, 4]


@pytest.mark.parametrize(("kw", "message"), [
    (dict(start=0, horizon=3), "start=0"),
    (dict(start=5, end=4, horizon=3), "start=5 is above end=4"),
    (dict(start=2, horizon=0), "horizon=0"),
    (dict(start=2, horizon=3, fraction=0.5), "exactly one of horizon=3"),
    (dict(start=2), "exactly one of horizon=None"),
    (dict(start=2, fraction=1.5), "fraction=1.5"),
    (dict(start=2, horizon=3, rounding="nearest"), "rounding='nearest'"),
])
def test_bad_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        DepthSchedule(**kw)


def test_setup_refuses_start_above_max_turns_a_depth_controller_and_a_plain_datamodule():
    with pytest.raises(ValueError, match="start=9 is above the DataModule's max_turns=8"):
        _ready(DepthSchedule(start=9, horizon=3), max_turns=8)
    cb = DepthSchedule(start=2, horizon=3)
    with pytest.raises(ValueError, match="both set the rollout cap"):
        cb.setup(FakeTrainer(callbacks=[RolloutDepthController(), cb]), FakeModule(), "fit")
    with pytest.raises(TypeError, match="RolloutDataModule-like"):
        cb.setup(FakeTrainer(dm=object()), FakeModule(), "fit")


def test_state_dict_restores_the_schedule_exactly():
    cb = DepthSchedule(start=2, fraction=0.5)
    _ready(cb, max_turns=8, max_steps=12)  # H = 6, end = 8
    other = DepthSchedule(start=2, fraction=0.5)
    _ready(other, max_turns=5, max_steps=40)  # configured differently: H = 20, end = 5
    with pytest.warns(UserWarning, match="checkpoint's horizon 6"):
        other.load_state_dict(cb.state_dict())
    assert other.state_dict() == cb.state_dict() == {"horizon": 6, "end": 8}
    assert [other.cap_at(s) for s in range(8)] == [cb.cap_at(s) for s in range(8)] == [2, 3, 4, 5, 6, 7, 8, 8]
    assert cb.state_key == "DepthSchedule{'start': 2}"


# ------------------------------------------------------------------------------------------- real fit
def _fit(model_dirs, tmp_path, steps, ckpt_path=None, save=False):
    model = Batches(student=model_dirs["student"], teacher=model_dirs["teacher"], max_logged_turns=4)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=9), episodes_per_step=2, max_turns=4, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    sched = DepthSchedule(start=1, horizon=3)  # end = max_turns = 4: caps 1 + s = 1, 2, 3, 4
    ckpt = [L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)] if save else []
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        enable_checkpointing=save, callbacks=[sched, *ckpt])
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model, sched, trainer


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_fit_plays_each_batch_at_its_cap_and_a_resume_continues_exactly(model_dirs, tmp_path):
    """start 1, end 4, H 3: cap(s) = 1 + floor(s + 1/2) = 1, 2, 3, 4. 4 steps uninterrupted == 2 + resume + 2."""
    full, sched, trainer = _fit(model_dirs, tmp_path / "full", 4)
    assert [caps for _, _, caps in full.batches] == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert float(trainer.callback_metrics["controller/cap"]) == 4.0
    _fit(model_dirs, tmp_path / "half", 2, save=True)
    resumed, resumed_sched, _ = _fit(model_dirs, tmp_path / "resumed", 4,
                                     ckpt_path=str(tmp_path / "half" / "last.ckpt"))
    assert resumed.batches == full.batches[2:]  # (DataModule cap, probe flags, rollout caps) per step
    assert resumed_sched.state_dict() == sched.state_dict() == {"horizon": 3, "end": 4}


# ------------------------------------------------------------------------------------------------ YAML
OVERLAY = str(CONF / "callbacks/depth_schedule.yaml")


@pytest.mark.filterwarnings("ignore:No seed found")
@pytest.mark.parametrize("base", ["textworld/opd.yaml", "textworld/turnopd.yaml"])
def test_overlay_builds_and_replaces_turnopds_controller(base, model_dirs, games_dir, search_qa_dir, tmp_path, isolate):
    """The overlay's ``Use:`` lines: appended to opd.yaml, and to turnopd.yaml after ``--trainer.callbacks=[]``."""
    extra = ["--trainer.callbacks=[]", "--config", OVERLAY] if base.endswith("turnopd.yaml") else ["--config", OVERLAY]
    cli, _, _ = build([CONF / base], model_dirs, {"games_dir": games_dir, "data_dir": search_qa_dir}, tmp_path, extra)
    (sched,) = [c for c in cli.trainer.callbacks if isinstance(c, DepthSchedule)]
    assert not any(isinstance(c, RolloutDepthController) for c in cli.trainer.callbacks)
    # end and H are set at setup
    assert (sched.start, sched.fraction, sched.end, sched.horizon, sched.rounding) == (2, 0.5, None, None, "half_up")
