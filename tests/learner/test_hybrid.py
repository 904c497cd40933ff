"""ATOD's hybrid objective, ATODModule (docs/algorithms.md §3): exact reductions (kappa = 1, rho = 0, w = 1,
one update = the sampled-token OPD loss; kappa = 0 = GRPO), T-DUR never touches the GRPO term, whole
groups under a staleness filter, F01c/F04/F06/F07 re-run with the hybrid loss, and a fit with several
updates per rollout batch (one policy version per batch, on-policy check, annealing, logs)."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.losses.freshness import FreshnessConfig, FreshnessWeighting
from lightning_opd.data import RolloutDataModule
from lightning_opd.losses import ClippedSurrogate, EpisodeReward, FullVocabReverseKL, SampledTokenReverseKL, log_probs
from lightning_opd.learner import ATODModule, OPDModule
from tests.helpers import KeywordEnvFactory, free_port, make_tokenizer
from tests.learner.test_module import (assert_masked_row_adds_nothing, make_batch, teacher_noise_off_the_loss,
                                       with_freshness)

# (kappa, rho, tdur, ppo_epochs): "atod" needs the collection-time pass (old log-probs + T-DUR)
HYBRIDS = {"atod": dict(kappa=0.7, rho=1.0, tdur=True, ppo_epochs=2), "grpo": dict(kappa=0.0, rho=1.0)}
SUCCESS, SCORE, GROUPS = [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.5, 2.0], [0, 0, 1, 1]


def scripted(batch):
    """Scripted rewards and two groups: r = success + score = [2, 0, 0.5, 2] (both groups informative)."""
    return replace(batch, success=torch.tensor(SUCCESS), rewards=torch.tensor(SCORE), group_id=torch.tensor(GROUPS))


def module_for(model_dirs, loss=None, micro_batch_size=2, teacher=None, **kw):
    """An ``ATODModule`` (default loss ``ClippedSurrogate``), or with a plain divergence an ``OPDModule``."""
    if loss is not None and not isinstance(loss, ClippedSurrogate):
        m = OPDModule(student=model_dirs["student"], teacher=teacher or model_dirs["teacher"], loss=loss,
                      micro_batch_size=micro_batch_size, **kw)
    else:
        m = ATODModule(student=model_dirs["student"], teacher=teacher or model_dirs["teacher"],
                       loss=loss if loss is not None else ClippedSurrogate(), micro_batch_size=micro_batch_size,
                       reward=EpisodeReward(1.0, 1.0), **kw)
    m.configure_model()
    return m


def prepared(module, batch):
    """What training_step does before the updates: the shared pass, plan, hybrid preparation."""
    lp = module.student_logprobs(batch) if module.needs_learner_logprobs else None
    batch = module.plan_batch(batch, lp)
    return module.prepare_batch(batch, lp)


def grads_of(module, batch, world_size=1):
    """One update's loss and gradients on an already prepared batch (step tokens all-reduced)."""
    module.student.zero_grad(set_to_none=True)
    tokens = module.reduce_sum(batch.loss_mask[:, 1:].sum())
    sums, _ = module.backward_step(batch, tokens, lambda loss: loss.backward(), world_size)
    return sums, {n: p.grad.clone() for n, p in module.student.named_parameters() if p.grad is not None}


def run(module, batch):
    return grads_of(module, prepared(module, batch))


@pytest.fixture(scope="module")
def batch(tokenizer):
    return scripted(make_batch(tokenizer))


# ---------------------------------------------------------------------------------------- reductions
def test_rho0_kappa1_w1_one_update_is_exactly_sampled_token_opd(model_dirs, batch):
    ref = module_for(model_dirs, SampledTokenReverseKL())
    hyb = module_for(model_dirs)  # kappa 1, rho 0, no T-DUR, one update per batch
    assert not hyb.needs_old_logprobs
    s_ref, g_ref = run(ref, batch)
    s_hyb, g_hyb = run(hyb, batch)
    assert s_ref["loss"].item() != 0 and torch.equal(s_ref["loss"], s_hyb["loss"])
    assert g_ref.keys() == g_hyb.keys() and all(torch.equal(g_ref[k], g_hyb[k]) for k in g_ref)


