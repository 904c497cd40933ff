"""Does an in-process vLLM engine slow the learner's own compute down? (issue 61: "find why our step is slower and
noisier on the Intel machine: thread binding, vLLM's CPU worker, the reload").

Our fit keeps a vLLM engine in the learner's process (``generator: auto``; ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). vLLM's
CPU worker binds the process's OpenMP threads to cores when it starts ("CPU backend doesn't allow to use
``torch.set_num_threads`` after the thread binding") and sets a NUMA memory policy; TRL's step has no engine. This
script times the same learner work in one process before and after an engine starts, alternating nothing else:

* ``learner``: the student's forward + backward (``labels = input_ids``) and the teacher's forward over a
  ``(--rows, --tokens)`` batch of random token ids (the peer workload's shape: 4 x 214), fp32 (or ``--dtype``);
* ``matmul``: a ``(rows * tokens, 576) @ (576, 1536)`` product (SmolLM2's MLP shape), GFLOP/s;

each ``--reps`` times after one warm-up, medians; then the engine (:class:`lightning_opd.rollout.vllm.VLLMGenerator`
on the student, the fit's settings) starts and samples one batch, and the same timings are taken again, then once
more after the engine has sampled ``--after-sampling`` more batches (its threads may keep spinning). Printed beside
them: ``torch.get_num_threads()``, the process's CPU affinity, the OpenMP/KMP environment, the CPU model.

Run alone: ``.venv/bin/python -m benchmarks.engine_interference`` (needs ``make prepare teacher install-vllm``).
Results: ``benchmarks/results/engine_interference.json`` (one entry per CPU model and dtype; a rerun replaces it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from benchmarks.common import ResultFile, add_artifact_args  # noqa: E402
from lightning_opd.cpu_isa import cpu_name  # noqa: E402


def state() -> dict:
    """Threads, affinity and the OpenMP environment of this process now."""
    return {"torch_threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "KMP_", "GOMP_", "LD_PRELOAD"))}}


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def measure(student, teacher, ids: torch.Tensor, reps: int) -> dict:
    """The learner's step work and a matmul, timed now."""
    def learner():
        student.zero_grad(set_to_none=True)
        student(input_ids=ids, labels=ids).loss.backward()
        with torch.no_grad():
            teacher(input_ids=ids)

    a = torch.randn(ids.numel(), 576, dtype=student.dtype)
    b = torch.randn(576, 1536, dtype=student.dtype)
    mm = timed(lambda: a @ b, reps * 5)
    return {"learner_s": timed(learner, reps), "matmul_gflops": 2 * a.shape[0] * 576 * 1536 / mm / 1e9, **state()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--tokens", type=int, default=214)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--after-sampling", type=int, default=5, help="batches the engine samples before the last timing")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from lightning_opd.rollout.vllm import VLLMGenerator

    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher, dtype=dtype).eval()
    ids = torch.randint(0, student.config.vocab_size, (a.rows, a.tokens))
    out = {"cpu": cpu_name(), "dtype": a.dtype, "shape": [a.rows, a.tokens], "before_engine": measure(student, teacher,
                                                                                                       ids, a.reps)}
    print("before the engine:", out["before_engine"], flush=True)
    gen = VLLMGenerator(model=a.model, dtype=a.dtype, max_model_len=2048)
    gen.start()
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": ids[i, :200].tolist()} for i in range(a.rows)]
    params = SamplingParams(max_tokens=16, temperature=1.0)
    gen.llm.generate(prompts, params, use_tqdm=False)
    out["after_engine_start"] = measure(student, teacher, ids, a.reps)
    print("after the engine started:", out["after_engine_start"], flush=True)
    for _ in range(a.after_sampling):
        gen.llm.generate(prompts, params, use_tqdm=False)
    out["after_sampling"] = measure(student, teacher, ids, a.reps)
    print(f"after {a.after_sampling} more sampled batches:", out["after_sampling"], flush=True)
    out["slowdown"] = out["after_sampling"]["learner_s"] / out["before_engine"]["learner_s"]
    print(f"learner work with the engine / without: {out['slowdown']:.2f}x ({cpu_name()}, {a.dtype})")
    ResultFile("engine_interference").put(f"{cpu_name()}/{a.dtype}", out)
    return out


if __name__ == "__main__":
    main()
