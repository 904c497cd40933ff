"""The divergence family: hand-worked values, fp64 references (fp32 and bf16 teachers), F01c for every
loss, the explicit JSD endpoints, top-k -> full-vocabulary convergence (F14) and the chunked,
recomputing path against naive full materialisation (values and gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.losses import (ForwardKL, FullVocabReverseKL, GeneralizedJSD, SampledTokenReverseKL,
                                  StudentTopKRenormalizedReverseKL, TeacherTopKForwardKL,
                                  TeacherTopKRenormalizedReverseKL)

FAMILY = {
    "reverse": FullVocabReverseKL,
    "sampled": SampledTokenReverseKL,
    "forward": ForwardKL,
    "jsd0.3": lambda **kw: GeneralizedJSD(beta=0.3, **kw),
    "student_topk8": lambda **kw: StudentTopKRenormalizedReverseKL(k=8, **kw),
    "teacher_topk8_reverse": lambda **kw: TeacherTopKRenormalizedReverseKL(k=8, **kw),
    "teacher_topk8": lambda **kw: TeacherTopKForwardKL(k=8, **kw),
    "teacher_topk8_tail": lambda **kw: TeacherTopKForwardKL(k=8, tail_bucket=True, **kw),
}


def _lp(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(x.double() / temperature, -1)


def _kl(lp_a: torch.Tensor, lp_b: torch.Tensor) -> torch.Tensor:
    return (lp_a.exp() * (lp_a - lp_b)).sum(-1)


def reference(name: str, s: torch.Tensor, t: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp64 per-token values straight from docs/algorithms.md §0.1/§0.3."""
    ls, lt = _lp(s, temperature), _lp(t, temperature)
    if name == "reverse":
        return _kl(ls, lt)
    if name == "sampled":  # k1 value
        return (ls - lt).gather(-1, targets[..., None]).squeeze(-1)
    if name == "forward":
        return _kl(lt, ls)
    if name == "jsd0.3":
        b = 0.3
        lm = (b * lt.exp() + (1 - b) * ls.exp()).log()
        return b * _kl(lt, lm) + (1 - b) * _kl(ls, lm)
    if name in ("student_topk8", "teacher_topk8_reverse"):
        idx = (ls if name == "student_topk8" else lt).topk(8, -1).indices
        a, c = ls.gather(-1, idx), lt.gather(-1, idx)
        return _kl(a - a.logsumexp(-1, keepdim=True), c - c.logsumexp(-1, keepdim=True))
    idx = lt.topk(8, -1).indices
    pt, lsk, ltk = lt.exp().gather(-1, idx), ls.gather(-1, idx), lt.gather(-1, idx)
    out = (pt * (ltk - lsk)).sum(-1)
    if name == "teacher_topk8_tail":
        tail_t, tail_s = 1 - pt.sum(-1), 1 - lsk.exp().sum(-1)
        out = out + tail_t * (tail_t.log() - tail_s.log())
    return out


# --------------------------------------------------------------------------------- hand-worked values
def _logs(p):
    return torch.tensor(p).log()[None]


A0 = torch.zeros(1, dtype=torch.long)


def test_hand_values_two_tokens():
    """p_S = (1/2, 1/2), p_T = (1/4, 3/4):
    reverse KL = 1/2 ln(4/3) = 0.1438410; forward KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.1308120;
    JSD(0.5): M = (3/8, 5/8), 1/2 [1/4 ln(2/3) + 3/4 ln(6/5)] + 1/2 [1/2 ln(4/3) + 1/2 ln(4/5)] = 0.0338221."""
    s, t = _logs([0.5, 0.5]), _logs([0.25, 0.75])
    expect = {FullVocabReverseKL(): 0.5 * math.log(4 / 3), ForwardKL(): 0.25 * math.log(0.5) + 0.75 * math.log(1.5),
              GeneralizedJSD(0.5): 0.5 * (0.25 * math.log(2 / 3) + 0.75 * math.log(1.2))
              + 0.5 * (0.5 * math.log(4 / 3) + 0.5 * math.log(0.8))}
    for loss, value in expect.items():
        assert loss.token_terms(s, t, A0).loss.item() == pytest.approx(value, abs=1e-6), type(loss).__name__
    assert 0.5 * math.log(4 / 3) == pytest.approx(0.1438410, abs=1e-7)


