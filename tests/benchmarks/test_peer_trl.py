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


def test_step_roofline_counts_sampling_teacher_and_student_flops(model_dirs, tokenizer, monkeypatch):
    """The tiny Llama (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads, untied head of V x 32): trunk linears
    2 x (1024 + 512 + 512 + 1024 + 3 x 2048) = 18432, so a forward over n tokens after c cached, head on h positions, is
    36864 n + 64 V h + 256 (n c + n (n + 1) / 2). One prompt of P = 3 tokens, C = 2 new, batch 1:
    sampling: prefill (3, 0, 1) = 110592 + 64 V + 1536 and one decode pass (1, 3, 1) = 36864 + 64 V + 1024;
    student forward + backward 3 x (5, 0, 2) and teacher (5, 0, 2): 4 x (184320 + 128 V + 3840).
    Total 902656 + 640 V FLOPs; at a peak of 1e6 FLOP/s that many microseconds."""
    monkeypatch.setattr("benchmarks.roofline.measure_machine", lambda model: {"matmul_flops": 1e6})
    from benchmarks.peer_trl import step_roofline

    v = len(tokenizer)
    r = step_roofline([3], batch=1, new_tokens=2, model=model_dirs["student"], teacher=model_dirs["teacher"])
    assert r["flops"] == 902656 + 640 * v
    assert r["seconds"] == pytest.approx((902656 + 640 * v) / 1e6)
    assert r["prompt_tokens_mean"] == 3


def test_report_gives_each_side_s_fraction_of_the_roofline(tmp_path, monkeypatch):
    """Roofline 4.0 s; TRL 8.0 s (50%), ours 5.0 s (80%); 1.5x TRL = 5.33 s/step = 75% of the roofline."""
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path)
    results = ResultFile("peer")
    results.put("trl_0", {"median_s": 8.0, "step_s": [8.0]})
    results.put("ours_0", {"median_s": 5.0, "step_s": [5.0]})
    results.put("roofline", {"seconds": 4.0, "flops": 8e11, "matmul_flops": 2e11, "prompt_tokens_mean": 200})
    text = report(results)
    assert "TRL at 50% of it, ours at 80%" in text
    assert "1.5x TRL's speed would be 5.33 s/step = 75% of the roofline" in text


def test_prompt_lengths_count_the_chat_template_tokens(model_dirs, tmp_path):
    """Each prompt's length is its token count under the student's chat template with the generation prompt, the
    template's text tokenised without extra special tokens: a list of token counts (not the 2 keys of the encoding
    ``apply_chat_template(tokenize=True)`` returns, the bug this guards)."""
    from benchmarks.peer_trl import prompt_lengths
    from lightning_opd.models.loading import load_tokenizer

    rows = [[{"role": "user", "content": "go north"}], [{"role": "system", "content": "play"},
                                                         {"role": "user", "content": "take key from box"}]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows))
    tok = load_tokenizer(model_dirs["student"])
    want = [len(tok(tok.apply_chat_template(r, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]) for r in rows]
    got = prompt_lengths(path, model_dirs["student"], 2)
    assert got == want and min(got) > 10
