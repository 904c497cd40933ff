"""``ServerPool``: the ``vllm serve`` replicas of one model as a sampler or a teacher reaches them.

What every served model needs, written once for :class:`~lightning_opd.rollout.remote.RemoteGenerator` (the
sampler) and :class:`~lightning_opd.teachers.remote.RemoteTeacher` (the teacher): one
:class:`~lightning_opd.serving.client.ServerClient` per URL (timeouts, retries with backoff), and at
:meth:`ServerPool.connect`: each server answers ``/health`` and lists the model in ``/v1/models`` (the first one it
lists when none is named), the context limit is the smallest ``max_model_len`` among them, a heartbeat polls each,
and a thread pool runs the requests (``max_concurrency`` in flight, all servers together). :attr:`ServerPool.stats`
gives the owner's running totals plus retries and bytes over every client; :meth:`ServerPool.close` stops the
heartbeats and the request threads.

Failover (F34): a request goes through :meth:`ServerPool.call`, which moves it to the next live replica when its
server does not answer (:attr:`ServerError.down <lightning_opd.serving.client.ServerError.down>`: connection refused
or reset, the deadline, HTTP 5xx/429, a failed heartbeat) and marks that server dead; while another replica is left
the failing one gets one attempt (no retries), the last one left its client's retries, so a request ends within::

    (n_live - 1) * timeout_s + timeout_s * (retries + 1) + backoff_s * (2**retries - 1)   # seconds

and the fit ends (a :class:`ServerError` naming every server and why it failed) only when none is left. A dead
server rejoins at the owner's next call (:meth:`ServerPool.rejoin`, at most every ``rejoin_s`` seconds per server):
``/health`` answers, it serves the model, the owner's connect check passes (the tokenizer) and the owner's
``on_rejoin`` (the sampler: the last pushed weights, confirmed by version). A weight push that fails on a server
resumes it (best effort, so it is not left paused) and marks it dead; a push is an error only when it failed on every
server it writes (:class:`~lightning_opd.serving.weight_push.ServerWeightPush`).

Several learner ranks: a server has one writer of its weights, rank ``r`` of ``W`` writes only to ``urls[r::W]``
(:meth:`ServerPool.writers`; :class:`~lightning_opd.serving.weight_push.ServerWeightPush` pushes to nothing else). A
sampler pool (``per_rank``) also requests only from those servers, so a push never lands between another rank's
requests, and fewer URLs than ranks is refused; a teacher pool requests from every server on every rank.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import torch

from lightning_opd.serving.client import ServerClient, ServerError

T = TypeVar("T")
#: the owner's per-server check at connect and rejoin: ``check(client, model entry of /v1/models)``
Check = Callable[[ServerClient, dict], None]


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
        rejoin_s: probe a dead server's ``/health`` at most this often (seconds, at the owner's calls of
            :meth:`rejoin`); 0: at every call.

    Raises:
        ValueError: a malformed URL or a bad client knob (:class:`~lightning_opd.serving.client.ServerClient`).
    """

    def __init__(self, urls: str | Sequence[str], *, owner: str, role: str, start_hint: str,
                 model: str | None = None, timeout_s: float = 120.0, retries: int = 2, backoff_s: float = 1.0,
                 heartbeat_s: float = 30.0, max_concurrency: int = 4, per_rank: bool = False,
                 totals: dict[str, float] | None = None, rejoin_s: float = 30.0) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if rejoin_s < 0:
            raise ValueError(f"{owner}: rejoin_s={rejoin_s} must be >= 0 (seconds between probes of a dead server)")
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
        self.totals: dict[str, float] = {**dict(totals or {}), "failovers": 0, "rejoins": 0}
        self.rejoin_s = float(rejoin_s)
        #: dead servers of :attr:`clients`: URL -> why (the failure that took it out, or why it could not rejoin)
        self.dead: dict[str, str] = {}
        self._probed: dict[str, float] = {}  # URL -> monotonic time of its last rejoin probe
        self._check: Check | None = None  # connect's check, run again at a rejoin
        #: the owner's step for a server that rejoins, after its health, model and check passed (the sampler: the
        #: last pushed weights); raising keeps the server out
        self.on_rejoin: Callable[[ServerClient], None] | None = None

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
        self._check = check
        for client in clients:
            self._admit(client)
        self.dead.clear()
        self.clients = clients
        self.executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix=f"remote-{self.role}")
        self.connected = True

    def _admit(self, client: ServerClient) -> None:
        """``client`` answers ``/health``, serves :attr:`model` and passes the connect check; its heartbeat starts.

        Raises:
            ServerError: the server is down or does not serve :attr:`model`; what the check raises.
        """
        if not client.healthy():
            raise ServerError(client.url, f"/health does not answer 200 ({self.role} {self.name}, timeout "
                              f"{client.timeout_s:g} s): start the {self.role} server first, e.g. "
                              f"{self.start_hint}", down=True)
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
        if self._check is not None:
            self._check(client, match[0])
        if self.heartbeat_s:
            client.start_heartbeat(self.heartbeat_s, min(self.heartbeat_s, 10.0))

    # --------------------------------------------------------------------------------------------- failover
    def live(self) -> list[ServerClient]:
        """This rank's servers that are not dead (a server whose heartbeat saw it fail is marked dead here)."""
        for c in self.clients:
            if c.url not in self.dead and c.heartbeat is not None and c.heartbeat.error is not None:
                self.mark_dead(c, c.heartbeat.error)
        return [c for c in self.clients if c.url not in self.dead]

    def mark_dead(self, client: ServerClient, why: str) -> None:
        """Take ``client`` out of :meth:`live` (its heartbeat stops) until :meth:`rejoin` lets it back."""
        with self.lock:
            if client.url in self.dead:
                return
            self.dead[client.url] = why
            self._probed[client.url] = time.monotonic()
        client.close()
        left = len(self.clients) - len(self.dead)
        warnings.warn(f"{self.role} server {client.url} is out ({why}); {left} of {len(self.clients)} left, it "
                      f"rejoins once /health answers (probed every {self.rejoin_s:g} s)", RuntimeWarning,
                      stacklevel=2)

    def call(self, fn: Callable[[ServerClient, int | None], T], first: ServerClient | None = None
             ) -> tuple[ServerClient, T]:
        """``fn(client, retries)`` on ``first`` (default: the first live server), moved to the next live server
        while the one tried does not answer (``ServerError.down``; it is marked dead): ``(the server that answered,
        what fn returned)``. ``retries`` is 0 while another live server is left to try, else ``None`` (the client's).

        Raises:
            ServerError: ``fn``'s error at once when the server answered something unusable (``down=False``); when
                no live server is left, naming every server of this rank and why it is out (``down=True``).
        """
        tried: set[str] = set()
        while True:
            live = [c for c in self.live() if c.url not in tried]
            if not live:
                raise self.dead_error()
            client = first if first is not None and first in live else live[0]
            tried.add(client.url)
            try:
                return client, fn(client, 0 if len(live) > 1 else None)
            except ServerError as err:
                if not err.down:
                    raise
                self.mark_dead(client, str(err).removeprefix(f"{client.url}: "))
                if len(self.live()):
                    self.count(failovers=1)
            first = None

    def dead_error(self, clients: Sequence[ServerClient] | None = None) -> ServerError:
        """The error when none of ``clients`` (default: this rank's) is live, naming each and why it is out."""
        clients = self.clients if clients is None else clients
        why = "; ".join(f"{c.url}: {self.dead.get(c.url, '?')}" for c in clients)
        return ServerError(", ".join(c.url for c in clients),
                           f"no {self.role} server of {self.owner} is left ({len(clients)} out: {why}). Start them "
                           "again and resume the fit from last.ckpt", down=True)

    def rejoin(self) -> list[str]:
        """Probe each dead server due a probe (every ``rejoin_s`` seconds): one that answers ``/health``, serves
        the model, passes the connect check and the owner's :attr:`on_rejoin` is live again. Call it between
        requests (the owners do at the start of each generate / score call). Returns the URLs that rejoined.
        A server that fails any step stays dead (its reason updated) and is probed again later."""
        back = []
        now = time.monotonic()
        for client in self.clients:
            if client.url not in self.dead or now - self._probed.get(client.url, 0.0) < self.rejoin_s:
                continue
            self._probed[client.url] = now
            if not client.healthy(min(client.timeout_s, 10.0)):
                continue
            try:
                self._admit(client)
                if self.on_rejoin is not None:
                    self.on_rejoin(client)
            except Exception as err:  # noqa: BLE001 - any failed step keeps it out; the reason is kept
                client.close()
                with self.lock:
                    self.dead[client.url] = f"answers /health again but could not rejoin: {err}"
                continue
            with self.lock:
                self.dead.pop(client.url, None)
            self.count(rejoins=1)
            back.append(client.url)
        return back

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
        return {**out, "servers_live": float(len(self.clients) - len(self.dead)),
                "retries": float(sum(c.retry_count for c in self.all_clients)),
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
        self.dead.clear()
