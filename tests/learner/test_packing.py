"""Sequence packing (issue 61, :mod:`lightning_opd.learner.packing`): a micro-batch's rows run as one sequence without
padding, and the student's log-probs, the loss, every gradient and the teacher's log-probs equal the padded passes'
(fp32), for a Llama and a Gemma2 with a 16-token sliding window (its mask is built from ``position_ids`` too), with
rows of different lengths, one of length 1, and micro-batches of one row. Models transformers cannot run packed
stay padded (auto) or are refused (true)."""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM, OPTConfig

from lightning_opd.learner import OPDModule
from lightning_opd.learner.packing import (PackingUnsupportedError, SequencePacking, check_packing, packed_positions,
                                           padding_stats)
from lightning_opd.losses import FullVocabReverseKL, SampledTokenReverseKL, TeacherTopKForwardKL
from tests.learner.test_module import make_batch, step_grads
from tests.models.test_logits import save_tiny

LOSSES = [pytest.param(FullVocabReverseKL, id="full_vocab"), pytest.param(SampledTokenReverseKL, id="sampled_token"),
          pytest.param(partial(TeacherTopKForwardKL, k=5, chunk_size=7), id="teacher_top_k")]


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def arch_dirs(request, model_dirs, tokenizer, tmp_path_factory):
    """Student and teacher directories of one architecture: the conftest Llamas, or Gemma2s (soft-capped logits,
    every other layer a 16-token sliding window)."""
    if request.param == "llama":
        return model_dirs
    root = tmp_path_factory.mktemp("gemma2")
    return {role: save_tiny(root / role, tokenizer, "gemma2", seed=seed, sliding_window=16,
                            final_logit_softcapping=2.0) for seed, role in enumerate(("student", "teacher"))}


def with_short_row(batch):
    """``make_batch``'s 4 episodes (109, 195, 163, 104 tokens) with a 1-token row inserted second (nothing supervised
    in it): lengths 109, 1, 195, 163, 104."""
    short = batch.select(slice(0, 1))
    per_token = {k: getattr(short, k).clone() for k in short._PER_TOKEN if getattr(short, k) is not None}
    per_token["attention_mask"][:, 1:] = 0
    per_token["input_ids"][:, 1:] = 0
    per_token["loss_mask"].zero_()
    per_token["turn_index"].fill_(-1)
    short = replace(short, **per_token)
    rows = [batch.select(slice(0, 1)), short] + [batch.select(slice(i, i + 1)) for i in (1, 2, 3)]
    return replace(batch, **{k: torch.cat([getattr(r, k) for r in rows]) for k in batch._TENSORS
                             if getattr(batch, k) is not None}, task_ids=())


def module_for(dirs, loss_cls, micro_batch_size: int, pack) -> OPDModule:
    m = OPDModule(student=dirs["student"], teacher=dirs["teacher"], loss=loss_cls(), micro_batch_size=micro_batch_size,
                  pack_sequences=pack)
    m.configure_model()
    return m


def trunk_lengths(model) -> tuple[list, torch.utils.hooks.RemovableHandle]:
    """Record the ``(rows, tokens)`` of every trunk pass of ``model``."""
    seen = []
    handle = model.base_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return seen, handle


