"""Failover between replicas (F34), at the pool: :meth:`ServerPool.call` moves a request whose server does not answer
to the next live one and marks the dead one out, ending only when none is left (naming every server and why); an
answer the server gave (a 4xx) is not moved; a dead server rejoins through :meth:`ServerPool.rejoin` once its
``/health`` answers again (the owner's ``on_rejoin`` runs); a weight push that fails on one server resumes it and
marks it dead, the others take the push, and it fails only when every server failed.

The servers are plain ``http.server`` handlers on 127.0.0.1 that answer like a healthy ``vllm serve`` and record the
routes they were sent (``tests.servers.http_server``); a "dead" server is one whose port was closed, a restart one
started again on the same port. The same behaviour on real ``vllm serve`` replicas, one killed: tests/rollout/
test_remote_failover.py and tests/teachers/test_remote_teacher_failover.py.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from lightning_opd.serving import ServerError, ServerPool, ServerWeightPush
from tests.servers import ModelServer, http_server


class _Replica(ModelServer):
    """Healthy, serves model ``m``; ``POST /echo`` answers ``{"port": its port}``, ``POST /bad`` HTTP 400, and
    ``POST /collective_rpc`` HTTP 500 on the ports in :attr:`failing_reload`; every POST path is recorded."""

    posts: list[tuple[int, str]] = []
    failing_reload: set[int] = set()
    lock = threading.Lock()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        port = self.server.server_address[1]
        with self.lock:
            self.posts.append((port, self.path))
        status = 200
        if self.path == "/bad":
            status = 400
        elif self.path == "/collective_rpc" and port in self.failing_reload:
            status = 500
        self.send_response(status)
        self.end_headers()
        self.wfile.write(json.dumps({"port": port}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture(autouse=True)
def _fresh_records():
    _Replica.posts, _Replica.failing_reload = [], set()


def _pool(urls, **kw) -> ServerPool:
    kw = {"heartbeat_s": 0, "timeout_s": 2.0, "retries": 2, "backoff_s": 0.05, **kw}
    return ServerPool(urls, owner="Test", role="sampler", start_hint="-", **kw)


def _echo(client, retries):
    return client.post("/echo", {}, retries=retries)["port"]


def _b_dies_after_connect(a: str, **kw) -> tuple[ServerPool, str, int, tuple]:
    """A pool of ``[a, b]`` connected, then ``b`` closed and a request sent to it first: ``(pool, b's URL, its port,
    what the call returned)``; the call warns naming ``b``."""
    with http_server(_Replica) as b:
        pool = _pool([a, b], **kw)
        pool.connect()
    with pytest.warns(RuntimeWarning, match=b.replace("http://", "")):
        answered = pool.call(_echo, first=pool.clients[1])
    return pool, b, int(b.rsplit(":", 1)[1]), answered


def test_a_request_moves_to_the_live_replica_and_the_dead_one_is_named():
    with http_server(_Replica) as a:
        pool, b, _, (client, port) = _b_dies_after_connect(a)
        assert client.url == a and port == int(a.rsplit(":", 1)[1])
        assert list(pool.dead) == [b] and "cannot connect" in pool.dead[b]
        stats = pool.stats
        assert stats["failovers"] == 1 and stats["servers_live"] == 1
        # the failing replica had one attempt (another was left): no retries counted on it
        assert pool.clients[1].retry_count == 0
        # the next call goes to the live one at once
        assert pool.call(_echo)[0].url == a
        pool.close()


def test_the_last_replica_gets_its_retries_then_the_error_names_every_server():
    with http_server(_Replica) as a, http_server(_Replica) as b:
        pool = _pool([a, b])
        pool.connect()
    # both closed now
    with pytest.warns(RuntimeWarning):
        with pytest.raises(ServerError, match="no sampler server of Test is left") as err:
            pool.call(_echo)
    assert a in str(err.value) and b in str(err.value) and err.value.down
    assert pool.clients[0].retry_count == 0 and pool.clients[1].retry_count == 2  # the last one: retries=2
    assert pool.stats["servers_live"] == 0


def test_an_answer_the_server_gave_is_not_moved():
    with http_server(_Replica) as a, http_server(_Replica) as b:
        pool = _pool([a, b])
        pool.connect()
        with pytest.raises(ServerError, match="HTTP 400") as err:
            pool.call(lambda c, r: c.post("/bad", {}, retries=r))
        assert not err.value.down and pool.dead == {}
        assert sum(path == "/bad" for _, path in _Replica.posts) == 1
        pool.close()


def test_a_dead_replica_rejoins_once_its_health_answers_and_on_rejoin_ran():
    with http_server(_Replica) as a:
        pool, b, port_b, _ = _b_dies_after_connect(a, rejoin_s=0.2)
        seen = []
        pool.on_rejoin = seen.append
        assert b in pool.dead
        assert pool.rejoin() == []  # still down
        with http_server(_Replica, port_b):
            assert pool.rejoin() == []  # probed less than rejoin_s ago
            time.sleep(0.25)
            assert pool.rejoin() == [b]
            assert [c.url for c in seen] == [b] and pool.dead == {}
            assert pool.call(_echo, first=pool.clients[1])[1] == port_b
            assert pool.stats["rejoins"] == 1 and pool.stats["servers_live"] == 2
        pool.close()


def test_a_server_whose_on_rejoin_fails_stays_out_with_the_reason():
    with http_server(_Replica) as a:
        pool, b, port_b, _ = _b_dies_after_connect(a, rejoin_s=0)

        def refuse(client):
            raise ServerError(client.url, "the snapshot is gone")

        pool.on_rejoin = refuse
        with http_server(_Replica, port_b):
            assert pool.rejoin() == []
            assert "could not rejoin" in pool.dead[b] and "the snapshot is gone" in pool.dead[b]
        pool.close()


def test_a_failed_push_resumes_that_server_marks_it_dead_and_the_others_serve_it(tmp_path):
    state = {"w": torch.ones(2)}
    with http_server(_Replica) as a, http_server(_Replica) as b:
        port_a, port_b = (int(u.rsplit(":", 1)[1]) for u in (a, b))
        _Replica.failing_reload = {port_b}
        pool = _pool([a, b])
        pool.connect()
        push = ServerWeightPush(str(tmp_path))
        with pytest.warns(RuntimeWarning, match="collective_rpc|reload_weights"):
            push.push(pool, state, 3)
        on_b = [path for port, path in _Replica.posts if port == port_b]
        on_a = [path for port, path in _Replica.posts if port == port_a]
        # b: paused, the reload failed, then resumed (not left paused), and out of the pool
        assert on_b == ["/pause?mode=wait", "/collective_rpc", "/resume"]
        assert list(pool.dead) == [b] and "reload_weights failed" in pool.dead[b]
        assert on_a == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                        "/resume"]
        assert push.last_version == 3
        # the next push goes to the live server only
        _Replica.posts = []
        push.push(pool, state, 4)
        assert {port for port, _ in _Replica.posts} == {port_a}
        # b back, healthy again: restore gives it the last snapshot (version 4)
        _Replica.failing_reload, _Replica.posts = set(), []
        push.restore(pool, pool.clients[1])
        assert [path for _, path in _Replica.posts] == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache",
                                                        "/update_weight_version", "/resume"]
        push.close()
        pool.close()


def test_a_push_that_fails_on_every_server_raises_naming_them(tmp_path):
    with http_server(_Replica) as a, http_server(_Replica) as b:
        _Replica.failing_reload = {int(u.rsplit(":", 1)[1]) for u in (a, b)}
        pool = _pool([a, b])
        pool.connect()
        push = ServerWeightPush(str(tmp_path))
        with pytest.warns(RuntimeWarning), pytest.raises(ServerError, match="no sampler server of Test is left") as e:
            push.push(pool, {"w": torch.ones(2)}, 1)
        assert a in str(e.value) and b in str(e.value) and "reload_weights failed" in str(e.value)
        assert push.last_version is None  # nothing was served
        resumed = sorted(port for port, path in _Replica.posts if path == "/resume")
        assert len(resumed) == 2
        push.close()
        pool.close()
