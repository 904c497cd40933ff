"""``SignOnlyReverseKL`` (issue 63, docs/algorithms.md §8.2): value and gradient worked out by hand on 3 tokens of a
3-word vocabulary, through both paths (full-vocabulary teacher logits, reported sampled-token log-probs) and the
chunked hidden-state path; the logged KL is the base class's; the stale (behaviour) signal; OPDModule's checks (a
sampled-token estimator: the truncated ratio applies on stale tokens); one OPDModule step against a by-hand surrogate
and a tiny fit."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from lightning_opd.learner.positions import supervised_positions
from lightning_opd.losses import SampledTokenReverseKL, SignOnlyReverseKL, TeacherSignal, log_probs
from lightning_opd.losses.off_policy import (UncorrectedOffPolicyError, is_sampled_token_estimator,
                                             resolve_truncated_ratio)
from lightning_opd.teachers import Teacher, check_teacher_serves, losses_for
from tests.helpers import KeywordEnvFactory
from tests.learner.test_module import make_batch, make_module, step_grads

# student and teacher logits of 3 tokens over a vocabulary of 3, and the sampled tokens
STUDENT = torch.tensor([[1.0, 0.0, -1.0], [0.0, 0.0, 0.0], [0.5, -0.5, 0.0]])
TEACHER = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, -0.5, 0.0]])  # token 3: the teacher = the student
TARGETS = torch.tensor([0, 2, 1])


def test_the_hand_worked_advantages_and_their_signs():
    """At T = 1: token 1, log p_S(0) = 1 - log(e + 1 + 1/e) = -0.40761, log p_T(0) = 2 - log(e^2 + 2) = -0.23954,
    A = +0.16807 -> +1; token 2, log p_S(2) = -log 3 = -1.09861, log p_T(2) = -log(e + 2) = -1.55144, A = -0.45283
    -> -1; token 3, the same logits: A = 0 exactly -> 0."""
    e = math.e
    a1 = (2 - math.log(e ** 2 + 2)) - (1 - math.log(e + 1 + 1 / e))
    a2 = -math.log(e + 2) + math.log(3)
    assert a1 == pytest.approx(0.16807, abs=1e-5) and a2 == pytest.approx(-0.45283, abs=1e-5)
    lp_s, lp_t = log_probs(STUDENT), log_probs(TEACHER)
    a = (lp_t - lp_s).gather(-1, TARGETS[:, None])[:, 0]
    torch.testing.assert_close(a, torch.tensor([a1, a2, 0.0]), rtol=0, atol=1e-6)
    assert torch.equal(SignOnlyReverseKL().policy_advantage(a), torch.tensor([1.0, -1.0, 0.0]))
    assert SampledTokenReverseKL().policy_advantage(a) is a  # the base class keeps A_t itself


@pytest.mark.parametrize("path", ["token_terms", "signal_terms"])
def test_value_and_gradient_by_hand_at_temperature_1(path):
    """loss_t = -sign(A_t) in value; d loss_t / d z_t = -sign(A_t) (onehot(a_t) - softmax(z_t)): token 1,
    softmax(1, 0, -1) = (0.66524, 0.24473, 0.09003) -> (-0.33476, 0.24473, 0.09003); token 2, sign -1, softmax 1/3 each
    -> (-1/3, -1/3, 2/3); token 3 (sign 0) -> 0."""
    z = STUDENT.clone().requires_grad_(True)
    out = run(SignOnlyReverseKL(), path, z, TEACHER, 1.0)
    torch.testing.assert_close(out.loss.detach(), torch.tensor([-1.0, 1.0, 0.0]), rtol=0, atol=1e-7)
    out.loss.sum().backward()
    want = torch.tensor([[-0.33476, 0.24473, 0.09003], [-1 / 3, -1 / 3, 2 / 3], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(z.grad, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("path", ["token_terms", "signal_terms"])
@pytest.mark.parametrize("temperature", [0.5, 1.3])
def test_gradient_is_minus_the_sign_times_the_score_function(path, temperature):
    """grad w.r.t. the student logits = -sign(A_t) (onehot(a_t) - softmax(z_t / T)) / T, A_t at the temperature."""
    z = STUDENT.clone().requires_grad_(True)
    out = run(SignOnlyReverseKL(), path, z, TEACHER, temperature)
    out.loss.sum().backward()
    lp_s, lp_t = log_probs(STUDENT, temperature), log_probs(TEACHER, temperature)
    sign = torch.sign((lp_t - lp_s).gather(-1, TARGETS[:, None]))  # (3, 1)
    onehot = torch.nn.functional.one_hot(TARGETS, 3).float()
    torch.testing.assert_close(z.grad, -sign * (onehot - lp_s.exp()) / temperature, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.loss.detach(), -sign[:, 0], rtol=0, atol=1e-7)


@pytest.mark.parametrize("path", ["token_terms", "signal_terms"])
def test_the_logged_kl_and_log_probs_are_the_sampled_reverse_kls(path):
    """Only the loss changes: ``kl`` (exact from full logits, the k1 estimate from reported log-probs), the student's
    and teacher's log-probs and the entropy are SampledTokenReverseKL's."""
    sign = run(SignOnlyReverseKL(), path, STUDENT, TEACHER, 0.7)
    base = run(SampledTokenReverseKL(), path, STUDENT, TEACHER, 0.7)
    for field in ("kl", "student_logprobs", "teacher_logprobs", "entropy"):
        assert torch.equal(getattr(sign, field), getattr(base, field)), field
    assert not torch.equal(sign.loss, base.loss)


def test_the_behaviour_signal_takes_the_sign_of_the_stale_advantage():
    """``signal="behaviour"``: A_t = log p_T(a_t) - log pi_b(a_t). Token 1 with log pi_b = -0.1 > log p_T = -0.23954:
    -1 where the recomputed advantage is +1; token 3 with log pi_b = -2: +1 where the recomputed one is 0."""
    behaviour = torch.tensor([-0.1, -1.0, -2.0])  # token 2: log p_T = -1.55144 < -1.0 -> -1, as recomputed
    loss = SignOnlyReverseKL(signal="behaviour")
    for path in ("token_terms", "signal_terms"):
        z = STUDENT.clone().requires_grad_(True)
        out = run(loss, path, z, TEACHER, 1.0, behaviour_logprobs=behaviour)
        torch.testing.assert_close(out.loss.detach(), torch.tensor([1.0, 1.0, -1.0]), rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="needs behaviour_logprobs"):
        loss.token_terms(STUDENT, TEACHER, TARGETS, 1.0)
    with pytest.raises(ValueError, match="signal='sign'"):
        SignOnlyReverseKL(signal="sign")


def test_the_chunked_hidden_state_paths_give_the_kernel():
    """``forward`` (hidden states + both heads, 2 tokens per chunk, recomputed in backward) and ``forward_signals``
    equal the kernel on the heads' logits, value and gradient."""
    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(5, 4, generator=g), torch.randn(5, 6, generator=g)
    ws, wt = torch.randn(4, 7, generator=g), torch.randn(6, 7, generator=g)
    targets = torch.randint(0, 7, (5,), generator=g)
    loss = SignOnlyReverseKL(chunk_size=2)
    results = []
    for how in ("kernel", "forward", "forward_signals"):
        h = hs.clone().requires_grad_(True)
        if how == "kernel":
            out = loss.token_terms(h @ ws, ht @ wt, targets, 0.8)
        elif how == "forward":
            out = loss(h, ht, targets, lambda x: x @ ws, lambda x: x @ wt, temperature=0.8)
        else:
            t_lp = log_probs(ht @ wt, 0.8).gather(-1, targets[:, None])[:, 0]
            out = loss.forward_signals(h, targets, lambda x: x @ ws, 0.8, teacher_sampled_logprobs=t_lp)
        out.loss.sum().backward()
        results.append((out.loss.detach(), h.grad))
    assert set(results[0][0].tolist()) <= {-1.0, 0.0, 1.0}
    for value, grad in results[1:]:
        torch.testing.assert_close(value, results[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=1e-6)


def test_it_passes_the_modules_checks_as_a_sampled_token_estimator(model_dirs):
    loss = SignOnlyReverseKL()
    assert type(loss).teacher_signal is TeacherSignal.SAMPLED_TOKEN and is_sampled_token_estimator(loss)
    assert resolve_truncated_ratio(loss, 1, None, False) and not resolve_truncated_ratio(loss, 0, None, False)
    with pytest.raises(UncorrectedOffPolicyError, match="SignOnlyReverseKL \\(a sampled-token estimator\\)"):
        resolve_truncated_ratio(loss, 2, False, False)

    class SampledOnly(Teacher):
        provides = frozenset({TeacherSignal.SAMPLED_TOKEN})

    check_teacher_serves(loss, SampledOnly())  # a served teacher's log-prob of the sampled token is enough
    assert "SignOnlyReverseKL" in losses_for(SampledOnly.provides)
    module = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=loss)
    assert module.weightings.truncated_ratio is None  # sync, lag 0: nothing stale
    module.weightings.resolve(1)  # a data configuration whose batches may be one version old
    assert module.weightings.truncated_ratio is not None and module.weightings.truncated_ratio.cap == 2.0


