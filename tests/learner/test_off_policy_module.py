"""Issue 58 inside ``OPDModule`` (docs/algorithms.md §7.1-§7.2, PROPOSED): the truncated ratio on by default for a
sampled-token loss on stale batches, in plain async as with the staleness monitor, and refused off without the named
opt-out; lags counted in applied updates (a skipped step ages no batch); the off-policy indicator and the samples
per update logged every step."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_opd.callbacks.staleness_monitor import StalenessMonitor
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL
from lightning_opd.losses.freshness import NO_LAG, FreshnessConfig, FreshnessWeighting
from lightning_opd.losses.off_policy import OffPolicyConfig, TruncatedRatio, UncorrectedOffPolicyError
from tests.helpers import KeywordEnvFactory
from tests.learner.test_nonfinite import NaNAt

pytestmark = pytest.mark.timeout(300)


def _dm(**kw):
    args = dict(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4, eval_batch_size=2,
                seed=0)
    args.update(kw)
    return RolloutDataModule(**args)


def _fit(model, dm, steps, callbacks=()):
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=list(callbacks))
    trainer.fit(model, datamodule=dm)
    return trainer


class Logged(L.Callback):
    """The scalars every step logged (``trainer.callback_metrics`` after the step)."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _opd(model_dirs, loss, **kw) -> OPDModule:
    return OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=loss, log_text_every_n_steps=0,
                     **kw)


# ---------------------------------------------------------------------------------------- defect 1: the ratio
def test_plain_async_sampled_token_fit_applies_the_ratio_by_default(model_dirs):
    """No staleness monitor, producer lead 2: the sampled-token loss trains with sg(min(π_old/π_b, 2)) on every token
    (before issue 58 only a monitor with freshness.truncated_ratio=true could turn it on, and plain async ran
    without it), logged with the indicator and the update counts."""
    model, logged = _opd(model_dirs, SampledTokenReverseKL()), Logged()
    _fit(model, _dm(mode="async", producer_lead=2), 3, [logged])
    assert isinstance(model.weightings.truncated_ratio, TruncatedRatio) and model.weightings.truncated_ratio.cap == 2.0
    for step in logged.steps:
        assert step["train/truncated_ratio"] == 1.0 and step["train/uncorrected_off_policy"] == 0.0
        assert 0.0 < step["train/ratio_mean"] <= 2.0 and 0.0 <= step["train/ratio_clip_frac"] <= 1.0
        assert step["train/applied_updates"] == 1.0 and step["train/samples_per_update"] == 2.0
        assert step["train/off_policy_gap"] == pytest.approx(step["train/kl"] - step["train/kl_k1"], abs=1e-5)
        assert "train/off_policy_gap_corrected" in step


def test_the_analytic_loss_still_runs_async_without_a_ratio(model_dirs):
    model, logged = _opd(model_dirs, FullVocabReverseKL()), Logged()
    _fit(model, _dm(mode="async", producer_lead=2), 2, [logged])
    assert model.weightings.truncated_ratio is None
    assert [s["train/truncated_ratio"] for s in logged.steps] == [0.0, 0.0]
    assert all("train/ratio_mean" not in s for s in logged.steps)
    assert all(s["train/uncorrected_off_policy"] == 0.0 for s in logged.steps)


def test_synchronous_sampled_token_fit_needs_no_ratio(model_dirs):
    model = _opd(model_dirs, SampledTokenReverseKL())
    _fit(model, _dm(), 1)
    assert model.weightings.truncated_ratio is None


@pytest.mark.parametrize("how", ["module", "monitor"])
def test_turning_the_ratio_off_on_stale_sampled_tokens_is_refused_naming_the_keys(model_dirs, how):
    callbacks = []
    if how == "module":
        model = _opd(model_dirs, SampledTokenReverseKL(), off_policy=OffPolicyConfig(truncated_ratio=False))
        key = "model.init_args.off_policy.truncated_ratio=false"
    else:
        model = _opd(model_dirs, SampledTokenReverseKL())
        callbacks = [StalenessMonitor(FreshnessConfig(truncated_ratio=False))]
        key = "StalenessMonitor init_args.freshness.truncated_ratio=false"
    with pytest.raises(UncorrectedOffPolicyError) as err:
        _fit(model, _dm(forced_lag=1), 1, callbacks)
    assert key in str(err.value) and "model.init_args.off_policy.allow_uncorrected=true" in str(err.value)


