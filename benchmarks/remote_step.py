"""The demo's OPD step with the teacher (and the sampler) in-process vs as ``vllm serve`` processes (issue 41).

One run, arms side by side, each fit alone on the cores except for the servers it talks to:

* ``in_process``: ``conf/textworld/opd.yaml`` with the teacher-top-50 loss (``TeacherTopKRenormalizedReverseKL``,
  the loss a served teacher can feed), the teacher model in the learner's process;
* ``remote_teacher``: the same, the teacher a ``vllm serve`` process (``RemoteTeacher``), started here, pinned to
  ``--server-cpus`` with ``OMP_NUM_THREADS`` = their count;
* ``remote_both``: also the sampler on a ``vllm serve`` process with weight pushes (``RemoteGenerator``);
* ``remote_both_async``: that, asynchronous (``mode: async``, ``producer_lead: 1``), learner on the other cores.

Each arm is a ``lightning-opd fit`` child process for ``--steps`` optimizer steps. Printed per arm: the median of
steps 2..N of ``timing/rollout_s`` + ``timing/update_s`` (seconds per step; async: wall seconds per step from the
step timestamps, which include waiting for the producer), steps per hour, the learner process's peak RSS (its own
``ru_maxrss``: with the teacher served, the teacher's weights leave it; compared with the teacher's size on disk),
the bytes per step the teacher client moved (JSON bodies), and each server's prompt tokens and how many of them
came from its prefix cache (``/metrics``). Results:
benchmarks/results/remote_step.json (one entry per arm, resumable).

Run: .venv/bin/python -m benchmarks.remote_step [--steps 6] [--arms in_process remote_teacher]
(needs ``make prepare teacher install-vllm``; alone on the machine: it starts servers and times fits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ResultFile, markdown_table

ARMS = ("in_process", "remote_teacher", "remote_both", "remote_both_async")
TEACHER = "artifacts/models/teacher-textworld"
STUDENT = "artifacts/models/smollm2-135m"

CHILD = """
import atexit, resource, sys, json
def report():
    print("REMOTE_STEP_MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
atexit.register(report)
from lightning_opd.cli import main
sys.argv = ["lightning-opd"] + json.loads(sys.argv[1])
main()
"""


def arm_config(arm: str, teacher_url: str | None, sampler_url: str | None, steps: int, run_dir: Path) -> dict:
    """The YAML overrides of ``arm`` on top of ``conf/textworld/opd.yaml``."""
    model = {"loss": {"class_path": "lightning_opd.losses.TeacherTopKRenormalizedReverseKL", "init_args": {"k": 50}},
             "export_dir": None}
    if teacher_url:
        model["teacher"] = {"class_path": "lightning_opd.teachers.RemoteTeacher",
                            "init_args": {"urls": [teacher_url], "heartbeat_s": 30}}
    data: dict = {}
    if sampler_url:
        data["generator"] = {"class_path": "lightning_opd.rollout.remote.RemoteGenerator",
                             "init_args": {"urls": [sampler_url], "weights_dir": str(run_dir / "pushed_weights")}}
    if arm.endswith("_async"):
        data.update(mode="async", producer_lead=1)
    return {"trainer": {"max_steps": steps, "val_check_interval": None, "limit_val_batches": 0,
                        "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                   "init_args": {"save_dir": str(run_dir), "name": arm}}},
            "model": {"init_args": model}, "data": {"init_args": data}}


def read_scalars(run_dir: Path, arm: str) -> dict[str, list[tuple[int, float, float]]]:
    """``{tag: [(step, wall time, value)]}`` from the arm's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list] = {}
    for events in sorted((run_dir / arm).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.wall_time, e.value) for e in acc.Scalars(tag))
    return out


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*.safetensors"))


