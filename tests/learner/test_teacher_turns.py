"""model.init_args.teacher_turn_loss (teacher intervention, issue 64): which tokens the term trains on, its value on
hand-worked logits and on a tiny model, the refusals, and a fit that trains on teacher turns."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_opd.data import RolloutDataModule
from lightning_opd.learner import ATODModule, OPDModule
from lightning_opd.learner.teacher_turns import TeacherTurnLoss, teacher_positions, teacher_turn_terms
from lightning_opd.losses import ClippedSurrogate, SampledTokenReverseKL
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.intervention import AnnealedIntervention, InterventionPolicy
from lightning_opd.rollout.scripted import ScriptedGenerator
from lightning_opd.teachers import RemoteTeacher
from tests.helpers import KeywordEnvFactory


class TeacherOnTurn(InterventionPolicy):
    def __init__(self, k: int) -> None:
        self.k = k

    def teacher_plays(self, traj, turn: int) -> bool:
        return turn == self.k


def test_hand_worked_terms():
    """Student logits (0, ln 3): p_S = (1/4, 3/4). ce on token 0: ln 4. Teacher logits (0, 0): p_T = (1/2, 1/2),
    forward KL = 1/2 ln((1/2)/(1/4)) + 1/2 ln((1/2)/(3/4)) = 1/2 ln(4/3)."""
    student = torch.tensor([[0.0, math.log(3.0)]])
    targets = torch.tensor([0])
    assert teacher_turn_terms("ce", student, targets, 1.0).item() == pytest.approx(math.log(4.0))
    fkl = teacher_turn_terms("forward_kl", student, targets, 1.0, torch.zeros(1, 2))
    assert fkl.item() == pytest.approx(0.5 * math.log(4.0 / 3.0))
    # at temperature 2 the student's logits are halved: p_S = (1/(1+sqrt 3), sqrt 3/(1+sqrt 3))
    assert teacher_turn_terms("ce", student, targets, 2.0).item() == pytest.approx(math.log(1 + math.sqrt(3.0)))


@pytest.mark.parametrize("kwargs, match", [({"kind": "sft"}, "kind='sft'"), ({"weight": -1.0}, "weight=-1.0")])
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TeacherTurnLoss(**kwargs)


def _three_turn_batch(tokenizer):
    """apple, need 3: turns 0 and 2 the student's ('apple'), turn 1 the teacher's ('apple')."""
    student = ScriptedGenerator(tokenizer, lambda r: "apple", policy_version=0)
    teacher = ScriptedGenerator(tokenizer, lambda r: "apple", policy_version=0)
    loop = AgentLoop(KeywordEnvFactory(need=3), student, tokenizer, intervention=TeacherOnTurn(1),
                     teacher_generator=teacher)
    trajs = loop.run([EpisodeSpec("apple", seed=0), EpisodeSpec("cherry", seed=1)], SamplingParams())
    return collate_trajectories(trajs, SamplingParams(), pad_id=tokenizer.pad_token_id, stop_ids=student.stop_ids)


@pytest.mark.parametrize("kind", ["ce", "forward_kl"])
def test_terms_are_the_models_log_probs_at_the_teacher_tokens(model_dirs, tokenizer, kind):
    """The term's positions are exactly those predicting teacher_token_mask's tokens (never a student token), and
    its values are -log p_S / the forward KL computed from the two models' plain forwards there."""
    batch = _three_turn_batch(tokenizer)
    module = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"],
                       teacher_turn_loss=TeacherTurnLoss(kind=kind, weight=0.5))
    module.configure_model()
    rows, cols = teacher_positions(batch)
    assert torch.equal(batch.teacher_token_mask[rows, cols + 1], torch.ones(rows.numel()))
    assert batch.loss_mask[rows, cols + 1].sum() == 0 and rows.numel() == int(batch.teacher_token_mask.sum())
    terms = module.teacher_turn_forward(batch)
    with torch.no_grad():
        lp_s = torch.log_softmax(module.student(batch.input_ids, attention_mask=batch.attention_mask).logits.float(), -1)
        lp_t = torch.log_softmax(module.teacher_model(batch.input_ids,
                                                      attention_mask=batch.attention_mask).logits.float(), -1)
    targets = batch.input_ids[rows, cols + 1]
    if kind == "ce":
        expected = -lp_s[rows, cols].gather(-1, targets[:, None]).squeeze(-1)
    else:
        expected = (lp_t[rows, cols].exp() * (lp_t[rows, cols] - lp_s[rows, cols])).sum(-1)
    assert torch.allclose(terms.detach(), expected, atol=1e-5)
    assert terms.requires_grad  # the student is trained through it


def test_forward_kl_needs_the_teachers_full_distribution(model_dirs):
    with pytest.raises(ValueError, match="forward_kl needs the teacher's full distribution; RemoteTeacher"):
        OPDModule(student=model_dirs["student"], teacher=RemoteTeacher("http://127.0.0.1:9", check_tokenizer=False),
                  loss=SampledTokenReverseKL(), teacher_turn_loss=TeacherTurnLoss(kind="forward_kl"))
    OPDModule(student=model_dirs["student"], teacher=RemoteTeacher("http://127.0.0.1:9", check_tokenizer=False),
              loss=SampledTokenReverseKL(), teacher_turn_loss=TeacherTurnLoss(kind="ce"))  # ce needs only the student


def test_atod_refuses_a_teacher_turn_term(model_dirs):
    with pytest.raises(ValueError, match="ATODModule has its own updates"):
        ATODModule(student=model_dirs["student"], teacher=model_dirs["teacher"], loss=ClippedSurrogate(),
                   teacher_turn_loss=TeacherTurnLoss(kind="ce"))


def _fit(model_dirs, teacher_turn_loss, prob=1.0, steps=2):
    torch.manual_seed(0)
    model = OPDModule(student=model_dirs["student"], teacher=model_dirs["teacher"],
                      teacher_turn_loss=teacher_turn_loss, log_text_every_n_steps=0)
    dm = RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                           eval_batch_size=2, seed=0, intervention=AnnealedIntervention(prob=prob),
                           teacher_generator="hf")
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0)
    model.configure_model()
    before = {k: v.clone() for k, v in model.student.state_dict().items()}
    trainer.fit(model, datamodule=dm)
    changed = any(not torch.equal(before[k], v) for k, v in model.student.state_dict().items())
    return model, trainer, changed


def test_fit_trains_on_teacher_turns_only_with_the_option(model_dirs):
    """Every turn the teacher's (prob 1): with teacher_turn_loss none there is no supervised token, so no update
    changes the weights; with ce the teacher's tokens train the student and the term is logged."""
    _, _, changed = _fit(model_dirs, None)
    assert not changed
    model, trainer, changed = _fit(model_dirs, TeacherTurnLoss(kind="ce", weight=1.0))
    assert changed
    logged = trainer.callback_metrics
    assert logged["train/teacher_turn_tokens"] > 0 and logged["train/teacher_turn_loss"] > 0
    assert logged["rollout/teacher_turns"] == 2.0 and logged["rollout/teacher_turn_share"] == 1.0
    assert logged["train/supervised_tokens"] == 0
