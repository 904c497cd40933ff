"""The losses from a teacher's reported signals (``signal_terms`` / ``forward_signals``, docs/algorithms.md §6.5):
given the teacher's sampled-token log-prob or its top-k ids and log-probs, worked out by hand from the same logits,
they equal the full-vocabulary path (``token_terms`` / ``forward``) in value and gradient; the tail bucket from
the top-k alone has hand values and no NaN when the tail rounds to 0; what they cannot serve is refused plainly."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.losses import (ClippedSurrogate, ForwardKL, FullVocabReverseKL, GeneralizedJSD,
                                  SampledTokenReverseKL, StudentTopKRenormalizedReverseKL, TeacherTopKForwardKL,
                                  TeacherTopKRenormalizedReverseKL)

V = 60


def _inputs(temperature: float, seed: int = 0, n: int = 9):
    g = torch.Generator().manual_seed(seed)
    s, t = torch.randn(n, V, generator=g), torch.randn(n, V, generator=g)
    return s, t, torch.randint(0, V, (n,), generator=g)


def _reported(t: torch.Tensor, targets: torch.Tensor, temperature: float, k: int) -> dict[str, torch.Tensor]:
    """What a teacher reports, by hand: ``log_softmax(t / T)`` gathered at the targets, and its top-k."""
    lp = torch.log_softmax(t.float() / temperature, -1)
    top = lp.topk(min(k, V), -1)
    return {"teacher_sampled_logprobs": lp.gather(-1, targets[:, None])[:, 0], "teacher_topk_ids": top.indices,
            "teacher_topk_logprobs": top.values}


SIGNAL_LOSSES = {
    "sampled": (lambda: SampledTokenReverseKL(), ()),
    "sampled_behaviour": (lambda: SampledTokenReverseKL("behaviour"), ("behaviour_logprobs",)),
    "clipped": (lambda: ClippedSurrogate(), ("opd_weight", "grpo_term", "old_logprobs")),
    "teacher_topk_rkl": (lambda: TeacherTopKRenormalizedReverseKL(k=7), ()),
    "teacher_topk_fkl": (lambda: TeacherTopKForwardKL(k=7), ()),
    "teacher_topk_fkl_tail": (lambda: TeacherTopKForwardKL(k=7, tail_bucket=True), ()),
    "teacher_topk_fkl_tail_k_ge_v": (lambda: TeacherTopKForwardKL(k=V + 5, tail_bucket=True), ()),
    "teacher_topk_fkl_small_tail": (lambda: TeacherTopKForwardKL(k=V - 2, tail_bucket=True), ()),
}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(SIGNAL_LOSSES))
def test_signal_terms_equal_token_terms_fed_the_same_teacher_distribution(name, temperature):
    make, extra_keys = SIGNAL_LOSSES[name]
    loss = make()
    s, t, targets = _inputs(temperature)
    g = torch.Generator().manual_seed(5)
    extras = {"behaviour_logprobs": -torch.rand(len(targets), generator=g) * 4,
              "opd_weight": torch.rand(len(targets), generator=g), "grpo_term": torch.randn(len(targets), generator=g),
              "old_logprobs": -torch.rand(len(targets), generator=g) * 4}
    extras = {k: extras[k] for k in extra_keys}
    reported = _reported(t, targets, temperature, getattr(loss, "k", 1))
    if loss.teacher_signal.value == "sampled_token":
        reported = {"teacher_sampled_logprobs": reported["teacher_sampled_logprobs"]}

    s_full, s_sig = s.clone().requires_grad_(), s.clone().requires_grad_()
    full = loss.token_terms(s_full, t, targets, temperature, **extras)
    sig = loss.signal_terms(s_sig, targets, temperature, **reported, **extras)
    weights = torch.linspace(0.5, 1.5, len(targets))
    (full.loss * weights).sum().backward()
    (sig.loss * weights).sum().backward()

    assert (sig.loss.detach() - full.loss.detach()).abs().max().item() <= 1e-6  # nats per token
    torch.testing.assert_close(s_sig.grad, s_full.grad, rtol=0, atol=1e-6)
    assert torch.equal(sig.student_logprobs, full.student_logprobs) and torch.equal(sig.entropy, full.entropy)
    assert (sig.teacher_logprobs - full.teacher_logprobs).abs().max().item() <= 1e-6
    # the logged kl: the k1 estimate, not the exact value (which needs all V teacher log-probs)
    assert torch.equal(sig.kl, sig.student_logprobs - sig.teacher_logprobs)
    assert not sig.kl.requires_grad


def test_tail_bucket_from_the_top_k_alone_hand_values():
    """p_T = (0.7, 0.2, 0.1), top-1 = {0}: tail 0.3; p_S = (0.5, 0.3, 0.2): tail 0.5."""
    p_t, p_s = torch.tensor([[0.7, 0.2, 0.1]]), torch.tensor([[0.5, 0.3, 0.2]])
    ids, lt = torch.tensor([[0]]), p_t.log()[:, :1]
    want_tail = 0.7 * math.log(0.7 / 0.5) + 0.3 * math.log(0.3 / 0.5)
    want_plain = 0.7 * math.log(0.7 / 0.5)
    for tail, want in ((True, want_tail), (False, want_plain)):
        out = TeacherTopKForwardKL(k=1, tail_bucket=tail).signal_terms(
            p_s.log(), torch.tensor([1]), 1.0, teacher_sampled_logprobs=p_t.log()[:, 1], teacher_topk_ids=ids,
            teacher_topk_logprobs=lt)
        assert out.loss.item() == pytest.approx(want, abs=1e-6)
        assert out.kl.item() == pytest.approx(math.log(0.3 / 0.2), abs=1e-6)  # k1 at the sampled token 1
    renorm = TeacherTopKRenormalizedReverseKL(k=2).signal_terms(
        p_s.log(), torch.tensor([1]), 1.0, teacher_sampled_logprobs=p_t.log()[:, 1],
        teacher_topk_ids=torch.tensor([[0, 1]]), teacher_topk_logprobs=p_t.log()[:, :2])
    qs, qt = torch.tensor([0.5, 0.3]) / 0.8, torch.tensor([0.7, 0.2]) / 0.9
    assert renorm.loss.item() == pytest.approx(float((qs * (qs / qt).log()).sum()), abs=1e-6)


def test_a_tail_that_rounds_to_zero_adds_zero_and_no_nan_gradient():
    """The teacher's top-2 hold all its fp32 mass (log-sum-exp 0 or a hair above): the tail term is 0, not NaN."""
    lt = torch.tensor([[0.0, -200.0], [-1e-9, -30.0]])  # reported log-probs, sums >= 1 in fp32
    student = torch.randn(2, 5, requires_grad=True)
    out = TeacherTopKForwardKL(k=2, tail_bucket=True).signal_terms(
        student, torch.tensor([0, 0]), 1.0, teacher_sampled_logprobs=lt[:, 0], teacher_topk_ids=torch.tensor([[0, 1], [0, 1]]),
        teacher_topk_logprobs=lt)
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(student.grad).all()
    no_tail = TeacherTopKForwardKL(k=2).signal_terms(
        student.detach(), torch.tensor([0, 0]), 1.0, teacher_sampled_logprobs=lt[:, 0],
        teacher_topk_ids=torch.tensor([[0, 1], [0, 1]]), teacher_topk_logprobs=lt)
    torch.testing.assert_close(out.loss.detach(), no_tail.loss, rtol=0, atol=1e-6)