def test_kappa0_is_exactly_grpo(model_dirs, batch):
    """Against GRPO written out here: full logits, token-mean of -ratio * A_i with A_i by hand."""
    module = module_for(model_dirs, kappa=0.0, rho=1.0)
    sums, grads = run(module, batch)
    s = 1 / (math.sqrt(2) + 1e-6)  # group 0: r = [2, 0]; group 1: r = [0.5, 2]; unbiased std sqrt(2), 1.0607
    adv = torch.tensor([s, -s, -0.75 / (math.sqrt(2 * 0.75 ** 2) + 1e-6), 0.75 / (math.sqrt(2 * 0.75 ** 2) + 1e-6)])
    torch.testing.assert_close(module.prepare_hybrid(batch).advantage, adv)
    module.student.zero_grad(set_to_none=True)
    logits = module.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    lp = log_probs(logits, batch.sampling.temperature).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.loss_mask[:, 1:]
    loss = (mask * -torch.exp(lp - lp.detach()) * adv[:, None]).sum() / mask.sum()
    loss.backward()
    torch.testing.assert_close(sums["loss"], loss.detach())
    for name, p in module.student.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-5)


def test_tdur_never_touches_the_grpo_term(model_dirs, batch):
    """kappa = 0: T-DUR on or off gives the same step exactly (both with the collection-time pass)."""
    on = run(module_for(model_dirs, kappa=0.0, rho=1.0, tdur=True, ppo_epochs=2), batch)
    off = run(module_for(model_dirs, kappa=0.0, rho=1.0, tdur=False, ppo_epochs=2), batch)
    assert torch.equal(on[0]["loss"], off[0]["loss"]) and all(torch.equal(on[1][k], off[1][k]) for k in on[1])
    # with kappa > 0 it does change the step (the weights are not all 1)
    with_opd = [run(module_for(model_dirs, kappa=1.0, rho=1.0, tdur=t, ppo_epochs=2), batch)[0]["loss"] for t in (0, 1)]
    assert with_opd[0] != with_opd[1]


def test_prepare_hybrid_stats_and_tdur_weights(model_dirs, batch):
    module = module_for(model_dirs, tdur=True)
    out = prepared(module, batch)
    assert out.old_logprobs.shape == out.turn_weight.shape == batch.input_ids.shape
    sup = batch.loss_mask > 0
    assert ((out.turn_weight[sup] >= 0) & (out.turn_weight[sup] <= 1)).all()
    assert torch.equal(out.turn_weight[~sup], torch.ones_like(out.turn_weight[~sup]))
    torch.testing.assert_close(out.old_logprobs[:, 1:], module.student_logprobs(batch))
    st = {k: v.local for k, v in module._step_stats.items()}  # this rank's values (logged over all ranks)
    assert st["grpo/groups"] == 2.0 and st["grpo/equal_reward_groups"] == 0.0 and st["grpo/reward_mean"] == 1.125
    assert st["grpo/equal_reward_share"] == 0.0
    assert 0 < st["tdur/mean_weight"] <= 1
    equal = module.prepare_hybrid(replace(batch, success=torch.ones(4), rewards=torch.ones(4)))
    assert torch.equal(equal.advantage, torch.zeros(4)) and module._step_stats["grpo/equal_reward_groups"].local == 2.0
    assert module._step_stats["grpo/equal_reward_share"].local == 1.0  # 2 of 2 groups