def run_arm(arm: str, steps: int, server_cpus: list[int], learner_cpus: list[int], run_dir: Path) -> dict:
    """Start the arm's servers, run its fit as a child process, stop the servers; the arm's measurements."""
    from lightning_opd.serving import ServerClient, VLLMServer

    servers = []
    try:
        teacher_url = sampler_url = None
        threads = max(1, len(server_cpus))
        if arm != "in_process":
            servers.append(VLLMServer(TEACHER, threads=threads, cpus=server_cpus, kv_cache_memory_bytes=1 << 29,
                                      max_model_len=2048).start())
            teacher_url = servers[-1].url
        if arm.startswith("remote_both"):
            from lightning_opd.rollout.remote import sampler_server_args

            servers.append(VLLMServer(STUDENT, threads=threads, cpus=server_cpus, kv_cache_memory_bytes=1 << 29,
                                      max_model_len=2048, dev_mode=True, extra_args=sampler_server_args(2048)).start())
            sampler_url = servers[-1].url
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            json.dump(arm_config(arm, teacher_url, sampler_url, steps, run_dir), f)  # JSON is YAML
        args = ["fit", "--config", "conf/textworld/opd.yaml", "--config", f.name]
        # in-process: the learner (and its teacher) on every core; served: the learner on learner_cpus, servers on theirs
        env = dict(os.environ, OMP_NUM_THREADS=str(len(os.sched_getaffinity(0)) if arm == "in_process"
                                                   else max(1, len(learner_cpus))))
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True,
                              preexec_fn=(lambda: os.sched_setaffinity(0, learner_cpus)) if arm != "in_process" else None)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"arm {arm}: fit failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        rss_kb = int(next(line.split()[-1] for line in proc.stdout.splitlines()
                          if line.startswith("REMOTE_STEP_MAXRSS_KB")))
        prompt_tokens = {}  # per server: prompt tokens it was sent and how many of them its prefix cache held
        for role, s in zip(("teacher", "sampler"), servers):
            m = ServerClient(s.url).metrics()
            prompt_tokens[role] = {"prompt_tokens": m.get("vllm:prompt_tokens_total", 0.0),
                                   "cached_prompt_tokens": m.get("vllm:prompt_tokens_cached_total", 0.0)}
    finally:
        for s in servers:
            s.stop()
    scalars = read_scalars(run_dir, arm)
    per_step = [r + u for (_, _, r), (_, _, u) in zip(scalars["timing/rollout_s"], scalars["timing/update_s"])]
    stamps = [w for _, w, _ in scalars["timing/rollout_s"]]
    wall_steps = [b - a for a, b in zip(stamps, stamps[1:])]
    timed = wall_steps[1:] if arm.endswith("_async") else per_step[1:]
    sent = scalars.get("teacher/bytes_sent", [])
    received = scalars.get("teacher/bytes_received", [])
    teacher_bytes = ((sent[-1][2] + received[-1][2]) / len(sent)) if sent else 0.0
    s_sent, s_received = scalars.get("sampler/bytes_sent", []), scalars.get("sampler/bytes_received", [])
    sampler_bytes = ((s_sent[-1][2] + s_received[-1][2]) / len(s_sent)) if s_sent else 0.0
    pushes = scalars.get("sampler/push_seconds", [])
    push_s = (pushes[-1][2] / scalars["sampler/pushes"][-1][2]) if pushes and scalars["sampler/pushes"][-1][2] else 0.0
    return {"arm": arm, "steps": len(per_step), "step_s_median": statistics.median(timed),
            "steps_per_hour": 3600.0 / statistics.median(timed), "learner_peak_rss_gb": rss_kb / 2 ** 20,
            "teacher_weights_gb": dir_bytes(TEACHER) / 2 ** 30, "teacher_bytes_per_step": teacher_bytes,
            "sampler_bytes_per_step": sampler_bytes, "push_s_mean": push_s,
            "rollout_s_median": statistics.median(r for _, _, r in scalars["timing/rollout_s"][1:]),
            "update_s_median": statistics.median(u for _, _, u in scalars["timing/update_s"][1:]),
            "fit_wall_s": wall, "server_prompt_tokens": prompt_tokens, "server_cpus": server_cpus if arm != "in_process" else None,
            "learner_cpus": learner_cpus if arm != "in_process" else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--server-cpus", type=int, nargs="+", default=[1])
    ap.add_argument("--learner-cpus", type=int, nargs="+", default=[0])
    ap.add_argument("--out", default="remote_step", help="result name under benchmarks/results/ (.json)")
    args = ap.parse_args()
    results = ResultFile(args.out)
    run_dir = Path(tempfile.mkdtemp(prefix="remote_step_"))
    for arm in args.arms:
        if arm in results:
            print(f"{arm}: done already ({args.out})")
            continue
        print(f"{arm}: running {args.steps} steps ...", flush=True)
        results.put(arm, run_arm(arm, args.steps, args.server_cpus, args.learner_cpus, run_dir))
    rows = [results[a] for a in ARMS if a in results]
    base = next((r for r in rows if r["arm"] == "in_process"), None)
    print(markdown_table(
        ["arm", "s/step (median)", "rollout s", "update s", "steps/h", "x in-process", "learner peak RSS GB",
         "teacher bytes/step", "sampler bytes/step", "push s"],
        [[r["arm"], f"{r['step_s_median']:.1f}", f"{r['rollout_s_median']:.1f}", f"{r['update_s_median']:.1f}",
          f"{r['steps_per_hour']:.0f}", f"{base['step_s_median'] / r['step_s_median']:.2f}" if base else "-",
          f"{r['learner_peak_rss_gb']:.2f}", f"{r['teacher_bytes_per_step'] / 1e6:.2f} MB",
          f"{r.get('sampler_bytes_per_step', 0.0) / 1e6:.2f} MB", f"{r.get('push_s_mean', 0.0):.1f}"] for r in rows]))
    if rows:
        print(f"teacher weights on disk: {rows[0]['teacher_weights_gb']:.2f} GB")


if __name__ == "__main__":
    main()
