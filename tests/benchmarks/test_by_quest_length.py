"""benchmarks/by_quest_length.py (issue 63, design 1): greedy success and the won episodes' turns per quest length of
a mixed game set, per student and for the teacher's own episodes, on hand-written evaluate outputs."""

from __future__ import annotations

import json

import pytest

from benchmarks.by_quest_length import by_length, main, read_groups


def _record(task: str, seed: int, success: int, turns: int) -> dict:
    return {"task_id": task, "seed": seed, "success": success, "failure": 1 - success, "turns": turns}


def _evaluation(path, name: str, seed: int, outcomes: list[tuple[str, int, int]], teacher=None):
    data = {"students": [{"name": name, "greedy": [_record(t, seed, s, n) for t, s, n in outcomes]}],
            "teacher": None if teacher is None else {"episodes": [_record(t, seed, s, n) for t, s, n in teacher]}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return str(path)


# seed 0: q3 won in 3 and lost at 16; q6 won in 8 and lost at 16. seed 1: both q3 won (4, 5 turns), both q6 lost.
SEED0 = [("q3-eval-s00001", 1, 3), ("q3-eval-s00002", 0, 16), ("q6-eval-s00001", 1, 8), ("q6-eval-s00002", 0, 16)]
SEED1 = [("q3-eval-s00001", 1, 4), ("q3-eval-s00002", 1, 5), ("q6-eval-s00001", 0, 16), ("q6-eval-s00002", 0, 16)]
TEACHER = [("q3-eval-s00001", 1, 3), ("q3-eval-s00002", 1, 4), ("q6-eval-s00001", 1, 7), ("q6-eval-s00002", 0, 16)]


def test_by_length_by_hand():
    records = {(t, 0): _record(t, 0, s, n) for t, s, n in SEED0 + [("eval-s00009", 1, 2)]}
    out = by_length(records)
    assert list(out) == [3, 6, None, "all"]
    assert out[3] == {"episodes": 2, "success": 0.5, "won_turns": 3.0}
    assert out[6] == {"episodes": 2, "success": 0.5, "won_turns": 8.0}
    assert out[None] == {"episodes": 1, "success": 1.0, "won_turns": 2.0}  # an id without q<L>-
    assert out["all"] == {"episodes": 5, "success": 0.6, "won_turns": (3 + 8 + 2) / 3}


def test_labelled_files_merge_and_the_teacher_is_one_group(tmp_path, capsys):
    a0 = _evaluation(tmp_path / "vanilla" / "seed0" / "eval" / "step=14.json", "vanilla", 0, SEED0, TEACHER)
    a1 = _evaluation(tmp_path / "vanilla" / "seed1" / "eval" / "step=15.json", "vanilla", 1, SEED1, TEACHER)
    text = main([f"vanilla={a0},{a1}"])
    assert text.splitlines()[2:] == [
        "| vanilla | 3 | 4 | 0.75 | 4.00 |",   # wins in 3, 4, 5 turns
        "| vanilla | 6 | 4 | 0.25 | 8.00 |",
        "| vanilla | all | 8 | 0.50 | 5.00 |",  # (3 + 8 + 4 + 5) / 4
        "| teacher | 3 | 4 | 1.00 | 3.50 |",   # the teacher's episodes keyed by each file's seed
        "| teacher | 6 | 4 | 0.50 | 7.00 |",
        "| teacher | all | 8 | 0.75 | 4.67 |"]
    assert capsys.readouterr().out.strip() == text
    # one file, no label (its path has "="): the student's own name; no teacher episodes: no teacher rows
    only = main([_evaluation(tmp_path / "s" / "step=3.json", "start", 0, SEED0)])
    assert only.splitlines()[2] == "| start | 3 | 2 | 0.50 | 3.00 |" and "teacher" not in only


def test_bad_groups_are_refused(tmp_path):
    a0 = _evaluation(tmp_path / "a0.json", "a", 0, SEED0)
    with pytest.raises(ValueError, match="name the merged group"):
        read_groups(f"{a0},{a0}")
    with pytest.raises(ValueError, match="seed 0 is already in group 'a'"):
        read_groups(f"a={a0},{a0}")
    two = tmp_path / "two.json"
    two.write_text(json.dumps({"students": [{"name": "x", "greedy": []}, {"name": "y", "greedy": []}]}))
    with pytest.raises(ValueError, match="2 students; a LABEL merges files of one student each"):
        read_groups(f"b={two}")
    with pytest.raises(SystemExit):
        main([f"a={a0}", f"a={_evaluation(tmp_path / 'a1.json', 'a', 1, SEED1)}"])
