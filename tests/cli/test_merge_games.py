"""``lightning-opd merge-games`` (lightning_opd/cli/artifacts.py): arguments checked before any work, output never
replaced without ``--force``, a bad source named with exit status 2, and what it prints when it merged."""

from __future__ import annotations

import pytest

from lightning_opd.cli import main
from tests.envs.test_textworld_mix import _fake_set


def _must_not_run(*args, **kwargs):
    raise AssertionError("the helper started working on bad arguments")


@pytest.mark.parametrize(("args", "message"), [
    (["a"], "give at least two game sets to merge (got ['a'])"),
    (["a", "b", "--train", "-1"], "argument --train: -1 must be >= 0"),
    (["a", "b", "--eval", "x"], "argument --eval: 'x' is not an integer"),
])
def test_bad_arguments_are_refused_before_any_work(args, message, exits, monkeypatch, tmp_path):
    monkeypatch.setattr("lightning_opd.envs.textworld_mix.merge_game_sets", _must_not_run)
    code, out = exits(["merge-games", *args, "--out", str(tmp_path / "mix")])
    assert code == 2 and message in out
    assert not (tmp_path / "mix").exists()
    code, out = exits(["merge-games", "a", "b"])
    assert code == 2 and "--out is required" in out


def test_merge_prints_the_mix_and_refuses_to_replace_without_force(exits, capsys, tmp_path):
    a = _fake_set(tmp_path / "a", 3, train=2, evals=1, tag="a")
    b = _fake_set(tmp_path / "b", 6, train=2, evals=1, tag="b")
    out = tmp_path / "mix"
    main(["merge-games", str(a), str(b), "--out", str(out), "--train", "1"])
    assert capsys.readouterr().out.splitlines() == [
        str(out), "quest length 3: 1 train, 1 held-out games; expert walkthroughs 3-3 commands",
        "quest length 6: 1 train, 1 held-out games; expert walkthroughs 6-6 commands"]
    code, text = exits(["merge-games", str(a), str(b), "--out", str(out)])
    assert code == 2 and f"--out {out} exists; pass --force to replace it" in text
    main(["merge-games", str(b), str(a), "--out", str(out), "--force"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "quest length 3: 2 train, 1 held-out games; expert walkthroughs 3-3 commands"
    code, text = exits(["merge-games", str(a), str(a), "--out", str(tmp_path / "twice")])
    assert code == 2 and "lightning-opd merge-games: error:" in text and "both hold quest-3 games" in text
    assert not (tmp_path / "twice").exists()
