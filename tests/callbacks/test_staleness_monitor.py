"""StalenessMonitor (f-OPD, PROPOSED §1.4): the adaptive lag bound, what it installs and hands over,
state, and the lag-0 invariant on a real synchronous fit (read from ``training_step``'s outputs). The
weighting itself (M1, M2, M3) is tested in tests/losses/test_freshness.py."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.losses.freshness import FreshnessConfig, FreshnessReport
from tests.helpers import KeywordEnvFactory
from tests.losses.test_freshness import _batch


@pytest.mark.parametrize(("freshness", "bounds"), [
    ([0.4, 0.4, 0.4], [4, 4, 3]),  # three low steps in a row -> one down
    ([0.4, 0.4, 0.6, 0.4, 0.4, 0.4], [4, 4, 4, 4, 4, 3]),  # the streak restarts
    ([0.9, 0.9, 0.9, 0.9, 0.9], [5, 6, 7, 8, 8]),  # up to lag_cap
    ([0.4] * 12, [4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1]),  # down to 1
])
def test_adaptive_lag_bound_table(freshness, bounds):
    mon = StalenessMonitor(FreshnessConfig(lag_cap=8), initial_lag_bound=4)
    seen = []
    for f in freshness:
        mon.on_train_batch_end(None, Logs(), {"freshness": FreshnessReport(stats={"freshness_mean": f})}, None, 0)
        seen.append(mon.freshness.lag_bound)
    assert seen == bounds and mon.lag_bound == bounds[-1]  # decided, held by the weighting alone


def test_no_freshness_measured_leaves_the_bound():
    mon = StalenessMonitor(initial_lag_bound=4)
    for outputs in ({"freshness": FreshnessReport(stats={"freshness_mean": float("nan")})}, {"freshness": None}, None):
        mon.on_train_batch_end(None, Logs(), outputs, None, 0)
    assert mon.lag_bound == 4 and mon.low_streak == 0


class Logs:
    def __init__(self):
        self.logged = {}

    def log(self, key, value, batch_size):
        self.logged[key] = value


def test_logs_the_reported_diagnostics():
    mon, module = StalenessMonitor(initial_lag_bound=4, adaptive_lag=False), Logs()
    stats = {"lag_mean": 1.0, "freshness_mean": 0.7}
    mon.on_train_batch_end(None, module, {"freshness": FreshnessReport(stats=stats)}, None, 0)
    assert module.logged == {"staleness/lag_mean": 1.0, "staleness/freshness_mean": 0.7,
                             "staleness/lag_bound": 4.0, "staleness/skipped_steps": 0.0,
                             "staleness/skipped_steps_by_lag_bound": 0.0}


class Installs:
    def __init__(self):
        self.freshness = None

    def configure_freshness(self, weighting):
        self.freshness = weighting


class Trainer:
    def __init__(self, datamodule, log_dir=None):
        self.datamodule, self.log_dir, self.global_step = datamodule, log_dir, 0


class DM:
    max_allowed_lag = 2


def test_setup_installs_the_weighting_with_the_default_bound():
    config = FreshnessConfig(truncated_ratio=True, weighting=False, filtering=False)
    mon, module = StalenessMonitor(config, adaptive_lag=False), Installs()
    mon.setup(Trainer(DM()), module, "fit")
    w = module.freshness
    assert w is mon.freshness and w.config is config and not w.needs_learner_logprobs
    # §7.2: the bound starts at the configured producer lead (max_allowed_lag 2 with pushes every version), so the
    # producer-side control acts from the first step (before issue 58: max(4, 2) = 4, above the lead)
    assert mon.lag_bound == w.lag_bound == 2
    with pytest.raises(TypeError, match="configure_freshness"):
        StalenessMonitor().setup(Trainer(DM()), object(), "fit")


def test_state_roundtrip_and_key():
    mon = StalenessMonitor(initial_lag_bound=4)
    mon.freshness.set_lag_bound(2)
    mon.low_streak, mon.skipped_steps = 1, 3
    other = StalenessMonitor(initial_lag_bound=4)
    other.load_state_dict(mon.state_dict())
    assert (other.lag_bound, other.low_streak, other.freshness.lag_bound, other.skipped_steps) == (2, 1, 2, 3)
    old = StalenessMonitor(initial_lag_bound=4)  # a checkpoint from before issue 40 named the bound max_lag_bound
    old.load_state_dict({"max_lag_bound": 3, "low_streak": 0, "skipped_steps": 0})
    assert old.lag_bound == 3
    assert mon.state_key == "StalenessMonitor{'lag_cap': 8, 'tau_rho': 0.1, 'tau_chi': 0.1, 'alpha': 4.0, 'beta': 1.0}"


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="initial_lag_bound=9"):
        StalenessMonitor(FreshnessConfig(lag_cap=8), initial_lag_bound=9)
    with pytest.raises(ValueError, match="patience=0"):
        StalenessMonitor(patience=0)
    with pytest.raises(ValueError, match="freshness.tau_rho=0"):
        StalenessMonitor(FreshnessConfig(tau_rho=0))
    with pytest.raises(ValueError, match="init_args.mode='dry': choose control"):
        StalenessMonitor(mode="dry")
    with pytest.raises(ValueError, match="freshness.score='age'"):
        StalenessMonitor(FreshnessConfig(score="age"))


def _plan(weighting, lags, groups, drift):
    """The weighting's plan of a one-turn batch (tests/losses/test_freshness.py's ``_batch``), one process."""
    batch, student = _batch(lags=lags, groups=groups, drift=drift)
    return weighting.plan(10 - batch.behaviour_version, student, batch.behaviour_logprobs[:, 1:],
                          batch.loss_mask[:, 1:], batch.turn_index[:, 1:], batch.group_id, lambda x: x)


def test_heavy_dropping_does_not_loosen_the_bound():
    """Issue 18: drifts 0 / 0.8 / 0.8 / 0.8 nats drop 3 of 4 samples; the survivors' mean (0.982) loosened the
    bound 4 -> 5. The mean over all four samples, 0.2465 < low_freshness, starts a low streak instead."""
    mon = StalenessMonitor(initial_lag_bound=4)
    _plan(mon.freshness, [0, 0, 0, 0], [0, 1, 2, 3], [0.0, 0.8, 0.8, 0.8])
    report = mon.freshness.report()
    assert report.keep.tolist() == [True, False, False, False]
    mon.on_train_batch_end(None, Logs(), {"freshness": report}, None, 0)
    assert (mon.lag_bound, mon.low_streak) == (4, 1)


def test_measure_mode_applies_nothing_and_moves_no_bound(tmp_path):
    mon = StalenessMonitor(FreshnessConfig(truncated_ratio=True), mode="measure", initial_lag_bound=4)
    w = mon.freshness
    c = w.config
    assert (c.weighting, c.filtering, c.truncated_ratio, w.needs_learner_logprobs) == (False, False, None, True)
    mon.setup(Trainer(DM(), log_dir=str(tmp_path)), Installs(), "fit")
    plan = _plan(w, [0, 1, 5, 0], [0, 1, 2, 3], [0.0, 0.1, 0.0, 0.8])
    assert plan.keep is None and plan.sample_weight is None
    logs = Logs()
    for _ in range(3):  # f̄ = 0.7 would move nothing anyway; 0.9 thrice would raise a controlling monitor's bound
        mon.on_train_batch_end(Trainer(DM()), logs, {"freshness": FreshnessReport(stats={"freshness_mean": 0.9})},
                               None, 0)
    assert mon.lag_bound == w.lag_bound == 4 and mon.low_streak == 0
    trainer = Trainer(DM())
    trainer.global_step = 7
    mon.on_train_batch_end(trainer, logs, {"freshness": w.report()}, None, 0)
    assert logs.logged["staleness/would_drop_samples"] == 2.0 and logs.logged["staleness/dropped_samples"] == 0.0
    rows = [json.loads(line) for line in (tmp_path / "staleness_samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lag"], r["kept"]) for r in rows] == [(7, 0.0, True), (7, 1.0, True), (7, 5.0, True),
                                                                  (7, 0.0, True)]
    assert [r["rho"] for r in rows] == pytest.approx([0.0, 0.1, 0.0, 0.8])
    assert rows[1]["score"] == pytest.approx(2 / 8 + 1 / 3) and rows[1]["chi"] == 0.0
    assert rows[1]["freshness"] == pytest.approx(1 / (1 + math.exp(4 * (2 / 8 + 1 / 3 - 1))))


def test_counts_and_logs_skipped_steps():
    mon, logs = StalenessMonitor(initial_lag_bound=4, adaptive_lag=False), Logs()
    for skipped in (True, False, True):
        mon.on_train_batch_end(None, logs, {"freshness": None, "skipped_update": skipped}, None, 0)
    assert mon.skipped_steps == 2 and logs.logged["staleness/skipped_steps"] == 2.0


class Spy(StalenessMonitor):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.history = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        report = outputs["freshness"]
        self.history.append((report.freshness.clone(), report.keep.clone()))
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


@pytest.mark.timeout(300)
def test_lag_zero_invariant_on_a_synchronous_fit(model_dirs):
    """Synchronous rollouts: every freshness >= 0.95 and nothing dropped."""
    spy = Spy()
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, max_turns=3, max_new_tokens=4)
    L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, limit_val_batches=0, callbacks=[spy]).fit(model, datamodule=dm)
    assert len(spy.history) == 3
    for fresh, keep in spy.history:
        assert fresh.min().item() >= 0.95 and keep.all()
    assert spy.lag_bound == 4  # starts at the producer lead (sync: 1, §7.2); f̄ > 0.8 three times: 1 -> 4


class DropAt(L.Callback):
    """At batch ``at``: snapshot weights and optimizer state, then make the filter drop every sample
    (min_freshness above any lag-0 freshness); afterwards record whether the step changed them."""

    def __init__(self, monitor, at=1):
        self.monitor, self.at, self.changed = monitor, at, {}

    @staticmethod
    def _state(trainer, module):
        opt = trainer.optimizers[0]
        moments = {k: v.clone() if torch.is_tensor(v) else v for p in module.student.parameters()
                   for k, v in [(f"{id(p)}/{name}", t) for name, t in opt.state[p].items()]}
        return {n: p.detach().clone() for n, p in module.student.named_parameters()}, moments

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = self._state(trainer, module)
        w = self.monitor.freshness
        w.config = replace(w.config, min_freshness=0.999 if trainer.global_step == self.at else 0.05)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        weights, moments = self._state(trainer, module)
        same_weights = all(torch.equal(weights[n], self.before[0][n]) for n in weights)
        same_moments = moments.keys() == self.before[1].keys() and all(
            torch.equal(torch.as_tensor(moments[k]), torch.as_tensor(self.before[1][k])) for k in moments)
        self.changed[trainer.global_step - 1] = (not same_weights, not same_moments, outputs.get("skipped_update"),
                                   trainer.global_step, module.policy_version)


@pytest.mark.timeout(300)
def test_all_dropped_step_changes_nothing_and_the_run_ends(model_dirs):
    """Issue 18 / §1.5: at step 1 the filter drops every sample; weights and AdamW's exp_avg, exp_avg_sq and
    step are bit-identical across it; it still counts for max_steps and the policy version (a rollout
    iteration), and the monitor logs it."""
    mon = StalenessMonitor(adaptive_lag=False)
    spy = DropAt(mon, at=1)
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, max_turns=3, max_new_tokens=4)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[mon, spy])
    trainer.fit(model, datamodule=dm)
    # (weights changed, optimizer state changed, skipped, global_step, policy_version) after each step
    assert spy.changed == {0: (True, True, False, 1, 1), 1: (False, False, True, 2, 2),
                           2: (True, True, False, 3, 3)}
    assert trainer.global_step == 3 and mon.skipped_steps == 1
    assert trainer.callback_metrics["staleness/skipped_steps"].item() == 1.0


@pytest.mark.timeout(300)
def test_measure_mode_update_equals_a_run_without_the_monitor(model_dirs, tmp_path):
    """mode="measure": the trained weights are bit-identical to a run without any monitor, and the staleness/*
    diagnostics are logged."""
    def fit(callbacks):
        L.seed_everything(0)
        model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
        dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, max_turns=3, max_new_tokens=4,
                               forced_lag=1)
        trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=callbacks, default_root_dir=tmp_path)
        trainer.fit(model, datamodule=dm)
        return {n: p.detach().clone() for n, p in model.student.named_parameters()}, trainer.callback_metrics

    plain, plain_logs = fit([])
    measured, logs = fit([StalenessMonitor(FreshnessConfig(min_freshness=0.9, truncated_ratio=True), mode="measure",
                                           initial_lag_bound=1)])
    assert plain.keys() == measured.keys() and all(torch.equal(plain[n], measured[n]) for n in plain)
    assert not any(k.startswith("staleness/") for k in plain_logs)
    assert len((tmp_path / "staleness_samples.jsonl").read_text().splitlines()) == 3 * 4  # 3 steps x 4 samples
    assert logs["staleness/lag_max"].item() == 1.0 and 0.0 < logs["staleness/freshness_mean"].item() <= 1.0
    assert logs["staleness/dropped_samples"].item() == 0.0 and logs["staleness/lag_bound"].item() == 1.0
    start = AutoModelForCausalLM.from_pretrained(model_dirs["student"]).model.embed_tokens.weight
    assert not torch.equal(plain["model.embed_tokens.weight"], start)  # the runs did train


# ------------------------------------------------------------- issue 39 item 2: the bound under a forced lag
def _forced(lag: int) -> Trainer:
    """A trainer holding a real synchronous DataModule with ``forced_lag=lag`` (its ``max_allowed_lag`` is ``lag``)."""
    return Trainer(RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, forced_lag=lag))


def _setup_bound(mon, trainer):
    mon.setup(trainer, Installs(), "fit")
    return mon.lag_bound


def _step(mon, logs, f_mean, **outputs):
    mon.on_train_batch_end(None, logs, {"freshness": FreshnessReport(stats={"freshness_mean": f_mean}), **outputs},
                           None, 0)
    return mon.lag_bound


def test_forced_lag_floors_the_adaptive_bound():
    """forced_lag 2, lag_cap 8, Δ_max starting at 4 (initial_lag_bound; the default would be the forced lag, §7.2); nine
    low steps (patience 3) lower it to 3,
    2 and then hold it at 2 (before: 1, where every lag-2 sample failed lag <= Δ_max); one high step raises it to 3.
    A checkpoint saved with a bound of 1 is raised to the floor when restored after setup."""
    assert _setup_bound(StalenessMonitor(FreshnessConfig(lag_cap=8)), _forced(2)) == 2  # default: the forced lag
    mon = StalenessMonitor(FreshnessConfig(lag_cap=8), initial_lag_bound=4)
    mon.setup(_forced(2), Installs(), "fit")
    assert mon.lag_bound == 4
    seen = [_step(mon, Logs(), f) for f in [0.4] * 9 + [0.9]]
    assert seen == [4, 4, 3, 3, 3, 2, 2, 2, 2, 3]
    assert mon.lag_bound_floor == 2
    mon.load_state_dict({"lag_bound": 1, "low_streak": 0, "skipped_steps": 0})
    assert mon.lag_bound == mon.freshness.lag_bound == 2
    plain = StalenessMonitor(FreshnessConfig(lag_cap=8))  # without a forced lag the floor stays 1
    plain.setup(_forced(0), Installs(), "fit")
    assert plain.lag_bound_floor == 1 and [_step(plain, Logs(), 0.4) for _ in range(12)][-1] == 1


@pytest.mark.parametrize(("kw", "message"), [
    (dict(freshness=FreshnessConfig(lag_cap=1)),
     "data.init_args.forced_lag=2 exceeds StalenessMonitor init_args.freshness.lag_cap=1"),
    (dict(initial_lag_bound=1), "StalenessMonitor init_args.initial_lag_bound=1 is below data.init_args.forced_lag=2"),
])
def test_a_bound_that_cannot_reach_the_forced_lag_is_refused_naming_both_keys(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StalenessMonitor(**kw).setup(_forced(2), Installs(), "fit")
    # measure mode applies no filter: nothing to refuse, the reported bound is floored
    mon = StalenessMonitor(mode="measure", **kw)
    mon.setup(_forced(2), Installs(), "fit")
    assert mon.lag_bound == mon.lag_bound_floor == min(2, mon.freshness.config.lag_cap)


def test_a_step_the_lag_bound_emptied_is_counted_apart_from_freshness():
    """Three steps planned by the monitor's own weighting (bound 1, no adaptive move): (a) lags 2, 2, both fresh
    (f = 0.881): the bound alone emptied the step; (b) lags 0, 0 with drift 1.0 nats (f = 9e-5 < 0.05): freshness
    emptied it; (c) one lag-2 sample, one stale, one fresh: a step with an update. Logged per step:
    dropped_by_lag_bound, dropped_by_freshness; cumulative: skipped_steps (2) and skipped_steps_by_lag_bound (1)."""
    mon, logs = StalenessMonitor(FreshnessConfig(weighting=False), initial_lag_bound=1, adaptive_lag=False), Logs()
    steps = [(dict(lags=[2, 2], groups=[0, 1], drift=[0.0, 0.0]), True),
             (dict(lags=[0, 0], groups=[0, 1], drift=[1.0, 1.0]), True),
             (dict(lags=[2, 0, 0], groups=[0, 1, 2], drift=[0.0, 1.0, 0.0]), False)]
    seen = []
    for kw, skipped in steps:
        _plan(mon.freshness, **kw)
        mon.on_train_batch_end(None, logs, {"freshness": mon.freshness.report(), "skipped_update": skipped}, None, 0)
        seen.append(tuple(logs.logged[f"staleness/{k}"] for k in ("dropped_by_lag_bound", "dropped_by_freshness",
                                                                    "lag_bound_dropped_tokens", "skipped_steps",
                                                                    "skipped_steps_by_lag_bound")))
    assert seen == [(2.0, 0.0, 8.0, 1.0, 1.0), (0.0, 2.0, 0.0, 2.0, 1.0), (1.0, 1.0, 4.0, 2.0, 1.0)]
    state = mon.state_dict()
    assert state["skipped_steps_by_lag_bound"] == 1
    other = StalenessMonitor(initial_lag_bound=1)
    other.load_state_dict(state)
    assert (other.skipped_steps, other.skipped_steps_by_lag_bound) == (2, 1)


class TrainedWith(L.Callback):
    """Per step: (the lag bound the step's filter used, its largest lag, samples dropped, skipped update)."""

    def __init__(self, monitor):
        self.monitor, self.seen = monitor, []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.bound = self.monitor.freshness.lag_bound

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        st = outputs["freshness"].stats
        self.seen.append((self.bound, st["lag_max"], st["dropped_samples"], outputs["skipped_update"]))


@pytest.mark.timeout(300)
def test_forced_lag_fit_with_a_falling_bound_never_drops_a_sample(model_dirs):
    """fopd_lag2's failure on the tiny models: forced_lag 2 and a mean freshness always below low_freshness (0.99:
    above any score's 0.982), patience 1, so the bound falls one step per step from 4; no freshness threshold
    (min_freshness 0). Step v has lag min(v, 2). Before: the bound reached 1 for step 3 and its lag-2 samples were
    all dropped (no update). Now it stops at the forced lag, and nothing is dropped."""
    mon = StalenessMonitor(FreshnessConfig(min_freshness=0.0, weighting=False), low_freshness=0.99, patience=1,
                           initial_lag_bound=4)
    spy = TrainedWith(mon)
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, max_turns=3, max_new_tokens=4,
                           forced_lag=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[mon, spy])
    trainer.fit(model, datamodule=dm)
    assert spy.seen == [(4, 0.0, 0.0, False), (3, 1.0, 0.0, False), (2, 2.0, 0.0, False), (2, 2.0, 0.0, False)]
    assert (mon.lag_bound, mon.skipped_steps, mon.skipped_steps_by_lag_bound) == (2, 0, 0)
    assert trainer.callback_metrics["staleness/dropped_by_lag_bound"].item() == 0.0
