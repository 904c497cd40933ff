"""``WithPrivilegedContext``: an environment whose policy sees the privileged context itself.

What a privileged-context teacher (:class:`~lightning_opd.teachers.privileged.PrivilegedTeacher`, PROPOSED,
docs/algorithms.md §6.3) does as a policy: every episode's first user message starts with the environment's
:meth:`~lightning_opd.envs.base.EnvFactory.privileged_context` and a blank line, exactly the teacher's
``placement="before_observation"`` view of the first prompt. ``lightning-opd evaluate --privileged-context``
plays held-out games this way (e.g. the base student with the walkthrough in its prompt: how strong the
self-distillation teacher is when it acts).
"""

from __future__ import annotations

from lightning_opd.envs.base import EnvFactory, StepResult, TextEnv


class _Prepended:
    """One episode of ``env`` whose first message starts with ``text``."""

    def __init__(self, env: TextEnv, text: str) -> None:
        self.env, self.text = env, text

    def reset(self) -> str:
        return f"{self.text}\n\n{self.env.reset()}"

    def parse_action(self, reply: str) -> str:
        return self.env.parse_action(reply)

    def step(self, action: str) -> StepResult:
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()


class WithPrivilegedContext(EnvFactory):
    """``envs`` with each task's privileged text before the first observation of its episodes (the policy sees it).

    Args:
        envs: an environment factory that provides privileged context.

    Raises:
        ValueError: ``envs`` provides none (names it), or gives none for a task (at ``make``).
    """

    def __init__(self, envs: EnvFactory) -> None:
        if not getattr(envs, "provides_privileged_context", False):
            raise ValueError(f"{type(envs).__name__} provides no privileged context "
                             "(EnvFactory.provides_privileged_context is False): implement privileged_context for it")
        self.envs = envs
        self.system_prompt = envs.system_prompt

    def train_tasks(self) -> list[str]:
        return self.envs.train_tasks()

    def eval_tasks(self) -> list[str]:
        return self.envs.eval_tasks()

    def expert_actions(self, task_id: str) -> list[str]:
        return self.envs.expert_actions(task_id)

    def make(self, task_id: str) -> TextEnv:
        text = self.envs.privileged_context(task_id)
        if not text:
            raise ValueError(f"{type(self.envs).__name__} gives no privileged context for task {task_id!r}")
        return _Prepended(self.envs.make(task_id), text)
