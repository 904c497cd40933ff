"""Generation throughput on the TextWorld rollout workload: VLLMGenerator vs the HF backend, with its roofline.

For batch sizes 1, 8 and 32, plays that many SmolLM2-135M episodes at once (temperature 1, up to
``--turns`` turns, 16 new tokens per turn) with each backend and reports sampled tokens per second of
generation time, the prompt tokens actually prefilled vs served from a cache (the HF backend's KV cache
kept between turns, vLLM's prefix cache), and the achieved fraction of the roofline
(:mod:`benchmarks.roofline`: prefill and decode passes at the matmul FLOP/s and memory bandwidth
measured in the same run). Results go to benchmarks/results/generation_throughput.json; a rerun skips
what is there (resumable; entries written before the roofline existed are rerun).

Run: .venv/bin/python -m benchmarks.generation_throughput   (needs `make prepare install-vllm`)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from benchmarks.common import ResultFile, markdown_table  # noqa: E402
from benchmarks.roofline import (GenerationLog, Machine, ModelShape, fraction, measure_machine,  # noqa: E402
                                 rollout_roofline)
from lightning_opd.envs.textworld_env import TextWorldEnvFactory  # noqa: E402
from lightning_opd.models import load_causal_lm, load_tokenizer  # noqa: E402
from lightning_opd.rollout import (AgentLoop, EpisodeSpec, HFGenerator, SamplingParams, policy_configs,  # noqa: E402
                                   stop_token_ids)


class Policy:
    def __init__(self, path):
        self.student_path = path
        self.tokenizer = load_tokenizer(path)
        self.policy_model = load_causal_lm(path).eval()
        self.policy_version = 0


def make_generator(backend: str, policy: Policy, vllm_block_size: int | None = None):
    """An attached generator of ``backend`` (``"hf"``: KV cache kept between turns; ``"vllm"``: a started
    engine with prefix caching, warmed up on one untimed episode by the caller)."""
    if backend == "hf":
        gen = HFGenerator()
    else:
        from lightning_opd.rollout.vllm import VLLMGenerator

        extra = {} if vllm_block_size is None else {"block_size": vllm_block_size}
        gen = VLLMGenerator(kv_cache_memory_bytes=1 << 30, max_model_len=4096, engine_kwargs=extra)
    gen.attach(policy, stop_token_ids(policy.tokenizer, policy_configs(policy)[1]))
    if backend == "vllm":
        gen.start()
    return gen


def run(backend: str, batch: int, policy: Policy, envs: TextWorldEnvFactory, turns: int, machine: Machine,
        vllm_block_size: int | None = None) -> dict:
    gen = make_generator(backend, policy, vllm_block_size)
    if backend == "vllm":
        warm = AgentLoop(envs, gen, policy.tokenizer, max_turns=1)
        warm.run([EpisodeSpec(envs.train_tasks()[0])], SamplingParams())  # engine warm-up, not timed
    log = GenerationLog(gen)
    loop = AgentLoop(envs, gen, policy.tokenizer, max_turns=turns)
    tasks = envs.train_tasks()
    specs = [EpisodeSpec(tasks[i % len(tasks)], seed=i) for i in range(batch)]
    loop.run(specs, SamplingParams(temperature=1.0, max_new_tokens=16))
    extra = {"block_size": gen.block_size} if backend == "vllm" else {}
    if backend == "vllm":
        gen.shutdown()
    roof = rollout_roofline(ModelShape.of(policy.policy_model), machine, log.calls)
    return {"tokens": roof["sampled_tokens"], "prefill_tokens": roof["prefill_tokens"],
            "cached_prompt_tokens": roof["cached_tokens"], "passes": roof["passes"], "flops": roof["flops"],
            "bytes": roof["bytes"], "roofline_s": roof["roofline_s"], "seconds": log.seconds,
            "tokens_per_s": roof["sampled_tokens"] / log.seconds,
            "roofline_fraction": fraction(roof["roofline_s"], log.seconds),
            **extra}


def push_timing(policy: Policy, repeats: int = 3) -> dict:
    """Seconds to push the student's weights into a running vLLM engine (F09 path) vs a plain copy."""
    from lightning_opd.rollout.vllm import VLLMGenerator

    gen = VLLMGenerator(kv_cache_memory_bytes=1 << 28, max_model_len=2048)
    gen.attach(policy, stop_token_ids(policy.tokenizer, policy_configs(policy)[1]))
    gen.start()
    state = policy.policy_model.state_dict()
    pushes, copies = [], []
    for v in range(repeats):
        pushes.append(gen.push_weights(state, v + 1))
        t0 = time.perf_counter()
        copy = {k: t.clone() for k, t in state.items()}
        copies.append(time.perf_counter() - t0)
        del copy
    gen.shutdown()
    return {"push_s": min(pushes), "copy_s": min(copies)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/models/smollm2-135m")
    p.add_argument("--games", default="artifacts/games/quest3")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    p.add_argument("--vllm-block-size", type=int, default=None,
                   help="KV block size of the vLLM engine (the prefix cache reuses whole blocks; CPU default 128)")
    p.add_argument("--results", default="generation_throughput", help="result file name under benchmarks/results")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    results = ResultFile(a.results)
    policy = Policy(a.model)
    if "machine" not in results:
        results.put("machine", measure_machine(policy.policy_model))
    machine = Machine(results["machine"]["matmul_flops"], results["machine"]["bandwidth"])
    envs = TextWorldEnvFactory(a.games)
    bs = "" if a.vllm_block_size is None else f"/bs{a.vllm_block_size}"
    for batch in a.batches:
        for backend in a.backends:
            key = f"{backend}/b{batch}/t{a.turns}" + (bs if backend == "vllm" else "")
            if key not in results or "roofline_s" not in results[key]:
                print(f"running {key} ...", flush=True)
                results.put(key, run(backend, batch, policy, envs, a.turns, machine, a.vllm_block_size))
    if "vllm" in a.backends and "push" not in results:
        results.put("push", push_timing(policy))
    rows = []
    for batch in a.batches:
        for backend in a.backends:
            r = results[f"{backend}/b{batch}/t{a.turns}" + (bs if backend == "vllm" else "")]
            prompt = r["prefill_tokens"] + r["cached_prompt_tokens"]
            rows.append([batch, backend, f"{r['tokens_per_s']:.0f}", f"{r['seconds']:.1f}", r["prefill_tokens"],
                         f"{r['cached_prompt_tokens'] / prompt:.0%}", r["passes"], f"{r['roofline_s']:.1f}",
                         f"{r['roofline_fraction']:.0%}"])
    m = results["machine"]
    print(f"\nfp32 matmul peak {m['matmul_flops'] / 1e9:.0f} GFLOP/s (best of the model's shapes), memory bandwidth "
          f"{m['bandwidth'] / 1e9:.1f} GB/s, {m['threads']} threads; {a.turns} turns, 16 new tokens/turn")
    print(markdown_table(["batch", "backend", "sampled tokens/s", "generate s", "prefilled tokens", "prompt cached",
                          "forward passes", "roofline s", "of roofline"], rows))
    if "push" in results:
        push = results["push"]
        print(f"\nweight push into vLLM: {push['push_s']:.2f} s vs plain copy of the same weights "
              f"{push['copy_s']:.2f} s "
              f"({push['push_s'] / push['copy_s']:.1f}x)")


if __name__ == "__main__":
    main()
