"""The demo's evaluation beside its roofline (issue 43).

Runs ``lightning-opd evaluate`` as ``make demo`` does (the same function, in-process: the student before, the
teacher and the student after, greedy on all held-out games of ``--games``, at most 8 turns, the teacher-trajectory
KL, ``--avg-k 0 --no-own-traj-kl``) and counts, in the same run, the work it must do:

* **generation**: every ``generate`` call of every engine (:class:`benchmarks.roofline.GenerationLog`): prompt tokens
  prefilled after prefix reuse (vLLM's own count), decode steps; each forward pass at
  ``max(FLOPs / peak, bytes / bandwidth)`` (:func:`benchmarks.roofline.rollout_roofline`);
* **teacher-trajectory KL**: every trunk forward of :func:`~lightning_opd.evaluation.teacher_kl.trajectory_kl`
  (``2 N_trunk T`` + causal attention over its real tokens) and the two output heads on every scored position
  (``2 x 2 N_head`` per token), at the matmul peak;
* **environment**: the seconds the agent loop spends starting episodes and in ``_advance`` (the environment's
  ``reset``/``step``, decoding a reply, rendering an observation): measured, and counted in the roofline as they
  are (they run between ``generate`` calls).

The roofline is their sum; the achieved fraction is roofline seconds / the wall seconds of the whole
``evaluate`` (model loads, engine starts and weight pushes included: they are overhead, not work). Printed too:
the fraction without the environment seconds, and each part's measured seconds. The machine's ceilings
(:func:`benchmarks.roofline.measure_machine`) are measured in the same process before and after the evaluation,
and the higher of each is used (the matmul probe varied 268-311 GFLOP/s between runs; the higher peak gives the
lower, conservative fraction).

Run: .venv/bin/python -m benchmarks.eval_throughput   (needs `make prepare teacher student-opd install-vllm`;
``--students`` to evaluate others, ``--limit N`` for the first N games only).
Results: benchmarks/results/eval_throughput.json (one entry per settings key; a rerun replaces it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from benchmarks.common import ResultFile, add_artifact_args, markdown_table  # noqa: E402
from benchmarks.roofline import GenerationLog, Machine, ModelShape, fraction, measure_machine, rollout_roofline  # noqa: E402
from lightning_opd.evaluation import evaluate as evaluate_mod  # noqa: E402
from lightning_opd.evaluation import teacher_kl  # noqa: E402
from lightning_opd.rollout.agent_loop import AgentLoop  # noqa: E402


class EvalRecorder:
    """Counts the work of one ``evaluate`` while it runs (patches undone on exit).

    Attributes:
        logs: one :class:`GenerationLog` per generator ``evaluate`` created.
        trunk_calls: per KL trunk forward, the real tokens of each row (list of ints).
        kl_scored_tokens: positions the KL scored (each costs both output heads).
        kl_seconds: wall seconds inside ``trajectory_kl``.
        env_seconds: wall seconds in the agent loop's episode starts and ``_advance`` calls.
    """

    def __init__(self) -> None:
        self.logs: list[GenerationLog] = []
        self.trunk_calls: list[list[int]] = []
        self.kl_scored_tokens = 0
        self.kl_seconds = 0.0
        self.env_seconds = 0.0

    @contextlib.contextmanager
    def recording(self):
        """Patch ``Backends._generator``, ``teacher_kl.trunk_hidden_states``/``trajectory_kl`` and the agent
        loop's ``_start``/``_advance`` to count; restore them afterwards."""
        saved = [(evaluate_mod.Backends, "_generator"), (teacher_kl, "trunk_hidden_states"),
                 (teacher_kl, "trajectory_kl"), (AgentLoop, "_start"), (AgentLoop, "_advance")]
        originals = [getattr(owner, name) for owner, name in saved]
        make_generator, trunk, kl, start, advance = originals
        seen: dict[int, GenerationLog] = {}

        def generator(backends, engine_path):
            gen = make_generator(backends, engine_path)
            if id(gen) not in seen:
                seen[id(gen)] = GenerationLog(gen)
                self.logs.append(seen[id(gen)])
            return gen

        def trunk_hidden_states(model, input_ids, attention_mask):
            self.trunk_calls.append([int(n) for n in attention_mask.sum(dim=1).tolist()])
            return trunk(model, input_ids, attention_mask)

        def trajectory_kl(*args, **kwargs):
            t0 = time.perf_counter()
            out = kl(*args, **kwargs)
            self.kl_seconds += time.perf_counter() - t0
            self.kl_scored_tokens += out.tokens
            return out

        def timed(fn):
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.env_seconds += time.perf_counter() - t0
            return wrapper

        patched = [generator, trunk_hidden_states, trajectory_kl, timed(start), timed(advance)]
        for (owner, name), fn in zip(saved, patched):
            setattr(owner, name, fn)
        try:
            yield self
        finally:
            for (owner, name), fn in zip(saved, originals):
                setattr(owner, name, fn)

    def roofline(self, shape: ModelShape, machine: Machine) -> dict:
        """Counted quantities and roofline seconds of the recorded work (every policy shares ``shape``).

        Returns:
            ``generation`` (:func:`rollout_roofline` over every engine's calls), ``kl_flops``, ``kl_roofline_s``,
            ``env_s`` and ``roofline_s`` (their sum, seconds).
        """
        calls = [rows for log in self.logs for rows in log.calls]
        generation = rollout_roofline(shape, machine, calls)
        trunk_flops = sum(2 * shape.trunk_params * n + shape.attention_flops(n) for rows in self.trunk_calls for n in rows)
        kl_flops = trunk_flops + 2 * 2 * shape.head_params * self.kl_scored_tokens
        kl_s = kl_flops / machine.matmul_flops
        return {"generation": generation, "kl_trunk_tokens": sum(map(sum, self.trunk_calls)),
                "kl_trunk_passes": len(self.trunk_calls), "kl_scored_tokens": self.kl_scored_tokens,
                "kl_flops": kl_flops, "kl_roofline_s": kl_s, "env_s": self.env_seconds,
                "roofline_s": generation["roofline_s"] + kl_s + self.env_seconds}