def test_staleness_filter_drops_whole_groups_and_kept_advantages_are_unchanged(model_dirs, batch):
    module = module_for(model_dirs, kappa=0.5, rho=1.0)
    module.configure_freshness(FreshnessWeighting(FreshnessConfig(filtering=True, weighting=False), lag_bound=2))
    module.policy_version = 3
    stale = replace(batch, behaviour_version=torch.tensor([3, 3, 3, 0]))  # row 3 lag 3 > 2: group 1 goes
    blp = stale.behaviour_logprobs.clone()
    blp[:, 1:] = torch.where(stale.loss_mask[:, 1:] > 0, module.student_logprobs(stale), blp[:, 1:])
    planned = prepared(module, replace(stale, behaviour_logprobs=blp))
    assert planned.loss_mask[2:].sum() == 0 and planned.loss_mask[:2].sum() > 0
    kept_only = module_for(model_dirs, kappa=0.5, rho=1.0)
    ref = kept_only.prepare_hybrid(batch.select(slice(0, 2)))
    torch.testing.assert_close(planned.advantage[:2], ref.advantage)
    s1, g1 = grads_of(module, planned)
    s2, g2 = grads_of(kept_only, ref)
    torch.testing.assert_close(s1["loss"], s2["loss"])
    for k in g2:
        torch.testing.assert_close(g1[k], g2[k], atol=1e-6, rtol=1e-5)


def test_f13_reward_function_errors_and_fallback_reach_the_step(model_dirs, batch):
    from lightning_opd.losses.grpo import RewardFunctionError

    def broken(b):
        raise KeyError("score")

    module = module_for(model_dirs, kappa=0.5, rho=1.0)
    module.reward_fn = broken
    with pytest.raises(RewardFunctionError, match="raised KeyError"):
        prepared(module, batch)
    module.reward_fn = lambda b: torch.tensor([1.0, float("nan"), 0.0, 1.0])  # group 0 unusable, group 1 fine
    out = prepared(module, batch)
    assert torch.isfinite(out.advantage).all() and torch.equal(out.advantage[:2], torch.zeros(2))
    st = module._step_stats
    assert st["grpo/invalid_rewards"].local == 1.0 and st["grpo/invalid_groups"].local == 1.0
    sums, grads = grads_of(module, out)
    assert torch.isfinite(sums["loss"]) and all(torch.isfinite(g).all() for g in grads.values())


def test_hybrid_settings_need_the_surrogate(model_dirs):
    for kw in (dict(kappa=0.5), dict(rho=1.0), dict(tdur=True)):  # ATODModule: the hybrid knobs need the surrogate
        with pytest.raises(ValueError, match="model.init_args.loss: ATODModule's hybrid objective needs loss "
                                             "lightning_opd.losses.ClippedSurrogate, got FullVocabReverseKL"):
            ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=FullVocabReverseKL(), **kw)
        with pytest.raises(TypeError):  # OPDModule has no hybrid knobs at all
            OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=FullVocabReverseKL(), **kw)
    with pytest.raises(ValueError, match="model.init_args.loss=lightning_opd.losses.ClippedSurrogate is ATOD's hybrid "
                                         "objective: set model.class_path=lightning_opd.learner.ATODModule"):
        OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate())
    for kw, bad in ((dict(ppo_epochs=0), "model.ppo_epochs=0"), (dict(ppo_mini_batches=0), "model.ppo_mini_batches=0"),
                    (dict(kappa=-1.0), "model.kappa=-1.0"), (dict(rho=float("nan")), "model.rho=nan"),
                    (dict(advantage_eps=-1.0), "model.advantage_eps=-1.0")):
        with pytest.raises(ValueError, match=bad):
            ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate(), **kw)
    plain = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    assert plain.updates_per_batch == 1 and not plain.needs_learner_logprobs and not hasattr(plain, "kappa")
    atod = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"])
    assert (atod.kappa, atod.rho, atod.updates_per_batch, type(atod.loss_fn)) == (1.0, 0.0, 1, ClippedSurrogate)
    with pytest.raises(ValueError, match="model.rho=-0.5"):  # e.g. set by a schedule: caught when set
        atod.rho = -0.5
    with pytest.raises(ValueError, match="model.kappa=inf"):
        atod.set_kappa(float("inf"))
    assert (atod.kappa, atod.rho) == (1.0, 0.0)


