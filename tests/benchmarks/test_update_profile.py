"""The update profile's bookkeeping (no timing asserted): phase seconds from the module's ``record_function`` labels,
whose CPU totals include their children, and the labels really reaching the profiler from an OPD step."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
from torch.profiler import ProfilerActivity, profile

from benchmarks.update_profile import PHASES, phase_table
from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import OPDModule
from tests.helpers import KeywordEnvFactory


def event(key: str, seconds: float, count: int) -> SimpleNamespace:
    return SimpleNamespace(key=key, cpu_time_total=seconds * 1e6, count=count)


def test_phase_table_subtracts_children_and_divides_by_steps():
    """Over 2 steps: rollout 6 s holding a 2 s push (+ 0.2 s policy push), forward 10 s holding teacher 3 s and trunk
    4 s, backward 8 s, optimizer 1 s, 8 forwards. Per step: rollout (6 - 2) / 2 = 2, push 1.1, teacher 1.5, trunk 2,
    heads + loss (10 - 3 - 4) / 2 = 1.5, backward 4, optimizer 0.5; 4 passes. Other operators are ignored."""
    events = [event("opd.rollout", 6, 2), event("rollout.weight_push", 2, 2), event("opd.policy_push", 0.2, 2),
              event("opd.forward", 10, 8), event("opd.teacher", 3, 8), event("opd.student_trunk", 4, 8),
              event("opd.backward", 8, 8), event("opd.optimizer", 1, 2), event("aten::mm", 99, 1000)]
    t = phase_table(events, steps=2)
    assert t["forward_passes"] == 4
    assert t["seconds"] == {"rollout (sampling, env)": 2.0, "weight push": 1.1, "teacher forward": 1.5,
                            "student trunk forward": 2.0, "heads + loss (forward)": 1.5, "backward": 4.0,
                            "optimizer step": 0.5}


def test_missing_labels_count_zero():
    """A step without a weight push (no vLLM sampler) has 0 s there, not an error."""
    t = phase_table([event("opd.rollout", 3, 1)], steps=1)
    assert t["seconds"]["weight push"] == 0.0 and t["seconds"]["rollout (sampling, env)"] == 3.0


def test_opd_step_emits_the_labels(model_dirs):
    """One real OPD step of the tiny models (2 episodes, micro_batch_size 1) under torch.profiler: the rollout and
    the policy report once, forward, teacher, student trunk and backward once per micro-batch (2), the optimizer once."""
    module = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"], micro_batch_size=1)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4, seed=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.fit(module, datamodule=dm)
    counts = {e.key: e.count for e in prof.key_averages() if e.key in PHASES}
    assert counts["opd.rollout"] == 1 and counts["opd.policy_push"] == 1 and counts["opd.optimizer"] == 1
    for key in ("opd.forward", "opd.teacher", "opd.student_trunk", "opd.backward"):
        assert counts[key] == 2, (key, counts)
