"""OPDModule: F01 (a, b, c), F04, F06, F07 (micro-batches and 2 gloo ranks) and the teacher's scoring
convention (F02, teacher side)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.losses import (ForwardKL, FullVocabReverseKL, GeneralizedJSD, SampledTokenReverseKL,
                                  StudentTopKRenormalizedReverseKL, TeacherTopKForwardKL, log_probs)
from lightning_opd.models.tokenizers import TokenizerMismatchError
from lightning_opd.learner import OPDModule
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator
from tests.helpers import KeywordEnvFactory, free_port, make_tokenizer, save_model_dir

LOSSES = [FullVocabReverseKL, SampledTokenReverseKL, ForwardKL, partial(GeneralizedJSD, beta=0.5, chunk_size=3),
          partial(StudentTopKRenormalizedReverseKL, k=5, chunk_size=7),
          partial(TeacherTopKForwardKL, k=5, tail_bucket=True, chunk_size=2)]
LOSSES = [pytest.param(cls, id=getattr(cls, "func", cls).__name__) for cls in LOSSES]

REPLIES = {"apple": ["apple", "apple"], "cherry": ["cherry is what I say", "cherry"],
           "door": ["grape", "door", "door"], "key": ["key"]}


def make_batch(tokenizer, temperature: float = 1.0):
    """Four scripted episodes of different lengths (the key episode is cut by the context limit)."""
    envs = KeywordEnvFactory(need=2)
    gen = ScriptedGenerator(tokenizer, lambda r: REPLIES[r.task_id][min(r.turn, len(REPLIES[r.task_id]) - 1)])
    loop = AgentLoop(envs, gen, tokenizer, max_turns=4)
    sampling = SamplingParams(temperature=temperature)
    trajs = loop.run([EpisodeSpec(t, seed=i) for i, t in enumerate(envs.train_tasks())], sampling)
    return collate_trajectories(trajs, sampling, pad_id=tokenizer.pad_token_id)


def make_module(model_dirs, loss_cls=FullVocabReverseKL, micro_batch_size=1, teacher=None, pack_sequences=False):
    m = OPDModule(student=model_dirs["student"], teacher=teacher or model_dirs["teacher"], loss=loss_cls(),
                  micro_batch_size=micro_batch_size, pack_sequences=pack_sequences)
    m.configure_model()
    return m


def with_turn_blend(module, batch):
    """Install TurnOPD's turn-blend weighting at alpha = 0.5 (step 2 of 4): per-token weights != 1."""
    from lightning_opd.losses.turn_blend import TurnBlendWeighting

    module.configure_turn_blend(TurnBlendWeighting(alpha=0.5))
    module.policy_version = 2
    return batch


def with_scheme(module, batch, scheme: str):
    """The batch with weighting ``scheme`` ("none", "freshness", "turn_blend") installed on the module."""
    return {"none": lambda m, b: b, "freshness": with_freshness, "turn_blend": with_turn_blend}[scheme](module, batch)


SCHEMES = ["none", "freshness", "turn_blend"]


def with_freshness(module, batch):
    """Install f-OPD's freshness weighting (M1 weights + M3 ratios) and make the batch stale enough for
    non-trivial weights: lags 0..3 and behaviour log-probs off the learner's by per-sample drifts."""
    from lightning_opd.losses.freshness import FreshnessConfig, FreshnessWeighting

    module.configure_freshness(FreshnessWeighting(FreshnessConfig(filtering=False, truncated_ratio=True), lag_bound=4,
                                                  measure=True))
    module.policy_version = 3
    lp = module.student_logprobs(batch)
    drift = torch.tensor([0.0, 0.02, 0.05, 0.1])[: batch.size, None]
    blp = batch.behaviour_logprobs.clone()
    blp[:, 1:] = torch.where(batch.loss_mask[:, 1:] > 0, lp - drift, blp[:, 1:])
    return replace(batch, behaviour_logprobs=blp, behaviour_version=torch.tensor([3, 2, 1, 0])[: batch.size])


def step_grads(module, batch, world_size=1, step_tokens=None, stats_out=None):
    """One update's sums and gradients; the step's ``TurnStats`` are appended to ``stats_out`` if given."""
    module.student.zero_grad(set_to_none=True)
    batch = module.plan_batch(batch)
    tokens = batch.loss_mask[:, 1:].sum() if step_tokens is None else step_tokens
    if step_tokens is None:
        tokens = module.reduce_sum(tokens)
    sums, stats = module.backward_step(batch, tokens, lambda loss: loss.backward(), world_size)
    if stats_out is not None:
        stats_out.append(stats)
    grads = {n: p.grad.clone() for n, p in module.student.named_parameters() if p.grad is not None}
    return sums, grads


