"""Teacher intervention: policies that decide, turn by turn, whether the student or the teacher plays.

Once a small student makes an early mistake, the rest of its episode is a state the teacher never sees in good
play ("the prefix trap", issue 64). An intervention policy lets the teacher act: before every round of the agent
loop (:class:`~lightning_opd.rollout.agent_loop.AgentLoop`) it says, per running episode, whether this turn is the
teacher's. Teacher turns are sampled by the teacher generator and recorded with their role
(``Trajectory.turn_roles``, ``Trajectory.teacher_mask``); the student trains on its own turns only unless the
learner is told otherwise (``teacher_turn_loss``, :mod:`lightning_opd.learner.teacher_turns`).

Policies (chosen in YAML as ``data.init_args.intervention: {class_path: ..., init_args: ...}``):

* :class:`NoIntervention`: every turn is the student's (today's behaviour; the same as no policy).
* :class:`AnnealedIntervention` (Guided-OPD, arXiv 2606.15912): each turn is the teacher's with probability ``p``,
  annealed to 0 over training by ``AnnealingSchedule(attribute="intervention_prob", ...)``
  (:mod:`lightning_opd.callbacks.annealing`, which calls ``RolloutDataModule.set_intervention_prob``). The draw of
  turn ``k`` of an episode with seed ``s`` is a pure function of ``(seed, s, k)``: a run replays and resumes exactly.
* :class:`TakeoverIntervention` (RelayOPD, arXiv 2607.26057): the teacher plays every remaining turn after the
  student's ``after_invalid_actions``-th invalid action, or after ``stall_turns`` turns in a row without a positive
  reward.

A policy only reads the trajectory so far (and may mark it, like the takeover's ``takeover_turn``); it is asked only
for training batches, never for held-out evaluation (the student alone is measured). Writing your own: subclass
:class:`InterventionPolicy` and implement :meth:`InterventionPolicy.teacher_plays` (tutorials/composing_controllers.md).
"""

from __future__ import annotations

import random

from lightning_opd.rollout.types import TEACHER, Trajectory


class InterventionPolicy:
    """Decides, before each turn of a training episode, whether the teacher plays it.

    Subclasses implement :meth:`teacher_plays`; a policy with a knob a controller moves keeps it in
    :meth:`state_dict` (plain numbers) so a resumed run continues exactly.
    """

    def teacher_plays(self, traj: Trajectory, turn: int) -> bool:
        """Whether turn ``turn`` (zero-based) of ``traj`` is played by the teacher. ``traj`` holds the episode so
        far: ``rewards`` (points per turn played), ``invalid_actions``, ``turn_roles``, ``seed``."""
        raise NotImplementedError(f"{type(self).__name__} must implement teacher_plays(traj, turn)")

    def state_dict(self) -> dict:
        """The policy's state to checkpoint (plain numbers); default none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; default nothing."""


class NoIntervention(InterventionPolicy):
    """Every turn is the student's: today's behaviour (the default; needs no teacher generator)."""

    def teacher_plays(self, traj: Trajectory, turn: int) -> bool:
        return False


class AnnealedIntervention(InterventionPolicy):
    """Each turn is the teacher's with probability ``prob`` (Guided-OPD, arXiv 2606.15912).

    The draw of turn ``k`` of the episode with sampling seed ``s`` is ``u = Random(f"{seed}:{s}:{k}").random()``
    (Python's string seeding is SHA-512 based: the same on every run and platform, and no global RNG is touched);
    the teacher plays when ``u < prob``. So with a fixed ``prob`` schedule a run is reproducible and resumes exactly.

    Args:
        prob: probability that a turn is the teacher's, in [0, 1] (the value until a controller sets another:
            ``AnnealingSchedule(attribute="intervention_prob", start, end, steps)`` sets it before every batch).
        seed: salt of the per-turn draws (two runs with different salts draw different turns).

    Raises:
        ValueError: ``prob`` outside [0, 1] (here and in :meth:`set_intervention_prob`).
    """

    def __init__(self, prob: float = 0.5, seed: int = 0) -> None:
        self.seed = int(seed)
        self.prob = 0.0
        self.set_intervention_prob(prob)

    def set_intervention_prob(self, prob: float) -> None:
        """Use ``prob`` for turns started from now on (the annealing controller's setter)."""
        if not 0.0 <= float(prob) <= 1.0:
            raise ValueError(f"intervention prob={prob} must be in [0, 1] (the chance that a turn is the teacher's)")
        self.prob = float(prob)

    def draw(self, episode_seed: int, turn: int) -> float:
        """The uniform draw in [0, 1) of turn ``turn`` of the episode with seed ``episode_seed``."""
        return random.Random(f"{self.seed}:{episode_seed}:{turn}").random()

    def teacher_plays(self, traj: Trajectory, turn: int) -> bool:
        return self.prob > 0.0 and self.draw(traj.seed, turn) < self.prob

    def state_dict(self) -> dict:
        return {"prob": self.prob}

    def load_state_dict(self, state: dict) -> None:
        self.set_intervention_prob(state.get("prob", self.prob))


class TakeoverIntervention(InterventionPolicy):
    """The teacher plays every remaining turn once the student fails (RelayOPD, arXiv 2607.26057).

    Before turn ``k`` the takeover fires when the student has made ``after_invalid_actions`` invalid actions
    (``StepResult.invalid_action``; turn ``k`` is then the first teacher turn right after the k-th invalid one), or
    when its last ``stall_turns`` turns all had a reward <= 0 (no progress). It marks ``traj.takeover_turn = k``.

    Args:
        after_invalid_actions: invalid actions that hand the episode over (>= 1; ``None``: this trigger off).
        stall_turns: turns in a row without a positive reward that hand it over (>= 1; ``None``: off).

    Raises:
        ValueError: both triggers off, or one below 1.
    """

    def __init__(self, after_invalid_actions: int | None = 2, stall_turns: int | None = None) -> None:
        if after_invalid_actions is None and stall_turns is None:
            raise ValueError("TakeoverIntervention needs after_invalid_actions or stall_turns (both are None)")
        for name, value in (("after_invalid_actions", after_invalid_actions), ("stall_turns", stall_turns)):
            if value is not None and value < 1:
                raise ValueError(f"TakeoverIntervention {name}={value} must be >= 1 (or None: off)")
        self.after_invalid_actions, self.stall_turns = after_invalid_actions, stall_turns

    def fires(self, traj: Trajectory) -> bool:
        """Whether the student's turns so far call for a takeover (invalid actions or a stall)."""
        k, stall = self.after_invalid_actions, self.stall_turns
        if k is not None and traj.invalid_actions >= k:
            return True
        return stall is not None and len(traj.rewards) >= stall and all(r <= 0 for r in traj.rewards[-stall:])

    def teacher_plays(self, traj: Trajectory, turn: int) -> bool:
        if traj.took_over:
            return True
        if TEACHER not in traj.turn_roles and self.fires(traj):
            traj.takeover_turn = turn
            return True
        return False
