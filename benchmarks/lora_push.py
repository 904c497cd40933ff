"""A LoRA student's weight push against a full fine-tune's, and what sampling costs afterwards (issue 65).

Same run, the demo's student (SmolLM2-135M, fp32) with a rank-``--rank`` adapter on every linear layer of the decoder
(conf/textworld/opd_lora.yaml's; its ``B`` drawn at random so the adapter changes the outputs), four generators:

* ``in-process full``: ``merged_state_dict`` (what ``lora.push: merged`` and a full fine-tune send: every tensor of
  the model) into an in-process vLLM engine started without LoRA (``VLLMWeightSync``: in place);
* ``in-process adapter``: ``adapter_state`` (the default ``lora.push: adapter``) into an engine started with LoRA
  (``VLLMGenerator.push_adapter``: written to a folder, ``add_lora`` under a new id, the previous one removed);
* ``served full`` / ``served adapter``: the same two into ``vllm serve`` samplers on this machine (dev mode; the second
  with ``--enable-lora``): a safetensors snapshot and vLLM's reload route, or the adapter's folder and
  ``/v1/load_lora_adapter`` (``--no-served`` leaves them out).

Per push: bytes of the tensors shipped and seconds from the learner's state to a generator that samples with it
(building the state included). Then sampling: ``--prompts`` fresh prompts of ``--prompt-tokens`` tokens per round,
``--new-tokens`` new tokens each (the demo's turn: 16), greedy, the same prompts on each generator; rounds alternate
the order (``--rounds``). The learner's memory, full fine-tuning vs LoRA, is benchmarks/lora_memory.py's.

Results: benchmarks/results/lora_push.json (the CPU model and cores named). Run alone on the cores:
  .venv/bin/python -m benchmarks.lora_push
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from benchmarks.common import RESULTS, write_json  # noqa: E402
from lightning_opd.models.loading import load_causal_lm  # noqa: E402
from lightning_opd.models.lora import LoRAConfig, adapter_state, apply_lora, merged_state_dict  # noqa: E402


def _student(path: str, rank: int):
    model = apply_lora(load_causal_lm(path), LoRAConfig(rank=rank))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return model


class _Policy:
    """What ``PolicyModule`` offers a generator: the student, its directory, version and LoRA configuration."""

    def __init__(self, model, path: str, lora: LoRAConfig | None, tokenizer=None) -> None:
        self.policy_model, self.student_path, self.lora, self.policy_version = model, path, lora, 0
        self.tokenizer = tokenizer


def _in_process(path: str, lora: LoRAConfig | None, model):
    from lightning_opd.rollout.vllm import VLLMGenerator

    gen = VLLMGenerator(kv_cache_memory_bytes=1 << 30, max_model_len=2048)
    gen.attach(_Policy(model, path, lora), [model.config.eos_token_id])
    gen.follow_policy = False
    gen.start()
    return gen, None


def _served(path: str, lora: LoRAConfig, model, tokenizer):
    """A sampler server (dev mode, ``sampler_server_args``; with LoRA for ``push: adapter``) and its generator."""
    from lightning_opd.rollout.remote import RemoteGenerator, sampler_server_args
    from lightning_opd.serving import VLLMServer

    server = VLLMServer(path, dev_mode=True, max_model_len=2048, kv_cache_memory_bytes=1 << 30, threads=2,
                        max_lora_rank=lora.vllm_max_lora_rank if lora.push == "adapter" else None,
                        extra_args=tuple(sampler_server_args(2048))).start()
    gen = RemoteGenerator(server.url, heartbeat_s=0)
    gen.attach(_Policy(model, path, lora, tokenizer), [model.config.eos_token_id])
    gen.follow_policy = False
    return gen, server


def _sample(gen, prompts, new_tokens: int) -> float:
    from lightning_opd.rollout.generator import GenerationRequest, SamplingParams

    requests = [GenerationRequest(key=(i, len(p)), prompt_ids=p, seed=i) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    gen.generate(requests, SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
    gen.release()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="artifacts/models/smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                        help="also the served sampler (two `vllm serve` processes: without LoRA and with it)")
    args = parser.parse_args()
    from lightning_opd.cpu_isa import cpu_name

    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores", flush=True)
    model = _student(args.model, args.rank)
    from lightning_opd.models.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    adapter, merged = LoRAConfig(rank=args.rank, push="adapter"), LoRAConfig(rank=args.rank, push="merged")
    gens, servers = {}, []
    for name, make in (("in-process full", lambda: _in_process(args.model, None, model)),
                       ("in-process adapter", lambda: _in_process(args.model, adapter, model)),
                       ("served full", lambda: _served(args.model, merged, model, tokenizer)),
                       ("served adapter", lambda: _served(args.model, adapter, model, tokenizer))):
        if name.startswith("served") and not args.served:
            continue
        gens[name], server = make()
        servers += [server] if server is not None else []
    pushes = {k: [] for k in gens}
    samples = {k: [] for k in gens}
    nbytes = {}
    version = 0
    try:
        for r in range(args.rounds):
            prompts = [torch.randint(100, 40000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(
                1000 * r + i)).tolist() for i in range(args.prompts)]
            order = list(gens) if r % 2 == 0 else list(reversed(gens))
            for kind in order:
                gen = gens[kind]
                version += 1
                t0 = time.perf_counter()  # from the learner's state to a generator that samples with it
                state = adapter_state(model, args.model) if kind.endswith("adapter") else merged_state_dict(model)
                gen.push_weights(state, version)
                pushes[kind].append(time.perf_counter() - t0)
                nbytes[kind] = sum(t.numel() * t.element_size() for t in state.values())
                samples[kind].append(_sample(gen, prompts, args.new_tokens))
                print(f"round {r} {kind}: push {pushes[kind][-1]:.2f} s ({nbytes[kind] / 1e6:.1f} MB), sampling "
                      f"{samples[kind][-1]:.2f} s", flush=True)
    finally:
        for gen in gens.values():
            gen.close() if hasattr(gen, "close") else gen.shutdown()
        for server in servers:
            server.stop()
    record = {"model": args.model, "rank": args.rank, "rounds": args.rounds, "prompts": args.prompts,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "push_bytes": nbytes, "push_seconds": pushes, "sampling_seconds": samples,
              "push_seconds_median": {k: statistics.median(v) for k, v in pushes.items()},
              "sampling_seconds_median": {k: statistics.median(v) for k, v in samples.items()},
              "sampling_ratio_adapter_over_full": {
                  where: [a / f for a, f in zip(samples[f"{where} adapter"], samples[f"{where} full"])]
                  for where in ("in-process", "served") if f"{where} adapter" in samples}}
    write_json(RESULTS / "lora_push.json", record)
    print(json.dumps({k: record[k] for k in ("push_bytes", "push_seconds_median", "sampling_seconds_median",
                                             "sampling_ratio_adapter_over_full")}, indent=1))


if __name__ == "__main__":
    main()
