"""The per-task-type table of an evaluate JSON: task types from ids, a failed episode scored 0, means by hand."""

import pytest

from benchmarks.task_types import episode_score, report, summarise, task_type


def _record(task, success, failure, reward):
    return {"task_id": task, "seed": 0, "success": success, "failure": failure, "reward": reward}


def _result():
    """Two types x 2 tasks; 'before' wins nothing and fails one (reward -1.0 from ScienceWorld's -100), 'teacher'
    and 'after' win some; rewards are score / 100."""
    tasks = ["find-plant-test-v1", "find-plant-test-v2", "lifespan-longest-lived-test-v7", "lifespan-longest-lived-test-v8"]
    before = [_record(tasks[0], 0, 1, -1.0), _record(tasks[1], 0, 0, 0.25), _record(tasks[2], 0, 0, 0.0),
              _record(tasks[3], 0, 0, 0.5)]
    teacher = [_record(tasks[0], 1, 0, 1.0), _record(tasks[1], 0, 0, 0.5), _record(tasks[2], 1, 0, 1.0),
               _record(tasks[3], 0, 1, -0.5)]
    after = [_record(t, 1, 0, 1.0) for t in tasks]
    return {"students": [{"name": "before", "greedy": before}, {"name": "teacher", "greedy": teacher},
                         {"name": "after", "greedy": after}]}


def test_task_type_and_score():
    assert task_type("find-living-thing-test-v225") == "find-living-thing"
    assert task_type("coin-test-s20003") == "coin" and task_type("north") == "north"
    assert episode_score(_record("t", 0, 1, -1.0)) == 0.0 and episode_score(_record("t", 0, 0, 0.25)) == 0.25


def test_summary_by_hand():
    s = summarise(_result(), scale=100, resamples=200)
    score = {a["label"]: a["mean"] for a in s["overall"]["score"]["arms"]}
    # before: 0 (failed) + 25 + 0 + 50 = 75 / 4; teacher: 100 + 50 + 100 + 0 (failed) = 250 / 4; after: 100
    assert score == pytest.approx({"before": 18.75, "teacher": 62.5, "after": 100.0})
    success = {a["label"]: a["mean"] for a in s["overall"]["success"]["arms"]}
    assert success == {"before": 0.0, "teacher": 0.5, "after": 1.0}
    last = s["overall"]["score"]["after_minus_teacher"]
    assert last["label"] == "after - teacher" and last["diff"] == pytest.approx(37.5)
    assert s["by_type"]["find-plant"]["before"] == {"episodes": 2, "success": 0.0, "score": 12.5}
    assert s["by_type"]["lifespan-longest-lived"]["teacher"] == {"episodes": 2, "success": 0.5, "score": 50.0}
    text = report(s)
    assert "| find-plant | 2 | 0.00 / 12.5 | 0.50 / 75.0 | 1.00 / 100.0 |" in text
    assert "score, after - teacher: +37.50" in text


def test_no_students_is_refused():
    with pytest.raises(ValueError, match="no students"):
        summarise({"students": []})
