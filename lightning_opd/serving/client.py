"""HTTP to one ``vllm serve`` endpoint: bounded timeouts, retries with backoff, a heartbeat, errors naming the URL.

Every request has a timeout (``timeout_s``); a transient failure (connection refused or reset, a timeout, an
answer that broke off mid-body, HTTP 5xx / 429) is retried ``retries`` times with exponential backoff
(``backoff_s * 2**i``) and counted (:attr:`ServerClient.retry_count`, logged by the callers); what still fails
raises :class:`ServerError` naming the URL, the route and what failed, so a dead or stuck server ends the run
within ``timeout_s * (retries + 1) + sum(backoffs)`` seconds instead of hanging it. A 4xx answer (a malformed
request, e.g. a top-k above the server's ``--max-logprobs``) is not retried. :class:`Heartbeat` polls ``/health`` in a
thread for long runs and reports the first failure to the next request.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import requests


class ServerError(RuntimeError):
    """A ``vllm serve`` endpoint failed: down, died, too slow, or answered something this client cannot use.

    Attributes:
        url: the endpoint's base URL.
    """

    def __init__(self, url: str, what: str) -> None:
        super().__init__(f"{url}: {what}")
        self.url = url


TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


class ServerClient:
    """JSON over HTTP to one server.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000`` (a trailing ``/`` or ``/v1`` is dropped).
        timeout_s: per-request timeout (seconds; connect and read).
        retries: retries of a transient failure (>= 0).
        backoff_s: first backoff (seconds), doubled each retry.

    Raises:
        ValueError: a URL without ``http://``/``https://``, ``timeout_s <= 0``, ``retries < 0`` or ``backoff_s < 0``.
    """

    def __init__(self, url: str, timeout_s: float = 120.0, retries: int = 2, backoff_s: float = 1.0) -> None:
        url = str(url).rstrip("/")
        if url.endswith("/v1"):
            url = url[:-3]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server url={url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8000)")
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"{url}: timeout_s={timeout_s} must be > 0, retries={retries} and backoff_s={backoff_s} "
                             ">= 0")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.retry_count = 0  #: transient failures retried so far
        self.request_count = 0  #: requests answered so far
        self.bytes_sent = 0  #: request bodies sent so far (bytes, JSON)
        self.bytes_received = 0  #: answer bodies received so far (bytes)
        self.heartbeat: Heartbeat | None = None
        self._local = threading.local()  # one requests.Session per thread (Session is not thread-safe)

    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def healthy(self, timeout_s: float | None = None) -> bool:
        """``GET /health`` answered 200 within ``timeout_s`` (default: the client's)."""
        try:
            return self.session.get(self.url + "/health", timeout=timeout_s or self.timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def request(self, method: str, route: str, payload: Any = None, timeout_s: float | None = None) -> Any:
        """``method route`` with a JSON body; the JSON answer (``None`` for an empty body).

        Raises:
            ServerError: after the retries, naming the URL, the route and the failure (connection, timeout after
                ``timeout_s`` s, HTTP status and the server's message); at once for a 4xx or a body that is not
                JSON; at once when the heartbeat saw the server fail.
        """
        if self.heartbeat is not None:
            self.heartbeat.check()
        timeout = timeout_s or self.timeout_s
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.retry_count += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                r = self.session.request(method, self.url + route, json=payload, timeout=timeout)
                self.bytes_sent += len(r.request.body or b"")
                self.bytes_received += len(r.content)
            except requests.Timeout:
                last = f"{method} {route} timed out after timeout_s={timeout:g} s"
                continue
            except requests.ConnectionError as e:
                last = f"{method} {route}: cannot connect ({type(e).__name__}: {e}); is the server running?"
                continue
            except requests.RequestException as e:  # e.g. ChunkedEncodingError: the server died mid-answer
                last = f"{method} {route}: the answer broke off ({type(e).__name__}: {e}); did the server die?"
                continue
            if r.status_code in TRANSIENT_STATUS:
                last = f"{method} {route} answered HTTP {r.status_code}: {r.text[:500]}"
                continue
            if r.status_code >= 400:
                raise ServerError(self.url, f"{method} {route} answered HTTP {r.status_code}: {r.text[:1000]}")
            self.request_count += 1
            if not r.content:
                return None
            try:
                return r.json()
            except ValueError:
                raise ServerError(self.url, f"{method} {route} answered a body that is not JSON: {r.text[:300]!r}")
        raise ServerError(self.url, f"{last} ({self.retries + 1} attempts, retries={self.retries})")

    def post(self, route: str, payload: Any = None, timeout_s: float | None = None) -> Any:
        """``POST route`` (see :meth:`request`)."""
        return self.request("POST", route, payload, timeout_s)

    def get(self, route: str, timeout_s: float | None = None) -> Any:
        """``GET route`` (see :meth:`request`)."""
        return self.request("GET", route, None, timeout_s)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus ``/metrics``, summed over label sets: ``{metric name: value}``.

        Raises:
            ServerError: naming the URL, when ``/metrics`` cannot be read (no retries: a monitoring read).
        """
        try:
            r = self.session.get(self.url + "/metrics", timeout=self.timeout_s)
            r.raise_for_status()
        except requests.RequestException as e:
            raise ServerError(self.url, f"GET /metrics failed ({type(e).__name__}: {e})") from e
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out

    def start_heartbeat(self, interval_s: float = 10.0, timeout_s: float = 10.0) -> "Heartbeat":
        """Poll ``/health`` every ``interval_s`` seconds in a daemon thread; a failure is raised by the next
        :meth:`request`."""
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(self, interval_s, timeout_s)
            self.heartbeat.start()
        return self.heartbeat

    def close(self) -> None:
        """Stop the heartbeat."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None


class Heartbeat(threading.Thread):
    """``GET /health`` every ``interval_s`` seconds; after ``misses`` failures in a row the server counts as down.

    Args:
        client: the server's client.
        interval_s: seconds between polls.
        timeout_s: seconds each poll may take.
        misses: consecutive failed polls that mean down (>= 1).
    """

    def __init__(self, client: ServerClient, interval_s: float = 10.0, timeout_s: float = 10.0,
                 misses: int = 2) -> None:
        super().__init__(name=f"heartbeat {client.url}", daemon=True)
        if interval_s <= 0 or timeout_s <= 0 or misses < 1:
            raise ValueError(f"heartbeat of {client.url}: interval_s={interval_s} and timeout_s={timeout_s} must be "
                             f"> 0, misses={misses} >= 1")
        self.client, self.interval_s, self.timeout_s, self.misses = client, interval_s, timeout_s, misses
        self.error: str | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        missed = 0
        while not self._stop_event.wait(self.interval_s):
            if self.client.healthy(self.timeout_s):
                missed = 0
                continue
            missed += 1
            if missed >= self.misses:
                self.error = (f"/health failed {missed} times in a row (heartbeat every {self.interval_s:g} s, "
                              f"timeout {self.timeout_s:g} s): the server is down or stuck")
                return

    def check(self) -> None:
        """Raise :class:`ServerError` when the heartbeat saw the server go down."""
        if self.error is not None:
            raise ServerError(self.client.url, self.error)

    def stop(self) -> None:
        self._stop_event.set()
