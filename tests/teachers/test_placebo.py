"""The placebo teacher (``ShuffledTeacher``, issue 63, docs/algorithms.md §8.1) on tiny models: its permutation stays
within each episode (row) and is a uniformly drawn permutation of that row's scored positions; every signal is the
real teacher's distribution at the permuted position, taken at the token sampled at the unpermuted one, worked out by
hand from the teacher model's own logits; the full-vocabulary and the sampled-token paths see one placebo; seeded and
resumed exactly (``state_dict`` round trip through ``torch.save``); and it trains in ``OPDModule``."""

from __future__ import annotations

import io
import itertools

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner.positions import supervised_positions
from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL, TeacherSignal
from lightning_opd.models.tokenizers import TokenizerMismatchError
from lightning_opd.teachers import InProcessTeacher, ShuffledTeacher
from lightning_opd.teachers.placebo import within_row_permutation
from tests.helpers import KeywordEnvFactory, make_tokenizer
from tests.learner.test_module import make_batch, make_module, step_grads

S, K, F = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K, TeacherSignal.FULL_VOCAB


def shuffled(model_dirs, tokenizer, seed: int = 0) -> ShuffledTeacher:
    t = ShuffledTeacher(model_dirs["teacher"], seed=seed)
    t.bind(tokenizer, len(tokenizer))
    t.load()
    return t


@pytest.fixture(scope="module")
def real(model_dirs, tokenizer):
    t = InProcessTeacher(model_dirs["teacher"], vocab_size=len(tokenizer))
    t.load()
    return t


@pytest.fixture(scope="module")
def batch(tokenizer):
    return make_batch(tokenizer, temperature=0.7)


def positions(batch):
    return (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)  # (N,) each, row-major


def by_hand_logprobs(teacher, batch, rows, cols, temperature, vocab_size):
    """``(N, V)`` the teacher model's own log-probs at ``(rows, cols)`` (its full forward, cut to ``V``)."""
    with torch.no_grad():
        logits = teacher.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return torch.log_softmax(logits[:, :-1][rows, cols][:, :vocab_size].float() / temperature, dim=-1)


def assert_within_rows(perm: torch.Tensor, rows: torch.Tensor) -> None:
    assert torch.equal(rows[perm], rows)
    for r in rows.unique():
        own = (rows == r).nonzero()[:, 0]
        assert sorted(perm[own].tolist()) == own.tolist(), f"row {int(r)}: not a permutation of its positions"


# ---------------------------------------------------------------------------------------------- the permutation
def test_the_permutation_maps_each_row_onto_its_own_positions():
    rows = torch.tensor([2, 0, 0, 1, 0, 1, 1, 3, 0, 2])  # any order; row 3 has one position
    g = torch.Generator().manual_seed(5)
    moved = 0
    for _ in range(20):
        perm = within_row_permutation(rows, g)
        assert perm.dtype == torch.long and perm.shape == rows.shape
        assert_within_rows(perm, rows)
        assert perm[7] == 7  # the row with one scored position is left as is
        moved += int((perm != torch.arange(10)).sum())
    assert moved > 0
    state = g.get_state()
    assert within_row_permutation(torch.zeros(0, dtype=torch.long), g).shape == (0,)
    assert torch.equal(g.get_state(), state)  # N = 0 draws nothing


def test_every_permutation_of_a_row_is_drawn_about_equally_often():
    """Uniform over the 3! = 6 permutations of a 3-position row: 6,000 draws give each 1,000 +- 150 (about 5 binomial
    standard deviations, sd = sqrt(6000 * 1/6 * 5/6) = 28.9), and 1 fixed point on average (1.00 +- 0.05)."""
    rows = torch.tensor([4, 4, 4])
    g = torch.Generator().manual_seed(0)
    draws = [tuple(within_row_permutation(rows, g).tolist()) for _ in range(6000)]
    counts = {p: draws.count(p) for p in itertools.permutations(range(3))}
    assert set(draws) == set(counts) and all(850 <= c <= 1150 for c in counts.values()), counts
    fixed = sum(sum(int(p[i] == i) for i in range(3)) for p in draws) / len(draws)
    assert abs(fixed - 1.0) < 0.05


