"""Generation throughput on the TextWorld rollout workload: VLLMGenerator vs the HF backend.

For batch sizes 1, 8 and 32, plays that many SmolLM2-135M episodes at once (temperature 1, up to
``--turns`` turns, 16 new tokens per turn) with each backend and reports sampled tokens per second of
generation time, beside the decode bound ``batch x memory bandwidth / weight bytes`` (tokens/s), with
the bandwidth measured in the same run. Results go to benchmarks/results/generation_throughput.json;
a rerun skips what is there (resumable).

Run: .venv/bin/python -m benchmarks.generation_throughput   (needs `make prepare install-vllm`)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from benchmarks.common import ResultFile, markdown_table, memory_bandwidth_gbs  # noqa: E402
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


class Timed:
    """Wraps a generator and accumulates the seconds spent in ``generate`` and the tokens it sampled."""

    def __init__(self, inner):
        self.inner, self.seconds, self.tokens, self.prompt_tokens = inner, 0.0, 0, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, requests, sampling):
        t0 = time.perf_counter()
        outs = self.inner.generate(requests, sampling)
        self.seconds += time.perf_counter() - t0
        self.tokens += sum(len(o.token_ids) for o in outs)
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        return outs

    def release(self):
        self.inner.release()


def run(backend: str, batch: int, policy: Policy, envs: TextWorldEnvFactory, turns: int) -> dict:
    if backend == "hf":
        gen = HFGenerator()
    else:
        from lightning_opd.rollout.vllm import VLLMGenerator

        gen = VLLMGenerator(kv_cache_memory_bytes=1 << 30, max_model_len=4096)
    gen.attach(policy, stop_token_ids(policy.tokenizer, policy_configs(policy)[1]))
    if backend == "vllm":
        gen.start()
        warm = AgentLoop(envs, gen, policy.tokenizer, max_turns=1)
        warm.run([EpisodeSpec(envs.train_tasks()[0])], SamplingParams())  # engine warm-up, not timed
    timed = Timed(gen)
    loop = AgentLoop(envs, timed, policy.tokenizer, max_turns=turns)
    tasks = envs.train_tasks()
    specs = [EpisodeSpec(tasks[i % len(tasks)], seed=i) for i in range(batch)]
    loop.run(specs, SamplingParams(temperature=1.0, max_new_tokens=16))
    if backend == "vllm":
        gen.shutdown()
    return {"tokens": timed.tokens, "prompt_tokens": timed.prompt_tokens, "seconds": timed.seconds,
            "tokens_per_s": timed.tokens / timed.seconds}


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="artifacts/models/smollm2-135m")
    p.add_argument("--games", default="artifacts/games/quest3")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    a = p.parse_args()
    torch.manual_seed(0)
    results = ResultFile("generation_throughput")
    if "bandwidth_gbs" not in results:
        results.put("bandwidth_gbs", memory_bandwidth_gbs())
    policy = Policy(a.model)
    envs = TextWorldEnvFactory(a.games)
    # parameters read per decoded token; tied embeddings share one storage and are counted once
    weight_bytes = sum(p.numel() * p.element_size() for p in policy.policy_model.parameters())
    for batch in a.batches:
        for backend in a.backends:
            key = f"{backend}/b{batch}/t{a.turns}"
            if key not in results:
                print(f"running {key} ...", flush=True)
                results.put(key, run(backend, batch, policy, envs, a.turns))
    if "vllm" in a.backends and "push" not in results:
        results.put("push", push_timing(policy))
    bw = results["bandwidth_gbs"]
    rows = []
    for batch in a.batches:
        bound = batch * bw * 1e9 / weight_bytes
        row = [batch]
        for backend in ("hf", "vllm"):
            r = results.data.get(f"{backend}/b{batch}/t{a.turns}")
            row.append("-" if r is None else f"{r['tokens_per_s']:.0f}")
        hf, vl = (results.data.get(f"{b}/b{batch}/t{a.turns}") for b in ("hf", "vllm"))
        row.append("-" if not (hf and vl) else f"{vl['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
        row.append(f"{bound:.0f}")
        rows.append(row)
    print(f"\nmemory bandwidth {bw:.1f} GB/s, weights {weight_bytes / 1e6:.0f} MB (fp32), {a.turns} turns, 16 new tokens/turn")
    print(markdown_table(["batch", "HF tokens/s", "vLLM tokens/s", "vLLM / HF", "decode bound tokens/s"], rows))
    if "push" in results:
        push = results["push"]
        print(f"\nweight push into vLLM: {push['push_s']:.2f} s vs plain copy of the same weights {push['copy_s']:.2f} s "
              f"({push['push_s'] / push['copy_s']:.1f}x)")


if __name__ == "__main__":
    main()
