"""Peak memory and time of every divergence: chunked from hidden states vs naive full materialisation.

For each loss and ``T`` in {1024, 4096} tokens (B = 1, V = 49152, D = 576 as in SmolLM2, fp32), one
forward + backward of ``loss.sum()`` w.r.t. the student's hidden states and head weight, two ways:

* naive: ``(T, V)`` student and teacher logits materialised, the kernel applied to all of them;
* chunked: ``loss(hidden_s, hidden_t, targets, head_s, head_t)``, i.e. ``chunk_size`` tokens at a time,
  recomputed in the backward pass (lightning_opd/losses/chunked.py).

Peak memory = the process's resident high-water mark during the call (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``) minus the resident size just before (inputs and weights excluded,
the ``(V, D)`` head gradient included). Time = best of ``--repeats`` calls. Results:
benchmarks/results/loss_memory.json (resumable). Linux only (reads /proc).

Run: .venv/bin/python -m benchmarks.loss_memory
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from benchmarks.common import ResultFile, markdown_table
from lightning_opd.losses import (ForwardKL, FullVocabReverseKL, GeneralizedJSD, SampledTokenReverseKL,
                                  StudentTopKRenormalizedReverseKL, TeacherTopKForwardKL)

LOSSES = {
    "reverse KL (full vocab)": lambda c: FullVocabReverseKL(chunk_size=c),
    "sampled-token reverse KL": lambda c: SampledTokenReverseKL(chunk_size=c),
    "forward KL (full vocab)": lambda c: ForwardKL(chunk_size=c),
    "JSD(0.5)": lambda c: GeneralizedJSD(beta=0.5, chunk_size=c),
    "student top-50 reverse KL": lambda c: StudentTopKRenormalizedReverseKL(k=50, chunk_size=c),
    "teacher top-32 forward KL + tail": lambda c: TeacherTopKForwardKL(k=32, tail_bucket=True, chunk_size=c),
}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn, repeats: int) -> tuple[float, float]:
    """(peak MB above the resident size before the call, best seconds) of ``fn()``."""
    peak, best = 0.0, float("inf")
    for _ in range(repeats):
        gc.collect()
        before = _status_kb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        peak = max(peak, (_status_kb("VmHWM") - before) / 1024)
    return peak, best


def run(name: str, t: int, mode: str, args) -> dict:
    torch.manual_seed(0)
    d, v = args.hidden, args.vocab
    head_s = torch.nn.Linear(d, v, bias=False)
    head_t = torch.nn.Linear(d, v, bias=False).requires_grad_(False)
    h_s = torch.randn(t, d, requires_grad=True)
    h_t = torch.randn(t, d)
    targets = torch.randint(0, v, (t,))
    loss = LOSSES[name](args.chunk_size)

    def call():
        if mode == "naive":
            with torch.no_grad():
                t_logits = head_t(h_t)
            out = loss.token_terms(head_s(h_s), t_logits, targets)
        else:
            out = loss(h_s, h_t, targets, head_s, head_t)
        out.loss.sum().backward()
        h_s.grad, head_s.weight.grad = None, None

    peak, seconds = measure(call, args.repeats)
    return {"peak_mb": peak, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    results = ResultFile("loss_memory")
    suffix = f"V{a.vocab}/D{a.hidden}/c{a.chunk_size}"
    for t in a.tokens:
        for name in LOSSES:
            for mode in ("naive", "chunked"):
                key = f"{name}/T{t}/{mode}/{suffix}"
                if key not in results:
                    print(f"running {key} ...", flush=True)
                    results.put(key, run(name, t, mode, a))
    rows = []
    for t in a.tokens:
        for name in LOSSES:
            n, c = (results[f"{name}/T{t}/{m}/{suffix}"] for m in ("naive", "chunked"))
            rows.append([name, t, f"{n['peak_mb']:.0f}", f"{c['peak_mb']:.0f}", f"{c['peak_mb'] / n['peak_mb']:.3f}" if n["peak_mb"] else "-",
                         f"{n['seconds']:.2f}", f"{c['seconds']:.2f}", f"{c['seconds'] / n['seconds']:.2f}x"])
    print(f"\nV = {a.vocab}, D = {a.hidden}, B = 1, fp32, chunk {a.chunk_size} tokens; forward + backward")
    print(markdown_table(["loss", "T", "naive peak MB", "chunked peak MB", "peak ratio", "naive s", "chunked s",
                          "time ratio"], rows))


if __name__ == "__main__":
    main()
