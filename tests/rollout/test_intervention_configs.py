"""The teacher-intervention recipes (conf/textworld/intervention_*.yaml) built as users run them: overlays on
conf/textworld/opd.yaml through LightningCLI (tests/test_configs.py builds every conf file; this checks the values)."""

from __future__ import annotations

from lightning_opd.callbacks.annealing import AnnealingSchedule
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.intervention import AnnealedIntervention, TakeoverIntervention
from tests.test_configs import BASE, CONF, _isolate, build_cli, games_dir, search_qa_dir  # noqa: F401 - fixtures


def test_annealed_recipe(build_cli):
    cli, _, _ = build_cli(BASE, CONF / "textworld" / "intervention_annealed.yaml")
    policy = cli.datamodule.session.intervention
    assert isinstance(policy, AnnealedIntervention) and (policy.prob, policy.seed) == (0.5, 0)
    assert isinstance(cli.datamodule.session.teacher_generator, HFGenerator)
    (schedule,) = [c for c in cli.trainer.callbacks if isinstance(c, AnnealingSchedule)]
    assert (schedule.attribute, schedule.start, schedule.end, schedule.fraction) == ("intervention_prob", 0.5, 0.0, 0.8)
    assert cli.trainer.logger.name == "intervention_annealed"


def test_takeover_recipe(build_cli):
    cli, _, _ = build_cli(BASE, CONF / "textworld" / "intervention_takeover.yaml")
    policy = cli.datamodule.session.intervention
    assert isinstance(policy, TakeoverIntervention) and (policy.after_invalid_actions, policy.stall_turns) == (2, None)
    assert isinstance(cli.datamodule.session.teacher_generator, HFGenerator)


def test_teacher_turn_loss_from_the_command_line(build_cli):
    """docs/usage.md's third command: the takeover recipe training on the teacher's turns with cross-entropy."""
    from lightning_opd.learner.teacher_turns import TeacherTurnLoss

    cli, _, _ = build_cli(BASE, CONF / "textworld" / "intervention_takeover.yaml",
                          extra=["--model.init_args.teacher_turn_loss.kind=ce"])
    assert cli.model.teacher_turn_loss == TeacherTurnLoss(kind="ce", weight=1.0)
