"""The teacher seam (lightning_opd/teachers): each loss names the teacher signal it needs, a loss/teacher pair that
does not fit is refused naming both, and the in-process teacher's three signals equal a direct full-logits
computation on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.learner import OPDModule
from lightning_opd.losses import (ClippedSurrogate, ForwardKL, FullVocabReverseKL, GeneralizedJSD,
                                  SampledTokenReverseKL, StudentTopKRenormalizedReverseKL, TeacherSignal,
                                  TeacherTopKForwardKL, TeacherTopKRenormalizedReverseKL)
from lightning_opd.teachers import InProcessTeacher, Teacher, check_teacher_fits, check_teacher_serves, losses_for
from tests.helpers import save_model_dir
from tests.learner.test_module import make_batch

S, K, F = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K, TeacherSignal.FULL_VOCAB


class SampledTokenTeacher(Teacher):
    """A teacher that reports only the sampled token's log-prob."""

    provides = frozenset({S})


class TopKTeacher(Teacher):
    """What a ``vllm serve`` endpoint with ``prompt_logprobs=k`` gives: the sampled token and the top-k."""

    provides = frozenset({S, K})


@pytest.mark.parametrize(("loss", "signal"), [
    (SampledTokenReverseKL(), S), (ClippedSurrogate(), S), (TeacherTopKRenormalizedReverseKL(), K),
    (TeacherTopKForwardKL(tail_bucket=True), K), (StudentTopKRenormalizedReverseKL(), F), (FullVocabReverseKL(), F),
    (ForwardKL(), F), (GeneralizedJSD(), F)])
def test_each_loss_names_the_teacher_signal_it_needs(loss, signal):
    assert type(loss).teacher_signal is signal
    check_teacher_fits(loss, InProcessTeacher("unused", vocab_size=10))  # the in-process teacher serves every loss


def test_a_sampled_token_teacher_is_refused_for_the_full_vocabulary_loss_naming_both():
    with pytest.raises(ValueError) as err:
        check_teacher_fits(FullVocabReverseKL(), SampledTokenTeacher())
    msg = str(err.value)
    assert "model.init_args.loss=FullVocabReverseKL needs the teacher's full_vocab" in msg
    assert "teacher SampledTokenTeacher provides only ['sampled_token']" in msg
    assert "use one of SampledTokenReverseKL, ClippedSurrogate, SignOnlyReverseKL with this teacher" in msg


def test_a_top_k_teacher_fits_the_teacher_top_k_losses_only():
    assert set(losses_for(TopKTeacher.provides)) == {"SampledTokenReverseKL", "ClippedSurrogate", "SignOnlyReverseKL",
                                                     "TeacherTopKForwardKL", "TeacherTopKRenormalizedReverseKL"}
    check_teacher_fits(TeacherTopKForwardKL(), TopKTeacher())
    with pytest.raises(ValueError, match=r"StudentTopKRenormalizedReverseKL needs the teacher's full_vocab.*"
                                         r"TopKTeacher provides only \['sampled_token', 'top_k'\]"):
        check_teacher_fits(StudentTopKRenormalizedReverseKL(), TopKTeacher())
    check_teacher_serves(TeacherTopKForwardKL(), TopKTeacher())  # a fitting pair: the losses' signal path (§6.5)


def test_the_module_refuses_a_loss_its_teacher_cannot_serve_at_construction(model_dirs, monkeypatch):
    import lightning_opd.learner.opd as opd_mod

    monkeypatch.setattr(opd_mod, "InProcessTeacher", lambda *a, **k: SampledTokenTeacher())
    with pytest.raises(ValueError, match=r"loss=ForwardKL needs the teacher's full_vocab.*SampledTokenTeacher"):
        OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ForwardKL())


@pytest.fixture(scope="module")
def teacher(tmp_path_factory, tokenizer):
    """An in-process teacher whose embeddings are padded past the shared vocabulary (cut to ``[:V]``, F01b)."""
    path = save_model_dir(tmp_path_factory.mktemp("teacher") / "padded", tokenizer, seed=1,
                          vocab_size=len(tokenizer) + 8)
    t = InProcessTeacher(str(path), vocab_size=len(tokenizer))
    t.load()
    return t


@pytest.mark.parametrize("chunk_size", [3, 256])
def test_in_process_signals_equal_a_direct_full_logits_computation(teacher, tokenizer, chunk_size):
    temperature, k = 0.7, 5
    batch = make_batch(tokenizer, temperature)
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)  # (N,)
    targets = batch.input_ids[:, 1:][rows, cols]
    with torch.no_grad():  # by hand: the model's own forward, (B, T, V+8) -> (N, V) log-probs
        logits = teacher.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        lp = torch.log_softmax(logits[:, :-1][rows, cols][:, :len(tokenizer)].float() / temperature, dim=-1)
    want_topk = lp.topk(k, dim=-1)

    out = teacher.score(batch, rows, cols, (S, K, F), temperature, top_k=k, chunk_size=chunk_size)
    assert out.signals == {S, K, F}
    n = rows.shape[0]
    assert out.sampled_logprobs.shape == (n,) and out.topk_ids.shape == (n, k) == out.topk_logprobs.shape
    assert out.hidden.shape[0] == n and not out.hidden.requires_grad
    torch.testing.assert_close(out.sampled_logprobs, lp.gather(-1, targets[:, None])[:, 0], rtol=0, atol=1e-5)
    assert torch.equal(out.topk_ids, want_topk.indices)
    torch.testing.assert_close(out.topk_logprobs, want_topk.values, rtol=0, atol=1e-5)
    full = torch.log_softmax(out.head(out.hidden).float() / temperature, dim=-1)  # FULL_VOCAB: head on the hidden
    assert full.shape == lp.shape
    torch.testing.assert_close(full, lp, rtol=0, atol=1e-5)

    only = teacher.score(batch, rows, cols, (S,), temperature, chunk_size=chunk_size)  # asked for one: gets one
    assert only.signals == {S} and torch.equal(only.sampled_logprobs, out.sampled_logprobs)


def test_in_process_teacher_refuses_what_it_cannot_answer(teacher, tokenizer, tmp_path):
    batch = make_batch(tokenizer)
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    assert teacher.score(batch, rows, cols, (K,), top_k=10_000).topk_ids.shape == (rows.shape[0], len(tokenizer))
    with pytest.raises(ValueError, match=r"top_k=None must be >= 1"):
        teacher.score(batch, rows, cols, (K,))
    with pytest.raises(ValueError, match=r"asked for \['top_k'\] but provides only \['sampled_token'\]"):
        SampledTokenTeacher().check_request((K,), top_k=5)
    with pytest.raises(RuntimeError, match=r"InProcessTeacher\(never-loaded\) is not loaded"):
        InProcessTeacher("never-loaded", vocab_size=10).score(batch, rows, cols, (S,))
