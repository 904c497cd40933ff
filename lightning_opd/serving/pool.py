"""``ServerPool``: the ``vllm serve`` replicas of one model as a sampler or a teacher reaches them.

What every served model needs, written once for :class:`~lightning_opd.rollout.remote.RemoteGenerator` (the
sampler) and :class:`~lightning_opd.teachers.remote.RemoteTeacher` (the teacher): one
:class:`~lightning_opd.serving.client.ServerClient` per URL (timeouts, retries with backoff), and at
:meth:`ServerPool.connect`: each server answers ``/health`` and lists the model in ``/v1/models`` (the first one it
lists when none is named), the context limit is the smallest ``max_model_len`` among them, a heartbeat polls each,
and a thread pool runs the requests (``max_concurrency`` in flight, all servers together). :attr:`ServerPool.stats`
gives the owner's running totals plus retries and bytes over every client; :meth:`ServerPool.close` stops the
heartbeats and the request threads.

Several learner ranks: a server has one writer of its weights, rank ``r`` of ``W`` writes only to ``urls[r::W]``
(:meth:`ServerPool.writers`; :class:`~lightning_opd.serving.weight_push.ServerWeightPush` pushes to nothing else). A
sampler pool (``per_rank``) also requests only from those servers, so a push never lands between another rank's
requests, and fewer URLs than ranks is refused; a teacher pool requests from every server on every rank.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from lightning_opd.serving.client import ServerClient, ServerError


def rank_world() -> tuple[int, int]:
    """This process's rank and the world size (``(0, 1)`` without ``torch.distributed``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ServerPool:
    """The servers of one served model (replicas), the client side: connect, this rank's clients, stats, close.

    Args:
        urls: the servers' base URLs, e.g. ``http://10.0.0.7:8002``.
        owner: the holder's class name (``RemoteGenerator``, ``RemoteTeacher``), named in errors with the URLs.
        role: ``"sampler"`` or ``"teacher"``, named in errors and in the request threads' names.
        start_hint: how to start a server, named when one does not answer ``/health``.
        model: the served model name (``None``: the first one ``/v1/models`` lists, resolved at :meth:`connect`).
        timeout_s, retries, backoff_s: each client's (:class:`~lightning_opd.serving.client.ServerClient`).
        heartbeat_s: poll ``/health`` this often (seconds; 0: off); a failure is raised at the next request.
        max_concurrency: requests in flight at once (all servers together).
        per_rank: request only this rank's share of the servers (``urls[r::W]``, a sampler); ``False``: every rank
            requests every server (a teacher).
        totals: the owner's running totals (counts, seconds), added to by :meth:`count` and reported by
            :attr:`stats`.

    Raises:
        ValueError: a malformed URL or a bad client knob (:class:`~lightning_opd.serving.client.ServerClient`).
    """

    def __init__(self, urls: str | Sequence[str], *, owner: str, role: str, start_hint: str,
                 model: str | None = None, timeout_s: float = 120.0, retries: int = 2, backoff_s: float = 1.0,
                 heartbeat_s: float = 30.0, max_concurrency: int = 4, per_rank: bool = False,
                 totals: dict[str, float] | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.all_clients = [ServerClient(u, timeout_s, retries, backoff_s) for u in urls]
        self.clients: list[ServerClient] = []  #: the servers this rank requests from (:meth:`connect`)
        self.owner, self.role, self.start_hint = owner, role, start_hint
        self.model = model
        self.heartbeat_s = float(heartbeat_s)
        self.max_concurrency = int(max_concurrency)
        self.per_rank = per_rank
        self.max_model_len: int | None = None  #: the smallest ``max_model_len`` of :attr:`clients` (tokens)
        self.executor: ThreadPoolExecutor | None = None  #: the request threads (:meth:`connect`)
        self.connected = False
        #: guards :attr:`totals` and the clients' byte counters (request threads and pushes add to them)
        self.lock = threading.Lock()
        self.totals: dict[str, float] = dict(totals or {})

    @property
    def urls(self) -> list[str]:
        """All configured servers' URLs."""
        return [c.url for c in self.all_clients]

    @property
    def name(self) -> str:
        """``Owner(url, ...)``, as errors name the holder."""
        return f"{self.owner}({', '.join(self.urls)})"

    def writers(self) -> list[ServerClient]:
        """The servers whose weights this rank writes: ``all_clients[r::W]`` (one writer per server; empty on a
        rank past the last URL)."""
        rank, world = rank_world()
        return self.all_clients[rank::world]

    def connect(self, check: Callable[[ServerClient, dict], None] | None = None) -> None:
        """Reach the servers this rank requests from (once): each answers ``/health`` and serves :attr:`model`;
        ``check(client, model_entry)`` runs on each (e.g. the teacher's tokenizer check), before its heartbeat
        starts; :attr:`max_model_len` is the smallest the servers report.

        Raises:
            ValueError: ``per_rank`` with fewer servers than learner ranks.
            ServerError: a server is down or does not serve ``model`` (naming its URL); what ``check`` raises.
        """
        if self.connected:
            return
        clients = self.all_clients
        if self.per_rank:
            world = rank_world()[1]
            if len(clients) < world:
                raise ValueError(f"{self.name}: {len(clients)} {self.role} server(s) for {world} learner ranks; give "
                                 "at least one URL per rank (rank r uses urls[r::world_size], so each server has one "
                                 "writer of its weights)")
            clients = self.writers()
        self.max_model_len = None  # the servers of this connect only (a reconnect after close() reads them again)
        for client in clients:
            if not client.healthy():
                raise ServerError(client.url, f"/health does not answer 200 ({self.role} {self.name}, timeout "
                                  f"{client.timeout_s:g} s): start the {self.role} server first, e.g. "
                                  f"{self.start_hint}")
            served = client.get("/v1/models").get("data") or []
            names = [m.get("id") for m in served]
            if self.model is None and names:
                self.model = names[0]
            match = [m for m in served if m.get("id") == self.model]
            if not match:
                raise ServerError(client.url, f"serves {names}, not model={self.model!r} ({self.owner}.model)")
            n = match[0].get("max_model_len")
            if n:
                self.max_model_len = min(int(n), self.max_model_len or int(n))
            if check is not None:
                check(client, match[0])
            if self.heartbeat_s:
                client.start_heartbeat(self.heartbeat_s, min(self.heartbeat_s, 10.0))
        self.clients = clients
        self.executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix=f"remote-{self.role}")
        self.connected = True

    def count(self, **amounts: float) -> None:
        """Add ``amounts`` to :attr:`totals` (thread-safe)."""
        with self.lock:
            for key, value in amounts.items():
                self.totals[key] += value

    @property
    def stats(self) -> dict[str, float]:
        """Totals since start: :attr:`totals` plus retries and bytes sent/received over all clients (JSON bodies)."""
        with self.lock:
            out = dict(self.totals)
        return {**out, "retries": float(sum(c.retry_count for c in self.all_clients)),
                "bytes_sent": float(sum(c.bytes_sent for c in self.all_clients)),
                "bytes_received": float(sum(c.bytes_received for c in self.all_clients))}

    def close(self) -> None:
        """Stop the heartbeats and the request threads (a later :meth:`connect` reaches the servers again)."""
        for c in self.all_clients:
            c.close()
        if self.executor is not None:
            self.executor.shutdown(wait=False)
            self.executor = None
        self.connected = False
