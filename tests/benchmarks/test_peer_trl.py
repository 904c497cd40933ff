"""The TRL peer benchmark's bookkeeping (no timing asserted, TRL not imported): the prompts both sides train on,
step seconds from step-end clocks, and the printed ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.common import ResultFile
from benchmarks.peer_trl import report, step_seconds, write_prompts
from lightning_opd.envs.textworld_env import SYSTEM_PROMPT, TextWorldEnvFactory

GAMES = Path(__file__).resolve().parents[2] / "artifacts/games/quest3"


def test_step_seconds_are_differences_of_step_end_clocks():
    """Ends at 10, 13, 17.5, 18 s: steps 2..4 took 3, 4.5 and 0.5 s; the first step is not timed."""
    assert step_seconds([10.0, 13.0, 17.5, 18.0]) == [3.0, 4.5, 0.5]
    assert step_seconds([5.0]) == []


def test_prompts_are_the_first_turns_our_agent_loop_sees(tmp_path):
    """Each row: our system message, then the first user message ``reset`` gives, of the training games in order."""
    if not (GAMES / "manifest.json").exists():
        pytest.fail(f"missing {GAMES}: run `make games` first")
    path = tmp_path / "prompts.jsonl"
    assert write_prompts(str(GAMES), None, 3, path) == 3
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    factory = TextWorldEnvFactory(str(GAMES))
    for row, task in zip(rows, factory.train_tasks()[:3]):
        env = factory.make(task)
        first = env.reset()
        env.close()
        assert row["prompt"] == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": first}]


def test_report_ratio_is_trl_median_over_ours(tmp_path, monkeypatch):
    """Rounds: TRL 8.0 and 9.0 s (median 8.5), ours 5.0 and 6.0 s (median 5.5): ours is 8.5 / 5.5 = 1.55x."""
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path)
    results = ResultFile("peer")
    for key, median in (("trl_0", 8.0), ("trl_1", 9.0), ("ours_0", 5.0), ("ours_1", 6.0)):
        results.put(key, {"median_s": median, "step_s": [median]})
    text = report(results)
    assert "TRL 8.50 s/step, ours 5.50 s/step" in text
    assert "ours is 1.55x TRL's speed" in text
