"""F20: the module's head path (trunk hidden states -> output embeddings -> the family's logit
post-processing) gives the log-probs of the model's own forward for every accepted architecture, and
an architecture it cannot reproduce is refused at setup, naming the model key and the architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, BertConfig, BertLMHeadModel, LlamaForCausalLM

from lightning_opd.losses import log_probs
from lightning_opd.models import logits as logits_mod
from lightning_opd.models.logits import LogitTransform, UnsupportedArchitectureError, check_head_path, logit_transform
from tests.learner.test_module import make_batch, make_module

# model_type -> config keys that switch its post-processing on (and make it matter on a tiny model)
FAMILIES = {"llama": {}, "granite": {"logits_scaling": 8.0}, "gemma2": {"final_logit_softcapping": 2.0},
            "cohere": {"logit_scale": 4.0}}


def tiny_config(tokenizer, model_type: str, **extra):
    return AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                max_position_embeddings=4096, tie_word_embeddings=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id, **extra)


def save_tiny(path, tokenizer, model_type: str, seed: int = 0, **extra) -> str:
    """A random 2-layer, 32-wide model of ``model_type`` over ``tokenizer``, saved as a HF directory."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, model_type, **extra)).float()
    with torch.no_grad():  # logits with std ~1.7, as tests.helpers.make_model
        model.get_input_embeddings().weight.normal_(0, 0.5)
        model.get_output_embeddings().weight.normal_(0, 0.3)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def model_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """``(B, T-1)`` log-probs of the next tokens from ``model(...).logits`` (the reference)."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    return log_probs(logits, temperature).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_module_logprobs_equal_the_models_forward(family, tokenizer, tmp_path):
    extra = FAMILIES[family]
    dirs = {role: save_tiny(tmp_path / role, tokenizer, family, seed=seed, **extra)
            for seed, role in enumerate(("student", "teacher"))}
    module = make_module(dirs)
    batch = make_batch(tokenizer, temperature=0.7)
    keep = batch.loss_mask[:, 1:] > 0
    want_s = model_logprobs(module.student, batch, 0.7)[keep]
    want_t = model_logprobs(module.teacher_model, batch, 0.7)[keep]
    out, _, _ = module.token_losses(batch)
    for got, want in ((module.student_logprobs(batch)[keep], want_s), (out.student_logprobs[keep], want_s),
                      (module.teacher_logprobs(batch)[keep], want_t), (out.teacher_logprobs[keep], want_t)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if extra:  # the post-processing matters here: the bare head is far from the model's log-probs
        with torch.no_grad():
            h = module.hidden_states(module.student, batch)[:, :-1]
            bare = log_probs(module.student.get_output_embeddings()(h), 0.7)
        bare = bare.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)[keep]
        assert (bare - want_s).abs().max() > 0.05


def test_logit_transform_by_hand(tokenizer):
    x = torch.tensor([8.0, -16.0, 2.0])
    torch.testing.assert_close(LogitTransform(divisor=8.0)(x), torch.tensor([1.0, -2.0, 0.25]))
    torch.testing.assert_close(LogitTransform(multiplier=0.5)(x), torch.tensor([4.0, -8.0, 1.0]))
    # 2 tanh(x / 2): x = 2 -> 2 tanh(1) = 1.523188
    torch.testing.assert_close(LogitTransform(softcap=2.0)(x)[2], torch.tensor(1.523188), rtol=0, atol=1e-6)
    assert logit_transform(tiny_config(tokenizer, "llama")) == LogitTransform()
    assert logit_transform(tiny_config(tokenizer, "granite", logits_scaling=8.0)) == LogitTransform(divisor=8.0)
    # the same config key multiplies in HyperCLOVA X (families are told apart by model_type)
    assert logit_transform(tiny_config(tokenizer, "hyperclovax", logits_scaling=8.0)) == LogitTransform(multiplier=8.0)
    assert logit_transform(tiny_config(tokenizer, "cohere", logit_scale=4.0)) == LogitTransform(multiplier=4.0)
    assert logit_transform(tiny_config(tokenizer, "gemma2", final_logit_softcapping=2.0)) == LogitTransform(softcap=2.0)


@pytest.mark.timeout(120)
def test_unknown_post_processing_of_the_student_is_refused_at_setup(model_dirs, monkeypatch):
    forward = LlamaForCausalLM.forward

    def scaled_forward(self, *args, **kwargs):  # a family that post-processes its logits in a way we do not know
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    monkeypatch.setattr(LlamaForCausalLM, "forward", scaled_forward)
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"model\.init_args\.student: LlamaForCausalLM \(model_type 'llama'\).*differs.*_FAMILIES"):
        make_module(model_dirs)


@pytest.mark.timeout(120)
def test_a_family_missing_from_the_table_is_refused_for_the_teacher(model_dirs, tokenizer, tmp_path, monkeypatch):
    teacher = save_tiny(tmp_path / "granite", tokenizer, "granite", logits_scaling=8.0)
    monkeypatch.delitem(logits_mod._FAMILIES, "granite")
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"model\.init_args\.teacher: GraniteForCausalLM \(model_type 'granite'\).*differs"):
        make_module(model_dirs, teacher=teacher)


def test_a_trunk_that_is_not_the_heads_input_is_refused(tokenizer):
    # BERT's LM head is dense + norm + decoder: base_model -> output embeddings skips the first two
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, is_decoder=True)
    with pytest.raises(UnsupportedArchitectureError, match=r"model\.init_args\.teacher: BertLMHeadModel"):
        check_head_path(BertLMHeadModel(cfg), len(tokenizer), "model.init_args.teacher")


def test_the_probe_runs_without_dropout_and_keeps_the_mode(tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, "llama", attention_dropout=0.5)).train()
    assert check_head_path(model, len(tokenizer), "model.init_args.student") < 1e-6
    assert model.training