def test_hand_values_top_k():
    """p_S = (.5, .3, .2), p_T = (.2, .3, .5).
    Student top-2 = {0, 1}: renormalised p_S = (.625, .375), p_T = (.4, .6):
    .625 ln(.625/.4) + .375 ln(.375/.6) = 0.1026781.
    Teacher top-1 = {2}: .5 ln(.5/.2) = 0.4581454; tail bucket: p_T(tail) = .5, p_S(tail) = .8:
    + .5 ln(.5/.8) = -0.2350018 -> 0.2231436 (<= full forward KL 0.2748872)."""
    s, t = _logs([0.5, 0.3, 0.2]), _logs([0.2, 0.3, 0.5])
    assert StudentTopKRenormalizedReverseKL(k=2).token_terms(s, t, A0).loss.item() == pytest.approx(0.1026781, abs=1e-6)
    assert TeacherTopKForwardKL(k=1).token_terms(s, t, A0).loss.item() == pytest.approx(0.4581454, abs=1e-6)
    tail = TeacherTopKForwardKL(k=1, tail_bucket=True).token_terms(s, t, A0).loss.item()
    assert tail == pytest.approx(0.2231436, abs=1e-6)
    assert tail <= ForwardKL().token_terms(s, t, A0).loss.item() == pytest.approx(0.2748872, abs=1e-6)


def test_hand_values_teacher_top_k_reverse_kl():
    """TurnOPD's loss (docs/algorithms.md §2.6): reverse KL on the TEACHER's top-k, both renormalised.
    p_S = (.5, .3, .2), p_T = (.2, .3, .5). Teacher top-2 = {2, 1} (the student's would be {0, 1}):
    renormalised p_S = (.2/.5, .3/.5) = (.4, .6) on (2, 1), p_T = (.5/.8, .3/.8) = (.625, .375):
    .4 ln(.4/.625) + .6 ln(.6/.375) = -0.1785148 + 0.2820018 = 0.1034873.
    Teacher top-1 = {2}: both renormalise to 1 there, loss 0 (the student's mass elsewhere is not seen)."""
    s, t = _logs([0.5, 0.3, 0.2]), _logs([0.2, 0.3, 0.5])
    two = TeacherTopKRenormalizedReverseKL(k=2).token_terms(s, t, A0)
    assert two.loss.item() == pytest.approx(0.4 * math.log(0.4 / 0.625) + 0.6 * math.log(0.6 / 0.375), abs=1e-6)
    assert two.loss.item() == pytest.approx(0.1034873, abs=1e-6)
    assert two.loss.item() != pytest.approx(StudentTopKRenormalizedReverseKL(k=2).token_terms(s, t, A0).loss.item())
    assert TeacherTopKRenormalizedReverseKL(k=1).token_terms(s, t, A0).loss.item() == pytest.approx(0.0, abs=1e-7)
    assert two.kl.item() == pytest.approx(FullVocabReverseKL().token_terms(s, t, A0).loss.item())  # logged KL: full


def test_teacher_top_k_reverse_kl_gradient_flows_through_the_student_only():
    """Student logits (0, 0, 0), teacher p_T = (.2, .3, .5), k = 2 (support {2, 1}): the gradient of the
    renormalised reverse KL w.r.t. the student's logits is p~_S (log p~_S/p~_T - KL) on the support and 0 off
    it: p~_S = (.5, .5), log ratios ln(.5/.375), ln(.5/.625), KL = .5 (0.2876821 - 0.2231436) = 0.0322693,
    so grad = .5 (0.2876821 - 0.0322693, -0.2231436 - 0.0322693) = (0.1277064, -0.1277064) at (1, 2), 0 at 0."""
    s = torch.zeros(1, 3, requires_grad=True)
    t = _logs([0.2, 0.3, 0.5])
    TeacherTopKRenormalizedReverseKL(k=2).token_terms(s, t, A0).loss.sum().backward()
    torch.testing.assert_close(s.grad, torch.tensor([[0.0, 0.1277064, -0.1277064]]), atol=1e-6, rtol=0)


