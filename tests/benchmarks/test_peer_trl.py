"""The TRL peer benchmark's bookkeeping (no timing asserted, TRL not imported): the prompts both sides train on,
step seconds from step-end clocks, each row's commands, the rounds it needs, and the printed ratio with its
interval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.common import ResultFile
from benchmarks.peer_trl import (CHILD, DOCS_HEADER, docs_row, main, ours_command, ours_overrides, parse_args,
                                 ratio_interval, report, step_seconds, trl_command, trl_config, write_prompts)
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


def test_step_roofline_counts_sampling_teacher_and_student_flops(model_dirs, tokenizer, monkeypatch):
    """The tiny Llama (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads, untied head of V x 32): trunk linears
    2 x (1024 + 512 + 512 + 1024 + 3 x 2048) = 18432, so a forward over n tokens after c cached, head on h positions, is
    36864 n + 64 V h + 256 (n c + n (n + 1) / 2). One prompt of P = 3 tokens, C = 2 new, batch 1:
    sampling: prefill (3, 0, 1) = 110592 + 64 V + 1536 and one decode pass (1, 3, 1) = 36864 + 64 V + 1024;
    student forward + backward 3 x (5, 0, 2) and teacher (5, 0, 2): 4 x (184320 + 128 V + 3840).
    Total 902656 + 640 V FLOPs; at a peak of 1e6 FLOP/s that many microseconds. The peak is the one of the row's
    dtype: the bf16 row asks the probe for bf16."""
    import torch

    asked = []
    monkeypatch.setattr("benchmarks.roofline.measure_machine",
                        lambda model, dtypes: asked.append(dtypes) or {"matmul_flops": 1e6})
    from benchmarks.peer_trl import step_roofline

    v = len(tokenizer)
    r = step_roofline([3], batch=1, new_tokens=2, model=model_dirs["student"], teacher=model_dirs["teacher"],
                      dtype="bfloat16")
    assert asked == [(torch.bfloat16,)]
    assert r["flops"] == 902656 + 640 * v
    assert r["seconds"] == pytest.approx((902656 + 640 * v) / 1e6)
    assert (r["prompt_tokens_mean"], r["dtype"], r["matmul_flops"]) == (3, "bfloat16", 1e6)


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


def test_ratio_interval_is_a_t_interval_over_paired_rounds():
    """Rounds: TRL 8, 9, 10 s and ours 4, 6, 5 s give ratios 2.0, 1.5, 2.0: mean 11/6 = 1.8333, standard deviation
    sqrt(1/12) (deviations 1/6, -1/3, 1/6), standard error 1/6, t_{0.975, 2} = 4.302653, so 1.8333 -+ 0.717109 =
    [1.116224, 2.550442]. One round gives no interval."""
    ci = ratio_interval([8.0, 9.0, 10.0], [4.0, 6.0, 5.0])
    assert ci["per_round"] == [2.0, 1.5, 2.0] and ci["rounds"] == 3
    assert ci["ratio"] == pytest.approx(11 / 6)
    assert (ci["low"], ci["high"]) == pytest.approx((11 / 6 - 4.302653 / 6, 11 / 6 + 4.302653 / 6), abs=1e-6)
    one = ratio_interval([8.0], [4.0])
    assert (one["ratio"], one["low"], one["high"]) == (2.0, None, None)
    with pytest.raises(ValueError, match=r"got TRL \[8.0, 9.0\] and ours \[4.0\]"):
        ratio_interval([8.0, 9.0], [4.0])


def _three_rounds(tmp_path, monkeypatch, precision="fp32") -> ResultFile:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(common, "cpu_name", lambda: "GenuineIntel Intel(R) Xeon(R) Test")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    results = ResultFile("peer")
    for rnd, (trl, ours) in enumerate(((8.0, 4.0), (9.0, 6.0), (10.0, 5.0))):
        results.put(f"{precision}/trl_{rnd}", {"median_s": trl, "step_s": [trl], "steps": 10})
        results.put(f"{precision}/ours_{rnd}", {"median_s": ours, "step_s": [ours], "steps": 10})
    results.put(f"{precision}/roofline", {"seconds": 4.0, "flops": 8e11, "matmul_flops": 2e11, "dtype": "float32",
                                          "prompt_tokens_mean": 200})
    return results


def test_report_gives_medians_ratio_interval_and_roofline(tmp_path, monkeypatch):
    """The 3 rounds above: TRL median 9.0 s, ours 5.0 s (1.80x by medians); mean per-round ratio 1.83x in
    [1.12, 2.55]; roofline 4.0 s: TRL at 44%, ours at 80%; 1.5x TRL = 6.00 s/step = 67% of the roofline. Each fit's
    row names its CPU. A round with one side missing is left out; the other row is empty."""
    results = _three_rounds(tmp_path, monkeypatch)
    results.put("fp32/trl_3", {"median_s": 1.0, "step_s": [1.0]})  # its ours_3 never ran
    text = report(results, "fp32")
    assert "| trl | 0 | 8.00 | 8.00 | GenuineIntel Intel(R) Xeon(R) Test (2 cores) |" in text
    assert "| trl | 3 |" not in text
    assert "TRL 9.00 s/step, ours 5.00 s/step (medians over rounds): ours is 1.80x TRL's speed" in text
    assert "ratio per round 2.00 1.50 2.00: mean 1.83x, 95% t-interval [1.12, 2.55] over 3 rounds" in text
    assert "at 200 GFLOP/s float32" in text and "TRL at 44% of it, ours at 80%" in text
    assert "1.5x TRL's speed would be 6.00 s/step = 67% of the roofline" in text
    assert report(results, "bf16").endswith("(no round with both sides finished)")


def test_docs_row_names_the_cpu_and_the_interval(tmp_path, monkeypatch):
    results = _three_rounds(tmp_path, monkeypatch)
    assert len(DOCS_HEADER) == 8
    assert docs_row(results, "fp32") == ["fp32", "GenuineIntel Intel(R) Xeon(R) Test (2 cores)", "3 x 10", "9.00",
                                         "5.00", "1.83x (1.12-2.55)", "4.00 s at 200 GFLOP/s float32", "44% / 80%"]
    assert docs_row(results, "bf16") is None


def test_fewer_than_three_rounds_are_refused_before_anything_runs(monkeypatch):
    """``--rounds 2`` stops at the command line (TRL's venv is never looked at); ``--rounds 3`` is the default."""
    monkeypatch.setattr("benchmarks.peer_trl.ensure_trl_venv", lambda venv: pytest.fail("reached TRL's venv"))
    with pytest.raises(SystemExit, match=r"--rounds 2: a results run needs >= 3 alternating rounds"):
        main(["--rounds", "2"])
    with pytest.raises(SystemExit, match=r"--steps 2: need >= 3"):
        main(["--steps", "2"])
    args = parse_args([])
    assert (args.rounds, args.precision, args.name) == (3, ["fp32", "bf16"], "peer_trl_rows")


@pytest.mark.parametrize("precision, bf16, init, trainer, teacher", [
    ("fp32", False, {"dtype": "float32"}, "32-true", "float32"),
    ("bf16", True, None, "bf16-mixed", "bfloat16"),
    ("fp32-packed", False, {"dtype": "float32"}, "32-true", "float32"),
])
def test_each_row_builds_both_sides_commands(tmp_path, precision, bf16, init, trainer, teacher):
    """fp32: TRL ``bf16=False`` with fp32 weights, ours ``32-true`` and an fp32 teacher. bf16 (TRL's defaults): TRL
    ``bf16=True`` and no init kwargs (TRL's default), ours ``bf16-mixed`` and a bf16 teacher. The workload is the
    same in both rows and the rest of our overrides survives the merge."""
    args = parse_args(["--precision", precision, "--steps", "5", "--model", "m", "--teacher", "t", "--games", "g"])
    cfg = trl_config(args, precision, tmp_path / "p.jsonl", tmp_path)
    assert (cfg["bf16"], cfg["model_init_kwargs"], cfg["teacher_model_init_kwargs"]) == (bf16, init, init)
    assert (cfg["steps"], cfg["batch"], cfg["max_new_tokens"], cfg["beta"], cfg["student"]) == (5, 4, 16, 1.0, "m")
    cmd = trl_command(Path("/venv/bin/python"), cfg, tmp_path / "trl.json")
    assert cmd[:3] == ["/venv/bin/python", str(CHILD), "--args"] and cmd[4:] == ["--out", str(tmp_path / "trl.json")]
    assert json.loads(cmd[3]) == cfg
    ours = ours_overrides(args, precision, tmp_path)
    assert (ours["trainer"]["precision"], ours["model"]["init_args"]["teacher_dtype"]) == (trainer, teacher)
    assert ours["trainer"]["max_steps"] == 5 and ours["model"]["init_args"]["student"] == "m"
    assert ours["model"]["init_args"]["optimizer"]["init_args"]["fused"] is True
    assert ours["model"]["init_args"].get("pack_sequences", False) == ("auto" if precision == "fp32-packed" else False)
    assert ours_command(tmp_path / "o.yaml") == [sys.executable, "-m", "lightning_opd", "fit", "--config",
                                                 "conf/textworld/opd.yaml", "--config", str(tmp_path / "o.yaml")]


def test_our_cli_takes_the_bf16_row_s_overrides(tmp_path):
    """The bf16 row's overrides parse in ``lightning-opd fit`` (``--print_config``: nothing is built or trained)."""
    args = parse_args(["--precision", "bf16"])
    cfg = tmp_path / "ours.yaml"
    cfg.write_text(json.dumps(ours_overrides(args, "bf16", tmp_path)))
    out = subprocess.run(ours_command(cfg) + ["--print_config"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "  precision: bf16-mixed" in lines and "    teacher_dtype: bfloat16" in lines and "  max_steps: 10" in lines