def test_the_explicit_opt_out_runs_uncorrected_and_the_run_logs_it(model_dirs):
    model, logged = _opd(model_dirs, SampledTokenReverseKL(),
                         off_policy=OffPolicyConfig(truncated_ratio=False, allow_uncorrected=True)), Logged()
    with pytest.warns(UserWarning, match="WITHOUT the importance ratio"):
        _fit(model, _dm(forced_lag=1), 2, [logged])
    assert model.weightings.truncated_ratio is None
    assert [s["train/uncorrected_off_policy"] for s in logged.steps] == [1.0, 1.0]


def test_a_monitor_config_with_the_ratio_on_hands_it_to_the_learner(model_dirs):
    """``FreshnessConfig(truncated_ratio=True)`` (the tutorial's M3, with the analytic loss): the module applies it."""
    model = _opd(model_dirs, FullVocabReverseKL())
    model.configure_freshness(FreshnessWeighting(FreshnessConfig(truncated_ratio=True, ratio_cap=3.0)))
    assert model.weightings.truncated_ratio is not None and model.weightings.truncated_ratio.cap == 3.0
    model.configure_freshness(None)
    assert model.weightings.truncated_ratio is None


# ------------------------------------------------------------------------------ defect 2: lag in applied updates
def test_applied_lag_leaves_out_the_skipped_steps(model_dirs):
    """Learner at version 5; the step that published version 4 applied no update (its weights are version 3's).
    Behaviour versions 3, 4, 5, -1: lags 5-3-1 = 1 (4 in (3, 5]), 5-4 = 1 (4 not in (4, 5]), 0, NO_LAG."""
    model = _opd(model_dirs, FullVocabReverseKL())
    model.policy_version, model.lags.skipped_versions = 5, [4]
    versions = torch.tensor([3, 4, 5, -1])
    assert model.lags.applied_lag(model.policy_version, versions[:3]).tolist() == [1, 1, 0]

    class Rows:
        behaviour_version = versions

    assert model.lags.sample_lags(model.policy_version, Rows()).tolist() == [1, 1, 0, NO_LAG]


def test_a_skipped_step_ages_no_batch_and_survives_a_checkpoint(model_dirs):
    """forced_lag 2, 5 steps; the step at version 1 has a NaN teacher, so its update is skipped (F28) and version 2
    holds version 1's weights. Step v trains on the batch of version b = max(0, v - 2): iteration lags 0, 1, 2, 2, 2;
    in applied updates, v - b minus the skipped versions in (b, v]: 0, 1, 2-1, 2-1 (2 in (1, 3]), 2 (none in (2, 4]).
    Before issue 58 every lag counted the skipped step: 0, 1, 2, 2, 2."""
    model, logged = _opd(model_dirs, FullVocabReverseKL(), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2)), Logged()
    with pytest.warns(UserWarning, match="update skipped"):
        _fit(model, _dm(forced_lag=2), 5, [NaNAt({1}), logged])
    assert [s["rollout/lag_max"] for s in logged.steps] == [0.0, 1.0, 1.0, 1.0, 2.0]
    assert [s["train/applied_updates"] for s in logged.steps] == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert [s["train/samples_per_update"] for s in logged.steps] == [2.0, 0.0, 2.0, 2.0, 2.0]
    # version 2 no longer counts for any batch the learner can get (at most 2 iterations old at version 5): pruned
    assert model.policy_version == 5 and model.lags.skipped_versions == []
    model.lags.skipped_versions = [4]
    checkpoint: dict = {}
    model.on_save_checkpoint(checkpoint)
    other = _opd(model_dirs, FullVocabReverseKL())
    other.on_load_checkpoint(checkpoint)
    assert other.lags.skipped_versions == [4]