def test_one_opd_step_is_the_sign_weighted_score_function(model_dirs, tokenizer):
    """One ``OPDModule`` update (one micro-batch): the step loss is -(1/N) sum_t sign(A_t) and the gradient that of the
    by-hand surrogate -(1/N) sum_t sign(A_t) log p_S(a_t), A_t from both models' full logits."""
    module = make_module(model_dirs, SignOnlyReverseKL, micro_batch_size=4)
    batch = make_batch(tokenizer)
    sums, grads = step_grads(module, batch)
    rows, cols = supervised_positions(batch)
    targets = batch.input_ids[:, 1:][rows, cols]
    v = module.vocab_size
    with torch.no_grad():
        t_logits = module.teacher_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    module.student.zero_grad(set_to_none=True)
    s_logits = module.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp_s = torch.log_softmax(s_logits[:, :-1][rows, cols][:, :v].float(), -1).gather(-1, targets[:, None])[:, 0]
    lp_t = torch.log_softmax(t_logits[:, :-1][rows, cols][:, :v].float(), -1).gather(-1, targets[:, None])[:, 0]
    sign = torch.sign(lp_t - lp_s.detach())
    n = len(targets)
    assert 0 < int((sign > 0).sum()) < n  # both directions occur
    torch.testing.assert_close(sums["loss"], -sign.sum() / n, rtol=0, atol=1e-6)
    (-(sign * lp_s).sum() / n).backward()
    for name, p in module.student.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_tiny_fit_trains_with_it(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=SignOnlyReverseKL())
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              num_sanity_val_steps=0).fit(model, datamodule=dm)
    assert model.policy_version == 2
    start = dict(AutoModelForCausalLM.from_pretrained(model_dirs["student"]).named_parameters())
    assert any(not torch.equal(p.detach(), start[n].detach()) for n, p in model.student.named_parameters())  # it moved


def run(loss, path, student, teacher, temperature, **extras):
    """The loss's per-token terms from full teacher logits (``token_terms``) or from the teacher's reported log-probs
    of the sampled tokens (``signal_terms``), on ``TARGETS``."""
    if path == "token_terms":
        return loss.token_terms(student, teacher, TARGETS, temperature, **extras)
    t_lp = log_probs(teacher, temperature).gather(-1, TARGETS[:, None])[:, 0]
    return loss.signal_terms(student, TARGETS, temperature, teacher_sampled_logprobs=t_lp, **extras)
