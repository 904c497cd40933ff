"""The freshness-vs-gradient mechanism check (issue 18): its rank statistics against hand-worked ranks, and a tiny
end-to-end run on the random 2-layer models whose gradients are checked against known identities."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.freshness_gradient import (average_ranks, bootstrap_ci, bootstrap_difference_ci, collate, gradient_cosines, loss_gradient,
                                           make_samples, make_versions, measure, measured_parameters, parser,
                                           report, spearman, summarize)
from tests.helpers import KeywordEnvFactory, make_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_average_ranks_share_ties():
    assert average_ranks([1, 2, 2, 3]).tolist() == [1, 2.5, 2.5, 4]
    assert average_ranks([5, 5, 5]).tolist() == [2, 2, 2]
    assert average_ranks([3, 1, 2]).tolist() == [3, 1, 2]


def test_spearman_hand_worked_with_ties():
    """x ranks [1, 2.5, 2.5, 4], y ranks [1, 3, 2, 4]; deviations [-1.5, 0, 0, 1.5] and [-1.5, .5, -.5, 1.5]:
    4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)."""
    assert spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(3 / math.sqrt(10), abs=1e-12)
    assert spearman([1, 2, 2, 3], [40, 20, 30, 10]) == pytest.approx(-3 / math.sqrt(10), abs=1e-12)
    # ties on both sides: ranks [1.5, 1.5, 3.5, 3.5] and [1.5, 3.5, 1.5, 3.5], deviations orthogonal
    assert spearman([1, 1, 2, 2], [1, 2, 1, 2]) == 0.0
    assert spearman([1, 2, 3], [1, 10, 100]) == pytest.approx(1.0)  # monotone, not linear
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(spearman([1], [2]))
    with pytest.raises(ValueError, match="3 x values but 2 y values"):
        spearman([1, 2, 3], [1, 2])


def test_bootstrap_ci_skips_constant_resamples():
    """Two pairs: a resample is either both the same pair (constant: left out) or both pairs (ρ = ±1)."""
    lo, hi, used = bootstrap_ci([1, 2], [1, 2], n_boot=400, seed=0)
    assert (lo, hi) == (1.0, 1.0) and 100 < used < 300
    lo, hi, _ = bootstrap_ci([1, 2, 3, 4], [8, 6, 4, 2], n_boot=200)
    assert (lo, hi) == (-1.0, -1.0)
    assert bootstrap_ci([1, 1], [1, 2], n_boot=10)[2] == 0
    x, y = [1, 2, 3, 4, 5], [2, 1, 4, 3, 5]  # ρ = 0.8
    a = bootstrap_ci(x, y, seed=3)
    assert spearman(x, y) == pytest.approx(0.8)
    assert a == bootstrap_ci(x, y, seed=3) and a[0] < 0.8 < a[1]
    with pytest.raises(ValueError, match="--bootstrap=0"):
        bootstrap_ci([1, 2], [1, 2], n_boot=0)


def test_bootstrap_difference_ci_is_paired():
    """x1 = y ranks y perfectly (ρ = 1 on every resample with two distinct values), x2 = -y perfectly wrong
    (ρ = -1): the difference is exactly 2 on every defined resample; x1 against itself is exactly 0."""
    y = [1, 2, 3, 4, 5]
    d, lo, hi, used = bootstrap_difference_ci(y, [-v for v in y], y, n_boot=300, seed=1)
    assert (d, lo, hi) == (2.0, 2.0, 2.0) and 250 < used <= 300  # resamples of one distinct value are NaN
    assert bootstrap_difference_ci(y, y, [5, 1, 4, 2, 3], n_boot=50)[:3] == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="lengths 2, 3, 3 differ"):
        bootstrap_difference_ci([1, 2], [1, 2, 3], [1, 2, 3])


def test_summarize_within_lag_and_minus_age_only_hand_worked():
    """Lag 1: cos rises with f_cal (ρ = +1), lag 2: falls with it (ρ = -1). Age-only is constant within a lag
    and higher at lag 1, where cos is higher: over all 6 samples its ranks are [5, 5, 5, 2, 2, 2] (ties), cos's
    [4, 5, 6, 3, 2, 1]: deviations [1.5]*3 + [-1.5]*3 and [.5, 1.5, 2.5, -.5, -1.5, -2.5]: 13.5 / sqrt(13.5 * 17.5)
    = sqrt(13.5 / 17.5). f_cal ranks [4, 5, 6, 1, 2, 3] (lag 1 higher, rising; lag 2 lower, rising), deviations
    [.5, 1.5, 2.5, -2.5, -1.5, -.5] against cos's: (.25 + 2.25 + 6.25 + 1.25 + 2.25 + 1.25) / 17.5 = 13.5 / 17.5."""
    cos = [0.1, 0.2, 0.3, 0.0, -0.1, -0.2]
    f_cal = [0.7, 0.8, 0.9, 0.1, 0.2, 0.3]
    records = [{"cos": c, "lag": 1 if i < 3 else 2, "f_age_only": 0.95 if i < 3 else 0.88, "f_cal": f,
                "s_age_only": 0.0, "s_cal": 0.0, "rho": -f, "chi": 0.0} for i, (c, f) in enumerate(zip(cos, f_cal))]
    s = summarize(records, ["age_only", "cal"], n_boot=200)
    assert s["within_lag"]["1"]["f_cal"]["spearman"] == pytest.approx(1.0)
    assert s["within_lag"]["2"]["f_cal"]["spearman"] == pytest.approx(-1.0)
    assert s["within_lag"]["1"]["rho"]["spearman"] == pytest.approx(-1.0)
    assert math.isnan(s["within_lag"]["1"]["chi"]["spearman"]) and "f_age_only" not in s["within_lag"]["1"]
    age = s["spearman_with_cos"]["f_age_only"]["spearman"]
    assert age == pytest.approx(math.sqrt(13.5 / 17.5))
    assert s["spearman_with_cos"]["f_cal"]["spearman"] == pytest.approx(13.5 / 17.5)
    assert s["minus_age_only"]["f_cal"]["difference"] == pytest.approx(13.5 / 17.5 - math.sqrt(13.5 / 17.5))
    text = report({"summary": s, "seconds": {"total": 1, "versions": 0, "generate": 0, "gradients": 1},
                   "machine": {"cpu_count": 2, "torch_threads": 1}, "dropped_empty_samples": 0,
                   "reference_episodes": 2, "measured_parameters": 10}, "k")
    assert "| 1 | 3 | +1.000 [+1.000, +1.000]" in text and "| 2 | 3 | -1.000 [-1.000, -1.000]" in text
    assert f"| f_cal | {13.5 / 17.5 - math.sqrt(13.5 / 17.5):+.3f} |" in text
    assert "minus_age_only" in summarize(records, ["cal"], n_boot=10) and not summarize(records, ["cal"],
                                                                                         n_boot=10)["minus_age_only"]