def test_saturated_wrong_student_reverse_kl_gradient_vanishes_forward_kl_does_not():
    """The Search-QA stall (README "Search-QA"): the student is sure of the wrong token, the teacher of another.
    Logits s = (20, 0, 0), t = (0, 20, 0): p_S = (a, b, b), p_T = (b, a, b) with b = 1/(e^20 + 2) = 2.06e-9,
    a = 1 - 2b. Reverse KL = 20 a - 20 b = 20.0 nats (large), but its logit gradient
    p_S (log p_S/p_T - KL) = 20 b (3a, -1 - a + b, -a + b) ~ (1.2e-7, -8.2e-8, -4.1e-8): nothing to learn from.
    Forward KL's logit gradient is p_S - p_T = (a - b, b - a, 0) ~ (1, -1, 0)."""
    b = 1 / (math.exp(20) + 2)
    a = 1 - 2 * b
    t = torch.tensor([[0.0, 20.0, 0.0]])
    grads, values = {}, {}
    for loss in (FullVocabReverseKL(), ForwardKL()):
        s = torch.tensor([[20.0, 0.0, 0.0]], requires_grad=True)
        out = loss.token_terms(s, t, A0)
        out.loss.sum().backward()
        grads[type(loss).__name__], values[type(loss).__name__] = s.grad[0], out.loss.item()
    assert values["FullVocabReverseKL"] == pytest.approx(20 * (a - b), abs=1e-4)
    assert values["ForwardKL"] == pytest.approx(20 * (a - b), abs=1e-4)  # symmetric case: same value
    assert grads["FullVocabReverseKL"].abs().max().item() < 1e-5  # fp32 noise around the 1e-7 hand value
    torch.testing.assert_close(grads["ForwardKL"], torch.tensor([a - b, b - a, 0.0]), atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------------- fp64 references
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
@pytest.mark.parametrize("name", list(FAMILY))
@pytest.mark.parametrize("teacher_dtype", [torch.float32, torch.bfloat16])
def test_matches_fp64_reference(name, temperature, teacher_dtype):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 5, 64, generator=g) * 3, (torch.randn(3, 5, 64, generator=g) * 3).to(teacher_dtype)
    targets = torch.randint(0, 64, (3, 5), generator=g)
    out = FAMILY[name]().token_terms(s, t, targets, temperature)
    assert out.loss.dtype == torch.float32  # F05: upcast before temperature and softmax
    ref = reference(name, s, t.double(), targets, temperature)  # from the same (bf16-rounded) teacher values
    torch.testing.assert_close(out.loss.double(), ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.kl.double(), reference("reverse", s, t.double(), targets, temperature),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(FAMILY))
def test_f01c_teacher_equal_student_is_exactly_zero(name):
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 6, 40, generator=g) * 3
    out = FAMILY[name]().token_terms(s.clone().requires_grad_(), s.clone(), torch.randint(0, 40, (2, 6), generator=g))
    assert torch.equal(out.loss.detach().abs(), torch.zeros_like(out.loss)), name
    assert torch.equal(out.kl, torch.zeros_like(out.kl)), name


