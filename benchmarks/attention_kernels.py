"""Is there a faster attention kernel for the student's bf16 backward on CPU? (issue 61: the bf16 step is 1.74x the
fp32 step, not 2x, and ``benchmarks.update_profile`` puts PyTorch's CPU flash-attention backward at 4.22 s of the
23.5 s bf16 step against 4.44 s at fp32: bf16 buys that kernel nothing.)

Times causal self-attention forward and backward at the student's shapes (SmolLM2-135M: 9 heads x 64 dims, one
episode of ``--tokens`` tokens per pass, batch 1 as the learner packs them) for the three implementations a user can
pick without writing a kernel:

* ``flash``: ``F.scaled_dot_product_attention(is_causal=True)``, which on CPU dispatches to
  ``_scaled_dot_product_flash_attention_for_cpu`` (transformers' ``attn_implementation="sdpa"``, our default);
* ``math``: the same call under ``sdpa_kernel(SDPBackend.MATH)`` (PyTorch's reference path: matmuls + softmax);
* ``eager``: transformers' ``attn_implementation="eager"`` computation: ``softmax(QK^T / sqrt(d) + causal mask)``
  in float32, cast back, times ``V`` (the matmuls run at the input dtype, i.e. on AMX in bf16).

Each is timed ``--reps`` times after 2 warm-ups at float32 and bfloat16, medians of forward and backward (ms), all
in one process, alternating nothing else. Then each kernel's bf16 output is compared with a float64 reference
(max and mean absolute error) so that a faster kernel is not a less exact one.

Run alone: ``.venv/bin/python -m benchmarks.attention_kernels`` (torch only, ~1 minute on 2 cores).
Results: ``benchmarks/results/attention_kernels.json`` (one entry per CPU model; a rerun replaces it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import ResultFile
from lightning_opd.cpu_isa import cpu_name

HEADS, HEAD_DIM = 9, 64  # SmolLM2-135M


def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA with PyTorch's backend choice (CPU: flash). ``q, k, v``: ``(1, H, T, d)``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA forced onto PyTorch's math backend. ``q, k, v``: ``(1, H, T, d)``."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """transformers' eager attention: float32 softmax of the masked scores, matmuls at the input dtype.
    ``q, k, v``: ``(1, H, T, d)``; returns ``(1, H, T, d)``."""
    t = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    mask = torch.full((t, t), float("-inf"), dtype=scores.dtype).triu(1)
    return torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype) @ v


KERNELS = {"flash": flash, "math": math, "eager": eager}


def time_kernel(fn, dtype: torch.dtype, tokens: int, reps: int) -> dict:
    """Median forward and backward milliseconds of ``fn`` on random ``(1, 9, tokens, 64)`` inputs."""
    q, k, v = (torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=dtype)
    for _ in range(2):
        fn(q, k, v).backward(grad)
    fwd, bwd = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(q, k, v)
        t1 = time.perf_counter()
        out.backward(grad)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return {"forward_ms": 1e3 * statistics.median(fwd), "backward_ms": 1e3 * statistics.median(bwd)}


def errors(tokens: int) -> dict:
    """Each kernel's bf16 output against float64 flash attention on the same inputs: max and mean absolute error."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=torch.float64) for _ in range(3))
    ref = flash(q, k, v)
    out = {}
    for name, fn in KERNELS.items():
        diff = (fn(q.bfloat16(), k.bfloat16(), v.bfloat16()).double() - ref).abs()
        out[name] = {"max_abs": diff.max().item(), "mean_abs": diff.mean().item()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[650, 1300],
                   help="episode lengths (tokens); the demo's 8-turn episodes are ~650-1,430")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in args.tokens:
            for name, fn in KERNELS.items():
                r = time_kernel(fn, dtype, tokens, args.reps)
                rows[f"{str(dtype).removeprefix('torch.')}/T{tokens}/{name}"] = r
                print(f"{str(dtype):15s} T={tokens:5d} {name:6s} forward {r['forward_ms']:7.1f} ms"
                      f"  backward {r['backward_ms']:7.1f} ms", flush=True)
    err = errors(max(args.tokens))
    for name, e in err.items():
        print(f"{name:6s} bf16 vs float64: max abs {e['max_abs']:.4f}  mean abs {e['mean_abs']:.6f}")
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    ResultFile("attention_kernels").put(cpu_name(), {"torch": torch.__version__, "threads": torch.get_num_threads(),
                                                     "reps": args.reps, "times": rows, "bf16_errors": err})


if __name__ == "__main__":
    main()