def rescore(out: dict, machine: Machine, shape: ModelShape) -> dict:
    """``out`` of :func:`run` with its roofline (seconds) and fractions at ``machine``'s ceilings."""
    roof = out["recorder"].roofline(shape, machine)
    model_s = roof["generation"]["roofline_s"] + roof["kl_roofline_s"]
    return out | {"roofline": roof, "fraction": fraction(roof["roofline_s"], out["seconds"]),
                  "fraction_without_env": fraction(model_s, out["seconds"] - out["env_s"])}


def run(args) -> dict:
    """One ``evaluate`` of ``args.students`` recorded; returns its seconds, counts, results, and the ``recorder``
    (:func:`rescore` adds the roofline)."""
    settings = evaluate_mod.EvalSettings(avg_k=0, own_traj_kl=False, max_turns=args.max_turns,
                                         max_context_tokens=args.max_context_tokens, batch_size=args.batch_size,
                                         backend=args.backend, vllm_block_size=args.vllm_block_size or None)
    recorder = EvalRecorder()
    with recorder.recording():
        t0 = time.perf_counter()
        result = evaluate_mod.evaluate(args.students, games=args.games, limit=args.limit, settings=settings,
                                       teacher=args.teacher, cache_dir=None)
        seconds = time.perf_counter() - t0
    generate_s = sum(log.seconds for log in recorder.logs)
    out = {"seconds": seconds, "generate_s": generate_s, "kl_s": recorder.kl_seconds, "env_s": recorder.env_seconds,
           "other_s": seconds - generate_s - recorder.kl_seconds - recorder.env_seconds, "recorder": recorder,
           "engine_starts": result["engine_starts"], "tasks": len(result["tasks"]),
            "success": {s["name"]: s["summary"]["greedy"]["success"] for s in result["students"]},
            "teacher_traj_kl": {s["name"]: s["summary"].get("teacher_traj_kl", {}).get("mean") for s in result["students"]},
            "turns": {s["name"]: s["summary"]["greedy"]["turns"] for s in result["students"]}}
    return out


