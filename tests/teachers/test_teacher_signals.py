"""Losses from a teacher without ``FULL_VOCAB`` (docs/algorithms.md §6.5) on tiny models: a second, real
:class:`Teacher` that reports only the sampled token's log-prob and the top-k (what a ``vllm serve`` endpoint's
``prompt_logprobs`` gives), computed by hand from the teacher model's own logits, gives the same per-token losses as
the in-process teacher's hidden states + head, and the same ``OPDModule`` micro-batch loss and gradients; the
full-vocabulary loss with it is refused naming the losses that work."""

from __future__ import annotations

from typing import Collection

import pytest
import torch

from lightning_opd.learner import OPDModule
from lightning_opd.losses import (FullVocabReverseKL, SampledTokenReverseKL, TeacherSignal, TeacherTopKForwardKL,
                                  TeacherTopKRenormalizedReverseKL)
from lightning_opd.models.logits import output_head, trunk_hidden_states
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.teachers import InProcessTeacher, Teacher, TeacherScores, check_teacher_fits, check_teacher_serves
from tests.helpers import make_model
from tests.learner.test_module import make_batch, make_module, step_grads

S, K, F = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K, TeacherSignal.FULL_VOCAB


class LogitsTeacher(Teacher):
    """Test-only teacher with what a remote endpoint reports (``SAMPLED_TOKEN``, ``TOP_K``), worked out by hand from a
    causal LM's full logits in this process: ``log_softmax(logits[:, :V] / T)`` gathered at the sampled tokens, and
    its top-k. Nothing of the in-process teacher's head path is used."""

    provides = frozenset({S, K})

    def __init__(self, model, vocab_size: int) -> None:
        self.model, self.vocab_size = model, vocab_size

    @torch.no_grad()
    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        self.check_request(signals, top_k)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (B, T, V')
        lp = torch.log_softmax(logits[:, :-1][rows, cols][:, :self.vocab_size].float() / temperature, -1)  # (N, V)
        out = TeacherScores()
        if S in signals:
            out.sampled_logprobs = lp.gather(-1, batch.input_ids[:, 1:][rows, cols][:, None])[:, 0]
        if K in signals:
            top = lp.topk(min(top_k, self.vocab_size), dim=-1)
            out.topk_ids, out.topk_logprobs = top.indices, top.values
        return out


@pytest.fixture(scope="module")
def teacher(model_dirs, tokenizer):
    t = InProcessTeacher(model_dirs["teacher"], vocab_size=len(tokenizer))
    t.load()
    return t


@pytest.fixture(scope="module")
def batches(tokenizer):
    """The scripted rollout batch at each sampling temperature."""
    return {temperature: make_batch(tokenizer, temperature) for temperature in (1.0, 0.7)}


@pytest.fixture(scope="module")
def module(model_dirs):
    """One ``OPDModule`` (tiny student and teacher), its loss and teacher swapped by the tests."""
    return make_module(model_dirs, loss_cls=FullVocabReverseKL, micro_batch_size=4)


LOSSES = {"sampled": lambda: SampledTokenReverseKL(chunk_size=5),
          "teacher_topk_rkl": lambda: TeacherTopKRenormalizedReverseKL(k=8, chunk_size=5),
          "teacher_topk_fkl_tail": lambda: TeacherTopKForwardKL(k=8, tail_bucket=True, chunk_size=5),
          "teacher_topk_fkl": lambda: TeacherTopKForwardKL(k=8, chunk_size=5)}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(LOSSES))