def test_batch_has_variable_lengths(tokenizer):
    batch = make_batch(tokenizer)
    lengths = batch.attention_mask.sum(1).tolist()
    assert len(set(lengths)) == 4


# ------------------------------------------------------------------------------------------------ F01
def test_f01a_different_tokenizers_fail_at_setup_naming_both(tmp_path, model_dirs):
    other = make_tokenizer(vocab_size=320, seed=7, extra_words=("zebra", "quokka"))
    other_dir = save_model_dir(tmp_path / "other-teacher", other, seed=3)
    with pytest.raises(TokenizerMismatchError) as err:
        OPDModule(student=model_dirs["student"], teacher=str(other_dir))
    assert model_dirs["student"] in str(err.value) and str(other_dir) in str(err.value)


def test_f01_same_size_different_tokenizer_fails(tmp_path, model_dirs, tokenizer):
    other = make_tokenizer(vocab_size=len(tokenizer), seed=11, extra_words=("zebra", "quokka", "walrus"))
    assert len(other) == len(tokenizer) and other.get_vocab() != tokenizer.get_vocab()
    other_dir = save_model_dir(tmp_path / "same-size", other, seed=3)
    with pytest.raises(TokenizerMismatchError):
        OPDModule(student=model_dirs["student"], teacher=str(other_dir))


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_f01b_padded_teacher_embeddings_train_on_real_vocab(tmp_path, model_dirs, tokenizer, loss_cls):
    """Same tokenizer, teacher embedding padded to 320 rows with the student's weights: compared over the real
    vocabulary only, so the KL is exactly 0 and the step is finite."""
    student = make_module(model_dirs, loss_cls).student
    padded = save_model_dir(tmp_path / "padded", tokenizer, seed=0, vocab_size=len(tokenizer) + 20)
    from transformers import AutoModelForCausalLM

    big = AutoModelForCausalLM.from_pretrained(str(padded))
    with torch.no_grad():
        sd = {k: v for k, v in student.state_dict().items()}
        for key, param in (("model.embed_tokens.weight", big.model.embed_tokens.weight),
                           ("lm_head.weight", big.lm_head.weight)):
            param[: len(tokenizer)] = sd[key]
            param[len(tokenizer):] = 5.0  # junk rows that must never be scored
        big.load_state_dict({k: v for k, v in sd.items() if "embed_tokens" not in k and "lm_head" not in k},
                            strict=False)
    big.save_pretrained(str(padded))
    module = make_module(model_dirs, loss_cls, teacher=str(padded))
    assert module.vocab_size == len(tokenizer)
    out, mask, _ = module.token_losses(make_batch(tokenizer))
    assert out.kl[mask > 0].abs().max().item() < 1e-5


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("loss_cls", LOSSES)
def test_f01c_teacher_equal_student_kl_zero_on_every_token(model_dirs, tokenizer, loss_cls, scheme):
    module = make_module({"student": model_dirs["student"], "teacher": model_dirs["student"]}, loss_cls)
    batch = make_batch(tokenizer)
    batch = with_scheme(module, batch, scheme)
    out, mask, _ = module.token_losses(batch)
    assert torch.equal(out.kl[mask > 0], torch.zeros_like(out.kl[mask > 0]))
    sums, grads = step_grads(module, batch)
    # the analytic gradient at p_S = p_T is 0; in float32 it is 0 up to rounding of sum_v p_v (d_j - p_j)
    assert sums["loss"].abs().item() == 0.0 and all(g.abs().max() < 1e-6 for g in grads.values())


# ------------------------------------------------------------------------------------------------ F02
@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_teacher_scored_at_the_sampling_temperature(model_dirs, tokenizer, temperature):
    module = make_module(model_dirs)
    batch = make_batch(tokenizer, temperature)
    out, mask, _ = module.token_losses(batch)
    with torch.no_grad():
        logits = module.teacher_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    expect = log_probs(logits, temperature).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    keep = mask > 0
    torch.testing.assert_close(out.teacher_logprobs[keep], expect[keep])
    # logits are computed only where a supervised token is predicted: elsewhere 0
    assert torch.equal(out.teacher_logprobs[~keep], torch.zeros_like(out.teacher_logprobs[~keep]))


