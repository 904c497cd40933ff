"""A LoRA student's learner memory against a full fine-tune's, and how much of the peak is the allocator (issue 65).

Each measurement is a fresh process doing two OPD-shaped updates of the demo's student (SmolLM2-135M, fp32): forward
over ``--learner-tokens`` tokens (4 rows), a sampled-token loss on the full logits, backward, a fused AdamW step (the
second update holds AdamW's moments, as every update after the first). Per process:

* ``peak_rss_mb``: the peak resident memory (``ru_maxrss``, MB), after loading and after each forward / backward /
  step (``rss_mb``: the running peak at each point);
* ``saved_for_backward_mb``: the bytes autograd keeps for backward in the first forward (unique storages of the saved
  tensors, parameters left out), what the activations cost whatever the allocator does;
* ``trainable_parameters``.

Two kinds (``full``: every parameter trained; ``lora``: rank ``--rank`` on every linear layer of the decoder,
conf/textworld/opd_lora.yaml's) under two allocator settings: ``glibc`` (the default: glibc's malloc raises its mmap
threshold to the size of the largest block freed, up to 32 MB, so later blocks of that size come from the heap, and
freed heap memory stays resident) and ``mmap128k`` (``MALLOC_MMAP_THRESHOLD_=131072``: the threshold fixed, every block
above 128 KiB mmapped and returned to the system when freed). The RSS peak under ``mmap128k`` is close to the live
memory; the difference between the two settings is memory glibc held but nothing used.

Results: benchmarks/results/lora_memory.json (the CPU model and cores named). The memory does not depend on other
load, but run it alone for its seconds:
  .venv/bin/python -m benchmarks.lora_memory
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ALLOCATORS = {"glibc": {}, "mmap128k": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
KINDS = ("full", "lora")


def _rss_mb() -> float:
    """The process's peak resident memory so far (MB; ``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(model_dir: str, kind: str, rank: int, tokens: int) -> dict:
    """One process's measurement (see the module docstring). Returns the record printed as JSON."""
    import torch

    from lightning_opd.models.loading import load_causal_lm
    from lightning_opd.models.lora import LoRAConfig, apply_lora

    torch.manual_seed(0)
    model = load_causal_lm(model_dir)
    if kind == "lora":
        model = apply_lora(model, LoRAConfig(rank=rank))
    model.train()
    rss = {"load": _rss_mb()}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    vocab = model.get_input_embeddings().num_embeddings  # ids 100..40000 on SmolLM2 (49,152), as lora_push's prompts
    ids = torch.randint(min(100, vocab // 2), min(40000, vocab), (4, tokens // 4),
                        generator=torch.Generator().manual_seed(0))
    for update in range(2):
        with torch.autograd.graph.saved_tensors_hooks(pack if update == 0 else (lambda t: t), lambda t: t):
            logits = model(input_ids=ids).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -(lp * torch.randn_like(lp)).mean()
        rss[f"forward{update}"] = _rss_mb()
        del logits, lp
        loss.backward()
        rss[f"backward{update}"] = _rss_mb()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rss[f"step{update}"] = _rss_mb()
    return {"kind": kind, "peak_rss_mb": _rss_mb(), "rss_mb": rss,
            "saved_for_backward_mb": sum(saved.values()) / 2 ** 20,
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="artifacts/models/smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--learner-tokens", type=int, default=2048, help="tokens per update (4 rows)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the 4 processes, the order alternating")
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.rank, args.learner_tokens)))
        return
    from benchmarks.common import RESULTS, write_json
    from lightning_opd.cpu_isa import cpu_name

    cpu = cpu_name()
    print(f"CPU: {cpu}, {len(os.sched_getaffinity(0))} cores", flush=True)
    runs = []
    for r in range(args.rounds):
        cells = [(a, k) for a in ALLOCATORS for k in KINDS]
        for allocator, kind in (cells if r % 2 == 0 else cells[::-1]):
            out = subprocess.run([sys.executable, "-m", "benchmarks.lora_memory", "--child", kind, "--model", args.model,
                                  "--rank", str(args.rank), "--learner-tokens", str(args.learner_tokens)],
                                 env={**os.environ, **ALLOCATORS[allocator]}, check=True, capture_output=True, text=True)
            rec = {"round": r, "allocator": allocator, **json.loads(out.stdout.strip().splitlines()[-1])}
            runs.append(rec)
            print(f"round {r} {allocator:8s} {kind}: peak {rec['peak_rss_mb']:,.0f} MB, saved for backward "
                  f"{rec['saved_for_backward_mb']:,.0f} MB, {rec['trainable_parameters']:,} trainable", flush=True)
    write_json(RESULTS / "lora_memory.json", {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "model": args.model,
                                              "rank": args.rank, "learner_tokens": args.learner_tokens, "runs": runs})


if __name__ == "__main__":
    main()
