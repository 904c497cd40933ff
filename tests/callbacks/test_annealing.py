"""AnnealingSchedule (ATOD Eq. 10-12, docs/algorithms.md §3.2): kappa and rho at the start, middle, end of
annealing and after it, the horizon as a fraction of max_steps in rollout iterations, the step = policy
version (not optimizer updates), argument checks, logging and state."""

from __future__ import annotations

import math

import pytest

from lightning_opd.callbacks.annealing import AnnealingSchedule


class FakeModule:
    def __init__(self, version=0, updates_per_batch=1):
        self.policy_version, self.updates_per_batch = version, updates_per_batch
        self.kappa, self.rho, self.tdur, self.logged, self.calls = 1.0, 0.0, False, {}, []
        self.clip_eps = 0.2  # a number without a setter

    def set_kappa(self, value):
        self.calls.append(("kappa", value))
        self.kappa = value

    def set_rho(self, value):
        self.calls.append(("rho", value))
        self.rho = value

    def set_tdur(self, value):
        self.tdur = value

    def log(self, key, value, batch_size):
        self.logged[key] = value


class FakeTrainer:
    def __init__(self, max_steps=-1):
        self.max_steps = max_steps


def _ready(cb, max_steps=-1, **kw):
    module = FakeModule(**kw)
    cb.setup(FakeTrainer(max_steps), module, "fit")
    return module


@pytest.mark.parametrize(("step", "kappa", "rho"), [(0, 1.0, 1.0), (20, 0.775, 1.25), (40, 0.55, 1.5), (80, 0.1, 2.0),
                                                     (81, 0.1, 2.0), (150, 0.1, 2.0)])
def test_atod_kappa_and_rho_by_hand(step, kappa, rho):
    k = AnnealingSchedule("kappa", start=1.0, end=0.1, steps=80)
    r = AnnealingSchedule("rho", start=1.0, end=2.0, steps=80)
    assert k.value_at(step) == pytest.approx(kappa, abs=1e-12) and r.value_at(step) == pytest.approx(rho, abs=1e-12)
    # the paper's closed forms: kappa = max(0.1, 1 - 0.9 min(s, 80) / 80), rho = 1 + min(s, 80) / 80
    assert k.value_at(step) == pytest.approx(max(0.1, 1 - 0.9 * min(step, 80) / 80), abs=1e-12)
    assert r.value_at(step) == pytest.approx(1 + min(step, 80) / 80, abs=1e-12)
    if step >= 80:
        assert k.value_at(step) == 0.1 and r.value_at(step) == 2.0  # exactly constant after the horizon


def test_fraction_of_max_steps_counts_rollout_iterations():
    cb = AnnealingSchedule("rho", start=1.0, end=2.0, fraction=0.5)
    with pytest.raises(RuntimeError, match="horizon unknown before setup"):
        cb.value_at(3)
    _ready(cb, max_steps=40, updates_per_batch=2)  # 40 optimizer updates = 20 rollout iterations -> horizon 10
    assert cb.horizon == 10
    assert [cb.value_at(s) for s in (0, 5, 10, 19)] == [1.0, 1.5, 2.0, 2.0]
    atod = AnnealingSchedule("kappa", 1.0, 0.1, fraction=80 / 150)
    _ready(atod, max_steps=150)
    assert atod.horizon == 80 and atod.value_at(40) == pytest.approx(0.55)


def test_cosine_shape():
    cb = AnnealingSchedule("kappa", start=1.0, end=0.0, steps=10, shape="cosine")
    assert cb.value_at(0) == 1.0 and cb.value_at(5) == pytest.approx(0.5) and cb.value_at(10) == 0.0
    assert cb.value_at(2) == pytest.approx((1 + math.cos(0.2 * math.pi)) / 2)


def test_sets_the_attribute_per_rollout_batch_and_logs_the_value_trained_with():
    cb = AnnealingSchedule("kappa", start=1.0, end=0.1, steps=4)
    module = _ready(cb, updates_per_batch=3)
    seen = []
    for version in range(6):  # several optimizer updates per batch: the step is still the policy version
        module.policy_version = version
        cb.on_train_batch_start(None, module, None, version)
        seen.append(module.kappa)
        module.policy_version += 1  # what training_step does once per batch
        cb.on_train_batch_end(None, module, None, None, version)
        assert module.logged == {"schedule/kappa": module.kappa}
    assert seen == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1, 0.1])


def test_the_value_goes_through_the_named_setter_once_per_batch():
    cb = AnnealingSchedule("rho", start=1.0, end=2.0, steps=2)
    module = _ready(cb)
    module.policy_version = 1
    cb.on_train_batch_start(None, module, None, 0)
    assert module.calls == [("rho", 1.5)]  # set_rho(1.5): the module checks the value there, once
    with pytest.raises(ValueError, match=r"has no setter set_clip_eps\(\) for 'clip_eps'"):
        _ready(AnnealingSchedule("clip_eps", 0.3, 0.1, steps=2))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"attribute": "kappa", "start": 1, "end": 0}, "give exactly one of steps=None and fraction=None"),
    ({"attribute": "kappa", "start": 1, "end": 0, "steps": 5, "fraction": 0.5}, "give exactly one of steps=5"),
    ({"attribute": "kappa", "start": 1, "end": 0, "steps": 0}, "steps=0 must be >= 1"),
    ({"attribute": "kappa", "start": 1, "end": 0, "fraction": 1.5}, r"fraction=1.5 must be in \(0, 1\]"),
    ({"attribute": "kappa", "start": 1, "end": 0, "steps": 5, "shape": "step"}, "shape='step'"),
    ({"attribute": "ka-ppa", "start": 1, "end": 0, "steps": 5}, "attribute='ka-ppa'"),
    ({"attribute": "loss_fn.clip_eps", "start": 1, "end": 0, "steps": 5}, "attribute='loss_fn.clip_eps'"),
])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AnnealingSchedule(**kwargs)


