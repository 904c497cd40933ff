"""ATOD's hybrid objective as part of :class:`~lightning_opd.module.OPDModule` (docs/algorithms.md §3).

With :class:`~lightning_opd.losses.grpo.ClippedSurrogate` as the module's ``loss``, before the first
update the batch gets its GRPO group advantages, its old log-probs and, with ``tdur``, its T-DUR turn
weights (:meth:`HybridObjective.prepare_hybrid`); then ``ppo_epochs`` passes over ``ppo_mini_batches``
contiguous mini-batches, one optimizer update each, all on the same advantages. The whole batch is
still one rollout iteration: ``policy_version`` moves by 1 (§3.1 note), while ``trainer.global_step``
(and so ``trainer.max_steps``) counts optimizer updates, ``updates_per_batch`` per batch. ``kappa`` and
``rho`` are plain attributes that callbacks may change between steps (``AnnealingSchedule``).

Deliberate simplification: PPO mini-batches are contiguous row ranges, the same in every epoch (no
shuffling).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from lightning_opd.data.collate import RolloutBatch
from lightning_opd.losses.divergences import TokenLoss
from lightning_opd.losses.grpo import (ClippedSurrogate, clipped_surrogate, compute_rewards, group_advantages,
                                       hybrid_advantage)
from lightning_opd.losses.tdur import tdur_weights


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
        """The batch's ``ppo_mini_batches`` contiguous row ranges (the batch itself when 1)."""
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
