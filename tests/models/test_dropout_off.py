"""F25: dropout is off in every pass that computes log-probs. A tiny Llama with ``attention_dropout=0.1`` and a tiny
GPT-2 with ``resid_pdrop = embd_pdrop = attn_pdrop = 0.1``, each used as both student and teacher, give a per-token
KL of exactly 0 and a zero gradient on every path: the module's loss (student in train mode, as in a fit), the
learner's no-grad log-probs (the behaviour signal of the freshness weighting, ATOD's old log-probs), a fit step's
logged ``train/kl``/``train/loss``, the HF sampler's behaviour log-probs, the teacher-trajectory KL of ``evaluate``
and of the ``TeacherTrajectoryKL`` callback. A model whose train-mode forward stays noisy is refused, named."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_opd.callbacks.teacher_traj_kl import TeacherTrajectoryKL
from lightning_opd.data import RolloutDataModule
from lightning_opd.evaluation.evaluate import EvalSettings, evaluate
from lightning_opd.evaluation.teacher_kl import trajectory_kl
from lightning_opd.learner import OPDModule
from lightning_opd.models.dropout import TrainModeNoiseError, check_no_train_mode_noise
from lightning_opd.models.loading import load_causal_lm
from lightning_opd.rollout.chat import ChatFormat, stop_token_ids
from lightning_opd.rollout.generator import GenerationRequest, SamplingParams
from lightning_opd.rollout.hf import HFGenerator
from lightning_opd.rollout.types import NON_ASSISTANT, Trajectory
from tests.helpers import KeywordEnvFactory, make_model
from tests.rollout.test_chat_and_generators import _score_like_trainer
from tests.learner.test_module import make_batch, step_grads

pytestmark = pytest.mark.timeout(300)

#: the config keys each tiny model sets above 0 (GPT2Config's own default summary_first_dropout=0.1 included)
DROPOUT_KEYS = {"llama": {"attention_dropout": 0.1},
                "gpt2": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1, "summary_first_dropout": 0.1}}


@pytest.fixture(scope="module")
def dropout_dirs(tmp_path_factory, tokenizer):
    """Model directories with dropout 0.1 in their config.json: a Llama (attention dropout) and a GPT-2
    (residual, embedding and attention dropout)."""
    root = tmp_path_factory.mktemp("dropout_models")
    llama = make_model(tokenizer, seed=0)
    llama.config.attention_dropout = 0.1
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=2048, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id))
    out = {}
    for name, model in (("llama", llama), ("gpt2", gpt2)):
        model.save_pretrained(str(root / name))
        tokenizer.save_pretrained(str(root / name))
        out[name] = str(root / name)
    return out


ARCHS = ["llama", "gpt2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_f25_loading_sets_every_dropout_key_to_zero_and_names_them(dropout_dirs, arch, caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_opd.models.loading"):
        model = load_causal_lm(dropout_dirs[arch])
    for key, value in DROPOUT_KEYS[arch].items():
        assert getattr(model.config, key) == 0.0
        assert f"{key}={value}" in caplog.text
    assert dropout_dirs[arch] in caplog.text
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert check_no_train_mode_noise(model.train(), "x") == 0.0 and model.training  # mode restored


@pytest.mark.parametrize("arch", ARCHS)
def test_f25_module_kl_logprobs_and_gradient_exactly_zero_in_train_mode(dropout_dirs, tokenizer, arch):
    """The loss pass, the learner's and the teacher's no-grad log-prob passes (behaviour signal, ATOD's old
    log-probs, T-DUR) and the HF sampler, with the student in train mode as Lightning leaves it in a fit."""
    module = OPDModule(student=dropout_dirs[arch], teacher=dropout_dirs[arch], micro_batch_size=2)
    module.configure_model()
    assert module.student.training
    batch = make_batch(tokenizer)
    out, mask, _ = module.token_losses(batch)
    assert mask.sum() > 20 and torch.equal(out.kl[mask > 0], torch.zeros_like(out.kl[mask > 0]))
    sums, grads = step_grads(module, batch)
    # as F01c: the analytic gradient at p_S = p_T is 0; float32 rounding of sum_v p_v (d_j - p_j) leaves < 1e-6
    assert sums["loss"].item() == 0.0 and sums["kl"].item() == 0.0
    assert max(g.abs().max().item() for g in grads.values()) < 1e-6
    learner = module.student_logprobs(batch)
    assert torch.equal(learner, module.student_logprobs(batch)) and torch.equal(learner, module.teacher_logprobs(batch))
    # the HF sampler's behaviour log-probs are the trainer's recomputation with the student as it trains
    gen = HFGenerator(reuse_kv_cache=False)
    gen.attach(module, stop_token_ids(tokenizer))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    prompts = [ChatFormat(tokenizer).first_prompt(w) for w in ("apple door", "key")]
    outs = gen.generate([GenerationRequest(key=i, prompt_ids=p, seed=i) for i, p in enumerate(prompts)], sampling)
    assert module.student.training  # the sampler restored the mode
    for p, o in zip(prompts, outs):
        ref = _score_like_trainer(module.student, p, o.token_ids, sampling)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-5, rtol=0)


class GradRecorder(Callback):
    """The largest absolute gradient entry before every optimizer step."""

    def __init__(self) -> None:
        self.max_grad: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.max_grad.append(max(p.grad.abs().max().item() for p in pl_module.student.parameters() if p.grad is not None))


def _datamodule():
    return RolloutDataModule(env=KeywordEnvFactory(need=2), episodes_per_step=2, max_turns=2, max_new_tokens=4,
                             eval_batch_size=2, seed=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_f25_fit_step_logs_kl_and_loss_zero_and_the_gradient_is_zero(dropout_dirs, arch):
    module = OPDModule(student=dropout_dirs[arch], teacher=dropout_dirs[arch], log_text_every_n_steps=0)
    grads = GradRecorder()
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[grads])
    trainer.fit(module, datamodule=_datamodule())
    metrics = trainer.callback_metrics
    assert float(metrics["train/supervised_tokens"]) > 0
    assert float(metrics["train/kl"]) == 0.0 and float(metrics["train/loss"]) == 0.0
    assert len(grads.max_grad) == 1 and grads.max_grad[0] < 1e-6


@pytest.mark.parametrize("arch", ARCHS)
def test_f25_teacher_trajectory_kl_exactly_zero_with_models_left_in_train_mode(dropout_dirs, tokenizer, arch):
    student, teacher = load_causal_lm(dropout_dirs[arch]).train(), load_causal_lm(dropout_dirs[arch]).train()
    traj = Trajectory(task_id="north")
    traj.append([5, 17, 9], assistant=False, turn=NON_ASSISTANT)
    traj.append([40, 41, 42, 43, 2], assistant=True, turn=0)
    res = trajectory_kl(student, teacher, [traj], vocab_size=len(tokenizer))
    assert res.tokens == 5 and res.mean == 0.0 and student.training and teacher.training


def test_f25_evaluate_and_the_callback_score_kl_exactly_zero(dropout_dirs, tmp_path):
    path = dropout_dirs["llama"]
    settings = EvalSettings(backend="hf", device="cpu", seeds=[0], avg_k=0, max_turns=2, max_new_tokens=4,
                            max_context_tokens=512)
    res = evaluate([f"s={path}"], env_class="tests.helpers.KeywordEnvFactory", env_args={"need": 2}, settings=settings,
                   teacher=path, cache_dir=None)
    kl = res["students"][0]["summary"]["teacher_traj_kl"]
    assert kl["tokens"] > 0 and kl["mean"] == 0.0
    # the callback under validate (it loads its own teacher) and with the module's teacher after a fit step's setup
    cb = TeacherTrajectoryKL(cache_dir=None)
    module = OPDModule(student=path, teacher=path, log_text_every_n_steps=0)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])
    trainer.validate(module, datamodule=_datamodule())
    assert cb.last.tokens > 0 and float(trainer.callback_metrics["val/teacher_traj_kl"]) == 0.0


def test_f25_a_model_noisy_in_train_mode_is_refused_naming_it(dropout_dirs):
    model = load_causal_lm(dropout_dirs["llama"])
    for layer in model.model.layers:  # a dropout no config key controls (set after the model was built)
        layer.self_attn.attention_dropout = 0.5
    with pytest.raises(TrainModeNoiseError, match="model.init_args.student: LlamaForCausalLM.*train mode"):
        check_no_train_mode_noise(model, "model.init_args.student")
    assert not model.training