@contextlib.contextmanager
def teacher_noise_off_the_loss(teacher, batch):
    """F04 probe: while active, the teacher's final hidden state gets N(0, 1e3^2) noise at every position
    whose next token is not supervised (observations, padding, cut-reply closers), row by row for
    whatever micro-batch of ``batch`` is running, in every teacher pass, padded ``(B, T)`` or packed ``(1, N)``
    (rows end to end, ``position_ids`` restarting at 0 at each row: learner/packing.py)."""
    seen = {}

    def capture_ids(_module, args, kwargs):
        seen["ids"], seen["positions"] = kwargs["input_ids"], kwargs.get("position_ids")

    def segments(i, width):  # (start, length) of the rows laid in row i of the pass
        pos = seen["positions"]
        if pos is None:
            return [(0, width)]
        starts = (pos[i] == 0).nonzero().flatten().tolist() + [width]
        return [(a, b - a) for a, b in zip(starts[:-1], starts[1:])]

    def perturb_hidden(_module, _inputs, hidden):
        ids = seen["ids"]
        next_is_obs = torch.ones(ids.shape, dtype=torch.bool)
        for i in range(ids.shape[0]):
            for start, n in segments(i, ids.shape[1]):
                j = next(j for j in range(batch.size) if torch.equal(batch.input_ids[j, :n], ids[i, start:start + n]))
                next_is_obs[i, start:start + n - 1] = batch.loss_mask[j, 1:n] == 0
        return torch.where(next_is_obs[..., None], hidden + torch.randn(hidden.shape) * 1e3, hidden)

    handles = [teacher.base_model.register_forward_pre_hook(capture_ids, with_kwargs=True),
               teacher.model.norm.register_forward_hook(perturb_hidden)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------------ F04
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("micro_batch_size,pack", [(1, False), (4, False), (4, True)])
def test_f04_observation_tokens_never_reach_loss_or_grads(model_dirs, tokenizer, loss_cls, micro_batch_size, pack,
                                                          scheme):
    module = make_module(model_dirs, loss_cls, micro_batch_size, pack_sequences=pack)
    batch = with_scheme(module, make_batch(tokenizer), scheme)
    sums, grads = step_grads(module, batch)

    with teacher_noise_off_the_loss(module.teacher_model, batch):
        sums2, grads2 = step_grads(module, batch)
    assert torch.equal(sums["loss"], sums2["loss"])
    for name in grads:
        assert torch.equal(grads[name], grads2[name]), name


# ------------------------------------------------------------------------------------------------ F06
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("loss_cls", LOSSES)
def test_f06_all_masked_micro_batch_is_finite_and_adds_nothing(model_dirs, tokenizer, loss_cls, scheme):
    module = make_module(model_dirs, loss_cls, micro_batch_size=1)
    assert_masked_row_adds_nothing(lambda b: step_grads(module, b), with_scheme(module, make_batch(tokenizer), scheme))


def assert_masked_row_adds_nothing(grads_of, batch):
    """F06 with ``grads_of(batch) -> (sums, grads)``: row 1 of the 4-row ``batch`` fully masked gives a
    finite step equal to dropping the row, and alone it gives loss 0 and all-zero gradients."""
    masked = replace(batch, loss_mask=batch.loss_mask.clone())
    masked.loss_mask[1] = 0
    sums, grads = grads_of(masked)
    assert torch.isfinite(sums["loss"]) and all(torch.isfinite(g).all() for g in grads.values())
    sums_drop, grads_drop = grads_of(masked.select(torch.tensor([0, 2, 3])))  # same as dropping the row
    torch.testing.assert_close(sums["loss"], sums_drop["loss"])
    for name in grads:
        torch.testing.assert_close(grads[name], grads_drop[name])
    sums_only, grads_only = grads_of(masked.select(torch.tensor([1])))
    assert sums_only["loss"].item() == 0.0 and all(g.abs().max() == 0 for g in grads_only.values())


# ------------------------------------------------------------------------------------------------ F07
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("loss_cls", LOSSES)
def test_f07_micro_batch_layout_does_not_change_the_gradient(model_dirs, tokenizer, loss_cls, scheme):
    batch = make_batch(tokenizer)
    results = {}
    for mbs in (4, 2, 1):
        module = make_module(model_dirs, loss_cls, mbs)
        b = with_scheme(module, batch, scheme)
        results[mbs] = step_grads(module, b)
    for mbs in (2, 1):
        torch.testing.assert_close(results[mbs][0]["loss"], results[4][0]["loss"])
        for name, g in results[4][1].items():
            torch.testing.assert_close(results[mbs][1][name], g, atol=1e-6, rtol=1e-5)


def _rank_worker(rank, world, port, model_dirs, loss_name, scheme, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    tokenizer = make_tokenizer()
    batch = make_batch(tokenizer)
    module = make_module(model_dirs, {"full": FullVocabReverseKL, "sampled": SampledTokenReverseKL}[loss_name], 1)
    batch = with_scheme(module, batch, scheme)
    local = batch.select(slice(rank * 2, rank * 2 + 2))  # rank 0: rows 0-1, rank 1: rows 2-3
    sums, grads = step_grads(module, local, world_size=world)  # token count and f̄ all-reduced inside
    for g in grads.values():  # what DDP / FSDP do: average gradients over ranks
        dist.all_reduce(g)
        g /= world
    loss = sums["loss"].clone()
    dist.all_reduce(loss)
    if rank == 0:
        torch.save((loss, grads), out_path)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("loss_name", "scheme"), [("full", "none"), ("sampled", "none"), ("full", "freshness"),
                                                   ("full", "turn_blend")])
def test_f07_two_ranks_equal_single_process(model_dirs, tokenizer, loss_name, scheme, tmp_path):
    ctx = mp.get_context("spawn")
    port, out_path = free_port(), str(tmp_path / "rank0.pt")
    procs = [ctx.Process(target=_rank_worker, args=(r, 2, port, model_dirs, loss_name, scheme, out_path))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=150)
        assert p.exitcode == 0
    loss2, grads2 = torch.load(out_path, weights_only=True)
    loss_cls = {"full": FullVocabReverseKL, "sampled": SampledTokenReverseKL}[loss_name]
    module = make_module(model_dirs, loss_cls, 4)
    batch = with_scheme(module, make_batch(tokenizer), scheme)
    sums1, grads1 = step_grads(module, batch)
    torch.testing.assert_close(loss2, sums1["loss"])
    for name, g in grads1.items():
        torch.testing.assert_close(grads2[name], g, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(dtype="bf17"), r"model.init_args.dtype='bf17' is not a dtype: .*use one of \['bf16', 'bfloat16'"),
    (dict(teacher_dtype="fp8"), r"model.init_args.teacher_dtype='fp8' is not a dtype"),
    (dict(optimizer=lambda p: torch.optim.AdamW(p, lr=0.0)), r"model.init_args.optimizer.init_args.lr=0.0 must be > 0"),
    (dict(optimizer=lambda p: torch.optim.SGD(p, lr=-1e-3)), r"model.init_args.optimizer: Invalid learning rate"),
])
def test_bad_module_arguments_fail_at_construction(model_dirs, monkeypatch, kwargs, message):
    """Refused in __init__, before any weights load (load_causal_lm is never reached)."""
    import lightning_opd.learner.policy as policy_mod
    import lightning_opd.teachers.in_process as teacher_mod

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the argument check")

    monkeypatch.setattr(policy_mod, "load_causal_lm", no_load)
    monkeypatch.setattr(teacher_mod, "load_causal_lm", no_load)
    with pytest.raises(ValueError, match=message):
        OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], **kwargs)