# ----------------------------------------------------------------------------------------------- the scores
def test_scores_are_the_real_teachers_at_the_permuted_positions(model_dirs, tokenizer, real, batch):
    temperature, k, v = 0.7, 5, len(tokenizer)
    rows, cols = positions(batch)
    targets = batch.input_ids[:, 1:][rows, cols]
    lp = by_hand_logprobs(real, batch, rows, cols, temperature, v)  # (N, V)
    t = shuffled(model_dirs, tokenizer)
    out = t.score(batch, rows, cols, (S, K, F), temperature, top_k=k, chunk_size=3)
    perm = t.last_permutation
    assert_within_rows(perm, rows)
    assert (perm != torch.arange(len(perm))).sum() >= len(perm) // 2  # it moved most positions
    ref = real.score(batch, rows, cols, (S, K, F), temperature, top_k=k)
    assert torch.equal(out.hidden, ref.hidden[perm])  # FULL_VOCAB: the real teacher's hidden states, moved
    full = torch.log_softmax(out.head(out.hidden).float() / temperature, dim=-1)
    torch.testing.assert_close(full, lp[perm], rtol=0, atol=1e-5)
    # SAMPLED_TOKEN: log p_T(a_i | s_perm(i)), the token sampled AT i under the moved distribution ...
    torch.testing.assert_close(out.sampled_logprobs, lp[perm].gather(-1, targets[:, None])[:, 0], rtol=0, atol=1e-5)
    # ... not the already-gathered log p_T(a_perm(i) | s_perm(i))
    differ = targets != targets[perm]
    assert differ.any() and not torch.allclose(out.sampled_logprobs[differ], ref.sampled_logprobs[perm][differ])
    assert torch.equal(out.topk_ids, ref.topk_ids[perm])  # TOP_K: the moved distribution's own top-k
    torch.testing.assert_close(out.topk_logprobs, lp[perm].topk(k, dim=-1).values, rtol=0, atol=1e-5)


def test_a_row_with_one_scored_position_keeps_its_scores(model_dirs, tokenizer, real, batch):
    rows, cols = positions(batch)
    keep = (rows != 1) | (torch.arange(len(rows)) == (rows == 1).nonzero()[0, 0])  # row 1: its first position only
    rows, cols = rows[keep], cols[keep]
    t = shuffled(model_dirs, tokenizer)
    out = t.score(batch, rows, cols, (S,), 0.7)
    ref = real.score(batch, rows, cols, (S,), 0.7)
    (i,) = (rows == 1).nonzero()[:, 0].tolist()
    assert t.last_permutation[i] == i
    torch.testing.assert_close(out.sampled_logprobs[i], ref.sampled_logprobs[i], rtol=0, atol=1e-6)


