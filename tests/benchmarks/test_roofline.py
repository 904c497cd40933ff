"""The roofline's FLOP and byte counts, worked by hand on the tests' tiny Llama (no timing asserted)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import roofline as rf
from lightning_opd.rollout.generator import GenerationOutput, GenerationRequest, Generator, SamplingParams
from tests.helpers import StaticPolicy, make_model

# d 32, 2 layers, 4 heads of 8, 2 kv heads, MLP 64, V 300, untied head:
# per layer q 32*32 + k 32*16 + v 32*16 + o 32*32 + gate/up/down 3*32*64 = 9216; trunk 2 * 9216 = 18432
TRUNK, HEAD = 18432, 300 * 32
# parameters: embedding 9600 + head 9600 + 2 * (9216 + two norms of 32) + final norm 32 = 37792, fp32
WEIGHT_BYTES = 37792 * 4
KV_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # keys and values x layers x kv heads x head dim x fp32 = 256
ATTN = 4 * 2 * 4 * 8  # FLOPs per (query, key) pair: 4 L H d_head = 256


@pytest.fixture(scope="module")
def shape(tokenizer):
    return rf.ModelShape.of(make_model(tokenizer, vocab_size=300))


def test_model_shape_by_hand(shape, tokenizer):
    assert (shape.trunk_params, shape.head_params, shape.weight_bytes) == (TRUNK, HEAD, WEIGHT_BYTES)
    assert (shape.layers, shape.heads, shape.head_dim, shape.kv_heads, shape.kv_dtype_bytes) == (2, 4, 8, 2, 4)
    assert shape.kv_bytes_per_token == KV_PER_TOKEN == 256
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    tied_shape = rf.ModelShape.of(tied)
    assert tied_shape.head_params == HEAD  # one V x d matmul per position, tied or not
    assert tied_shape.weight_bytes == WEIGHT_BYTES - HEAD * 4  # the shared matrix is read once


def test_forward_and_attention_flops_by_hand(shape):
    # 3 new tokens after 5 cached: (query, key) pairs 6 + 7 + 8 = 3 * 5 + 3 * 4 / 2 = 21
    assert shape.attention_flops(3, 5) == ATTN * 21 == 5376
    assert shape.forward_flops(3, 5, head=1) == 2 * TRUNK * 3 + 2 * HEAD * 1 + 5376 == 135168
    assert shape.forward_flops(3) == 2 * TRUNK * 3 + 2 * HEAD * 3 + ATTN * 6 == 169728


ROWS = [rf.Row(cached=0, computed=10, sampled=3), rf.Row(cached=4, computed=6, sampled=1)]


def test_generation_passes_prefill_then_decode_steps():
    """Row 0 prefills 10 tokens and samples 3 (2 fed back), row 1 prefills 6 after 4 cached and samples 1."""
    assert rf.generation_passes(ROWS) == [[(0, 10), (4, 6)], [(10, 1)], [(11, 1)]]
    assert rf.generation_passes([rf.Row(0, 5, 1)]) == [[(0, 5)]]


def test_pass_flops_and_bytes_by_hand(shape):
    prefill, step1, step2 = rf.generation_passes(ROWS)
    # row 0: 2*18432*10 + 2*9600 + 256*55 = 401920; row 1: 2*18432*6 + 2*9600 + 256*(6*4 + 21) = 251904
    assert rf.pass_flops(shape, prefill) == 401920 + 251904 == 653824
    assert rf.pass_bytes(shape, prefill) == WEIGHT_BYTES + 256 * (10 + 10) == 156288
    assert rf.pass_flops(shape, step1) == 2 * TRUNK + 2 * HEAD + 256 * 11 == 58880
    assert rf.pass_bytes(shape, step1) == WEIGHT_BYTES + 256 * 11 == 153984
    assert rf.pass_flops(shape, step2) == 59136 and rf.pass_bytes(shape, step2) == 154240


def test_rollout_roofline_by_hand(shape):
    """At 1 MFLOP/s and 1 MB/s the prefill is compute-bound (0.653824 s > 0.156288 s) and both decode
    steps memory-bound (0.153984 s and 0.15424 s)."""
    out = rf.rollout_roofline(shape, rf.Machine(matmul_flops=1e6, bandwidth=1e6), [ROWS])
    assert {k: out[k] for k in ("prefill_tokens", "cached_tokens", "sampled_tokens", "passes")} == \
        {"prefill_tokens": 16, "cached_tokens": 4, "sampled_tokens": 4, "passes": 3}
    assert out["flops"] == 653824 + 58880 + 59136 and out["bytes"] == 156288 + 153984 + 154240
    assert out["roofline_s"] == pytest.approx(0.653824 + 0.153984 + 0.15424, rel=1e-12)
    assert rf.fraction(out["roofline_s"], 2 * out["roofline_s"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="measured_s=0 must be > 0"):
        rf.fraction(1.0, 0)


def test_update_flops_by_hand(shape):
    """An episode of 10 tokens, 3 of them supervised: forward 2*18432*10 + 2*9600*3 + 256*55 = 440320;
    the student pays it 3 times (forward + backward), the teacher once."""
    out = rf.update_flops(shape, shape, [(10, 3)])
    assert out == {"student_flops": 3 * 440320, "teacher_flops": 440320, "flops": 4 * 440320}
    assert rf.update_flops(shape, shape, [(10, 3), (10, 3)])["flops"] == 8 * 440320


class _Cached(Generator):
    """Claims the first 2 prompt tokens of every request come from a cache; replies ``[7] * (k + 1)``."""

    @property
    def policy_version(self) -> int:
        return 0

    def _generate(self, requests, sampling):
        return [GenerationOutput(token_ids=[7] * (k + 1), logprobs=[0.0] * (k + 1), finished=False,
                                 prompt_tokens_computed=len(r.prompt_ids) - 2, prompt_tokens_cached=2)
                for k, r in enumerate(requests)]


def test_generation_log_records_every_call(tokenizer):
    gen = _Cached()
    gen.attach(StaticPolicy(None, tokenizer), {2})
    log = rf.GenerationLog(gen)
    gen.generate([GenerationRequest(key=0, prompt_ids=[1] * 5), GenerationRequest(key=1, prompt_ids=[1] * 9)],
                 SamplingParams())
    gen.generate([GenerationRequest(key=0, prompt_ids=[1] * 4)], SamplingParams())
    assert log.calls == [[rf.Row(2, 3, 1), rf.Row(2, 7, 2)], [rf.Row(2, 2, 1)]]
    assert log.seconds > 0
    log.reset()
    assert log.calls == [] and log.seconds == 0


def test_measure_machine_reports_every_shape_per_dtype():
    """A real probe (tiny shapes, 1 ms per shape): one peak per dtype asked, each over both shapes."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    out = rf.measure_machine(model, dtypes=(torch.float32, torch.bfloat16), tokens=4, nbytes=1 << 16, repeats=1,
                             min_seconds=0.001)
    assert set(out["matmul_by_dtype_shape"]) == {"float32", "bfloat16"}
    assert all(set(v) == {"8x16", "16x8"} for v in out["matmul_by_dtype_shape"].values())
    assert out["matmul_flops_by_dtype"] == {k: max(v.values()) for k, v in out["matmul_by_dtype_shape"].items()}
    assert out["matmul_flops"] == out["matmul_flops_by_dtype"]["float32"] > 0 and out["dtype"] == "float32"
    assert out["matmul_by_shape"] == out["matmul_by_dtype_shape"]["float32"]
    assert out["bandwidth"] == max(out["bandwidth_by_probe"].values()) > 0
    assert set(out["bandwidth_by_probe"]) == {"copy", "read"}


