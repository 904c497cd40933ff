"""``ExpertDataModule``: expert trajectories for the teacher recipe, rendered by the agent loop.

Each training task is played once by a :class:`~lightning_opd.rollout.scripted.ScriptedGenerator` that
replies with the environment's expert actions, so the SFT data has exactly the token layout the policy
sees at rollout time. Held-out evaluation is inherited from :class:`RolloutDataModule`.
"""

from __future__ import annotations

from torch.utils.data import DataLoader

from lightning_opd.rollout.batch import collate_trajectories
from lightning_opd.data.datamodule import RolloutDataModule
from lightning_opd.envs.base import EnvFactory
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies
from lightning_opd.rollout.types import Trajectory


class ExpertDataModule(RolloutDataModule):
    """Expert walkthroughs of the training tasks as a map-style dataset (shuffled each epoch).

    Args:
        env: task pool with an expert (``EnvFactory.expert_actions``).
        batch_size: trajectories per optimizer step.
        require_success: drop expert episodes that do not win (a broken walkthrough).
        Other arguments: see :class:`RolloutDataModule` (used for held-out evaluation).

    Raises:
        RuntimeError: no expert trajectory succeeded.
    """

    def __init__(self, env: EnvFactory, batch_size: int = 4, require_success: bool = True, max_turns: int = 8,
                 max_new_tokens: int = 16, max_context_tokens: int = 2048, eval_temperature: float = 0.0,
                 eval_max_turns: int | None = None, eval_batch_size: int = 25, seed: int = 0) -> None:
        super().__init__(env=env, max_turns=max_turns, max_new_tokens=max_new_tokens,
                         max_context_tokens=max_context_tokens, eval_temperature=eval_temperature,
                         eval_max_turns=eval_max_turns, eval_batch_size=eval_batch_size, seed=seed)
        self.batch_size = batch_size
        self.require_success = require_success
        self.expert_trajectories: list[Trajectory] = []

    def expert_rollouts(self, tokenizer) -> list[Trajectory]:
        """Play every training task with its expert actions (token-exact renders), ``eval_batch_size`` episodes at a
        time: an environment backed by an engine process (TextWorldExpress, ScienceWorld: one JVM of ~60-300 MB per
        open episode) then holds at most that many engines, not one per training task (F31, docs/faults.md)."""
        tasks = self.env.train_tasks()
        gen = ScriptedGenerator(tokenizer, walkthrough_replies({t: self.env.expert_actions(t) for t in tasks}))
        longest = max(len(self.env.expert_actions(t)) for t in tasks)
        loop = AgentLoop(self.env, gen, tokenizer, max_turns=max(longest, 1), max_context_tokens=self.max_context_tokens)
        specs = [EpisodeSpec(task_id=t, seed=i) for i, t in enumerate(tasks)]
        trajs = [traj for start in range(0, len(specs), self.eval_batch_size)
                 for traj in loop.run(specs[start:start + self.eval_batch_size], SamplingParams())]
        if self.require_success:
            trajs = [t for t in trajs if t.success]
        if not trajs:
            raise RuntimeError("no expert trajectory succeeded; check the games' walkthroughs")
        return trajs

    def train_dataloader(self) -> DataLoader:
        """The expert trajectories (played once, on first use, with the connected policy's tokenizer)."""
        if not self.expert_trajectories:
            if self.session.policy is None:
                raise RuntimeError("ExpertDataModule is not connected to a policy (trainer.fit: the module's setup "
                                   "calls connect)")
            self.expert_trajectories = self.expert_rollouts(self.session.policy.tokenizer)
        return DataLoader(self.expert_trajectories, batch_size=self.batch_size, shuffle=True, num_workers=0,
                          collate_fn=lambda ts: collate_trajectories(ts, SamplingParams(), self.session.pad_id))