# ------------------------------------------------------------------------------------------ endpoints
def test_jsd_endpoints_are_forward_and_reverse_kl():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(4, 30, generator=g) * 2, torch.randn(4, 30, generator=g) * 2
    a = torch.zeros(4, dtype=torch.long)
    fwd, rev = ForwardKL().token_terms(s, t, a).loss, FullVocabReverseKL().token_terms(s, t, a).loss
    assert torch.equal(GeneralizedJSD(0.0).token_terms(s, t, a).loss, fwd)
    assert torch.equal(GeneralizedJSD(1.0).token_terms(s, t, a).loss, rev)
    # the endpoints are the limits of the scaled formula, not of the formula (which tends to 0)
    eps = 1e-4  # the error of the limit is O(eps * chi^2)
    torch.testing.assert_close(GeneralizedJSD(eps).token_terms(s, t, a).loss / eps, fwd, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(GeneralizedJSD(1 - eps).token_terms(s, t, a).loss / eps, rev, rtol=1e-2, atol=1e-3)
    half = GeneralizedJSD(0.5).token_terms(s, t, a).loss
    assert (half >= 0).all() and (half <= math.log(2)).all()


# -------------------------------------------------------------------------------------------- F14: k -> V
@pytest.mark.parametrize(("topk", "full"), [
    (lambda k: StudentTopKRenormalizedReverseKL(k=k), FullVocabReverseKL()),
    (lambda k: TeacherTopKRenormalizedReverseKL(k=k), FullVocabReverseKL()),
    (lambda k: TeacherTopKForwardKL(k=k), ForwardKL()),
    (lambda k: TeacherTopKForwardKL(k=k, tail_bucket=True), ForwardKL()),
])
def test_top_k_converges_to_full_vocabulary(topk, full):
    g = torch.Generator().manual_seed(4)
    v = 256
    s, t = torch.randn(64, v, generator=g) * 2.5, torch.randn(64, v, generator=g) * 2.5
    a = torch.zeros(64, dtype=torch.long)
    exact = full.token_terms(s, t, a).loss
    errors = [(topk(k).token_terms(s, t, a).loss - exact).abs().mean().item() for k in (4, 16, 64, 200, v)]
    assert errors[-1] < 1e-6  # k = V is the full-vocabulary loss
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors


def test_tail_bucket_forward_kl_grows_with_k_up_to_the_full_value():
    """Coarsening can only lose divergence (data processing): the tail-bucket loss is non-decreasing in k."""
    g = torch.Generator().manual_seed(5)
    s, t = torch.randn(32, 100, generator=g) * 2, torch.randn(32, 100, generator=g) * 2
    a = torch.zeros(32, dtype=torch.long)
    values = torch.stack([TeacherTopKForwardKL(k=k, tail_bucket=True).token_terms(s, t, a).loss
                          for k in (1, 5, 25, 99, 100)])
    assert (values[1:] - values[:-1] >= -1e-6).all()
    torch.testing.assert_close(values[-1], ForwardKL().token_terms(s, t, a).loss)


# ----------------------------------------------------------------------------- chunked vs naive gradients
@pytest.mark.parametrize("name", list(FAMILY))
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_chunked_from_hidden_states_matches_naive(name, chunk_size):
    """``forward`` (hidden states, heads, chunks recomputed in backward) equals the kernel on fully
    materialised logits: values, and gradients w.r.t. the student's hidden states and head weight."""
    torch.manual_seed(6)
    n, d, v = 23, 16, 50
    head_s, head_t = torch.nn.Linear(d, v, bias=False), torch.nn.Linear(d, v, bias=False)
    head_t.requires_grad_(False)
    h_s, h_t = torch.randn(n, d, requires_grad=True), torch.randn(n, d) * 2
    targets = torch.randint(0, v, (n,))
    w = torch.rand(n)

    loss = FAMILY[name](chunk_size=chunk_size)
    out = loss(h_s, h_t, targets, head_s, head_t, temperature=0.8)
    g_h, g_w = torch.autograd.grad((out.loss * w).sum(), (h_s, head_s.weight))

    naive = loss.token_terms(head_s(h_s), head_t(h_t), targets, 0.8)
    n_h, n_w = torch.autograd.grad((naive.loss * w).sum(), (h_s, head_s.weight))
    for field in ("loss", "kl", "student_logprobs", "teacher_logprobs", "entropy"):
        torch.testing.assert_close(getattr(out, field), getattr(naive, field), msg=field)
    torch.testing.assert_close(g_h, n_h, atol=1e-5, rtol=1e-4)  # fp32, different summation order
    torch.testing.assert_close(g_w, n_w, atol=1e-5, rtol=1e-4)
    assert g_w.abs().max() > 0


def test_no_supervised_positions_gives_empty_fields():
    head = torch.nn.Linear(4, 9, bias=False)
    out = FullVocabReverseKL()(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), head, head)
    assert out.loss.shape == (0,)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: GeneralizedJSD(beta=1.5), "beta=1.5"),
    (lambda: StudentTopKRenormalizedReverseKL(k=0), "k=0"),
    (lambda: TeacherTopKRenormalizedReverseKL(k=0), "k=0"),
    (lambda: TeacherTopKForwardKL(k=-2), "k=-2"),
    (lambda: FullVocabReverseKL(chunk_size=0), "chunk_size=0"),
])
def test_bad_arguments_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_mismatched_shapes_raise():
    head = torch.nn.Linear(4, 9, bias=False)
    with pytest.raises(ValueError, match="expected"):
        FullVocabReverseKL()(torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(3, dtype=torch.long), head, head)
