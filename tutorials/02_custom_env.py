"""Tutorial 2 - your own environment: the TextEnv protocol and EnvFactory, then teacher recipe + OPD in Python.

What it teaches:

1. An environment is two small classes (``lightning_opd/envs/base.py``): a ``TextEnv`` (one episode:
   ``reset`` -> first user message, ``parse_action`` -> the action in the model's reply, ``step`` ->
   ``StepResult``, ``close``) and an ``EnvFactory`` (the train and held-out task ids, ``make(task_id)``
   and, for the teacher recipe, ``expert_actions(task_id)``). The example is guess-the-number with
   higher/lower feedback; its expert is binary search.
2. Check a new environment before training on it: play every task once with the expert through the
   same ``AgentLoop`` the policy plays with, using a ``ScriptedGenerator`` that replies with
   ``walkthrough_replies`` (token-exact episodes, no model sampling). Every episode must be won.
3. The whole workflow in Python, no YAML: the teacher recipe (``SFTModule`` with a LoRA adapter on
   ``ExpertDataModule``: SFT on the expert's episodes rendered by the agent loop), then OPD
   (``OPDModule`` + ``RolloutDataModule``) with the just-trained teacher, each with a
   ``lightning.Trainer``; held-out success of the student before, the teacher and the student after
   (``PolicyModule`` + ``Trainer.validate``).
4. Privileged context (optional, ``--self-distill``): an ``EnvFactory`` that sets
   ``provides_privileged_context = True`` and implements ``privileged_context(task_id)`` (here: the secret itself)
   can be distilled with no trained teacher: ``PrivilegedTeacher`` scores the student's own tokens with the
   student's weights (``frozen``, ``live`` or ``ema``) shown that text in its system message, which the student
   never sees (PROPOSED, docs/algorithms.md §6.3). An environment without it is refused at setup, naming both.

Prerequisite: ``make model`` (artifacts/models/smollm2-135m; no games or teacher needed).

Run::

    .venv/bin/python tutorials/02_custom_env.py          # teacher 40 SFT steps, OPD 20 steps x 4 episodes,
                                                         # numbers 1..32 (not timed: estimated 15-20 min
                                                         # on 2 CPU cores; only --tiny is timed)
    .venv/bin/python tutorials/02_custom_env.py --tiny   # CI smoke run: 2 + 2 steps, numbers 1..16, 3 turns
                                                         # (3.5 min measured on 2 shared CPU cores)
    .venv/bin/python tutorials/02_custom_env.py --self-distill   # also OPD from the privileged teacher
    options: --out DIR (logs, teacher and student; default runs/tutorials/custom_env, --tiny: a temp dir)

To use the environment from YAML instead, put the two classes in an importable module and name the
factory in the config: ``data.init_args.env.class_path: my_package.guess.GuessNumberEnvFactory``.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_opd.data import RolloutDataModule
from lightning_opd.data.expert import ExpertDataModule
from lightning_opd.envs.base import EnvFactory, StepResult, TextEnv
from lightning_opd.models import load_tokenizer
from lightning_opd.learner import OPDModule
from lightning_opd.learner.policy import PolicyModule
from lightning_opd.rollout import AgentLoop, EpisodeSpec, SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies
from lightning_opd.learner import SFTModule

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "artifacts" / "models" / "smollm2-135m"


# ----------------------------------------------------------------------------------- 1. the environment
class GuessNumberEnv:
    """One episode: find ``secret`` in ``1..high``. The feedback carries the state (the remaining range),
    so the policy only has to read the last message. A reply without a number in range is an invalid
    action: the episode goes on and the agent loop counts it (``rollout/invalid_actions``)."""

    def __init__(self, secret: int, high: int) -> None:
        self.secret, self.high, self.lo, self.hi = secret, high, 1, high

    def reset(self) -> str:
        return f"Guess the secret number between 1 and {self.high}. Reply with one number."

    def parse_action(self, reply: str) -> str:
        match = re.search(r"\d+", reply)  # the first number in the reply, anything else ignored
        return match.group(0) if match else ""

    def step(self, action: str) -> StepResult:
        if not action or not 1 <= int(action) <= self.high:
            return StepResult(f"Reply with one number between {self.lo} and {self.hi}.", invalid_action=True)
        guess = int(action)
        if guess == self.secret:
            return StepResult(f"{guess} is correct!", reward=1.0, won=True)
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
        else:
            self.hi = min(self.hi, guess - 1)
        word = "low" if guess < self.secret else "high"
        return StepResult(f"{guess} is too {word}. The number is between {self.lo} and {self.hi}.")

    def close(self) -> None:
        pass


class GuessNumberEnvFactory(EnvFactory):
    """Tasks are the secrets ``1..high``; every 4th number is held out (disjoint splits)."""

    system_prompt = "You play guess-the-number. Reply with one number only."
    provides_privileged_context = True  # 4.: a PrivilegedTeacher may use privileged_context

    def __init__(self, high: int = 32) -> None:
        self.high = high

    def train_tasks(self) -> list[str]:
        return [str(n) for n in range(1, self.high + 1) if n % 4]

    def eval_tasks(self) -> list[str]:
        return [str(n) for n in range(1, self.high + 1) if n % 4 == 0]

    def make(self, task_id: str) -> GuessNumberEnv:
        return GuessNumberEnv(int(task_id), self.high)

    def privileged_context(self, task_id: str) -> str | None:
        """What a privileged-context teacher sees and the student never does (4.): here, the answer itself. A
        walkthrough, a demonstration or gold documents play this part in other environments."""
        return f"The secret number is {task_id}."

    def expert_actions(self, task_id: str) -> list[str]:
        """Binary search: guess the middle of the remaining range until it hits."""
        lo, hi, secret, guesses = 1, self.high, int(task_id), []
        while True:
            guesses.append(str((lo + hi) // 2))
            if int(guesses[-1]) == secret:
                return guesses
            lo, hi = (int(guesses[-1]) + 1, hi) if int(guesses[-1]) < secret else (lo, int(guesses[-1]) - 1)


# ------------------------------------------------------------------------ 2. check it with the expert
def check_with_expert(env: GuessNumberEnvFactory, tokenizer) -> int:
    """Play every task once with the expert's actions; returns the longest episode (turns).

    Raises:
        AssertionError: an expert episode was not won (a broken environment or expert).
    """
    assert isinstance(env.make("1"), TextEnv)  # the protocol is runtime-checkable
    tasks = env.train_tasks() + env.eval_tasks()
    expert = ScriptedGenerator(tokenizer, walkthrough_replies({t: env.expert_actions(t) for t in tasks}))
    longest = max(len(env.expert_actions(t)) for t in tasks)
    episodes = AgentLoop(env, expert, tokenizer, max_turns=longest).run([EpisodeSpec(t) for t in tasks], SamplingParams())
    won = sum(t.success for t in episodes)
    print(f"expert check: {won}/{len(episodes)} episodes won, at most {longest} turns")
    example = next(t for t in episodes if t.num_turns == longest)
    for m in example.messages:
        print(f"  {m['role']:>9}: {m['content']}")
    assert won == len(episodes), "the expert lost an episode: fix the environment or expert_actions"
    return longest


# ------------------------------------------------------------------------------ 3. teacher recipe + OPD
def trainer(out: Path, name: str | None, steps: int, quiet: bool) -> L.Trainer:
    """A CPU trainer; ``name=None``: no logger (evaluation)."""
    logger = TensorBoardLogger(str(out), name=name) if name else False
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=logger, log_every_n_steps=1,
                     enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                     enable_progress_bar=not quiet, enable_model_summary=not quiet)


def held_out_success(model_dir: Path, env: EnvFactory, max_turns: int, max_new_tokens: int, quiet: bool) -> float:
    """Greedy success on the held-out tasks of any model directory (``PolicyModule`` = just the policy)."""
    data = RolloutDataModule(env, max_turns=max_turns, max_new_tokens=max_new_tokens, eval_batch_size=25)
    ev = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=not quiet,
                   enable_model_summary=False)
    return float(ev.validate(PolicyModule(student=str(model_dir)), datamodule=data, verbose=False)[0]["val/success"])


def train_teacher(env: EnvFactory, out: Path, steps: int, max_turns: int, quiet: bool) -> Path:
    """The teacher recipe: a LoRA adapter on the base model, SFT on the expert's episodes; merged and
    exported to ``out/teacher`` (a Hugging Face directory)."""
    teacher = SFTModule(student=str(MODEL), lora_rank=16, lora_alpha=32, export_dir=str(out / "teacher"),
                        optimizer=partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.0))
    expert_data = ExpertDataModule(env, batch_size=4, max_turns=max_turns)
    trainer(out, "teacher_sft", steps, quiet).fit(teacher, datamodule=expert_data)
    return out / "teacher"


def distill(env: EnvFactory, teacher_dir: Path, out: Path, steps: int, episodes: int, max_turns: int,
            max_new_tokens: int, quiet: bool) -> tuple[Path, Path]:
    """OPD: the base model plays the environment, the teacher scores its tokens (reverse KL per token);
    the student is exported to ``out/student-opd``. Returns the student's directory and the run's log
    directory (``kl/turn_NN``, ``rollout/*``, ``train/*``)."""
    student = OPDModule(student=str(MODEL), teacher=str(teacher_dir), max_logged_turns=max_turns,
                        optimizer=partial(torch.optim.AdamW, lr=5e-5, weight_decay=0.0),
                        export_dir=str(out / "student-opd"))
    rollouts = RolloutDataModule(env, episodes_per_step=episodes, max_turns=max_turns, max_new_tokens=max_new_tokens,
                                 seed=0)
    opd = trainer(out, "opd", steps, quiet)
    opd.fit(student, datamodule=rollouts)
    return out / "student-opd", Path(opd.logger.log_dir)


def self_distill(env: EnvFactory, out: Path, steps: int, episodes: int, max_turns: int, max_new_tokens: int,
                 quiet: bool) -> Path:
    """OPD with no trained teacher (4.): the teacher is the student's starting weights shown
    ``env.privileged_context`` (``PrivilegedTeacher(weights="frozen")``); the student goes to
    ``out/student-self-distill``."""
    from lightning_opd.teachers import PrivilegedTeacher

    student = OPDModule(student=str(MODEL), teacher=PrivilegedTeacher(weights="frozen", placement="system"),
                        max_logged_turns=max_turns, optimizer=partial(torch.optim.AdamW, lr=5e-5, weight_decay=0.0),
                        export_dir=str(out / "student-self-distill"))
    rollouts = RolloutDataModule(env, episodes_per_step=episodes, max_turns=max_turns, max_new_tokens=max_new_tokens,
                                 seed=0)
    trainer(out, "self_distill", steps, quiet).fit(student, datamodule=rollouts)
    return out / "student-self-distill"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CI settings: 2 SFT + 2 OPD steps, numbers 1..16, 3 turns")
    p.add_argument("--out", type=Path, default=None, help="output directory (default runs/tutorials/custom_env)")
    p.add_argument("--self-distill", action="store_true", help="also OPD from the privileged-context teacher (4.)")
    a = p.parse_args(argv)
    if not (MODEL / "config.json").exists():
        raise SystemExit(f"missing {MODEL.relative_to(ROOT)}: run `make model` from the repository root first")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = (a.out or (Path(tempfile.mkdtemp(prefix="opd-custom-env-")) if a.tiny else ROOT / "runs/tutorials/custom_env"))
    out = out.resolve()
    if a.tiny:
        high, sft_steps, opd_steps, episodes, max_turns, max_new_tokens = 16, 2, 2, 2, 3, 6
    else:
        high, sft_steps, opd_steps, episodes, max_turns, max_new_tokens = 32, 40, 20, 4, 6, 8
    L.seed_everything(0, verbose=False)

    env = GuessNumberEnvFactory(high=high)
    longest = check_with_expert(env, load_tokenizer(str(MODEL)))
    teacher_dir = train_teacher(env, out, sft_steps, max(max_turns, longest), a.tiny)
    student_dir, run_dir = distill(env, teacher_dir, out, opd_steps, episodes, max_turns, max_new_tokens, a.tiny)

    policies = [("student before", MODEL), ("teacher", teacher_dir), ("student after", student_dir)]
    if a.self_distill:
        policies.append(("self-distilled", self_distill(env, out, opd_steps, episodes, max_turns, max_new_tokens,
                                                        a.tiny)))
    results = {name: held_out_success(path, env, max_turns, max_new_tokens, a.tiny) for name, path in policies}
    print(f"\nheld-out success ({len(env.eval_tasks())} secrets, greedy, at most {max_turns} turns):")
    for name, success in results.items():
        print(f"  {name:<15} {success:.2f}")
    print(f"\nlogs: tensorboard --logdir {out}")
    print(f"report: lightning-opd report {run_dir}")


if __name__ == "__main__":
    main()
