"""``RoutedTeacher`` owns its per-teacher step sums (``observe_kl`` / ``step_metrics``), and the ``Teacher`` base
declares what the learner reads of every teacher (``close``, ``stats``, ``observe_kl``, ``step_metrics``); no server
needed (fake teachers)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from lightning_opd.losses import TeacherSignal
from lightning_opd.teachers import RoutedTeacher, Teacher


class Counting(Teacher):
    provides = frozenset({TeacherSignal.SAMPLED_TOKEN})

    def __init__(self):
        self.closed = 0

    def close(self) -> None:
        self.closed += 1

    @property
    def stats(self) -> dict[str, float]:
        return {"requests": 3.0}


def test_the_base_teacher_has_no_metrics_and_closes_nothing():
    t = Teacher()
    t.close()
    t.observe_kl(None, torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool))
    assert t.stats == {} and t.step_metrics(lambda x: x, "kl", "cpu") == {}


def test_token_share_and_kl_per_teacher_then_reset():
    """Rows of tasks a, b, a: teacher one has rows 0 and 2 (3 + 1 supervised tokens, KL 0.5 and 2.0 per token),
    teacher two row 1 (2 tokens at 1.0): shares 4/6 and 2/6, KL (1.5 + 2.0) / 4 and 2.0 / 2."""
    one, two = Counting(), Counting()
    t = RoutedTeacher({"one": one, "two": two}, {"a": "one", "b": "two"})
    keep = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 9.0], [9.0, 2.0, 9.0]])
    batch = SimpleNamespace(size=2, task_ids=["a1", "b1"])
    t.observe_kl(batch, kl[:2], keep[:2])  # two micro-batches of the step
    t.observe_kl(SimpleNamespace(size=1, task_ids=["a2"]), kl[2:], keep[2:])
    out = t.step_metrics(lambda x: x, "kl_sampled", "cpu")
    assert math.isclose(out["teacher/one/token_share"], 4 / 6) and math.isclose(out["teacher/two/token_share"], 2 / 6)
    assert math.isclose(out["teacher/one/kl_sampled"], 3.5 / 4) and math.isclose(out["teacher/two/kl_sampled"], 1.0)
    assert out["teacher/one/requests"] == 3.0 and out["teacher/two/requests"] == 3.0
    again = t.step_metrics(lambda x: x, "kl_sampled", "cpu")
    assert again["teacher/one/token_share"] == 0.0 and math.isnan(again["teacher/one/kl_sampled"])
    t.close()
    assert (one.closed, two.closed) == (1, 1)