def report(r: dict) -> str:
    """The printed table: each part's measured and roofline seconds, and the fractions."""
    roof, gen = r["roofline"], r["roofline"]["generation"]
    rows = [["generation (every engine's generate calls)", f"{r['generate_s']:.1f}", f"{gen['roofline_s']:.1f}",
             f"{gen['prefill_tokens']} prefilled + {gen['cached_tokens']} cached prompt tokens, "
             f"{gen['sampled_tokens']} sampled, {gen['passes']} passes"],
            ["teacher-trajectory KL", f"{r['kl_s']:.1f}", f"{roof['kl_roofline_s']:.1f}",
             f"{roof['kl_trunk_passes']} trunk passes over {roof['kl_trunk_tokens']} tokens, "
             f"{roof['kl_scored_tokens']} scored"],
            ["environment + agent loop", f"{r['env_s']:.1f}", f"{roof['env_s']:.1f}", "counted as measured"],
            ["other (model loads, engine starts, weight pushes)", f"{r['other_s']:.1f}", "0", f"{r['engine_starts']} engine start(s)"],
            ["**whole evaluate**", f"**{r['seconds']:.1f}**", f"**{roof['roofline_s']:.1f}**",
             f"**{r['fraction']:.0%} of the roofline** ({r['fraction_without_env']:.0%} without the environment)"]]
    return markdown_table(["part", "measured s", "roofline s", "counted"], rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_artifact_args(p)
    p.add_argument("--students", nargs="+", default=None,
                   help="[LABEL=]PATH each (default: the demo's student before, teacher and student after)")
    p.add_argument("--student-after", default="artifacts/models/student-opd")
    p.add_argument("--limit", type=int, default=None, help="only the first N held-out games")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-context-tokens", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--backend", default="auto", choices=("auto", "hf", "vllm"))
    p.add_argument("--vllm-block-size", type=int, default=32, help="evaluate's --vllm-block-size (0: vLLM's default, 128)")
    p.add_argument("--no-save", action="store_true", help="print only (smoke runs)")
    args = p.parse_args(argv)
    if args.students is None:
        args.students = [f"student before={args.model}", f"teacher={args.teacher}",
                         f"student after (OPD)={args.student_after}"]
    missing = [s.partition("=")[2] or s for s in args.students if not Path(s.partition("=")[2] or s).exists()]
    if missing:
        raise SystemExit(f"missing student directories {missing}: run `make prepare teacher student-opd` first")
    from lightning_opd.models.loading import load_causal_lm

    model = load_causal_lm(args.model)
    shape = ModelShape.of(model)
    before = measure_machine(model)
    out = run(args)
    after = measure_machine(model)  # the ceilings vary from probe to probe (10-15% seen): the higher of the two
    machine = Machine(max(before["matmul_flops"], after["matmul_flops"]), max(before["bandwidth"], after["bandwidth"]))
    out = rescore(out, machine, shape) | {
        "machine": {"matmul_flops": machine.matmul_flops, "bandwidth": machine.bandwidth, "threads": after["threads"],
                    "probes": [{k: c[k] for k in ("matmul_flops", "bandwidth")} for c in (before, after)]},
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    print(f"{out['tasks']} held-out games x {len(args.students)} policies, greedy, <= {args.max_turns} turns; "
          f"matmul peak {machine.matmul_flops / 1e9:.0f} GFLOP/s, bandwidth {machine.bandwidth / 1e9:.1f} GB/s")
    print(report(out))
    print("success:", {k: round(v, 2) for k, v in out["success"].items()})
    del model
    if not args.no_save:
        key = f"{args.backend}_bs{args.vllm_block_size or None}_limit{args.limit}_turns{args.max_turns}_policies{len(args.students)}"
        ResultFile("eval_throughput").put(key, {k: v for k, v in out.items() if k != "recorder"})
    return out


if __name__ == "__main__":
    main()