def test_the_full_vocabulary_and_sampled_token_paths_see_one_placebo(model_dirs, tokenizer, batch):
    """Two teachers with one seed, one asked for FULL_VOCAB and one for SAMPLED_TOKEN, draw the same permutation; the
    head on the moved hidden states gathered at the sampled tokens is the sampled-token signal, and the sampled-token
    loss (value and gradient) is the same from either path."""
    temperature = 0.7
    rows, cols = positions(batch)
    targets = batch.input_ids[:, 1:][rows, cols]
    full_t, sampled_t = shuffled(model_dirs, tokenizer), shuffled(model_dirs, tokenizer)
    full = full_t.score(batch, rows, cols, (F,), temperature)
    sampled = sampled_t.score(batch, rows, cols, (S,), temperature)
    assert torch.equal(full_t.last_permutation, sampled_t.last_permutation)
    teacher_logits = full.head(full.hidden)  # (N, V)
    gathered = torch.log_softmax(teacher_logits.float() / temperature, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(sampled.sampled_logprobs, gathered, rtol=0, atol=1e-5)
    student = torch.randn(len(targets), len(tokenizer), generator=torch.Generator().manual_seed(0))
    loss = SampledTokenReverseKL()
    results = []
    for path in ("full", "sampled"):
        logits = student.clone().requires_grad_(True)
        out = (loss.token_terms(logits, teacher_logits, targets, temperature) if path == "full" else
               loss.signal_terms(logits, targets, temperature, teacher_sampled_logprobs=sampled.sampled_logprobs))
        out.loss.sum().backward()
        results.append((out.loss.detach(), logits.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------- seeded, resumed
def test_seeded_and_resumed_exactly(model_dirs, tokenizer, batch):
    rows, cols = positions(batch)

    def perms(t, n):
        out = []
        for _ in range(n):
            t.score(batch, rows, cols, (S,), 0.7)
            out.append(t.last_permutation.clone())
        return out

    first = perms(shuffled(model_dirs, tokenizer, seed=0), 3)
    assert all(torch.equal(a, b) for a, b in zip(first, perms(shuffled(model_dirs, tokenizer, seed=0), 3)))
    assert not torch.equal(first[0], perms(shuffled(model_dirs, tokenizer, seed=1), 1)[0])
    assert not torch.equal(first[0], first[1])  # the generator moves on at every call

    t = shuffled(model_dirs, tokenizer, seed=0)
    perms(t, 1)
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)  # as OPDModule.on_save_checkpoint keeps it
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert (state["seed"], state["calls"]) == (0, 1)
    resumed = shuffled(model_dirs, tokenizer, seed=0)
    resumed.load_state_dict(state)
    assert resumed.calls == 1
    assert all(torch.equal(a, b) for a, b in zip(first[1:], perms(resumed, 2)))
    with pytest.raises(ValueError, match=r"ran with seed=0, this one has seed=3: resume with "
                                         r"model.init_args.teacher.init_args.seed=0"):
        ShuffledTeacher(model_dirs["teacher"], seed=3).load_state_dict(state)


# ------------------------------------------------------------------------------------ construction, F01
def test_bind_checks_the_tokenizer_and_sets_the_vocabulary(model_dirs, tokenizer):
    t = ShuffledTeacher(model_dirs["teacher"])
    assert t.vocab_size is None and t.provides == frozenset(TeacherSignal)
    with pytest.raises(RuntimeError, match=r"shared vocabulary size is unknown; give vocab_size or call bind"):
        t.load()
    t.bind(tokenizer, len(tokenizer))
    assert t.vocab_size == max(tokenizer.get_vocab().values()) + 1 == len(tokenizer)
    with pytest.raises(TokenizerMismatchError, match="tokenizers differ"):
        ShuffledTeacher(model_dirs["teacher"]).bind(make_tokenizer(vocab_size=280), 280)
    with pytest.raises(ValueError, match=r"vocab_size=7, but the student's and the teacher's shared vocabulary has"):
        ShuffledTeacher(model_dirs["teacher"], vocab_size=7).bind(tokenizer, len(tokenizer))
    with pytest.raises(ValueError, match=r"ShuffledTeacher seed=-1 must be an integer >= 0"):
        ShuffledTeacher(model_dirs["teacher"], seed=-1)


# ------------------------------------------------------------------------------------------- in OPDModule
def test_one_opd_step_trains_towards_the_moved_distributions(model_dirs, tokenizer):
    """One ``OPDModule`` update with the placebo (one micro-batch, so one permutation): the step's logged KL is
    sum_i KL(p_S(.|s_i) || p_T(.|s_perm(i))), worked out from both models' full logits at the batch's temperature."""
    teacher = ShuffledTeacher(model_dirs["teacher"], seed=0)
    module = make_module(model_dirs, FullVocabReverseKL, micro_batch_size=4, teacher=teacher)
    assert module.teacher is teacher and module.teacher_model is teacher.model is not None  # an InProcessTeacher
    assert module.kl_metric == "kl" and module.teacher_path is None
    batch = make_batch(tokenizer)
    sums, grads = step_grads(module, batch)
    assert teacher.calls == 1 and grads
    rows, cols = supervised_positions(batch)
    v = module.vocab_size
    lp_t = by_hand_logprobs(teacher, batch, rows, cols, 1.0, v)[teacher.last_permutation]
    with torch.no_grad():
        logits = module.student(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp_s = torch.log_softmax(logits[:, :-1][rows, cols][:, :v].float(), dim=-1)
    kl = (lp_s.exp() * (lp_s - lp_t)).sum()
    torch.testing.assert_close(sums["kl"], kl, rtol=1e-5, atol=1e-5)
    real_kl = (lp_s.exp() * (lp_s - by_hand_logprobs(teacher, batch, rows, cols, 1.0, v))).sum()
    assert abs(float(kl - real_kl)) > 1e-3  # not the real teacher's objective


def test_a_fit_with_the_placebo_saves_and_restores_its_generator(model_dirs, tmp_path):
    from lightning_opd.learner import OPDModule

    teacher = ShuffledTeacher(model_dirs["teacher"], seed=2)
    model = OPDModule(student=model_dirs["student"], teacher=teacher)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    assert model.policy_version == 2 and teacher.calls >= 2
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert (ckpt["teacher_state"]["seed"], ckpt["teacher_state"]["calls"]) == (2, teacher.calls)
    fresh = OPDModule(student=model_dirs["student"], teacher=ShuffledTeacher(model_dirs["teacher"], seed=2))
    ckpt.pop("rng_states")  # restoring them would move this test process's random states
    fresh.on_load_checkpoint(ckpt)
    assert fresh.teacher.calls == teacher.calls
    assert torch.equal(fresh.teacher.generator.get_state(), teacher.generator.get_state())