@pytest.fixture(scope="module")
def fitted(model_dirs):
    """Two OPD steps of the tiny student at a large learning rate (versions 0, 1, 2 differ visibly)."""
    env = KeywordEnvFactory()
    module, dm, snaps = make_versions(model_dirs["student"], model_dirs["teacher"], env, versions=2, lr=1e-2,
                                      episodes=2, max_turns=2, max_new_tokens=4)
    return module, dm, snaps


def test_versions_are_kept_as_distinct_copies(fitted):
    module, _, snaps = fitted
    assert sorted(snaps) == [0, 1, 2] and module.policy_version == 2
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(snaps[0][name], snaps[1][name]) and not torch.equal(snaps[1][name], snaps[2][name])
    torch.testing.assert_close(snaps[2][name], module.student.state_dict()[name].cpu())


def test_gradient_of_a_sample_equal_to_the_reference_has_cos_one(fitted):
    """cos(g_i, G) = 1 when the reference batch is sample i itself (measured last, so gradients left over from
    earlier samples would show), < 1 for the others; G of two samples is their token-weighted mean gradient
    (token-mean aggregation, §0.5)."""
    module, dm, snaps = fitted
    samples, _ = make_samples(dm, snaps, lags=[0, 2], per_lag=2, reference=1)
    trajs = [t for _, t in samples if collate(dm, [t], "cpu").loss_mask[:, 1:].sum() > 0]
    assert len(trajs) >= 3
    batches = [collate(dm, [t], "cpu") for t in trajs]
    params = [p for _, p in measured_parameters(module.student, None)]
    cos, norms, ref_norm = gradient_cosines(module, batches, batches[-1], params)
    assert cos[-1] == pytest.approx(1.0, abs=1e-6) and norms[-1] == pytest.approx(ref_norm, rel=1e-6)
    assert all(c < 0.999 for c in cos[:-1]) and all(n > 0 for n in norms)

    a, b = batches[0], batches[1]
    n_a, n_b = float(a.loss_mask[:, 1:].sum()), float(b.loss_mask[:, 1:].sum())
    g_a, g_b = loss_gradient(module, a, params), loss_gradient(module, b, params)
    g_ab = loss_gradient(module, collate(dm, trajs[:2], "cpu"), params)
    for x, y, z in zip(g_a, g_b, g_ab):
        torch.testing.assert_close(z, (n_a * x + n_b * y) / (n_a + n_b), rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in module.student.parameters())


