"""``lightning-opd compare`` (lightning_opd.analysis.compare): arms read from ``evaluate`` files, seed files merged
into one arm, seeds counted as training runs only when an arm merges one file per run (or ``--runs seed``), the
table printed and ``--json`` written, never replaced without ``--force``."""

from __future__ import annotations

import json

import pytest

from lightning_opd.analysis.compare import load_arm_sources, load_arms, main as compare_main, runs_for_files
from lightning_opd.cli import main as cli_main


def write_eval(path, name, successes: dict[tuple[str, int], float], turns: float = 3.0):
    records = [{"task_id": t, "seed": s, "success": v, "turns": turns} for (t, s), v in successes.items()]
    sampled = [{**r, "sample": j} for r in records for j in range(2)]
    path.write_text(json.dumps({"config": {}, "students": [{"name": name, "greedy": records, "sampled": sampled}]}))
    return path


def test_compare_command_prints_the_table_and_writes_json(tmp_path, capsys):
    before = {(f"t{i}", 0): 0.0 for i in range(10)}
    after = {k: 1.0 for k in before}
    write_eval(tmp_path / "before.json", "smollm2", before)
    write_eval(tmp_path / "after.json", "student-opd", after)
    cli_main(["compare", f"before={tmp_path / 'before.json'}", str(tmp_path / "after.json"),
              "--json", str(tmp_path / "cmp.json")])
    out = capsys.readouterr().out
    assert "| before | 0.00 | [0.00, 0.00] | 10 (10) |" in out
    assert "| student-opd | 1.00 | [1.00, 1.00] | 10 (10) |" in out
    assert "| student-opd | +1.00 | [+1.00, +1.00] | 10 (10) | better |" in out
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["differences"][0]["verdict"] == "better" and saved["resamples"] == 10_000


def test_compare_merges_seed_files_into_one_arm(tmp_path):
    for s in range(3):
        write_eval(tmp_path / f"seed{s}.json", "opd", {(f"t{i}", s): float(i < s) for i in range(4)})
    arms = load_arms([f"opd={','.join(str(tmp_path / f'seed{s}.json') for s in range(3))}"])
    assert list(arms) == ["opd"] and len(arms["opd"]) == 12 and arms["opd"][("t1", 2)] == 1.0
    with pytest.raises(ValueError, match="'t0', seed 0 is already in another file"):
        load_arms([f"x={tmp_path / 'seed0.json'},{tmp_path / 'seed0.json'}"])
    with pytest.raises(ValueError, match="used twice"):
        load_arms([str(tmp_path / "seed0.json"), str(tmp_path / "seed1.json")])


def test_compare_command_with_seed_files_reports_runs(tmp_path, capsys):
    """One evaluate file per training seed, merged into an arm: each seed's difference, the two-level interval
    deciding the verdict, the t-interval and the one-level interval labelled "tasks only, runs fixed"."""
    specs = []
    for arm, wins in (("ref", [[0, 0, 0], [0, 0, 0]]), ("b", [[1, 1, 1], [0, 0, 0]])):
        files = [write_eval(tmp_path / f"{arm}{r}.json", arm, {(f"t{i}", r): float(v) for i, v in enumerate(row)})
                 for r, row in enumerate(wins)]
        specs.append(f"{arm}={','.join(map(str, files))}")
    cli_main(["compare", *specs, "--json", str(tmp_path / "cmp.json")])
    out = capsys.readouterr().out
    assert "2 runs x 3 tasks (training seeds 0, 1)" in out
    assert ("| arm - ref | difference | 95% CI (runs, then tasks) | 95% t-interval over runs | 95% CI tasks only, "
            "runs fixed | per run | paired episodes (tasks) | verdict |") in out
    assert ("| b | +0.50 | [+0.00, +1.00] | [-5.85, +6.85] | [+0.50, +0.50] | +1.00 (seed 0), +0.00 (seed 1) | 6 (3) | "
            "no difference detected at n = 2 runs x 3 tasks |") in out
    assert "| b | 0.50 | [0.00, 1.00] | [-5.85, 6.85] | [0.50, 0.50] | 1.00 (seed 0), 0.00 (seed 1) | 6 (3) |" in out
    saved = json.loads((tmp_path / "cmp.json").read_text())
    assert saved["runs"] == [0, 1] and saved["differences"][0]["per_run"] == {"0": 1.0, "1": 0.0}
    cli_main(["compare", *specs, "--runs", "none"])
    assert "| b | +0.50 | [+0.50, +0.50] | 6 (3) | better |" in capsys.readouterr().out


def test_sampled_table_averages_the_k_samples(tmp_path):
    path = tmp_path / "e.json"
    records = [{"task_id": "t0", "seed": 0, "sample": j, "success": float(j == 0)} for j in range(4)]
    path.write_text(json.dumps({"students": [{"name": "s", "greedy": [], "sampled": records}]}))
    assert load_arms([str(path)], table="sampled") == {"s": {("t0", 0): 0.25}}


