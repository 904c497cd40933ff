"""The GPU benchmark's FLOP accounting and loss, checked by hand on CPU with tiny shapes (no timing asserted)."""

import torch
import torch.nn.functional as F

from benchmarks import gpu_train_throughput as bench


def tiny_student():
    torch.manual_seed(0)
    return bench.build(bench.TINY["student"], torch.float32, "cpu")


def test_matmul_params_and_flops_by_hand():
    model = tiny_student()  # d 64, 2 layers, 4 heads of 16, 2 kv heads, MLP 128, V 512
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k, v, o, gate/up/down = 36864
    n = 2 * per_layer + 512 * 64  # + the LM head = 106496
    assert bench.matmul_params(model) == n == 106496
    attn = 2 * 4 * 16 * 64  # L * heads * head_dim * T at T = 64
    assert bench.flops_per_token(model, 64, train=True) == 6 * n + 12 * attn == 737280
    assert bench.flops_per_token(model, 64, train=False) == 2 * n + 4 * attn == 245760


def test_chunked_reverse_kl_matches_full_logits_value_and_gradient():
    torch.manual_seed(0)
    head_s, head_t = torch.nn.Linear(8, 50, bias=False), torch.nn.Linear(12, 50, bias=False)
    h_s = torch.randn(7, 8, requires_grad=True)
    h_t = torch.randn(7, 12)
    got = bench.reverse_kl_from_hidden(h_s, h_t, head_s, head_t, chunk=3)
    (g_got,) = torch.autograd.grad(got, h_s)
    lp_s, lp_t = F.log_softmax(head_s(h_s), -1), F.log_softmax(head_t(h_t), -1)
    want = (lp_s.exp() * (lp_s - lp_t)).sum()
    (g_want,) = torch.autograd.grad(want, h_s)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(g_got, g_want)
    assert got > 0


def test_tiny_run_reports_every_number(tmp_path):
    out = bench.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "r.json")])
    for key in ("train_tokens_per_s", "mfu", "peak_matmul_tflops", "generate_tokens_per_s", "achieved_tflops"):
        assert out[key] > 0, key
    assert out["generated_tokens"] == 2 * 8  # exactly --new-tokens per prompt (EOS disabled)
    assert out["model_flops_per_step"] == 2 * 64 * (bench.flops_per_token(tiny_student(), 64, True) +
                                                    bench.flops_per_token(
                                                        bench.build(bench.TINY["teacher"], torch.float32, "cpu"),
                                                        64, False))
    assert (tmp_path / "r.json").exists()