def test_setup_checks_the_attribute_and_max_steps():
    with pytest.raises(ValueError, match=r"FakeModule has no setter set_kapa\(\) for 'kapa'"):
        _ready(AnnealingSchedule("kapa", 1, 0, steps=3))
    with pytest.raises(ValueError, match=r"FakeModule.tdur is bool, not a number"):
        _ready(AnnealingSchedule("tdur", 1, 0, steps=3))
    with pytest.raises(ValueError, match="trainer.max_steps=-1 is unset"):
        _ready(AnnealingSchedule("rho", 1, 2, fraction=0.5))


def test_state_key_and_resume_keeps_the_horizon():
    cb = AnnealingSchedule("rho", 1.0, 2.0, fraction=0.5)
    _ready(cb, max_steps=20)
    assert cb.state_key == "AnnealingSchedule{'attribute': 'rho'}"
    assert AnnealingSchedule("kappa", 1, 0, steps=3).state_key != cb.state_key  # kappa and rho coexist
    resumed = AnnealingSchedule("rho", 1.0, 2.0, fraction=0.5)
    _ready(resumed, max_steps=40)  # the resumed run was given more steps
    resumed.load_state_dict(cb.state_dict())
    assert resumed.horizon == cb.horizon == 10
    assert [resumed.value_at(s) for s in range(12)] == [cb.value_at(s) for s in range(12)]


# -------------------------------------------------------------------- F22: schedules checked at setup
@pytest.mark.parametrize(("schedules", "model_kw", "keys"), [
    # rho annealed up from 0 while every GRPO group is one episode (data.group_size defaults to 1)
    ([AnnealingSchedule("rho", 0.0, 2.0, steps=4)], dict(rho=0.0),
     ("AnnealingSchedule('rho') callback", "init_args.start=0.0, init_args.end=2.0", "data.init_args.group_size=1")),
    # kappa annealed to 0 within the fit while rho stays 0: nothing to learn from iteration 2 on
    ([AnnealingSchedule("kappa", 1.0, 0.0, steps=2)], dict(rho=0.0),
     ("AnnealingSchedule('kappa') callback", "model.init_args.rho=0.0", "iteration 2")),
])
def test_f22_schedule_that_switches_a_term_off_is_refused_at_setup(model_dirs, schedules, model_kw, keys):
    from tests.learner.test_hybrid import fit_until_setup_error

    message = fit_until_setup_error(model_dirs, callbacks=schedules, **model_kw)
    for key in keys:
        assert key in message, (key, message)


def test_f22_schedule_check_counts_only_iterations_of_the_fit(model_dirs):
    """kappa reaches 0 at iteration 4 of its schedule, but a fit of 3 rollout iterations (6 optimizer updates,
    2 per batch) never gets there; the module's own rho (1.0) is overridden by a schedule that keeps it at 0."""
    from types import SimpleNamespace

    from lightning_opd.learner import ATODModule
    from lightning_opd.learner.atod import RolloutGroups

    module = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], kappa=1.0, rho=1.0, tdur=False,
                        ppo_epochs=2, ppo_mini_batches=1)
    kappa, rho = AnnealingSchedule("kappa", 1.0, 0.0, steps=4), AnnealingSchedule("rho", 0.0, 0.0, steps=1)
    module.connect_data(SimpleNamespace(group_size=1))  # the DataModule's group size handed over (no connect)
    assert module.rollout_groups == RolloutGroups(group_size=1, temperature=None)
    schedules = {"kappa": kappa, "rho": rho}
    plan = module._coefficient_plan(6, schedules)
    assert plan["kappa"][0] == [1.0, 0.75, 0.5] and plan["rho"][0] == [0.0, 0.0, 0.0]
    module.check_loss_terms(6, schedules)  # accepted
    # 10 updates = 5 iterations: kappa = 0 = rho at iteration 4
    with pytest.raises(ValueError, match=r"AnnealingSchedule\('kappa'\) callback .* and the AnnealingSchedule\('rho'\) "
                                         r"callback .* iteration 4"):
        module.check_loss_terms(10, schedules)


def test_schedules_are_handed_to_the_module_at_setup_and_consumed_by_its_check(model_dirs):
    """The callbacks' fit setup hands each schedule to ``set_<attribute>_schedule`` (the last of an attribute wins);
    the module's setup consumes them in its F22 check; a schedule of another coefficient is refused by name."""
    from types import SimpleNamespace

    from lightning_opd.learner import ATODModule

    module = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], kappa=1.0, rho=0.0)
    first, last = AnnealingSchedule("kappa", 1.0, 0.5, steps=2), AnnealingSchedule("kappa", 1.0, 0.0, steps=2)
    trainer = SimpleNamespace(max_steps=8)
    for cb in (first, last):
        cb.setup(trainer, module, "fit")
    assert module._schedules == {"kappa": last}
    with pytest.raises(TypeError, match=r"set_rho_schedule: expected a schedule of 'rho'.*attribute='kappa'"):
        module.set_rho_schedule(first)
    fake = SimpleNamespace(max_steps=8, datamodule=None, state=SimpleNamespace(fn="fit"))
    module._trainer = fake
    with pytest.raises(ValueError, match=r"AnnealingSchedule\('kappa'\) callback .* model.init_args.rho=0.0 .* iteration 2"):
        module.setup("fit")  # kappa 0 = rho from iteration 2 on
    assert module._schedules == {}  # consumed: a later fit without the callbacks does not see them
    module.setup("fit")  # accepted: kappa = 1 throughout
