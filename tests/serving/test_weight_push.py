"""One writer per server, for every pusher (:class:`~lightning_opd.serving.weight_push.ServerWeightPush` through
:meth:`~lightning_opd.serving.pool.ServerPool.writers`): at two learner ranks, rank ``r`` of 2 reloads only the servers
``urls[r::2]``, both for a served sampler (``RemoteGenerator.push_weights``) and for a served privileged teacher
with ``live`` weights (``PrivilegedTeacher.push``); a rank past the last URL writes no snapshot and reloads nothing; a
sampler with fewer URLs than ranks is refused at connect.

The ranks are the two values :func:`~lightning_opd.serving.pool.rank_world` gives (monkeypatched to ``(0, 2)`` and
``(1, 2)``, one process); the servers are plain ``http.server`` handlers that answer ``/health``, ``/v1/models`` and the
dev-mode push routes and record which routes each one was sent (``tests.servers.http_server``): the assertion is about
routing, which a real ``vllm serve`` would not make any clearer (tests/rollout/test_remote_generator.py and
tests/teachers/test_privileged_remote.py push to real servers)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import pytest
import torch

from lightning_opd.rollout.remote import RemoteGenerator
from lightning_opd.serving import ServerPool, ServerWeightPush
from lightning_opd.teachers import PrivilegedTeacher, RemoteTeacher
from tests.servers import http_server

PUSH_ROUTES = ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version", "/resume"]


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Healthy, serves model ``m``, answers every POST with ``{}``; records ``(port, path)`` of each POST."""

    posts: list[tuple[int, str]] = []
    lock = threading.Lock()

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        if self.path != "/health":
            self.wfile.write(json.dumps({"data": [{"id": "m", "max_model_len": 4096, "root": None}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.lock:
            self.posts.append((self.server.server_address[1], self.path))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def servers():
    """Three recording servers' URLs."""
    _Recorder.posts = []
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(http_server(_Recorder)) for _ in range(3)]


def at_rank(monkeypatch, rank: int, world: int = 2) -> None:
    """This process plays rank ``rank`` of ``world`` for the pool and the push."""
    for module in ("lightning_opd.serving.pool", "lightning_opd.serving.weight_push"):
        monkeypatch.setattr(f"{module}.rank_world", lambda: (rank, world))


def reloaded(urls: list[str]) -> list[str]:
    """The URLs that received a whole push (the five dev-mode routes in order), in ``urls`` order; posts cleared."""
    out = []
    for url in urls:
        port = int(url.rsplit(":", 1)[1])
        routes = [p for q, p in _Recorder.posts if q == port]
        assert routes in ([], PUSH_ROUTES), routes
        if routes:
            out.append(url)
    _Recorder.posts = []
    return out


STATE = {"w": torch.arange(4, dtype=torch.float32)}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_sampler_writes_only_to_its_ranks_servers(servers, monkeypatch, tmp_path, rank):
    at_rank(monkeypatch, rank)
    gen = RemoteGenerator(servers, heartbeat_s=0, weights_dir=str(tmp_path / "w"))
    try:
        gen.push_weights(STATE, 3)
        assert reloaded(servers) == servers[rank::2] == [c.url for c in gen.clients]
        assert [d.name for d in (tmp_path / "w" / f"rank{rank}").iterdir()] == ["v00000003"]
    finally:
        gen.close()


@pytest.mark.parametrize("rank", [0, 1])
def test_the_served_privileged_teacher_writes_only_to_its_ranks_servers(servers, monkeypatch, tmp_path, rank):
    """A ``live`` privileged teacher served on three replicas: every rank scores on all of them (the teacher pool is
    not split), but rank ``r`` pushes the weights to ``urls[r::2]`` only."""
    at_rank(monkeypatch, rank)
    teacher = PrivilegedTeacher("live", server=RemoteTeacher(servers, heartbeat_s=0, check_tokenizer=False),
                                weights_dir=str(tmp_path / "w"))
    teacher.attach_student(torch.nn.Linear(2, 2))
    try:
        teacher.load()
        assert teacher.server.clients == teacher.server.pool.clients == teacher.server.pool.all_clients
        teacher.on_optimizer_step()  # push_every=1: the push
        assert reloaded(servers) == servers[rank::2]
        assert teacher.pushed_version == 1 and teacher.stats["pushes"] == 1.0
    finally:
        teacher.close()


def test_a_rank_past_the_last_url_writes_nothing(servers, monkeypatch, tmp_path):
    """One teacher server, two ranks: rank 0 writes it; rank 1 writes no snapshot and reloads nothing."""
    pool = ServerPool(servers[:1], owner="RemoteTeacher", role="teacher", start_hint="-")
    pusher = ServerWeightPush(str(tmp_path / "w"))
    at_rank(monkeypatch, 1)
    assert pool.writers() == [] and pusher.push(pool, STATE, 1) == {"write": 0.0, "reload": 0.0, "total": 0.0}
    assert reloaded(servers) == [] and not (tmp_path / "w").exists()
    at_rank(monkeypatch, 0)
    pusher.push(pool, STATE, 1)
    assert reloaded(servers) == servers[:1]


def test_a_sampler_with_fewer_urls_than_ranks_is_refused(servers, monkeypatch):
    at_rank(monkeypatch, 0, world=4)
    gen = RemoteGenerator(servers, heartbeat_s=0)
    with pytest.raises(ValueError, match=r"3 sampler server\(s\) for 4 learner ranks; give at least one URL per rank"):
        gen.connect()
