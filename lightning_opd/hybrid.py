"""ATOD's hybrid objective as part of :class:`~lightning_opd.module.OPDModule` (docs/algorithms.md §3).

With :class:`~lightning_opd.losses.grpo.ClippedSurrogate` as the module's ``loss``, before the first
update the batch gets its GRPO group advantages, its old log-probs and, with ``tdur``, its T-DUR turn
weights (:meth:`HybridObjective.prepare_hybrid`); then ``ppo_epochs`` passes over ``ppo_mini_batches``
contiguous mini-batches, one optimizer update each, all on the same advantages. The whole batch is
still one rollout iteration: ``policy_version`` moves by 1 (§3.1 note), while ``trainer.global_step``
(and so ``trainer.max_steps``) counts optimizer updates, ``updates_per_batch`` per batch. ``kappa`` and
``rho`` are plain attributes that callbacks may change between steps (``AnnealingSchedule``).

F22 (docs/faults.md): at setup, with the module, the DataModule and the schedules known, a knob combination
that makes a term of the loss identically zero is refused, naming both keys (:meth:`HybridObjective.setup`).

Deliberate simplification: PPO mini-batches are contiguous row ranges, the same in every epoch (no
shuffling).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch

from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.losses.divergences import TokenLoss
from lightning_opd.losses.grpo import (ClippedSurrogate, EpisodeReward, clipped_surrogate, compute_rewards,
                                       group_advantages, hybrid_advantage)
from lightning_opd.losses.tdur import tdur_weights


@runtime_checkable
class CoefficientSchedule(Protocol):
    """What the F22 check reads of a callback that sets ``kappa`` or ``rho`` before every rollout batch
    (:class:`lightning_opd.callbacks.annealing.AnnealingSchedule` is one): the coefficient it drives, its
    value at every rollout iteration, the iteration after which it is constant, and how messages name it."""

    attribute: str
    start: float
    end: float
    horizon: int | None
    schedule_name: str

    def value_at(self, step: int) -> float:
        """The coefficient at rollout iteration ``step``."""


class HybridObjective:
    """Mixin of :class:`~lightning_opd.module.OPDModule`: the ATOD hybrid advantage, GRPO groups, PPO
    mini-batches and T-DUR (docs/algorithms.md §3; arXiv 2606.27814).

    Uses the module's ``loss_fn``, ``kappa``, ``rho``, ``tdur``, ``ppo_epochs``, ``ppo_mini_batches``,
    ``reward_fn``, ``advantage_eps``, ``student_logprobs``/``teacher_logprobs`` and ``_step_stats``
    (the step's statistics, logged by :meth:`_log_hybrid`).
    """

    @property
    def hybrid(self) -> bool:
        """The loss is ATOD's clipped surrogate (advantages, old log-probs and T-DUR apply)."""
        return isinstance(self.loss_fn, ClippedSurrogate)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per rollout batch (``ppo_epochs * ppo_mini_batches``)."""
        return self.ppo_epochs * self.ppo_mini_batches

    def _check_objective(self) -> None:
        """Check ``kappa``/``rho``/``tdur`` (also after a callback changed them).

        Raises:
            ValueError: a negative or non-finite coefficient, or hybrid settings without ``ClippedSurrogate``.
        """
        for name in ("kappa", "rho"):
            value = float(getattr(self, name))
            if not (value >= 0 and value != float("inf")):
                raise ValueError(f"model.{name}={value} must be a finite number >= 0")
        if not self.hybrid and (self.kappa != 1 or self.rho != 0 or self.tdur):
            raise ValueError(f"model.kappa={self.kappa}, model.rho={self.rho}, model.tdur={self.tdur}: the hybrid "
                             f"objective needs loss lightning_opd.losses.ClippedSurrogate, got {type(self.loss_fn).__name__} "
                             "(which needs kappa=1, rho=0, tdur=false)")

    def setup(self, stage: str) -> None:
        """At ``fit`` setup (after the DataModule's and the callbacks' setup, so every schedule's horizon is
        known): refuse a knob combination that makes a loss term identically zero (F22, :meth:`_check_signal`)."""
        super().setup(stage)
        if stage == "fit" and self.hybrid:
            self._check_signal(self.trainer)

    def _coefficient_plan(self, trainer) -> dict[str, tuple[list[float], str]]:
        """``{"kappa": (values, key), "rho": (values, key)}``: the coefficient at every rollout iteration
        ``0..n`` after which nothing changes any more (the latest horizon of the ``AnnealingSchedule``
        callbacks (:class:`CoefficientSchedule`) of ``kappa``/``rho``, capped by the iterations of the fit), and the configuration key
        that sets it (the schedule, which overrides the module's value, or ``model.init_args.<name>``)."""
        schedules = {cb.attribute: cb for cb in trainer.callbacks  # the last one wins, as in on_train_batch_start
                     if isinstance(cb, CoefficientSchedule) and cb.attribute in ("kappa", "rho")}
        last = max((cb.horizon for cb in schedules.values()), default=0)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            last = min(last, max(1, trainer.max_steps // self.updates_per_batch) - 1)
        plan = {}
        for name in ("kappa", "rho"):
            cb = schedules.get(name)
            if cb is None:
                value = float(getattr(self, name))
                plan[name] = ([value] * (last + 1), f"model.init_args.{name}={value}")
            else:
                plan[name] = ([cb.value_at(s) for s in range(last + 1)],
                              f"the {cb.schedule_name} callback (trainer.callbacks: init_args.start={cb.start}, "
                              f"init_args.end={cb.end})")
        return plan

    def _check_signal(self, trainer) -> None:
        """F22: refuse a configuration under which a term of the hybrid loss is identically zero.

        Refused, at any rollout iteration of the fit (schedules included, see :meth:`_coefficient_plan`):

        * ``rho > 0`` with ``data.group_size = 1``: every GRPO group is one episode, every advantage 0;
        * ``rho > 0`` with ``data.group_size > 1`` and ``data.temperature = 0``: greedy rollouts play every
          episode of a group (one task) the same way, so their rewards are equal and the advantages 0;
        * ``rho > 0`` with the default ``EpisodeReward`` and both of its weights 0: every reward is 0;
        * ``kappa = 0`` and ``rho = 0`` together: the advantage is 0 on every token, nothing to learn;
        * ``tdur`` with ``kappa = 0`` at every iteration: T-DUR weights only the OPD term, which is off.

        Raises:
            ValueError: naming both keys and the fix.
        """
        plan = self._coefficient_plan(trainer)
        (kappas, kappa_key), (rhos, rho_key) = plan["kappa"], plan["rho"]
        dm = trainer.datamodule
        group_size, temperature = getattr(dm, "group_size", None), getattr(getattr(dm, "sampling", None), "temperature", None)
        reward = self.reward_fn
        if any(r > 0 for r in rhos):
            if group_size == 1:
                raise ValueError(f"{rho_key} makes rho > 0 with data.init_args.group_size=1: every GRPO group holds "
                                 "one episode, so every advantage is exactly 0 and the rho term trains nothing; set "
                                 "data.init_args.group_size >= 2 (data.init_args.episodes_per_step a multiple of it) "
                                 "or rho = 0")
            if group_size is not None and temperature == 0:
                raise ValueError(f"{rho_key} makes rho > 0 with data.init_args.temperature=0: greedy rollouts play "
                                 f"the {group_size} episodes of a group alike, so their rewards are equal and every "
                                 "advantage is 0; set data.init_args.temperature > 0 or rho = 0")
            if type(reward) is EpisodeReward and reward.success_weight == 0 and reward.score_weight == 0:
                raise ValueError(f"{rho_key} makes rho > 0 with model.init_args.reward.init_args.success_weight=0 "
                                 "and model.init_args.reward.init_args.score_weight=0: every reward is 0, so every "
                                 "advantage is 0; give the reward a non-zero weight or set rho = 0")
        idle = [s for s, (k, r) in enumerate(zip(kappas, rhos)) if k == 0 and r == 0]
        if idle:
            raise ValueError(f"{kappa_key} and {rho_key} give kappa = 0 and rho = 0 at rollout iteration {idle[0]}: "
                             "the advantage is 0 on every token and the step learns nothing; keep kappa > 0 "
                             "(OPD term) or rho > 0 (GRPO term) at every iteration")
        if self.tdur and all(k == 0 for k in kappas):
            raise ValueError(f"model.init_args.tdur=true with {kappa_key}: T-DUR weights only the OPD term, which "
                             "kappa = 0 switches off; set tdur=false or kappa > 0")

    def advantage_inputs(self, batch: RolloutBatch) -> dict[str, torch.Tensor | None]:
        """``(b, T-1)`` per-token inputs of the hybrid loss for one (micro-)batch: ``opd_weight`` = κ · w_turn,
        ``grpo_term`` = ρ · Â (the episode's advantage on each of its tokens; T-DUR never enters it) and
        ``old_logprobs`` (``None``: π_old = sg(π_θ), one update per batch without T-DUR).

        Raises:
            RuntimeError: ``rho != 0`` but the batch has no advantages (:meth:`prepare_hybrid` not run).
        """
        shape = (batch.size, batch.input_ids.shape[1] - 1)
        dev = batch.input_ids.device
        w = batch.turn_weight[:, 1:] if batch.turn_weight is not None else torch.ones(shape, device=dev)
        if batch.advantage is None and self.rho != 0:
            raise RuntimeError("hybrid loss with rho != 0 on a batch without GRPO advantages: call prepare_hybrid first")
        adv = batch.advantage if batch.advantage is not None else torch.zeros(batch.size, device=dev)
        return {"opd_weight": float(self.kappa) * w.float(),
                "grpo_term": (float(self.rho) * adv.float())[:, None].expand(shape),
                "old_logprobs": batch.old_logprobs[:, 1:] if batch.old_logprobs is not None else None}

    @property
    def needs_old_logprobs(self) -> bool:
        """The hybrid loss needs a collection-time pass for π_old (several updates per batch, or T-DUR)."""
        return self.hybrid and (self.updates_per_batch > 1 or self.tdur)

    def prepare_hybrid(self, batch: RolloutBatch, student_logprobs: torch.Tensor | None = None) -> RolloutBatch:
        """Stage I-II of ATOD (§3.4) for the whole batch, before its first update: rewards (checked, F13),
        group advantages (over every episode of the group in the batch: staleness filters drop groups
        whole, so a kept group is complete), old log-probs (the learner's, now; see ``ClippedSurrogate``)
        when :attr:`needs_old_logprobs`, and T-DUR weights from the old and teacher log-probs.

        Args:
            batch: the planned rollout batch.
            student_logprobs: ``(B, T-1)`` learner log-probs already computed this step (reused as π_old).

        Raises:
            RewardFunctionError: the reward function raised or returned the wrong count (F13).
        """
        rewards = compute_rewards(self.reward_fn, batch)
        groups = group_advantages(rewards, batch.group_id, self.advantage_eps)
        finite = torch.isfinite(rewards)
        stats = {"grpo/reward_mean": float(rewards[finite].mean()) if bool(finite.any()) else 0.0,
                 "grpo/groups": float(groups.groups), "grpo/equal_reward_groups": float(groups.equal_groups),
                 "grpo/invalid_rewards": float(groups.invalid_rewards), "grpo/invalid_groups": float(groups.invalid_groups)}
        out = replace(batch, advantage=groups.advantage.to(batch.input_ids.device))
        if self.needs_old_logprobs:
            old = student_logprobs if student_logprobs is not None else self.student_logprobs(batch)
            out = replace(out, old_logprobs=torch.cat([torch.zeros_like(old[:, :1]), old], dim=1))  # (B, T)
            if self.tdur:
                mask = batch.loss_mask[:, 1:]
                tw = tdur_weights(old, self.teacher_logprobs(batch), mask, batch.turn_index[:, 1:])
                w = tw.token_weight.float()
                out = replace(out, turn_weight=torch.cat([torch.ones_like(w[:, :1]), w], dim=1))
                stats["tdur/mean_weight"] = tw.mean_weight(mask.sum(1) > 0)
        self._step_stats.update(stats)
        return out

    def mini_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """The batch's ``ppo_mini_batches`` contiguous row ranges (the batch itself when 1), always that many,
        empty ones included: every rank takes part in every update, whatever its rows (F19; the update's
        micro-batches are agreed in ``backward_step``)."""
        if self.ppo_mini_batches == 1:
            return [batch]
        idx = torch.arange(batch.size, device=batch.input_ids.device)
        return [batch.select(part) for part in torch.tensor_split(idx, self.ppo_mini_batches)]

    def _surrogate_stats(self, mb: RolloutBatch, out: TokenLoss, keep: torch.Tensor) -> None:
        """Accumulate the clip fraction and ratio statistics of one micro-batch (hybrid loss)."""
        inputs = self.advantage_inputs(mb)
        old = inputs["old_logprobs"] if inputs["old_logprobs"] is not None else out.student_logprobs
        adv = hybrid_advantage(out.teacher_logprobs, old, inputs["opd_weight"], inputs["grpo_term"])
        _, ratio, clipped = clipped_surrogate(out.student_logprobs, old, adv, self.loss_fn.clip_eps)
        ratio, st = ratio[keep].double(), self._step_stats
        if ratio.numel():
            st["_tokens"] = st.get("_tokens", 0.0) + ratio.numel()
            st["_ratio_sum"] = st.get("_ratio_sum", 0.0) + float(ratio.sum())
            st["_clipped"] = st.get("_clipped", 0.0) + float(clipped[keep].sum())
            st["ppo/ratio_min"] = min(st.get("ppo/ratio_min", float("inf")), float(ratio.min()))
            st["ppo/ratio_max"] = max(st.get("ppo/ratio_max", float("-inf")), float(ratio.max()))


    def _log_hybrid(self, n: int) -> None:
        """``train/kappa``, ``train/rho``, ``grpo/*``, ``ppo/*`` and ``tdur/*`` of the step (this rank)."""
        st = self._step_stats
        values = {k: v for k, v in st.items() if not k.startswith("_")}
        values.update({"train/kappa": float(self.kappa), "train/rho": float(self.rho),
                       "ppo/updates": float(self.updates_per_batch)})
        if st.get("_tokens"):
            values["ppo/clip_frac"] = st["_clipped"] / st["_tokens"]
            values["ppo/ratio_mean"] = st["_ratio_sum"] / st["_tokens"]
        for key, value in values.items():
            self.log(key, float(value), batch_size=n)