def test_sampled_loss_option_trains_and_differentiates_the_sampled_token_reverse_kl(model_dirs):
    """``--loss sampled`` (issue 18's experiment recipe): the versions are trained with, and the per-sample
    gradients are those of, SampledTokenReverseKL; a sample's gradient against itself has cos 1."""
    from lightning_opd.losses.divergences import SampledTokenReverseKL

    module, dm, snaps = make_versions(model_dirs["student"], model_dirs["teacher"], KeywordEnvFactory(), versions=1,
                                      lr=1e-2, episodes=2, max_turns=2, max_new_tokens=4, loss="sampled")
    assert isinstance(module.loss_fn, SampledTokenReverseKL) and sorted(snaps) == [0, 1]
    samples, _ = make_samples(dm, snaps, lags=[0], per_lag=2, reference=1)
    batches = [b for b in (collate(dm, [t], "cpu") for _, t in samples) if b.loss_mask[:, 1:].sum() > 0]
    params = [p for _, p in measured_parameters(module.student, None)]
    cos, _, _ = gradient_cosines(module, batches, batches[0], params)
    assert cos[0] == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="--loss='forward': use one of \\['analytic', 'sampled'\\]"):
        make_versions(model_dirs["student"], model_dirs["teacher"], KeywordEnvFactory(), versions=1, lr=1e-2,
                      episodes=2, max_turns=2, max_new_tokens=4, loss="forward")


def test_parameter_subset_freezes_the_others_only_meanwhile(fitted):
    module, dm, snaps = fitted
    names = [n for n, _ in measured_parameters(module.student, 1)]
    assert not any(".layers.0." in n for n in names) and any(".layers.1." in n for n in names)
    assert {"model.norm.weight", "lm_head.weight"} <= set(names) and "model.embed_tokens.weight" not in names
    samples, _ = make_samples(dm, snaps, lags=[0], per_lag=1, reference=1)
    batch = collate(dm, [samples[0][1]], "cpu")
    subset = [p for _, p in measured_parameters(module.student, 1)]
    full = dict(zip([n for n, _ in module.student.named_parameters()],
                    loss_gradient(module, batch, list(module.student.parameters()))))
    for name, g in zip(names, loss_gradient(module, batch, subset)):
        torch.testing.assert_close(g, full[name], rtol=1e-5, atol=1e-8)  # same gradient, fewer parameters
    assert all(p.requires_grad for p in module.student.parameters())
    with pytest.raises(ValueError, match="--last-blocks=0"):
        measured_parameters(module.student, 0)


def test_parameter_subset_leaves_out_a_head_tied_to_the_embeddings(tokenizer):
    """SmolLM2 ties its LM head to the input embeddings: the shared matrix would need the full backward pass."""
    model = make_model(tokenizer)
    model.lm_head.weight = model.model.embed_tokens.weight
    names = [n for n, _ in measured_parameters(model, 1)]
    assert names and all(".layers.1." in n or n == "model.norm.weight" for n in names)


def test_measure_end_to_end_tiny(model_dirs):
    """2 versions, lags 0/1, 2 samples each: per-sample records with the lag, components and freshness of the
    monitor's defaults (and a second variant), rank statistics with CIs, per-lag means."""
    args = parser().parse_args(["--model", model_dirs["student"], "--teacher", model_dirs["teacher"], "--versions", "2",
                                "--lr", "1e-2", "--episodes", "2", "--lags", "0", "1", "--samples-per-lag", "2",
                                "--reference", "2", "--max-turns", "2", "--max-new-tokens", "4", "--bootstrap", "50",
                                "--variant", 'tight={"tau_rho": 0.01, "tau_chi": 0.01}'])
    out = measure(args, KeywordEnvFactory())
    records = out["records"]
    assert len(records) + out["dropped_empty_samples"] == 4 and len(records) >= 3
    assert sorted({r["lag"] for r in records}) == [0, 1]
    for r in records:
        assert -1 <= r["cos"] <= 1 and 0 < r["f_default"] < 1 and r["tokens"] > 0
        assert r["f_age_only"] == pytest.approx(1 / (1 + math.exp(4.0 * (2.0 * r["lag"] / 8 - 1.0))))  # w_δ δ only
        assert r["delta"] == pytest.approx(r["lag"] / 8)  # the monitor's default Δ_cap
        if r["lag"] == 0:  # sampled by exactly θ_v: no rollout drift, freshness of a synchronous sample
            assert r["rho"] < 1e-4 and r["f_default"] > 0.95
        else:
            assert r["rho"] > 1e-3 and r["f_tight"] < r["f_default"]
    s = out["summary"]
    corr = s["spearman_with_cos"]
    assert set(corr) == {f"{k}_{v}" for k in "fs" for v in ("default", "age_only", "tight")} | {"lag", "rho", "chi"}
    assert corr["f_age_only"]["spearman"] == pytest.approx(-corr["lag"]["spearman"])  # a function of the lag alone
    assert set(s["per_lag"]) == {"0", "1"} and s["n"] == len(records)
    student = AutoModelForCausalLM.from_pretrained(model_dirs["student"])
    assert out["measured_parameters"] == sum(p.numel() for p in student.parameters())  # all by default
    assert out["seconds"]["total"] > 0 and out["machine"]["cpu_count"] >= 1
