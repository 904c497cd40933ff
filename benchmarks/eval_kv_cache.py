"""Held-out evaluation speed vs the vLLM KV cache size: does the prefix cache survive a 50-episode batch?

`lightning-opd evaluate` plays all held-out tasks at once (``--batch-size`` 50) and turn by turn: every turn
submits the 50 episodes' prompts again, each the previous turn's prompt plus one reply and one observation.
vLLM's prefix cache can serve the earlier turns' tokens only while their KV blocks are still in the cache;
when the cache holds fewer tokens than the 50 contexts together, least-recently-used eviction removes each
episode's blocks before its next turn (a cyclic access pattern) and every turn prefills its whole context
again. This script plays the same greedy episodes (the base SmolLM2 student, which fails and so plays every
turn) with each ``--kv-cache-gib`` size, side by side in one run, and prints per size: wall seconds, prompt
tokens prefilled vs served from the prefix cache, the ratio of seconds to the first size's, and how many greedy
episodes are token for token the first size's (a cached prefix and a recomputed one can differ in the last
float bits, so greedy decoding could flip where two tokens nearly tie).

Run: .venv/bin/python -m benchmarks.eval_kv_cache   (needs `make prepare install-vllm`)
Results: benchmarks/results/eval_kv_cache.json (keyed by the settings; a rerun skips finished entries).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks.common import ResultFile, add_artifact_args, markdown_table  # noqa: E402
from lightning_opd.evaluation.evaluate import Backends, EvalSettings, PolicyHandle, make_env  # noqa: E402
from lightning_opd.evaluation.teacher_kl import play_greedy  # noqa: E402
from lightning_opd.models.loading import load_tokenizer  # noqa: E402


def measure(kv_bytes: int, args) -> dict:
    """One greedy pass over the first ``args.tasks`` held-out tasks with a fresh engine of ``kv_bytes``."""
    settings = EvalSettings(max_turns=args.max_turns, max_context_tokens=args.max_context_tokens,
                            batch_size=args.tasks, backend="vllm", vllm_kv_cache_bytes=kv_bytes)
    env, _ = make_env(init_args={"games_dir": args.games, "max_observation_chars": 600, "repeat_goal": True})
    tasks = env.eval_tasks()[:args.tasks]
    backends = Backends(settings)
    try:
        handle = PolicyHandle(tokenizer=load_tokenizer(args.model), policy_model=None, student_path=args.model)
        loop = backends.loop(env, handle, args.model)
        t0 = time.perf_counter()
        trajs = play_greedy(loop, tasks, args.max_turns, 16, args.tasks)
        seconds = time.perf_counter() - t0
    finally:
        backends.close()
    return {"seconds": seconds, "prompt_tokens_computed": sum(t.prefill_tokens for t in trajs),
            "prompt_tokens_cached": sum(t.cached_prompt_tokens for t in trajs),
            "turns": sum(t.num_turns for t in trajs), "wins": sum(int(t.success) for t in trajs),
            "episode_digests": [hashlib.sha1(repr(t.token_ids).encode()).hexdigest()[:16] for t in trajs]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--kv-cache-gib", type=float, nargs="+", default=[1.0, 6.0], help="sizes compared (GiB)")
    p.add_argument("--tasks", type=int, default=50, help="held-out tasks, all played as one batch")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-context-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    results = ResultFile("eval_kv_cache")
    rows, first = [], None
    for gib in args.kv_cache_gib:
        key = f"kv{gib}GiB_tasks{args.tasks}_turns{args.max_turns}_ctx{args.max_context_tokens}"
        if key not in results:
            results.put(key, {**measure(int(gib * (1 << 30)), args), "cpu_count": os.cpu_count()})
        r = results[key]
        first = first or r
        same = sum(a == b for a, b in zip(r["episode_digests"], first["episode_digests"]))
        rows.append([f"{gib:g}", f"{r['seconds']:.0f}", r["prompt_tokens_computed"], r["prompt_tokens_cached"],
                     f"{r['seconds'] / first['seconds']:.2f}", r["wins"], f"{same} of {len(r['episode_digests'])}"])
    print(markdown_table(["KV cache (GiB)", "seconds", "prompt tokens prefilled", "served from prefix cache",
                          "seconds / first size's", "wins", "episodes token-identical to the first size's"], rows))


if __name__ == "__main__":
    main()
