"""F33: ``timeout_s`` is a total deadline per attempt, not per socket read. A plain local HTTP server that sends its
headers and then one byte a second (what a stuck proxy or a half-dead server looks like) against ``timeout_s=2,
retries=0``: the request ends in a ServerError naming the URL within ~2.5 s (before the fix each byte reset the read
timeout and the client waited for the whole drip); the heartbeat's ``/health`` probe is bounded the same way."""

import http.server
import time

import pytest

from lightning_opd.serving.client import Heartbeat, ServerClient, ServerError
from tests.servers import http_server

DRIP_S = 12  # the drip's length (bytes = seconds)


class _Drip(http.server.BaseHTTPRequestHandler):
    """Any GET or POST: 200 with headers at once (Content-Length ``DRIP_S``), then one byte a second."""

    def _drip(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", str(DRIP_S))
        self.end_headers()
        self.wfile.flush()
        try:
            for _ in range(DRIP_S):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(1.0)
        except OSError:  # the client gave up and closed the connection
            pass

    do_GET = do_POST = _drip

    def log_message(self, *args):
        pass


@pytest.fixture
def drip():
    with http_server(_Drip) as url:
        yield url


def test_a_server_that_drips_one_byte_a_second_ends_within_the_deadline(drip):
    client = ServerClient(drip, timeout_s=2, retries=0)
    assert client.deadline_s == 2.0
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"POST /v1/completions ran past its deadline of timeout_s=2 s") as e:
        client.post("/v1/completions", {"prompt": [1, 2]})
    took = time.monotonic() - t0
    assert e.value.url == drip and drip in str(e.value)
    assert took < 2.5, f"the request took {took:.1f} s against a 2 s deadline"


def test_the_whole_request_is_bounded_by_the_stated_formula(drip):
    """retries=1, backoff 0.2 s: deadline = 1 * 2 + 0.2 * (2**1 - 1) = 2.2 s; 2 attempts made, 1 retry counted."""
    client = ServerClient(drip, timeout_s=1, retries=1, backoff_s=0.2)
    assert client.deadline_s == pytest.approx(2.2)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=r"2 attempts, retries=1"):
        client.get("/v1/models")
    assert time.monotonic() - t0 < client.deadline_s + 0.5
    assert client.retry_count == 1


def test_the_heartbeat_probe_uses_the_same_deadline(drip):
    """``/health`` drips: healthy(2) is False within ~2.5 s, and a heartbeat with 2 misses reports the server down."""
    client = ServerClient(drip, timeout_s=2, retries=0)
    t0 = time.monotonic()
    assert client.healthy(2) is False
    assert time.monotonic() - t0 < 2.5
    beat = Heartbeat(client, interval_s=0.1, timeout_s=1, misses=2)
    t0 = time.monotonic()
    beat.start()
    beat.join(timeout=6)
    assert not beat.is_alive() and time.monotonic() - t0 < 3.5
    with pytest.raises(ServerError, match=r"/health failed 2 times in a row"):
        beat.check()
