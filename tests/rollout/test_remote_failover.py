"""F34 for the served sampler: two real tiny ``vllm serve`` sampler replicas on 127.0.0.1 (marker ``vllm``; three
starts, ~1 min each on 2 cores).

Pushed version 3 (perturbed weights) on both; one replica killed between two calls: the episodes move to the other,
every reply stamped 3 and sampled by the pushed weights (the same ids as before for the same seeds: the request seed
does not depend on the server); the dead one is out. Started again behind the same port with its original checkpoint
(it reports ``default``), it rejoins at the next call only after it was given the pushed snapshot (it reports ``3``)
and takes episodes again. Then the version check must read the replica that answered: the live replica is restarted
behind our back (not seen dead: no heartbeat, no failed request) and the other one killed, so every reply is answered
by the restarted one, which is found at the check and re-pushed, its replies sampled again. Before the fix, the killed
replica ended the call."""

from __future__ import annotations

import pytest

from lightning_opd.rollout.chat import stop_token_ids
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.remote import RemoteGenerator
from lightning_opd.serving import ServerClient
from tests.helpers import StaticPolicy
from tests.rollout.test_remote_generator import max_gap, prompts, requests_for
from tests.rollout.test_remote_version import original_and_perturbed, start_sampler

pytestmark = [pytest.mark.timeout(1500)]


def _served_by(client: ServerClient) -> float:
    """Replies a server completed since it started (vLLM's ``/metrics``)."""
    return client.metrics().get("vllm:request_success_total", 0.0)


@pytest.mark.vllm
def test_a_killed_replica_fails_over_rejoins_with_the_pushed_weights_and_is_version_checked(
        served_model_dirs, tokenizer, tmp_path):
    student = served_model_dirs["student"]
    original, new = original_and_perturbed(student)
    a, b = start_sampler(student), start_sampler(student)
    servers = [a, b]
    gen = RemoteGenerator([a.url, b.url], heartbeat_s=0, retries=1, backoff_s=0.2, rejoin_s=0,
                          weights_dir=str(tmp_path / "weights"))
    gen.attach(StaticPolicy(original, tokenizer), stop_token_ids(tokenizer))
    gen.follow_policy = False
    ps = prompts(tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    try:
        gen.push_weights(new.state_dict(), 3)
        before = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 3 for o in before) and max_gap(new, ps, before, sampling) < 1e-4
        ca, cb = gen.clients
        assert _served_by(ca) >= 1 and _served_by(cb) >= 1  # both replicas sampled

        # b dies: its episodes move to a, nothing stamped wrong, the same replies for the same seeds
        b.kill()
        gen.release()
        with pytest.warns(RuntimeWarning, match=b.url.replace("http://", "")):
            after = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 3 for o in after) and max_gap(new, ps, after, sampling) < 1e-4
        assert [o.token_ids for o in after] == [o.token_ids for o in before]
        assert list(gen.pool.dead) == [b.url] and gen.stats["servers_live"] == 1 and gen.stats["failovers"] >= 1

        # b restarts behind the same port with its checkpoint: it rejoins holding version 3, and samples again
        b2 = start_sampler(student, port=b.port)
        servers.append(b2)
        assert ServerClient(b.url).get("/weight_info")["weight_version"] == "default"
        gen.release()
        again = gen.generate(requests_for(ps), sampling)
        assert gen.pool.dead == {} and gen.stats["rejoins"] == 1
        assert gen.server_versions() == {a.url: "3", b.url: "3"}
        assert _served_by(cb) >= 1, "the rejoined replica sampled nothing"
        assert [o.token_ids for o in again] == [o.token_ids for o in before]
        assert max_gap(new, ps, again, sampling) < 1e-4

        # the version check reads the replica that answered: b restarts unseen (default), a dies
        b2.stop()
        b3 = start_sampler(student, port=b.port)
        servers.append(b3)
        a.kill()
        repushes = gen.stats["repushes"]
        gen.release()
        with pytest.warns(RuntimeWarning, match=a.url.replace("http://", "")):
            last = gen.generate(requests_for(ps), sampling)
        assert all(o.policy_version == 3 for o in last) and max_gap(new, ps, last, sampling) < 1e-4
        assert [o.token_ids for o in last] == [o.token_ids for o in before]
        assert gen.stats["repushes"] == repushes + 1 and gen.server_versions()[b.url] == "3"
    finally:
        gen.close()
        for s in servers:
            s.stop()