def test_atod_constructor_lists_only_its_own_knobs_and_takes_every_opd_argument(model_dirs, capsys, isolate):
    """Issue 40: ``ATODModule.__init__`` copies no parameter list of ``OPDModule``; OPDModule's arguments reach it by
    keyword (``**kwargs``) under the same ``model.init_args`` keys, which the CLI resolves and lists in ``--help``."""
    import inspect

    from lightning_opd.cli import init_parameters, main

    own = set(inspect.signature(ATODModule.__init__).parameters) - {"self", "kwargs"}
    opd = set(init_parameters(OPDModule))
    assert own & opd == {"loss"}  # the one shared name: ATOD narrows its type to ClippedSurrogate
    assert set(init_parameters(ATODModule)) == own | opd
    atod = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], micro_batch_size=None,
                      micro_batch_tokens=64, aggregation="sequence", max_nonfinite_steps=5, rho=0.5, ppo_mini_batches=2)
    assert (atod.micro_batch_size, atod.micro_batch_tokens, atod.aggregation, atod.nonfinite.max_in_a_row,
            atod.rho, atod.updates_per_batch) == (None, 64, "sequence", 5, 0.5, 2)
    with pytest.raises(TypeError):  # keyword only: no positional copy of OPDModule's order either
        ATODModule(model_dirs["student"], model_dirs["teacher"])
    with pytest.raises(SystemExit):
        main(["fit", "--model.help", "lightning_opd.learner.ATODModule"])
    out = capsys.readouterr().out
    for key in ("--model.kappa", "--model.ppo_mini_batches", "--model.student", "--model.micro_batch_tokens",
                "--model.grad_clip_norm", "--model.max_nonfinite_steps"):
        assert key in out, key
    assert "episodes per forward/backward" in out  # OPDModule's description of micro_batch_size
    atod_yaml = Path(__file__).resolve().parents[2] / "conf" / "textworld" / "atod.yaml"
    with pytest.raises(SystemExit) as exc:  # the CLI's checks of OPDModule's arguments see them on ATODModule too
        main(["fit", "--config", str(atod_yaml), "--trainer.gradient_clip_val=0.5",
              f"--model.init_args.student={model_dirs['student']}"])
    assert exc.value.code == 2 and ("trainer.gradient_clip_val=0.5: ATODModule optimizes manually and clips the "
                                    "gradient norm itself") in capsys.readouterr().err


