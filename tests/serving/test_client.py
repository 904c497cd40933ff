"""ServerClient against a real local HTTP server that misbehaves the way a dying ``vllm serve`` does."""

import http.server
import json

import pytest

from lightning_opd.serving import free_port
from lightning_opd.serving.client import ServerClient, ServerError
from tests.servers import http_server


class _BreaksOff(http.server.BaseHTTPRequestHandler):
    """Answers POST with a 200 whose body stops after 13 of the 1000 bytes its Content-Length promises (the socket
    closes mid-answer, as when the server is SIGKILLed while sending), for the first ``broken`` requests; whole
    JSON after that."""

    broken = 0
    seen = 0

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen += 1
        if type(self).seen <= type(self).broken:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self.wfile.flush()
            self.close_connection = True
            return
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def breaks_off():
    _BreaksOff.seen = 0
    with http_server(_BreaksOff) as url:
        yield url
    _BreaksOff.broken = 0


def test_an_answer_that_breaks_off_is_a_server_error_naming_the_url(breaks_off):
    """Every answer truncated: 1 try + 2 retries, then ServerError (not requests' ChunkedEncodingError) naming the
    URL, the route and the truncation; 2 retries counted, 3 requests seen, none answered."""
    _BreaksOff.broken = 10
    client = ServerClient(breaks_off, timeout_s=5, retries=2, backoff_s=0.01)
    with pytest.raises(ServerError, match=r"POST /v1/completions: the answer broke off \(ChunkedEncodingError") as e:
        client.post("/v1/completions", {"prompt": [1, 2]})
    assert e.value.url == breaks_off and breaks_off in str(e.value)
    assert "3 attempts" in str(e.value)
    assert (client.retry_count, client.request_count, _BreaksOff.seen) == (2, 0, 3)


def test_one_truncated_answer_is_retried_and_the_next_one_used(breaks_off):
    """The first answer truncated, the second whole: the call returns the second's JSON, 1 retry counted."""
    _BreaksOff.broken = 1
    client = ServerClient(breaks_off, timeout_s=5, retries=1, backoff_s=0.01)
    assert client.post("/v1/completions", {"prompt": [1]}) == {"ok": True}
    assert (client.retry_count, client.request_count, _BreaksOff.seen) == (1, 1, 2)


def test_metrics_of_a_server_that_is_down_is_a_server_error_naming_the_url():
    """Nothing listens on the port: metrics() raises ServerError naming the URL and /metrics, not requests' error."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=url.replace(".", r"\.") + r": GET /metrics failed \(ConnectionError"):
        ServerClient(url, timeout_s=2).metrics()
