"""Training throughput and MFU of one OPD step on a GPU, plus HF ``generate`` throughput.

An OPD step here is what ``OPDModule.training_step`` does per micro-batch: student forward + backward,
teacher forward (no grad) on the same ids, and the analytic full-vocabulary reverse KL on the sampled
tokens computed from hidden states chunk by chunk (each chunk's LM heads recomputed in the backward
pass, so no ``(B, T, V)`` tensor exists; docs/algorithms.md §0.2).

Models are random-init Hugging Face ``Qwen2ForCausalLM`` built from configs of real shapes (no
downloads): a 0.5B-class student (Qwen2.5-0.5B shapes) and a 1.7B-class teacher (Qwen3-1.7B shapes:
28 layers, d 2048, GQA 16/8, head dim 128), both with the 151,936-token vocabulary, in bf16.

MFU = achieved model FLOP/s / peak FLOP/s, where

* model FLOPs per step (PaLM appendix B convention, causal attention counted in full):
  student ``6 N_s + 12 L_s d_s T`` per token (forward + backward), teacher ``2 N_t + 4 L_t d_t T``
  per token (forward only), ``N`` = parameters that take part in matmuls (every decoder ``Linear``
  plus the LM head, embeddings excluded), ``T`` the sequence length;
* peak FLOP/s is *measured in the same run*: the best of several large bf16 matmuls
  (``--matmul-size`` cubed), so the ratio does not depend on a data-sheet number.

Imports only torch and transformers (the CPU model it records beside the device comes from
``lightning_opd/cpu_isa.py``, run from the source tree) and runs from the source tree without installing:

    python benchmarks/gpu_train_throughput.py                    # on a GPU machine (~5 min)
    python benchmarks/gpu_train_throughput.py --tiny --device cpu   # smoke run (seconds; what CI does)

Prints one JSON line per measurement and a summary table; ``--out FILE`` also writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 151936
# the product's CPU model probe (lightning_opd/cpu_isa.py: stdlib only), read from the source tree so that this
# script still runs without the package installed; what benchmarks.common.machine() records
cpu_name = runpy.run_path(str(Path(__file__).resolve().parents[1] / "lightning_opd" / "cpu_isa.py"))["cpu_name"]
SHAPES = {
    # Qwen2.5-0.5B
    "student": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                    num_key_value_heads=2, tie_word_embeddings=True, vocab_size=VOCAB),
    # Qwen3-1.7B sizes (head_dim 128 = 2048 / 16)
    "teacher": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, tie_word_embeddings=True, vocab_size=VOCAB),
}
TINY = {
    "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True, vocab_size=512),
    "teacher": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=True, vocab_size=512),
}


def build(shape: dict, dtype: torch.dtype, device: str) -> Qwen2ForCausalLM:
    """A random-init causal LM of the given shape (seeded), in ``dtype`` on ``device``, SDPA attention."""
    config = Qwen2Config(max_position_embeddings=32768, attn_implementation="sdpa", **shape)
    with torch.device(device):  # initialise on the device: seconds on a GPU instead of a minute on CPU
        model = Qwen2ForCausalLM(config)
    return model.to(dtype=dtype)


def matmul_params(model: Qwen2ForCausalLM) -> int:
    """``N``: parameters of every ``nn.Linear`` in the model (decoder projections and the LM head;
    tied or not, the head is one ``d x V`` matmul per token). Embedding lookups are excluded."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def flops_per_token(model: Qwen2ForCausalLM, seq_len: int, train: bool) -> float:
    """Model FLOPs per token (PaLM convention): ``6N + 12 L d T`` with backward, ``2N + 4 L d T`` without."""
    cfg = model.config
    attn = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * seq_len
    n = matmul_params(model)
    return 6 * n + 12 * attn if train else 2 * n + 4 * attn