# --------------------------------------------------------------------------- F01c F04 F06 F07, hybrid
@pytest.mark.parametrize("name", HYBRIDS)
def test_f01c_teacher_equal_student_kl_zero_and_opd_term_vanishes(model_dirs, batch, name):
    same = {"student": model_dirs["student"], "teacher": model_dirs["student"]}
    module = module_for(same, **HYBRIDS[name])
    out, mask, _ = module.token_losses(prepared(module, batch))
    assert torch.equal(out.kl[mask > 0], torch.zeros_like(out.kl[mask > 0]))
    sums, grads = run(module, batch)
    grpo_only = run(module_for(same, **{**HYBRIDS[name], "kappa": 0.0}), batch)  # what is left: the GRPO term
    torch.testing.assert_close(sums["loss"], grpo_only[0]["loss"], atol=1e-6, rtol=0)
    for k in grads:
        torch.testing.assert_close(grads[k], grpo_only[1][k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("name", "freshness"), [("atod", False), ("grpo", False), ("atod", True)])
def test_f04_observation_tokens_never_reach_the_hybrid_loss(model_dirs, batch, name, freshness):
    module = module_for(model_dirs, micro_batch_size=1, **HYBRIDS[name])
    b = with_freshness(module, batch) if freshness else batch
    sums, grads = run(module, b)
    # the teacher is perturbed in every pass that uses it: T-DUR's collection pass and the loss
    with teacher_noise_off_the_loss(module.teacher_model, b):
        sums2, grads2 = run(module, b)
    assert torch.equal(sums["loss"], sums2["loss"]) and all(torch.equal(grads[k], grads2[k]) for k in grads)


@pytest.mark.parametrize("name", HYBRIDS)
def test_f06_all_masked_micro_batch_adds_nothing_to_the_hybrid_loss(model_dirs, batch, name):
    module = module_for(model_dirs, micro_batch_size=1, **HYBRIDS[name])
    ready = prepared(module, batch)  # advantages of the whole groups, then row 1 masked
    assert_masked_row_adds_nothing(lambda b: grads_of(module, b), ready)


@pytest.mark.parametrize(("name", "freshness"), [("atod", False), ("grpo", False), ("atod", True)])
def test_f07_micro_batch_layout_does_not_change_the_hybrid_gradient(model_dirs, batch, name, freshness):
    results = {}
    for mbs in (4, 2, 1):
        module = module_for(model_dirs, micro_batch_size=mbs, **HYBRIDS[name])
        results[mbs] = run(module, with_freshness(module, batch) if freshness else batch)
    for mbs in (2, 1):
        torch.testing.assert_close(results[mbs][0]["loss"], results[4][0]["loss"])
        for k, g in results[4][1].items():
            torch.testing.assert_close(results[mbs][1][k], g, atol=1e-6, rtol=1e-5)


def _rank_worker(rank, world, port, model_dirs, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    batch = scripted(make_batch(make_tokenizer()))
    module = module_for(model_dirs, micro_batch_size=1, **HYBRIDS["atod"])
    local = batch.select(slice(rank * 2, rank * 2 + 2))  # each rank holds whole groups, as the DataModule plays them
    sums, grads = run_ranked(module, local, world)
    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    loss = sums["loss"].clone()
    dist.all_reduce(loss)
    if rank == 0:
        torch.save((loss, grads), out_path)
    dist.destroy_process_group()


def run_ranked(module, batch, world):
    return grads_of(module, prepared(module, batch), world)


@pytest.mark.timeout(240)
def test_f07_two_ranks_equal_single_process_hybrid(model_dirs, batch, tmp_path):
    ctx = mp.get_context("spawn")
    port, out_path = free_port(), str(tmp_path / "rank0.pt")
    procs = [ctx.Process(target=_rank_worker, args=(r, 2, port, model_dirs, out_path)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=200)
        assert p.exitcode == 0
    loss2, grads2 = torch.load(out_path, weights_only=True)
    sums1, grads1 = run(module_for(model_dirs, micro_batch_size=4, **HYBRIDS["atod"]), batch)
    torch.testing.assert_close(loss2, sums1["loss"])
    for k, g in grads1.items():
        torch.testing.assert_close(grads2[k], g, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------- several updates: fit
class Recording(ATODModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen, self.kappas, self.metrics = [], [], []

    def _check_on_policy(self, batch):
        self.seen.append((self.policy_version, batch.behaviour_version.tolist(), batch.group_id.tolist(),
                          batch.input_ids.clone()))
        self.kappas.append(self.kappa)
        return super()._check_on_policy(batch)

    def step_extras(self):
        self.metrics.append({k: v.local for k, v in self._step_stats.items()})  # this rank's values
        return super().step_extras()


def test_fit_with_several_updates_per_batch_is_one_policy_version_per_batch(model_dirs, tmp_path):
    model = Recording(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate(clip_eps=0.2),
                      kappa=1.0, rho=1.0, tdur=True, ppo_epochs=2, ppo_mini_batches=2, reward=EpisodeReward(1.0, 1.0),
                      optimizer=lambda p: torch.optim.AdamW(p, lr=3e-2), log_text_every_n_steps=0)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=4, group_size=2, max_turns=2,
                           max_new_tokens=4, eval_batch_size=2, seed=0)
    kappa = AnnealingSchedule("kappa", start=1.0, end=0.1, steps=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[kappa])
    trainer.fit(model, datamodule=dm)
    # 8 optimizer updates = 2 rollout batches x (2 epochs x 2 mini-batches); one version per batch, on-policy
    assert trainer.global_step == 8 and model.policy_version == 2
    assert [(v, b) for v, b, _, _ in model.seen] == [(0, [0, 0, 0, 0]), (1, [1, 1, 1, 1])]
    assert model.kappas == [1.0, 0.55]  # the schedule counts rollout iterations, not updates
    assert trainer.callback_metrics["schedule/kappa"].item() == pytest.approx(0.55)
    for _, _, groups, ids in model.seen:  # G = 2 episodes per task, sampled differently
        assert groups[0] == groups[1] != groups[2] == groups[3]
        assert not torch.equal(ids[0], ids[1]) and not torch.equal(ids[2], ids[3])
    for key in ("ppo/clip_frac", "ppo/ratio_mean", "ppo/ratio_min", "ppo/ratio_max", "ppo/updates",
                "grpo/equal_reward_groups", "grpo/equal_reward_share", "grpo/groups", "grpo/reward_mean", "tdur/mean_weight", "train/kappa",
                "train/rho", "train/loss"):
        assert key in trainer.callback_metrics, key
    assert trainer.callback_metrics["ppo/updates"].item() == 4.0
    # later updates on the same batch move the ratio away from 1 (what makes clipping matter)
    last = model.metrics[-1]
    assert last["ppo/ratio_max"] - last["ppo/ratio_min"] > 1e-3


# --------------------------------------------------------------------- F22: a loss term that is always 0
def fit_until_setup_error(model_dirs, callbacks=(), data=None, max_steps=4, **model_kw) -> str:
    """The ValueError that ``trainer.fit`` raises at setup, before any rollout (module and DataModule known)."""
    model = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate(),
                       log_text_every_n_steps=0, **model_kw)
    dm = RolloutDataModule(**{**dict(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                                     eval_batch_size=2, seed=0), **(data or {})})
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=list(callbacks))
    with pytest.raises(ValueError) as err:
        trainer.fit(model, datamodule=dm)
    assert model.policy_version == 0 and trainer.global_step == 0 and dm.sampler.batches_started == 0  # nothing generated
    return str(err.value)


@pytest.mark.parametrize(("model_kw", "data", "keys"), [
    (dict(rho=1.0), dict(group_size=1), ("model.init_args.rho=1.0", "data.init_args.group_size=1")),  # the default
    (dict(kappa=0.5, rho=1.0), dict(group_size=2, episodes_per_step=4, temperature=0.0),
     ("model.init_args.rho=1.0", "data.init_args.temperature=0")),
    (dict(rho=1.0, reward=EpisodeReward(0.0, 0.0)), dict(group_size=2),
     ("model.init_args.rho=1.0", "model.init_args.reward.init_args.success_weight=0", "score_weight=0")),
    (dict(kappa=0.0, rho=0.0), {}, ("model.init_args.kappa=0.0", "model.init_args.rho=0.0")),
    (dict(kappa=0.0, rho=1.0, tdur=True), dict(group_size=2), ("model.init_args.tdur=true", "model.init_args.kappa=0.0")),
], ids=["rho_group_size_1", "rho_greedy_groups", "rho_zero_reward", "kappa0_rho0", "tdur_kappa0"])
def test_f22_a_term_that_is_identically_zero_is_refused_at_setup(model_dirs, model_kw, data, keys):
    message = fit_until_setup_error(model_dirs, data=data, **model_kw)
    for key in keys:
        assert key in message, (key, message)


def test_f22_check_accepts_every_term_that_can_train(model_dirs):
    """The same knobs set so that every term can be non-zero pass the setup check."""
    from lightning_opd.learner.atod import RolloutGroups

    model = ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate(),
                       kappa=0.0, rho=1.0, reward=EpisodeReward(0.0, 1.0))
    dm = RolloutDataModule(env=KeywordEnvFactory(), episodes_per_step=4, group_size=2, temperature=0.7)
    model.rollout_groups = RolloutGroups(dm.group_size, dm.sampling.temperature)
    for kappa, rho, tdur in ((0.0, 1.0, False), (1.0, 0.0, True), (0.5, 2.0, True)):
        model.kappa, model.rho, model.tdur = kappa, rho, tdur
        model.check_loss_terms(max_steps=4)
    model.rollout_groups = RolloutGroups(group_size=1, temperature=0.0)  # OPD only: no groups needed
    model.kappa, model.rho = 1.0, 0.0
    model.check_loss_terms(max_steps=-1)