def test_reported_signals_give_the_full_vocabulary_path_loss(teacher, tokenizer, batches, name, temperature):
    """The same per-token losses (<= 1e-6 nats) and gradients from the teacher's sampled-token log-prob and top-8 as
    from its hidden states + head, when both come from the same teacher log-softmax."""
    loss, v, batch = LOSSES[name](), len(tokenizer), batches[temperature]
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)  # (N,)
    targets = batch.input_ids[:, 1:][rows, cols]
    student = make_model(tokenizer, seed=0)
    head = output_head(student, v)
    full_scores = teacher.score(batch, rows, cols, (F,), temperature)
    with torch.no_grad():  # by hand, from the in-process teacher's full log-softmax, head applied per loss chunk as
        # the old path applies it (so the teacher log-probs are the same floats; only the loss formulas differ)
        lp_t = torch.cat([torch.log_softmax(full_scores.head(h).float() / temperature, -1)
                          for h in full_scores.hidden.split(loss.chunk_size)])  # (N, V)
    top = lp_t.topk(8, dim=-1)
    reported = TeacherScores(sampled_logprobs=lp_t.gather(-1, targets[:, None])[:, 0], topk_ids=top.indices,
                             topk_logprobs=top.values)
    if loss.teacher_signal is S:
        reported = TeacherScores(sampled_logprobs=reported.sampled_logprobs)
    assert reported.signals == {loss.teacher_signal} | {S}

    def run(signal_path: bool):
        student.zero_grad(set_to_none=True)
        h_s = trunk_hidden_states(student, batch.input_ids, batch.attention_mask)[rows, cols]
        if signal_path:
            out = loss.forward_signals(h_s, targets, head, temperature, teacher_sampled_logprobs=reported.sampled_logprobs,
                                       teacher_topk_ids=reported.topk_ids, teacher_topk_logprobs=reported.topk_logprobs)
        else:
            out = loss(h_s, full_scores.hidden, targets, head, full_scores.head, temperature)
        out.loss.mean().backward()
        return out, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}

    (old, old_grads), (new, new_grads) = run(False), run(True)
    assert rows.numel() > 20
    assert (new.loss - old.loss).abs().max().item() <= 1e-6  # nats per token
    assert (new.teacher_logprobs - old.teacher_logprobs).abs().max().item() <= 1e-6
    assert torch.equal(new.student_logprobs, old.student_logprobs) and torch.equal(new.entropy, old.entropy)
    assert old_grads.keys() == new_grads.keys()
    for n in old_grads:
        torch.testing.assert_close(new_grads[n], old_grads[n], rtol=1e-5, atol=1e-7, msg=n)
    torch.testing.assert_close(new.kl, new.student_logprobs - new.teacher_logprobs, rtol=0, atol=0)  # k1, logged


@pytest.mark.parametrize("name", ["sampled", "teacher_topk_rkl", "teacher_topk_fkl_tail"])
def test_opd_module_trains_a_micro_batch_through_a_teacher_without_full_vocab(module, batches, name):
    """One ``training_step`` micro-batch pass (``backward_step``: token losses, aggregation, backward) with the
    in-process teacher, then with :class:`LogitsTeacher` on the same teacher weights (its own full forward): the same
    step loss (<= 1e-6 nats) and gradients; the logged kl is the k1 estimate."""
    batch, in_process = batches[0.7], module.teacher
    module.loss_fn = LOSSES[name]()
    assert module.kl_metric == "kl"
    sums_in, grads_in = step_grads(module, batch)

    remote_like = LogitsTeacher(in_process.model, module.vocab_size)
    check_teacher_serves(module.loss_fn, remote_like)
    module.teacher = remote_like
    try:
        assert module.kl_metric == "kl_sampled"
        out, mask, _ = module.token_losses(batch)
        sums_re, grads_re = step_grads(module, batch)
    finally:
        module.teacher = in_process

    assert abs(sums_re["loss"].item() - sums_in["loss"].item()) <= 1e-6  # nats (the step loss, §0.5)
    torch.testing.assert_close(sums_re["entropy"], sums_in["entropy"], rtol=0, atol=1e-5)
    for n in grads_in:
        torch.testing.assert_close(grads_re[n], grads_in[n], rtol=1e-5, atol=1e-7, msg=n)
    keep = mask > 0  # the logged kl is the k1 estimate over the supervised tokens
    k1 = (out.student_logprobs - out.teacher_logprobs)[keep].sum()
    torch.testing.assert_close(sums_re["kl"], k1, rtol=1e-6, atol=1e-5)


def test_full_vocabulary_loss_with_a_top_k_teacher_is_refused_naming_the_losses_that_work(teacher):
    top_k_teacher = LogitsTeacher(teacher.model, teacher.vocab_size)
    with pytest.raises(ValueError) as err:
        check_teacher_fits(FullVocabReverseKL(), top_k_teacher)
    msg = str(err.value)
    assert "model.init_args.loss=FullVocabReverseKL needs the teacher's full_vocab log-probs" in msg
    assert "teacher LogitsTeacher provides only ['sampled_token', 'top_k']" in msg
    assert ("use one of SampledTokenReverseKL, TeacherTopKForwardKL, TeacherTopKRenormalizedReverseKL, ClippedSurrogate,"
            " SignOnlyReverseKL with this teacher") in msg
    with pytest.raises(ValueError, match="FullVocabReverseKL needs the teacher's full_vocab"):
        check_teacher_serves(FullVocabReverseKL(), top_k_teacher)
    check_teacher_serves(TeacherTopKForwardKL(tail_bucket=True), top_k_teacher)  # fits: no error


def test_a_teacher_without_full_vocab_must_report_the_sampled_token():
    class TopKOnly(Teacher):
        provides = frozenset({K})

    with pytest.raises(ValueError, match=r"TopKOnly provides only \['top_k'\]: a teacher without full_vocab must also "
                                         r"provide sampled_token"):
        check_teacher_serves(TeacherTopKForwardKL(), TopKOnly())
