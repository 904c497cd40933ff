"""lightning_opd.models.precision: linear shapes, the matmul probe and the precision pick (issue 61)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from lightning_opd.models import precision
from lightning_opd.models.precision import (PrecisionChoice, config_linear_shapes, linear_shapes, matmul_flops,
                                            resolve_precision)
from tests.helpers import make_model


def test_linear_shapes_of_the_tiny_model_include_the_head(tokenizer):
    model = make_model(tokenizer, seed=0)
    cfg = model.config
    shapes = linear_shapes(model)
    assert shapes == [(32, 32), (32, 16), (32, 64), (64, 32), (32, cfg.vocab_size)]
    assert shapes == config_linear_shapes(cfg)
    assert (cfg.hidden_size, cfg.vocab_size) in shapes  # the LM head
    assert (cfg.hidden_size, cfg.intermediate_size) in shapes and (cfg.intermediate_size, cfg.hidden_size) in shapes


def test_config_shapes_of_smollm2_135m():
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, vocab_size=49152, num_attention_heads=9,
                      num_key_value_heads=3, num_hidden_layers=1)
    assert config_linear_shapes(cfg) == [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 8, bias=False))
    assert linear_shapes(model) == [(4, 8), (8, 4)]


def test_config_shapes_name_missing_fields():
    with pytest.raises(ValueError, match="intermediate_size"):
        config_linear_shapes(type("Cfg", (), {"hidden_size": 8, "vocab_size": 10})())


def test_matmul_flops_times_enough_calls(monkeypatch):
    calls = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda a, b: calls.append(a.shape) or real(a, b))
    out = matmul_flops([(64, 128), (128, 64), (64, 128)], torch.float32, tokens=32, min_seconds=0.02, warmup=2)
    assert list(out) == ["64x128", "128x64"]  # duplicates once, in order
    assert all(v > 1e6 for v in out.values())  # any CPU does > 1 MFLOP/s
    assert len(calls) >= 2 * (2 + 3)  # warm-ups plus at least 3 timed calls per shape
    assert calls[0] == (32, 64)


def test_matmul_flops_is_the_median_over_timed_calls(monkeypatch):
    ticks = iter([0.0, 1.0, 1.0, 1.5, 1.5, 3.5, 3.5, 4.0])  # timed calls of 1.0, 0.5, 2.0, 0.5 s
    monkeypatch.setattr(precision.time, "perf_counter", lambda: next(ticks))
    out = matmul_flops([(2, 3)], torch.float32, tokens=5, min_seconds=3.6, warmup=0)
    assert out == {"2x3": pytest.approx(2 * 5 * 2 * 3 / 0.75)}  # median of (1.0, 0.5, 2.0, 0.5)


def test_matmul_flops_rejects_bad_arguments():
    with pytest.raises(ValueError, match="tokens=0"):
        matmul_flops([(2, 2)], torch.float32, tokens=0)


@pytest.mark.parametrize("given,expected,dtype", [("32-true", "32-true", torch.float32), (32, "32-true", torch.float32),
                                                  ("bf16-mixed", "bf16-mixed", torch.bfloat16),
                                                  ("bf16-true", "bf16-true", torch.bfloat16)])
def test_explicit_values_pass_through_without_a_probe(monkeypatch, given, expected, dtype):
    monkeypatch.setattr(precision, "probe_dtypes", lambda *a, **k: pytest.fail("probed an explicit precision"))
    choice = resolve_precision(given, [(4, 4)])
    assert (choice.trainer_precision, choice.weights_dtype, choice.probe) == (expected, dtype, {})
    assert "explicitly" in choice.reason


def test_bad_value_names_itself_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'16-mixed'.*'auto', '32-true', 'bf16-mixed', 'bf16-true'"):
        resolve_precision("16-mixed", [(4, 4)])


def _fake_probe(speedup):
    def probe(shapes, device, min_seconds, tokens):
        keys = [f"{i}x{o}" for i, o in shapes]
        return {"cpu": "Test CPU", "device": str(device), "tokens": tokens, "speedup_geomean": speedup,
                "gflops": {"float32": {k: 100.0 for k in keys}, "bfloat16": {k: 100.0 * speedup for k in keys}}}
    return probe


@pytest.mark.parametrize("speedup,expected", [(8.5, "bf16-mixed"), (1.3, "bf16-mixed"), (1.29, "32-true"),
                                              (0.48, "32-true")])
def test_auto_on_cpu_picks_by_the_margin(monkeypatch, speedup, expected):
    monkeypatch.setattr(precision, "probe_dtypes", _fake_probe(speedup))
    choice = resolve_precision("auto", [(576, 1536)])
    assert choice.trainer_precision == expected
    assert choice.weights_dtype == (torch.bfloat16 if expected == "bf16-mixed" else torch.float32)
    assert f"{speedup:.2f}x" in choice.reason and "Test CPU" in choice.reason and "576x1536" in choice.reason
    assert choice.as_dict()["weights_dtype"] in ("bfloat16", "float32")


def test_auto_on_cuda_needs_no_probe(monkeypatch):
    monkeypatch.setattr(precision, "probe_dtypes", lambda *a, **k: pytest.fail("probed a GPU"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", [(4, 4)], device="cuda").trainer_precision == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    choice = resolve_precision("auto", [(4, 4)], device="cuda:0")
    assert (choice.trainer_precision, choice.weights_dtype) == ("32-true", torch.float32)
    assert "no probe" in choice.reason


def test_real_probe_at_model_shapes(tokenizer):
    model = make_model(tokenizer, seed=0)
    probe = precision.probe_dtypes(linear_shapes(model), min_seconds=0.01, tokens=16)
    assert set(probe["gflops"]) == {"float32", "bfloat16"}
    assert list(probe["gflops"]["float32"]) == [f"{i}x{o}" for i, o in linear_shapes(model)]
    assert probe["speedup_geomean"] > 0 and probe["cpu"]
    assert isinstance(resolve_precision("auto", model.config, min_seconds=0.01, tokens=16), PrecisionChoice)
