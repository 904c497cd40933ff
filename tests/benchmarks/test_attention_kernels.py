"""benchmarks/attention_kernels.py: the three kernels it times compute the same causal attention."""

import torch

from benchmarks.attention_kernels import KERNELS, eager, time_kernel


def test_kernels_agree_in_float64():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 9, 17, 64, dtype=torch.float64) for _ in range(3))
    ref = KERNELS["flash"](q, k, v)
    assert torch.allclose(KERNELS["math"](q, k, v), ref, atol=1e-10)
    # eager takes its softmax in float32 whatever the input dtype (transformers' eager attention does), so it agrees
    # to float32 precision only
    assert torch.allclose(KERNELS["eager"](q, k, v), ref, atol=1e-6)
    assert not torch.allclose(KERNELS["eager"](q, k, v), ref, atol=1e-12)


def test_eager_is_causal_by_hand():
    # T = 2, d = 1: row 0 sees only key 0 (output v0); row 1 softmaxes scores q1*k0 and q1*k1 over v0, v1.
    q = torch.tensor([[[[1.0], [2.0]]]], dtype=torch.float64)
    k = torch.tensor([[[[0.5], [1.0]]]], dtype=torch.float64)
    v = torch.tensor([[[[3.0], [5.0]]]], dtype=torch.float64)
    out = eager(q, k, v)
    w1 = torch.softmax(torch.tensor([2.0 * 0.5, 2.0 * 1.0], dtype=torch.float64), 0)
    assert out[0, 0, 0, 0].item() == 3.0
    assert abs(out[0, 0, 1, 0].item() - (w1[0] * 3.0 + w1[1] * 5.0).item()) < 1e-6  # float32 softmax


def test_time_kernel_reports_positive_medians():
    r = time_kernel(KERNELS["eager"], torch.float32, tokens=8, reps=2)
    assert set(r) == {"forward_ms", "backward_ms"} and r["forward_ms"] > 0 and r["backward_ms"] > 0
