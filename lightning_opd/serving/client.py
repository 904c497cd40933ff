"""HTTP to one ``vllm serve`` endpoint: total deadlines, retries with backoff, a heartbeat, API keys, errors naming
the URL.

Every attempt has a total deadline of ``timeout_s`` seconds (connect, headers and the whole body: the body is read
in pieces and the clock checked between them, each socket read bounded by the time left, so a server that sends one
byte a second cannot stretch it, F33); a transient failure (connection refused or reset, the deadline, an answer that
broke off mid-body, HTTP 5xx / 429) is retried ``retries`` times with exponential backoff (``backoff_s * 2**i``) and
counted (:attr:`ServerClient.retry_count`, logged by the callers); what still fails raises :class:`ServerError`
naming the URL, the route and what failed, so a dead, stuck or trickling server ends the run within::

    deadline = timeout_s * (retries + 1) + backoff_s * (2**retries - 1)   # seconds

instead of hanging it (the defaults' numbers: docs/scaling.md "Deadlines and retries"). A 4xx answer (a malformed
request, e.g. a top-k above the server's ``--max-logprobs``) is not retried. :class:`Heartbeat` polls ``/health``
(under the same per-attempt deadline) in a thread for long runs and reports the first failure to the next request.

API keys (F35): a server started with ``--api-key`` (or vLLM's ``VLLM_API_KEY``) refuses requests without
``Authorization: Bearer <key>``. The client sends the key from the environment only, ``LIGHTNING_OPD_API_KEY`` or
else ``VLLM_API_KEY`` (:data:`API_KEY_ENV`), never from a config argument, and never writes it in an error, a log line
or its ``repr``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import requests
import urllib3.exceptions

#: the environment variables the API key is read from, in order (the first one set wins)
API_KEY_ENV = ("LIGHTNING_OPD_API_KEY", "VLLM_API_KEY")


def api_key_from_env() -> tuple[str | None, str | None]:
    """``(key, the variable it came from)`` from :data:`API_KEY_ENV`; ``(None, None)`` when none is set."""
    for name in API_KEY_ENV:
        value = os.environ.get(name)
        if value:
            return value, name
    return None, None


class _Deadline(Exception):
    """An attempt ran past its total deadline."""


class ServerError(RuntimeError):
    """A ``vllm serve`` endpoint failed: down, died, too slow, or answered something this client cannot use.

    Attributes:
        url: the endpoint's base URL.
        down: the server did not answer (connection failure, deadline, an answer that broke off, HTTP 5xx/429 after
            the retries, a failed heartbeat): another replica may take the request
            (:meth:`~lightning_opd.serving.pool.ServerPool.call`). ``False``: it answered something unusable (a 4xx,
            a malformed body), which another replica of the same model would answer too.
    """

    def __init__(self, url: str, what: str, down: bool = False) -> None:
        key, _ = api_key_from_env()
        if key:  # an echo of the key (a proxy's error page) never reaches a log line
            what = what.replace(key, "<redacted>")
        super().__init__(f"{url}: {what}")
        self.url = url
        self.down = down


TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})


class ServerClient:
    """JSON over HTTP to one server.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8000`` (a trailing ``/`` or ``/v1`` is dropped).
        timeout_s: total deadline of one attempt (seconds: connect, headers and the whole body). The default, 120 s,
            is about 10x the slowest measured teacher request (12.5 s: a 1,200-token episode's top-50 on 2 loaded CPU
            cores, docs/scaling.md); a whole request ends within ``timeout_s * (retries + 1) + backoff_s *
            (2**retries - 1)`` = 363 s with the defaults.
        retries: retries of a transient failure (>= 0).
        backoff_s: first backoff (seconds), doubled each retry.

    The API key, when a server needs one, comes from the environment only (:data:`API_KEY_ENV`; read here, at
    construction).

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
        self._key, self._key_env = api_key_from_env()  # never in a message or the repr
        self._local = threading.local()  # one requests.Session per thread (Session is not thread-safe)

    @property
    def session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
        return s

    def __repr__(self) -> str:
        key = f"API key from ${self._key_env}" if self._key else "no API key"
        return f"ServerClient({self.url!r}, timeout_s={self.timeout_s:g}, retries={self.retries}, {key})"

    @property
    def deadline_s(self) -> float:
        """The longest one :meth:`request` can take (seconds): ``timeout_s * (retries + 1) + backoff_s *
        (2**retries - 1)``."""
        return self.timeout_s * (self.retries + 1) + self.backoff_s * (2 ** self.retries - 1)

    def _attempt(self, method: str, route: str, payload: Any, timeout: float) -> tuple[int, bytes, int]:
        """One try under a total deadline of ``timeout`` seconds: ``(HTTP status, body, bytes sent)``.

        Raises:
            _Deadline: the deadline passed (connecting, waiting for headers, or between pieces of the body).
            requests.RequestException: connection failures; ``ChunkedEncodingError`` for a body that broke off.
        """
        end = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else None
        try:
            r = self.session.request(method, self.url + route, json=payload, timeout=timeout, stream=True,
                                     headers=headers)
        except requests.Timeout as e:
            raise _Deadline from e
        try:
            sent = len(r.request.body or b"")
            conn = getattr(r.raw, "connection", None)
            sock = getattr(conn, "sock", None)
            chunks: list[bytes] = []
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    raise _Deadline
                if sock is not None:
                    sock.settimeout(left)  # each socket read ends by the deadline
                try:
                    chunk = r.raw.read1(1 << 16, decode_content=True)
                except urllib3.exceptions.TimeoutError as e:
                    raise _Deadline from e
                except (urllib3.exceptions.HTTPError, OSError) as e:
                    raise requests.exceptions.ChunkedEncodingError(e) from e
                if not chunk:
                    r.raw.release_conn()  # read to the end: the connection goes back to the pool for reuse
                    return r.status_code, b"".join(chunks), sent
                chunks.append(chunk)
        finally:
            r.close()

    def healthy(self, timeout_s: float | None = None) -> bool:
        """``GET /health`` answered 200 within ``timeout_s`` seconds in total (default: the client's deadline per
        attempt)."""
        try:
            return self._attempt("GET", "/health", None, timeout_s or self.timeout_s)[0] == 200
        except (_Deadline, requests.RequestException):
            return False

    def request(self, method: str, route: str, payload: Any = None, timeout_s: float | None = None,
                retries: int | None = None, plain_text: bool = False) -> Any:
        """``method route`` with a JSON body; the JSON answer (``None`` for an empty body), or with ``plain_text`` the
        body as text (vLLM's LoRA routes answer ``Success: ...`` in plain text).

        ``timeout_s`` (default: the client's) is the total deadline of each attempt, ``retries`` (default: the
        client's) the retries of a transient failure; the whole call ends within ``timeout_s * (retries + 1) +
        backoff_s * (2**retries - 1)`` seconds.

        Raises:
            ServerError: after the retries, naming the URL, the route and the failure (connection, the deadline of
                ``timeout_s`` s, HTTP status and the server's message; ``down=True``); at once when the heartbeat saw
                the server fail (``down=True``); at once for a 4xx (HTTP 401/403: naming the environment variable of
                the API key) or a body that is not JSON (``down=False``).
        """
        if self.heartbeat is not None:
            self.heartbeat.check()
        timeout = timeout_s or self.timeout_s
        retries = self.retries if retries is None else int(retries)
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                self.retry_count += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                status, body, sent = self._attempt(method, route, payload, timeout)
                self.bytes_sent += sent
                self.bytes_received += len(body)
            except _Deadline:
                last = f"{method} {route} ran past its deadline of timeout_s={timeout:g} s"
                continue
            except requests.ConnectionError as e:
                last = f"{method} {route}: cannot connect ({type(e).__name__}: {e}); is the server running?"
                continue
            except requests.RequestException as e:  # e.g. ChunkedEncodingError: the server died mid-answer
                last = f"{method} {route}: the answer broke off ({type(e).__name__}: {e}); did the server die?"
                continue
            text = body.decode("utf-8", errors="replace")
            if status in TRANSIENT_STATUS:
                last = f"{method} {route} answered HTTP {status}: {text[:500]}"
                continue
            if status >= 400:
                raise ServerError(self.url, f"{method} {route} answered HTTP {status}: {text[:1000]}"
                                  f"{self._key_hint(status)}")
            self.request_count += 1
            if not body:
                return None
            if plain_text:
                return text
            try:
                return json.loads(body)
            except ValueError:
                raise ServerError(self.url, f"{method} {route} answered a body that is not JSON: {text[:300]!r}")
        raise ServerError(self.url, f"{last} ({retries + 1} attempts, retries={retries})", down=True)

    def _key_hint(self, status: int) -> str:
        """What to do about an HTTP 401/403 ('' for other statuses)."""
        if status not in (401, 403):
            return ""
        if self._key is None:
            return (f" (the server requires an API key: set {API_KEY_ENV[0]} (or {API_KEY_ENV[1]}) in the learner's "
                    "environment to the server's --api-key / VLLM_API_KEY)")
        return f" (the server refused the API key from ${self._key_env}: set it to the server's --api-key)"

    def post(self, route: str, payload: Any = None, timeout_s: float | None = None,
             retries: int | None = None, plain_text: bool = False) -> Any:
        """``POST route`` (see :meth:`request`)."""
        return self.request("POST", route, payload, timeout_s, retries, plain_text)

    def get(self, route: str, timeout_s: float | None = None, retries: int | None = None) -> Any:
        """``GET route`` (see :meth:`request`)."""
        return self.request("GET", route, None, timeout_s, retries)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus ``/metrics``, summed over label sets: ``{metric name: value}``.

        Raises:
            ServerError: naming the URL, when ``/metrics`` cannot be read (no retries: a monitoring read).
        """
        try:
            status, body, _ = self._attempt("GET", "/metrics", None, self.timeout_s)
        except _Deadline as e:
            raise ServerError(self.url, f"GET /metrics ran past its deadline of timeout_s={self.timeout_s:g} s") from e
        except requests.RequestException as e:
            raise ServerError(self.url, f"GET /metrics failed ({type(e).__name__}: {e})") from e
        if status != 200:
            raise ServerError(self.url, f"GET /metrics answered HTTP {status}{self._key_hint(status)}")
        out: dict[str, float] = {}
        for line in body.decode("utf-8", errors="replace").splitlines():
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
        timeout_s: seconds each poll may take in total (the client's per-attempt deadline, :meth:`ServerClient.healthy`).
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
            raise ServerError(self.client.url, self.error, down=True)

    def stop(self) -> None:
        self._stop_event.set()
