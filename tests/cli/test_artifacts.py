"""``lightning-opd make-games | make-search-qa | merge-adapter`` (lightning_opd/cli/artifacts.py): arguments checked
before any work, output never replaced without ``--force``."""

from __future__ import annotations

import pytest

from lightning_opd.cli import main


@pytest.mark.parametrize(("args", "message"), [
    (["--train", "0", "--eval", "0"], "--train and --eval are both 0: nothing to generate"),
    (["--train", "-3"], "argument --train: -3 must be >= 0"),
    (["--eval", "-1"], "argument --eval: -1 must be >= 0"),
    (["--quest-length", "0"], "argument --quest-length: 0 must be >= 1"),
    (["--world-size", "0"], "argument --world-size: 0 must be >= 1"),
    (["--workers", "0"], "argument --workers: 0 must be >= 1"),
    (["--eval-fraction", "1.5"], "argument --eval-fraction: 1.5 must be in (0, 1)"),
])
def test_make_games_rejects_bad_arguments_before_any_work(args, message, exits, monkeypatch, tmp_path):
    monkeypatch.setattr("lightning_opd.envs.textworld_games.make_games", _must_not_run)
    code, out = exits(["make-games", "--out", str(tmp_path / "g"), *args])
    assert code == 2 and message in out
    assert not (tmp_path / "g").exists()


def _must_not_run(*args, **kwargs):
    raise AssertionError("the helper started working on bad arguments")


def test_make_games_never_replaces_output_without_force(exits, monkeypatch, tmp_path):
    out = tmp_path / "games"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    monkeypatch.setattr("lightning_opd.envs.textworld_games.make_games", _must_not_run)
    code, text = exits(["make-games", "--out", str(out), "--train", "1", "--eval", "1"])
    assert code == 2 and f"--out {out} exists; pass --force to replace it" in text
    assert (out / "manifest.json").read_text() == "{}"
    calls = []
    monkeypatch.setattr("lightning_opd.envs.textworld_games.make_games", lambda *a, **k: calls.append((a, k)) or a[0])
    main(["make-games", "--out", str(out), "--train", "1", "--eval", "2", "--force", "--max-attempts", "7"])
    (args, kwargs), = calls
    assert args[:3] == (str(out), 1, 2) and kwargs["max_attempts"] == 7


def test_make_search_qa_and_merge_adapter_refuse_existing_output(exits, monkeypatch, tmp_path):
    out = tmp_path / "kept"
    out.mkdir()
    (out / "file").write_text("x")
    monkeypatch.setattr("lightning_opd.envs.search_qa_kb.write_search_qa", _must_not_run)
    code, text = exits(["make-search-qa", "--out", str(out)])
    assert code == 2 and "exists; pass --force" in text
    code, text = exits(["make-search-qa", "--out", str(tmp_path / "new"), "--train", "0"])
    assert code == 2 and "argument --train: 0 must be >= 1" in text
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    code, text = exits(["merge-adapter", "--base", str(base), "--adapter", str(adapter), "--out", str(out)])
    assert code == 2 and f"--base {base} is not a model directory" in text
    base.mkdir(), adapter.mkdir()
    (base / "config.json").write_text("{}"), (adapter / "adapter_config.json").write_text("{}")
    monkeypatch.setattr("lightning_opd.models.loading.merge_adapter", _must_not_run)
    code, text = exits(["merge-adapter", "--base", str(base), "--adapter", str(adapter), "--out", str(out)])
    assert code == 2 and "exists; pass --force" in text
    assert (out / "file").read_text() == "x"