def test_compare_json_is_never_replaced_without_force(tmp_path, capsys):
    keys = {(f"t{i}", 0): 0.0 for i in range(4)}
    write_eval(tmp_path / "a.json", "a", keys)
    (tmp_path / "cmp.json").write_text("kept")
    with pytest.raises(SystemExit) as exc:
        cli_main(["compare", str(tmp_path / "a.json"), "--json", str(tmp_path / "cmp.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--json {tmp_path / 'cmp.json'} exists; pass --force to replace it" in err and "| a |" not in err
    assert (tmp_path / "cmp.json").read_text() == "kept"
    cli_main(["compare", str(tmp_path / "a.json"), "--json", str(tmp_path / "cmp.json"), "--force"])
    assert json.loads((tmp_path / "cmp.json").read_text())["arms"][0]["label"] == "a"


def test_one_evaluation_file_is_one_trained_student_whatever_its_seeds(tmp_path, capsys):
    """`lightning-opd evaluate --students base opd --seeds 0 1 2` (one trained student each), then `compare` of that
    file: the seeds are episode seeds, not training runs. Greedy episodes replay alike under every seed: base wins t0,
    opd t0-t2 of 4 tasks, in each seed. Read as 3 training runs they would give "3 runs x 4 tasks (training seeds 0, 1,
    2)" and a t-interval of zero width, [+0.50, +0.50], from three copies of one student. One-level: per task the
    difference is 0, 1, 1, 0 with all 3 seeds of a drawn task, so a resample's mean is K / 4, K ~ Bin(4, 1/2), both
    ends with chance 1/16 > 2.5%: [0, 1], n = 12 paired episodes."""
    wins = {"base": [1, 0, 0, 0], "opd": [1, 1, 1, 0]}
    students = [{"name": name, "greedy": [{"task_id": f"t{i}", "seed": s, "success": float(w)}
                                          for s in range(3) for i, w in enumerate(row)]} for name, row in wins.items()]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {}, "students": students}))
    cli_main(["compare", str(path)])
    out = capsys.readouterr().out
    assert "runs x" not in out and "training seeds" not in out and "t-interval" not in out
    assert out.startswith("success: mean over paired (task, seed) episodes; 95% percentile bootstrap CI, 10000 "
                          "resamples of tasks (all seeds of a drawn task)")
    assert "| opd | +0.50 | [+0.00, +1.00] | 12 (4) | no difference detected at n = 12 |" in out
    assert "its 3 seeds are read as episode seeds of one trained student" in out
    # the same students in two files, one each: still one trained student per arm
    for st in students:
        (tmp_path / f"{st['name']}.json").write_text(json.dumps({"students": [st]}))
    two = compare_main([str(tmp_path / "base.json"), str(tmp_path / "opd.json")])
    assert not two.run_level and two.differences[0].t_ci is None and two.size == "12 episodes"
    capsys.readouterr()
    # asked explicitly, the seeds count as runs (here, wrongly: three copies of one student)
    forced = compare_main([str(path), "--runs", "seed"])
    assert forced.size == "3 runs x 4 tasks" and forced.differences[0].t_ci == (0.5, 0.5)


def test_runs_are_counted_when_an_arm_merges_one_file_per_training_run(tmp_path):
    """`load_arm_sources` records each arm's files and their seeds: an arm merged from two or more files (one per
    training run) makes the seeds training runs; a merged file holding several seeds cannot stand for one run."""
    for s in range(2):
        write_eval(tmp_path / f"run{s}.json", "opd", {(f"t{i}", s): 1.0 for i in range(3)})
    write_eval(tmp_path / "base.json", "base", {(f"t{i}", s): 0.0 for i in range(3) for s in range(2)})
    arms, sources = load_arm_sources([str(tmp_path / "base.json"), f"opd={tmp_path / 'run0.json'},{tmp_path / 'run1.json'}"])
    assert sources == {"base": [(str(tmp_path / "base.json"), [0, 1])],
                       "opd": [(str(tmp_path / "run0.json"), [0]), (str(tmp_path / "run1.json"), [1])]}
    assert runs_for_files(sources) == "seed" and runs_for_files({"base": sources["base"]}) == "none"
    write_eval(tmp_path / "both.json", "x", {(f"t{i}", s): 1.0 for i in range(3) for s in (2, 3)})
    _, bad = load_arm_sources([f"x={tmp_path / 'run0.json'},{tmp_path / 'both.json'}"])
    with pytest.raises(ValueError, match=r"both.json holds episodes of seeds 2, 3: .*--runs none"):
        runs_for_files(bad)