def assert_grads_close(got: dict, want: dict) -> None:
    """Every parameter's gradient within 1e-5 of the reference, relative to its norm."""
    assert got.keys() == want.keys()
    for name, g in want.items():
        err = float((got[name] - g).norm() / g.norm().clamp_min(1e-30))
        assert err <= 1e-5, f"{name}: relative gradient difference {err:.2e}"


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_packed_passes_equal_padded_ones(arch_dirs, tokenizer, loss_cls):
    short = with_short_row(make_batch(tokenizer))
    assert short.lengths == [109, 1, 195, 163, 104]
    # one micro-batch; pairs (the 1-token row beside a 109-token one) and a single; one row each (a 1-token row alone
    # is left out: the unpacked learner cannot score a 1-column micro-batch either)
    for size, batch in ((5, short), (2, short), (1, make_batch(tokenizer))):
        keep = batch.loss_mask[:, 1:] > 0
        padded, packed = module_for(arch_dirs, loss_cls, size, False), module_for(arch_dirs, loss_cls, size, True)
        assert packed.packing.packs(packed.student)  # checked once (its probe passes are not recorded below)
        seen, handle = trunk_lengths(packed.student)
        lp_packed = packed.student_logprobs(batch)
        handle.remove()
        assert seen == [(1, sum(batch.lengths[i:i + size])) for i in range(0, batch.size, size)]  # no padded token
        torch.testing.assert_close(lp_packed[keep], padded.student_logprobs(batch)[keep], rtol=0, atol=1e-5)
        assert lp_packed[keep].abs().min() > 0  # real log-probs at the supervised positions
        torch.testing.assert_close(packed.teacher_logprobs(batch)[keep], padded.teacher_logprobs(batch)[keep],
                                   rtol=0, atol=1e-5)
        want_sums, want_grads = step_grads(padded, batch)
        got_sums, got_grads = step_grads(packed, batch)
        torch.testing.assert_close(got_sums["loss"], want_sums["loss"], rtol=1e-5, atol=0)
        assert_grads_close(got_grads, want_grads)
        assert len(want_grads) == len(list(packed.student.parameters()))
        assert packed.packing.packs(packed.student) and packed.packing.packs(packed.teacher_model)


def test_auto_packs_both_models_and_the_teacher_runs_packed(model_dirs, tokenizer):
    module = module_for(model_dirs, FullVocabReverseKL, 4, "auto")
    batch = make_batch(tokenizer)
    assert module.packing.packs(module.student) and module.packing.packs(module.teacher_model)
    seen_s, hs = trunk_lengths(module.student)
    seen_t, ht = trunk_lengths(module.teacher_model)
    module.token_losses(batch)
    hs.remove(), ht.remove()
    assert seen_s == seen_t == [(1, 109 + 195 + 163 + 104)]  # against 4 x 195 = 780 padded


def test_off_keeps_padded_passes(model_dirs, tokenizer):
    module = module_for(model_dirs, FullVocabReverseKL, 4, "false")
    seen, handle = trunk_lengths(module.student)
    module.student_logprobs(make_batch(tokenizer))
    handle.remove()
    assert seen == [(4, 195)]


def test_positions_restart_at_each_row():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    rows, cols, pos = packed_positions(mask)
    assert rows.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert cols.tolist() == pos.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="right-padded rows"):
        packed_positions(torch.tensor([[0, 1, 1], [1, 1, 1]]))


def test_padding_stats_of_the_hand_worked_batch(tokenizer):
    lengths = make_batch(tokenizer).lengths
    assert padding_stats([lengths]) == {"real": 571, "padded": 780, "packed": 571}
    assert padding_stats([lengths[:2], lengths[2:]]) == {"real": 571, "padded": 2 * 195 + 2 * 163, "packed": 571}


def tiny_opt(tokenizer):
    """OPT: its learned positions come from the attention mask, not ``position_ids``; packed rows would see each
    other's positions."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(OPTConfig(vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      word_embed_proj_dim=32))


def test_a_model_transformers_cannot_pack_stays_padded_with_the_reason(tokenizer, caplog):
    opt = tiny_opt(tokenizer)
    reason = check_packing(opt)
    assert reason is not None and "differ from each row alone" in reason
    packing = SequencePacking("auto")
    with caplog.at_level(logging.WARNING, logger="lightning_opd.learner.packing"):
        assert packing.packs(opt) is False
    assert "sequence packing off for OPTForCausalLM" in caplog.text and reason in caplog.text
    ids = torch.randint(1, len(tokenizer), (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    seen, handle = trunk_lengths(opt)
    packing.hidden_states(opt, ids, mask)
    handle.remove()
    assert seen == [(2, 6)]
    with pytest.raises(PackingUnsupportedError, match="pack_sequences=true but OPTForCausalLM cannot run packed"):
        SequencePacking(True).packs(opt)


def test_the_llama_and_the_gemma2_pass_the_check(arch_dirs):
    for role in ("student", "teacher"):
        model = AutoModelForCausalLM.from_pretrained(arch_dirs[role])
        assert check_packing(model) is None
        assert check_packing(model.to(torch.bfloat16)) is None


@pytest.mark.parametrize("value", ["yes", 1.0, None])
def test_a_bad_value_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"model.init_args.pack_sequences=.*use auto"):
        SequencePacking(value)