def test_measure_machine_probes_with_the_product_s_matmul_flops(monkeypatch):
    """The peaks come from :func:`lightning_opd.models.precision.matmul_flops` at the model's ``linear_shapes``, once
    per dtype, with the probe's settings passed through (stand-in: ``in * out`` FLOP/s in fp32, twice that in bf16):
    bf16 first gives its peak 2 * 16 * 24 = 768 as ``matmul_flops``."""
    calls = []

    def fake(shapes, dtype, tokens, min_seconds, warmup):
        calls.append((list(shapes), dtype, tokens, min_seconds, warmup))
        return {f"{i}x{o}": float(i * o * (2 if dtype == torch.bfloat16 else 1)) for i, o in shapes}

    monkeypatch.setattr(rf, "matmul_flops", fake)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 24), torch.nn.Linear(8, 16))
    out = rf.measure_machine(model, dtypes=(torch.bfloat16, torch.float32), tokens=7, nbytes=1 << 12, repeats=1,
                             min_seconds=0.5)
    assert calls == [([(8, 16), (16, 24)], torch.bfloat16, 7, 0.5, 3), ([(8, 16), (16, 24)], torch.float32, 7, 0.5, 3)]
    assert out["matmul_flops_by_dtype"] == {"bfloat16": 768.0, "float32": 384.0}
    assert (out["matmul_flops"], out["dtype"]) == (768.0, "bfloat16")
    assert out["matmul_by_shape"] == {"8x16": 256.0, "16x24": 768.0}
    with pytest.raises(ValueError, match="dtypes is empty"):
        rf.measure_machine(model, dtypes=())