# ------------------------------------------------------------------------------- §0.5 per-sequence option
def test_sequence_aggregation_is_the_mean_of_row_means_and_layout_independent(model_dirs, tokenizer):
    """``aggregation="sequence"``: the step loss is the mean over rows of each row's token-mean loss, the
    gradient is the same for micro-batch sizes 4, 2 and 1 (F07), and differs from the token mean's."""
    batch = make_batch(tokenizer)
    results = {}
    for mbs in (4, 2, 1):
        module = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=FullVocabReverseKL(),
                           micro_batch_size=mbs, aggregation="sequence")
        module.configure_model()
        denom = module.loss_denominator(batch, module.reduce_sum(batch.loss_mask[:, 1:].sum()))
        assert int(denom) == batch.size  # every episode has supervised tokens
        results[mbs] = step_grads(module, batch, step_tokens=denom)
    out, mask, _ = module.token_losses(batch)
    keep = (mask > 0).float()
    rows = (out.loss.detach() * keep).sum(1) / keep.sum(1)
    torch.testing.assert_close(results[4][0]["loss"], rows.mean())
    token = step_grads(make_module(model_dirs, FullVocabReverseKL, 4), batch)
    assert not torch.allclose(token[0]["loss"], rows.mean())  # rows of different lengths: the two means differ
    for mbs in (2, 1):
        torch.testing.assert_close(results[mbs][0]["loss"], results[4][0]["loss"])
        for name, g in results[4][1].items():
            torch.testing.assert_close(results[mbs][1][name], g, atol=1e-6, rtol=1e-5)


def test_unknown_aggregation_is_refused_naming_the_key(model_dirs):
    with pytest.raises(ValueError, match=r"model.init_args.aggregation='sample'"):
        OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], aggregation="sample")