def test_forward_signals_chunked_equals_one_chunk_and_handles_no_positions():
    g = torch.Generator().manual_seed(3)
    n, d = 11, 8
    h, w = torch.randn(n, d, generator=g), torch.randn(V, d, generator=g)
    targets = torch.randint(0, V, (n,), generator=g)
    reported = _reported(torch.randn(n, V, generator=g), targets, 0.7, 7)
    outs = [TeacherTopKForwardKL(k=7, tail_bucket=True, chunk_size=c).forward_signals(
        h, targets, lambda x: x @ w.T, 0.7, **reported) for c in (3, 256)]
    for f in ("loss", "kl", "student_logprobs", "teacher_logprobs", "entropy"):
        torch.testing.assert_close(getattr(outs[0], f), getattr(outs[1], f), rtol=1e-6, atol=1e-6)  # head rounding
    empty = SampledTokenReverseKL().forward_signals(h[:0], targets[:0], lambda x: x @ w.T, 1.0,
                                                    teacher_sampled_logprobs=torch.zeros(0))
    assert empty.loss.shape == (0,) == empty.kl.shape


@pytest.mark.parametrize("make", [FullVocabReverseKL, ForwardKL, GeneralizedJSD, StudentTopKRenormalizedReverseKL])
def test_a_full_vocabulary_loss_has_no_signal_path(make):
    s, _, targets = _inputs(1.0)
    with pytest.raises(NotImplementedError, match=rf"{make.__name__} needs the teacher's full_vocab"):
        make().forward_signals(s[:, :8], targets, lambda x: x @ torch.ones(V, 8).T, 1.0,
                               teacher_sampled_logprobs=torch.zeros(len(targets)))


def test_a_narrower_reported_top_k_is_refused_naming_prompt_logprobs():
    s, t, targets = _inputs(1.0)
    with pytest.raises(ValueError, match=r"TeacherTopKForwardKL\(k=7\) needs the teacher's top-7 .* ids \(9, 5\).*"
                                         r"prompt_logprobs >= 7"):
        TeacherTopKForwardKL(k=7).signal_terms(s, targets, 1.0, **_reported(t, targets, 1.0, 5))
    with pytest.raises(ValueError, match=r"inputs with another N: \{'teacher_sampled_logprobs': \(8,\)\}"):
        SampledTokenReverseKL().forward_signals(s[:, :8], targets, lambda x: x @ torch.ones(V, 8).T, 1.0,
                                                teacher_sampled_logprobs=torch.zeros(8))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_logged_k1_estimate_is_unbiased_for_the_full_reverse_kl_on_sampled_tokens(temperature):
    """§6.5: over tokens a ~ p_S (at the scoring temperature) the mean logged kl is the exact reverse KL."""
    g = torch.Generator().manual_seed(7)
    s, t = torch.randn(1, V, generator=g), torch.randn(1, V, generator=g)
    lp_s, lp_t = torch.log_softmax(s / temperature, -1), torch.log_softmax(t / temperature, -1)
    exact = float((lp_s.exp() * (lp_s - lp_t)).sum())
    n = 40_000
    a = torch.multinomial(lp_s.exp()[0], n, replacement=True, generator=g)  # (n,) on-policy tokens
    out = SampledTokenReverseKL().signal_terms(s.expand(n, V), a, temperature, teacher_sampled_logprobs=lp_t[0, a])
    se = out.kl.double().std().item() / math.sqrt(n)
    assert abs(out.kl.double().mean().item() - exact) < 4 * se
