"""KV cache sizing for vLLM engines (rollout/vllm.py ``kv_cache_bytes_for``; evaluate's batch-sized default)."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from lightning_opd.evaluation.evaluate import EvalSettings
from lightning_opd.rollout.vllm import kv_cache_bytes_for


def test_bytes_per_token_of_smollm2_135m_by_hand(tmp_path):
    # SmolLM2-135M: 30 layers, 9 query heads of 64 over hidden 576, 3 KV heads. K and V, float32:
    # 2 * 30 * 3 * 64 * 4 = 46,080 bytes per token; 1 GiB = 23,301 tokens (vLLM's log: 23,296 in whole blocks)
    LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                intermediate_size=1536, vocab_size=49152).save_pretrained(tmp_path)
    assert kv_cache_bytes_for(tmp_path, 1) == 46_080
    assert (1 << 30) // kv_cache_bytes_for(tmp_path, 1) == 23_301
    assert kv_cache_bytes_for(tmp_path, 50 * 2048, "bfloat16") == 50 * 2048 * 23_040


def test_tiny_model_and_bad_token_count(model_dirs):
    # tests.helpers.make_model: 2 layers, hidden 32 over 4 heads (head_dim 8), 2 KV heads -> 2*2*2*8*4 = 256 B
    assert kv_cache_bytes_for(model_dirs["student"], 1000) == 256_000
    with pytest.raises(ValueError, match="tokens=0"):
        kv_cache_bytes_for(model_dirs["student"], 0)


def test_evaluate_sizes_the_cache_for_the_whole_batch(model_dirs):
    student = model_dirs["student"]
    # 50 x 2048 tokens x 256 B = 26.2 MB: below the 1 GiB floor
    assert EvalSettings(batch_size=50, max_context_tokens=2048).kv_cache_bytes(student) == 1 << 30
    # 5000 x 4096 x 256 B = 5,242,880,000 B: above it, so exactly the batch's need
    assert EvalSettings(batch_size=5000, max_context_tokens=4096).kv_cache_bytes(student) == 5_242_880_000
    assert EvalSettings(vllm_kv_cache_bytes=123).kv_cache_bytes(student) == 123  # an explicit size wins
    with pytest.raises(ValueError, match="--vllm-kv-cache-bytes 0"):
        EvalSettings(vllm_kv_cache_bytes=0)