def reverse_kl_from_hidden(h_s: torch.Tensor, h_t: torch.Tensor, head_s, head_t, chunk: int) -> torch.Tensor:
    """Sum over ``N`` positions of KL(student || teacher) over the full vocabulary, nats.

    ``h_s`` ``(N, D_s)`` (grad), ``h_t`` ``(N, D_t)`` (no grad); each chunk's logits are built in fp32
    and recomputed in the backward pass (torch.utils.checkpoint), so peak memory is ``chunk x V``."""

    def chunk_kl(hs, ht):
        lp_s = F.log_softmax(head_s(hs).float(), -1)
        lp_t = F.log_softmax(head_t(ht).float(), -1)
        return (lp_s.exp() * (lp_s - lp_t)).sum()

    total = h_s.new_zeros((), dtype=torch.float32)
    for i in range(0, h_s.shape[0], chunk):
        total = total + checkpoint(chunk_kl, h_s[i:i + chunk], h_t[i:i + chunk], use_reentrant=False)
    return total


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_matmul_flops(device: str, dtype: torch.dtype, n: int, repeats: int) -> float:
    """Best FLOP/s of ``repeats`` ``(n, n) @ (n, n)`` matmuls in ``dtype`` (``2 n^3`` FLOPs each)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def opd_step(student, teacher, ids: torch.Tensor, opt, chunk: int) -> float:
    """One OPD optimizer step on ``ids`` ``(B, T)``; returns the mean reverse KL (nats/token)."""
    h_s = student.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].flatten(0, 1)
    with torch.no_grad():
        h_t = teacher.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].flatten(0, 1)
    kl = reverse_kl_from_hidden(h_s, h_t, student.lm_head, teacher.lm_head, chunk) / h_s.shape[0]
    kl.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(kl.detach())


def measure_training(student, teacher, args, dtype) -> dict:
    """Training tokens/s and MFU over ``--steps`` timed steps after ``--warmup`` untimed ones."""
    torch.manual_seed(0)
    vocab = student.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), device=args.device)
    if args.gradient_checkpointing:
        student.gradient_checkpointing_enable()
    student.train()
    teacher.eval().requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6, fused=args.device.startswith("cuda"))
    for _ in range(args.warmup):
        opd_step(student, teacher, ids, opt, args.chunk)
    sync(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    kl = 0.0
    for _ in range(args.steps):
        kl = opd_step(student, teacher, ids, opt, args.chunk)
    sync(args.device)
    seconds = (time.perf_counter() - t0) / args.steps
    tokens = args.batch * args.seq_len
    flops = tokens * (flops_per_token(student, args.seq_len, True) + flops_per_token(teacher, args.seq_len, False))
    out = {"train_tokens_per_s": tokens / seconds, "step_s": seconds, "model_flops_per_step": flops,
           "achieved_tflops": flops / seconds / 1e12, "last_kl": kl}
    if args.device.startswith("cuda"):
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    return out


@torch.no_grad()
def measure_generate(student, args) -> dict:
    """HF ``generate`` throughput: ``--gen-batch`` prompts of ``--prompt-len`` tokens, exactly
    ``--new-tokens`` sampled tokens each (EOS disabled); new tokens per second."""
    student.eval()
    torch.manual_seed(1)
    vocab = student.config.vocab_size
    ids = torch.randint(0, vocab, (args.gen_batch, args.prompt_len), device=args.device)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=True, temperature=1.0,
              top_k=0, pad_token_id=0, eos_token_id=None)
    student.generate(ids[:, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    sync(args.device)
    t0 = time.perf_counter()
    out = student.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync(args.device)
    seconds = time.perf_counter() - t0
    new = (out.shape[1] - ids.shape[1]) * args.gen_batch
    return {"generate_tokens_per_s": new / seconds, "generate_s": seconds, "generated_tokens": new}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tiny", action="store_true", help="tiny shapes and sizes: a smoke run of the code path")
    p.add_argument("--batch", type=int, default=8, help="sequences per OPD step")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (a multi-turn episode)")
    p.add_argument("--chunk", type=int, default=1024, help="positions per LM-head chunk of the loss")
    p.add_argument("--steps", type=int, default=10, help="timed OPD steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed OPD steps first")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--gen-batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--matmul-repeats", type=int, default=20)
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.tiny:
        for name, value in dict(batch=2, seq_len=64, chunk=32, steps=2, warmup=1, gen_batch=2, prompt_len=16,
                                new_tokens=8, matmul_size=256, matmul_repeats=2).items():
            setattr(args, name, value)
    dtype = getattr(torch, args.dtype)
    shapes = TINY if args.tiny else SHAPES
    torch.manual_seed(0)
    student, teacher = build(shapes["student"], dtype, args.device), build(shapes["teacher"], dtype, args.device)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)),
              "torch": torch.__version__, "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
              "student_matmul_params": matmul_params(student), "teacher_matmul_params": matmul_params(teacher)}
    peak = peak_matmul_flops(args.device, dtype, args.matmul_size, args.matmul_repeats)
    result["peak_matmul_tflops"] = peak / 1e12
    print(json.dumps({"peak_matmul_tflops": result["peak_matmul_tflops"]}), flush=True)
    train = measure_training(student, teacher, args, dtype)
    train["mfu"] = train["achieved_tflops"] * 1e12 / peak
    result.update(train)
    print(json.dumps(train), flush=True)
    gen = measure_generate(student, args)
    result.update(gen)
    print(json.dumps(gen), flush=True)
    print(f"\n| device | dtype | B x T | train tokens/s | MFU | matmul peak TFLOP/s | generate tokens/s |\n"
          f"|---|---|---|---|---|---|---|\n| {result['device']} | {args.dtype} | {args.batch} x {args.seq_len} | "
          f"{result['train_tokens_per_s']:.0f} | {result['mfu']:.3f} | {result['peak_matmul_tflops']:.1f} | "
          f"{result['generate_tokens_per_s']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
