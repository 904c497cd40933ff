"""benchmarks/compare_start_evaluations.py: two builds of one starting student are the same start only if every
greedy episode's replies match."""

import json

import pytest

from benchmarks.compare_start_evaluations import compare, main


def _evaluation(path, replies, kls, success=(0, 1)):
    greedy = [{"task_id": f"t{i}", "seed": 1, "success": s, "replies": r}
              for i, (r, s) in enumerate(zip(replies, success))]
    kl = [{"task_id": f"t{i}", "seed": 1, "kl": k} for i, k in enumerate(kls)]
    summary = {"greedy": {"success": sum(success) / len(success), "turns": 2.0},
               "teacher_traj_kl": {"mean": sum(kls) / len(kls)}}
    path.write_text(json.dumps({"students": [{"greedy": greedy, "teacher_traj_kl": kl, "summary": summary}]}))
    return path


def test_identical_replies_pass_and_report_the_kl_difference(tmp_path, capsys):
    a = _evaluation(tmp_path / "a.json", [["go north"], ["take key", "open box"]], [0.25, 0.5])
    b = _evaluation(tmp_path / "b.json", [["go north"], ["take key", "open box"]], [0.25, 0.50003])
    differ, lines = compare(a, b)
    assert differ == 0 and lines[0] == "(task, seed) episodes 2; identical greedy replies in 2; same success in 2"
    assert lines[2].endswith("max per-task |difference| 3.00e-05")  # |0.5 - 0.50003|
    assert main([str(a), str(b)]) == 0


def test_one_different_reply_fails(tmp_path):
    a = _evaluation(tmp_path / "a.json", [["go north"], ["take key", "open box"]], [0.25, 0.5])
    b = _evaluation(tmp_path / "b.json", [["go north"], ["take key", "open chest"]], [0.25, 0.5], success=(0, 0))
    differ, lines = compare(a, b)
    assert differ == 1 and "identical greedy replies in 1; same success in 1" in lines[0]
    assert main([str(a), str(b)]) == 1


def test_different_tasks_and_empty_files_are_named(tmp_path):
    a = _evaluation(tmp_path / "a.json", [["go north"], ["x"]], [0.25, 0.5])
    b = _evaluation(tmp_path / "b.json", [["go north"]], [0.25], success=(0,))
    with pytest.raises(ValueError, match=r"different \(task, seed\) episodes: \[\('t1', 1\)\]"):
        compare(a, b)
    (tmp_path / "c.json").write_text(json.dumps({"students": []}))
    with pytest.raises(ValueError, match=r"c.json: no student with greedy episodes"):
        compare(a, tmp_path / "c.json")
