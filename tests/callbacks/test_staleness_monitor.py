"""StalenessMonitor (f-OPD, PROPOSED §1.4): the adaptive lag bound, what it installs and hands over,
state, and the lag-0 invariant on a real synchronous fit (read from ``training_step``'s outputs). The
weighting itself (M1, M2, M3) is tested in tests/losses/test_freshness.py."""

from __future__ import annotations

import lightning as L
import pytest

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.losses.freshness import FreshnessReport
from tests.helpers import KeywordEnvFactory


@pytest.mark.parametrize(("freshness", "bounds"), [
    ([0.4, 0.4, 0.4], [4, 4, 3]),  # three low steps in a row -> one down
    ([0.4, 0.4, 0.6, 0.4, 0.4, 0.4], [4, 4, 4, 4, 4, 3]),  # the streak restarts
    ([0.9, 0.9, 0.9, 0.9, 0.9], [5, 6, 7, 8, 8]),  # up to lag_cap
    ([0.4] * 12, [4, 4, 3, 3, 3, 2, 2, 2, 1, 1, 1, 1]),  # down to 1
])
def test_adaptive_lag_bound_table(freshness, bounds):
    mon = StalenessMonitor(initial_lag_bound=4, lag_cap=8)
    seen = []
    for f in freshness:
        mon.on_train_batch_end(None, Logs(), {"freshness": FreshnessReport(stats={"freshness_mean": f})}, None, 0)
        seen.append((mon.max_lag_bound, mon.freshness.lag_bound))
    assert seen == [(b, b) for b in bounds]  # decided, then handed to the weighting


def test_no_freshness_measured_leaves_the_bound():
    mon = StalenessMonitor(initial_lag_bound=4)
    for outputs in ({"freshness": FreshnessReport(stats={"freshness_mean": float("nan")})}, {"freshness": None}, None):
        mon.on_train_batch_end(None, Logs(), outputs, None, 0)
    assert mon.max_lag_bound == 4 and mon.low_streak == 0


class Logs:
    def __init__(self):
        self.logged = {}

    def log(self, key, value, batch_size):
        self.logged[key] = value


def test_logs_the_reported_diagnostics():
    mon, module = StalenessMonitor(initial_lag_bound=4, adaptive_lag=False), Logs()
    stats = {"lag_mean": 1.0, "freshness_mean": 0.7, "ratio_mean": 1.1}
    mon.on_train_batch_end(None, module, {"freshness": FreshnessReport(stats=stats)}, None, 0)
    assert module.logged == {"staleness/lag_mean": 1.0, "staleness/freshness_mean": 0.7,
                             "staleness/max_lag_bound": 4.0, "staleness/ratio_mean": 1.1}


class Installs:
    def __init__(self):
        self.freshness = None

    def configure_freshness(self, weighting):
        self.freshness = weighting


class Trainer:
    def __init__(self, datamodule):
        self.datamodule = datamodule


class DM:
    max_allowed_lag = 2


def test_setup_installs_the_weighting_with_the_default_bound():
    mon, module = StalenessMonitor(truncated_ratio=True, adaptive_lag=False, weighting=False, filtering=False), Installs()
    mon.setup(Trainer(DM()), module, "fit")
    w = module.freshness
    assert w is mon.freshness and w.truncated_ratio and not w.needs_learner_logprobs
    assert mon.max_lag_bound == w.lag_bound == 4  # min(lag_cap 8, max(4, max_allowed_lag 2))
    with pytest.raises(TypeError, match="configure_freshness"):
        StalenessMonitor().setup(Trainer(DM()), object(), "fit")


def test_state_roundtrip_and_key():
    mon = StalenessMonitor(initial_lag_bound=4)
    mon.max_lag_bound, mon.low_streak = 2, 1
    other = StalenessMonitor(initial_lag_bound=4)
    other.load_state_dict(mon.state_dict())
    assert (other.max_lag_bound, other.low_streak, other.freshness.lag_bound) == (2, 1, 2)
    assert mon.state_key == "StalenessMonitor{'lag_cap': 8, 'tau_rho': 0.1, 'tau_chi': 0.1, 'alpha': 4.0, 'beta': 1.0}"


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="initial_lag_bound=9"):
        StalenessMonitor(initial_lag_bound=9, lag_cap=8)
    with pytest.raises(ValueError, match="init_args.max_lag=3: renamed init_args.initial_lag_bound"):
        StalenessMonitor(max_lag=3)
    with pytest.raises(ValueError, match="patience=0"):
        StalenessMonitor(patience=0)
    with pytest.raises(ValueError, match="tau_rho=0"):
        StalenessMonitor(tau_rho=0)


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
    assert spy.max_lag_bound == 7  # f̄ > 0.8 three times: 4 -> 7
