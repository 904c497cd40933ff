"""A LoRA student's weight push against a full fine-tune's, and what sampling costs afterwards (issue 65).

Same run, same process, the demo's student (SmolLM2-135M, fp32) with a rank-``--rank`` adapter on every linear layer
of the decoder (conf/textworld/opd_lora.yaml's; its ``B`` drawn at random so the adapter changes the outputs):

* ``full``: ``merged_state_dict`` (what ``lora.push: merged`` and a full fine-tune send: 134.5 M parameters) loaded
  into an in-process vLLM engine started without LoRA (``VLLMWeightSync``: in place);
* ``adapter``: ``adapter_state`` (the default ``lora.push: adapter``) loaded into an engine started with LoRA
  (``VLLMGenerator.push_adapter``: written to a folder, ``add_lora`` under a new id, the previous one removed).

Per push: bytes of the tensors shipped and seconds from the learner's state to an engine ready to sample (building
the state included). Then sampling: the same ``--prompts`` prompts of ``--prompt-tokens`` tokens, ``--new-tokens``
new tokens each (the demo's turn: 16), greedy, prefix cache emptied before each call, timed on each engine; rounds
alternate the two engines (``--rounds``). Learner memory: the peak resident memory of one OPD-shaped update
(forward, backward of the sampled-token loss and an AdamW step over ``--learner-tokens`` tokens), full fine-tuning vs
LoRA, each in a fresh process (``ru_maxrss``).

Results: benchmarks/results/lora_push.json (the CPU model and cores named). Run alone on the cores:
  .venv/bin/python -m benchmarks.lora_push
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
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


def _engine(path: str, lora: LoRAConfig | None, model):
    from lightning_opd.rollout.vllm import VLLMGenerator

    class Policy:  # what PolicyModule offers a generator: the student, its directory, its LoRA configuration
        policy_model, policy_version, student_path = model, 0, path

    Policy.lora = lora
    gen = VLLMGenerator(kv_cache_memory_bytes=1 << 30, max_model_len=2048)
    gen.attach(Policy(), [model.config.eos_token_id])
    gen.follow_policy = False
    gen.start()
    return gen


def _sample(gen, prompts, new_tokens: int) -> float:
    import vllm

    params = vllm.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gen.llm.reset_prefix_cache()
    t0 = time.perf_counter()
    gen.llm.generate(prompts, params, use_tqdm=False, lora_request=gen._lora_request)
    return time.perf_counter() - t0


def learner_peak(args) -> None:
    """Child process: one OPD-shaped update; prints the peak resident MB."""
    model = load_causal_lm(args.model)
    if args.child == "lora":
        model = apply_lora(model, LoRAConfig(rank=args.rank))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=True)
    ids = torch.randint(100, 40000, (4, args.learner_tokens // 4), generator=torch.Generator().manual_seed(0))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(2):  # the second update holds the optimizer's moments, as every update after the first
        logits = model(input_ids=ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-(lp * torch.randn_like(lp)).mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_mb": peak / 1024, "rss_before_mb": before / 1024,
                      "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="artifacts/models/smollm2-135m")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--learner-tokens", type=int, default=2048)
    parser.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        learner_peak(args)
        return
    from lightning_opd.cpu_isa import cpu_name

    print(f"CPU: {cpu_name()}, {len(os.sched_getaffinity(0))} cores", flush=True)
    memory = {}
    for kind in ("full", "lora"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.lora_push", "--child", kind, "--model", args.model,
                              "--rank", str(args.rank), "--learner-tokens", str(args.learner_tokens)],
                             check=True, capture_output=True, text=True)
        memory[kind] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"learner {kind}: peak {memory[kind]['peak_rss_mb']:.0f} MB, "
              f"{memory[kind]['trainable_parameters']:,} trainable parameters", flush=True)
    model = _student(args.model, args.rank)
    engines = {"full": _engine(args.model, None, model), "adapter": _engine(args.model, LoRAConfig(rank=args.rank), model)}
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (args.prompt_tokens,),
                                                  generator=torch.Generator().manual_seed(i)).tolist()}
               for i in range(args.prompts)]
    pushes = {k: [] for k in engines}
    samples = {k: [] for k in engines}
    nbytes = {}
    version = 0
    for r in range(args.rounds):
        for kind in (("full", "adapter") if r % 2 == 0 else ("adapter", "full")):
            gen = engines[kind]
            version += 1
            t0 = time.perf_counter()
            state = merged_state_dict(model) if kind == "full" else adapter_state(model, args.model)
            gen.push_weights(state, version)
            pushes[kind].append(time.perf_counter() - t0)
            nbytes[kind] = sum(t.numel() * t.element_size() for t in state.values())
            samples[kind].append(_sample(gen, prompts, args.new_tokens))
            print(f"round {r} {kind}: push {pushes[kind][-1]:.2f} s ({nbytes[kind] / 1e6:.1f} MB), sampling "
                  f"{samples[kind][-1]:.2f} s", flush=True)
    record = {"model": args.model, "rank": args.rank, "rounds": args.rounds, "prompts": args.prompts,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "push_bytes": nbytes, "push_seconds": pushes, "sampling_seconds": samples,
              "push_seconds_median": {k: statistics.median(v) for k, v in pushes.items()},
              "sampling_seconds_median": {k: statistics.median(v) for k, v in samples.items()},
              "sampling_ratio_adapter_over_full": [a / f for a, f in zip(samples["adapter"], samples["full"])],
              "learner_memory": memory}
    write_json(RESULTS / "lora_push.json", record)
    print(json.dumps({k: record[k] for k in ("push_bytes", "push_seconds_median", "sampling_seconds_median",
                                             "sampling_ratio_adapter_over_full")}, indent=1))
    for gen in engines.values():
        gen.shutdown()


if __name__ == "__main__":
    main()