# ------------------------------------------------------------------------------------- defect 6: the indicator
def test_off_policy_indicator_from_hand_made_sums(model_dirs):
    """4 supervised tokens, exact KL summed 3.0 and k1 summed 2.0: kl 0.75, kl_k1 0.5, gap 0.25. With the ratio on and
    its sums (3.5, 1, 3, 2.0) over 3 tokens: ratio_mean 3.5/3, clip 1/3, corrected gap 0.75 - 2.0/3. One applied
    update with 4 samples."""
    model = _opd(model_dirs, SampledTokenReverseKL())
    sums = {"kl": torch.tensor(3.0), "k1": torch.tensor(2.0)}
    out = model.weightings.off_policy_metrics(sums, torch.tensor(4.0), True, 1, 4, model.reduce_sum, model.device)
    assert out == pytest.approx({"train/kl_k1": 0.5, "train/off_policy_gap": 0.25, "train/truncated_ratio": 0.0,
                                 "train/uncorrected_off_policy": 0.0, "train/applied_updates": 1.0,
                                 "train/samples_per_update": 4.0})
    model.weightings.truncated_ratio = TruncatedRatio()
    model.weightings.truncated_ratio._sums = torch.tensor([3.5, 1.0, 3.0, 2.0], dtype=torch.float64)
    out = model.weightings.off_policy_metrics(sums, torch.tensor(4.0), True, 0, 0, model.reduce_sum, model.device)
    assert out["train/ratio_mean"] == pytest.approx(3.5 / 3) and out["train/ratio_clip_frac"] == pytest.approx(1 / 3)
    assert out["train/off_policy_gap_corrected"] == pytest.approx(0.75 - 2.0 / 3)
    assert out["train/samples_per_update"] == 0.0 and out["train/truncated_ratio"] == 1.0


def test_at_lag_zero_every_ratio_is_one_and_the_corrected_gap_equals_the_plain_one(model_dirs):
    """Synchronous HF sampling at temperature 1: π_b = π_θ, so every ratio is 1 (to rounding) when the ratio is forced
    on, and the corrected and plain gaps are equal (their size is sampling noise on these tiny random models)."""
    model, logged = _opd(model_dirs, SampledTokenReverseKL(), off_policy=OffPolicyConfig(truncated_ratio=True)), Logged()
    _fit(model, _dm(), 2, [logged])
    for step in logged.steps:
        assert step["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4) and step["train/ratio_clip_frac"] == 0.0
        assert step["train/off_policy_gap_corrected"] == pytest.approx(step["train/off_policy_gap"], abs=1e-3)


class FixedTokenLoss(OPDModule):
    """Every supervised token's loss is 1 and its learner log-prob ``-1 + log(ratio of its row)`` (behaviour -1)."""

    def __init__(self, *a, ratios, **k):
        super().__init__(*a, **k)
        self.ratios = torch.tensor(ratios)

    def token_losses(self, batch):
        from lightning_opd.losses.base import TokenLoss

        mask = batch.loss_mask[:, 1:]
        student = (-1.0 + self.ratios.log()[:, None]) * mask
        zeros = torch.zeros_like(mask)
        return TokenLoss(loss=mask.clone().requires_grad_(), kl=zeros, student_logprobs=student,
                         teacher_logprobs=zeros, entropy=zeros), mask, batch.turn_index[:, 1:]


@pytest.mark.parametrize("on, expected", [(True, (4 * 1.5 + 4 * 2.0) / 8), (False, 1.0)])
def test_a_ratio_other_than_one_scales_the_step_loss(model_dirs, on, expected):
    """Two rows of 4 supervised tokens at lag 1, pi_old/pi_b = 1.5 and 3 (capped at C = 2): the step loss (§0.5, the
    mean over the step's 8 tokens of r_t * l_t with l_t = 1) is (4 x 1.5 + 4 x 2) / 8 = 1.75 with the ratio, 1 without."""
    from tests.losses.test_freshness import _batch

    model = FixedTokenLoss(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=SampledTokenReverseKL(),
                           micro_batch_size=2, ratios=[1.5, 3.0], log_text_every_n_steps=0)
    model.weightings.truncated_ratio = TruncatedRatio(2.0) if on else None
    batch, _ = _batch(lags=[1, 1], groups=[0, 1], drift=[0.0, 0.0], version=5)
    sums, _ = model.backward_step(batch, torch.tensor(8.0), lambda loss: None)
    assert float(sums["loss"]) == pytest.approx(expected)
    if on:
        # ratios 1.5 x4, 2 x4 (clipped); k1 = log p_S - log p_T = -1 + log r (teacher 0)
        weighted = 4 * 1.5 * (-1 + math.log(1.5)) + 4 * 2.0 * (-1 + math.log(3.0))
        assert model.weightings.truncated_ratio.sums == pytest.approx((8 * 1.75, 4.0, 8.0, weighted), rel=1e-6)
