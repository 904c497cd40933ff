"""``PolicyModule``: what every trainer of the policy shares (OPD, the SFT teacher recipe).

It owns the student (loaded in ``configure_model``, the FSDP-ready hook), its tokenizer, the policy
version counter, the collectives over data-parallel ranks (:meth:`PolicyModule.reduce_sum`,
:meth:`PolicyModule.reduce_max`), the non-finite update guard (F28, :attr:`PolicyModule.nonfinite`, with the global
gradient norm it checks, :meth:`PolicyModule.grad_norm`; the learners decide with it: :meth:`PolicyModule.apply_update`
in ``OPDModule``'s manual optimization, ``SFTModule.optimizer_step``), held-out evaluation in Lightning's validation/test loops
and the export of the student as a Hugging Face directory at the end of ``fit``. At ``setup`` it binds the DataModule
once (``datamodule.connect(self)``, :class:`~lightning_opd.data.RolloutDataModule`) and keeps the
:class:`~lightning_opd.rollout.weight_sync.WeightSync` that returns, to which the learner reports its
new versions.

Metric glossary (validation ``val/``, test ``test/``; means over held-out episodes):

| key | unit | reduction |
|---|---|---|
| ``{val,test}/success`` | fraction of episodes won | mean over episodes |
| ``{val,test}/turns`` | turns per episode | mean over episodes |
| ``{val,test}/invalid_actions`` | invalid actions per episode | mean over episodes |
| ``{val,test}/reward`` | points per episode | mean over episodes |
| ``{val,test}/episodes`` | episodes evaluated | sum |
| ``{val,test}/policy_version`` | policy version (rollout iterations) | oldest version that played a held-out turn (min over episodes) |
| ``{val,test}/version_gap`` | versions | learner's version minus the version that played, max over episodes (0: the learner's current weights, F29) |
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random

import lightning as L
import numpy as np
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from torchmetrics import MaxMetric, MeanMetric, MinMetric, SumMetric

from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.distributed import gather_per_rank
from lightning_opd.learner.nonfinite import NonFiniteGuard
from lightning_opd.models.fsdp import full_state_dict, is_sharded, mixed_precision_policy, shard_causal_lm, unsharded_copy
from lightning_opd.models.loading import load_causal_lm, load_tokenizer, resolve_dtype, save_adapter_atomic, save_hf_atomic
from lightning_opd.models.lora import LoRAConfig, adapter_state, apply_lora, merged_state_dict
from lightning_opd.models.precision import weights_dtype_for
from lightning_opd.rollout.weight_sync import WeightSync

log = logging.getLogger(__name__)


class PolicyModule(L.LightningModule):
    """Base LightningModule owning the student policy.

    Args:
        student: Hugging Face causal-LM directory of the student (e.g. ``artifacts/models/smollm2-135m``).
        dtype: student parameter dtype (``float32``: also the master weights under ``trainer.precision: bf16-mixed``,
            whose autocast computes the matmuls in bf16; checkpoints and the export keep fp32).
        trust_remote_code: allow modelling code shipped with checkpoints (off by default, F15).
        export_dir: if set, the trained student is saved there as a Hugging Face directory (with
            tokenizer and chat template) when ``fit`` ends; written atomically (F16).
        gradient_checkpointing: recompute activations in the backward pass (less memory, ~30% slower);
            also the activation checkpointing of an FSDP run.
        fsdp_mixed_precision: under ``FSDP2Strategy``/``ModelParallelStrategy``: parameter and activation
            dtype of the sharded student (e.g. ``"bfloat16"``; gradients are reduced in fp32); ``None``:
            the ``dtype`` throughout.
        optimizer: optimizer factory over the student's parameters (:meth:`configure_optimizers`); default AdamW
            with learning rate :attr:`default_lr` and no weight decay.
        lr_scheduler: optional scheduler factory; stepped once per optimizer step.
        max_nonfinite_steps: an optimizer update whose loss or gradient is NaN/inf (on any rank) is skipped, weights
            and optimizer state unchanged, and counted (``train/nonfinite_steps_skipped``); this many in a row stop
            the run with :class:`~lightning_opd.learner.nonfinite.NonFiniteUpdateError` (optimizer updates, >= 1; F28).
        lora: train the student as a LoRA adapter on its frozen base weights
            (:class:`~lightning_opd.models.lora.LoRAConfig`: ``rank``, ``alpha``, ``target_modules``); ``None``: full
            fine-tuning. The optimizer sees the adapter's parameters only, generators receive the adapter only
            (:meth:`policy_state_dict`), checkpoints resume it exactly and the export writes the merged model to
            ``export_dir`` and the adapter to ``<export_dir>/adapter``. Not under FSDP (refused at setup).

    Sharding (``conf/trainer/fsdp.yaml``): under Lightning's ``ModelParallelStrategy`` (or
    :class:`~lightning_opd.models.fsdp.FSDP2Strategy`), ``configure_model`` shards the student with
    torch's FSDP2, one unit per decoder layer and the root (:func:`~lightning_opd.models.fsdp.shard_causal_lm`).

    Raises:
        FileNotFoundError: ``student`` is not a model directory.
        ValueError: an unknown ``dtype`` (at construction, before anything loads, naming
            ``model.init_args.dtype`` and the accepted names); a learning rate <= 0 (:func:`check_optimizer`);
            ``max_nonfinite_steps < 1`` (naming ``model.init_args.max_nonfinite_steps``); at setup, a device mesh
            with tensor parallelism (only data-parallel FSDP is supported); a LoRA student under FSDP.
    """

    #: learning rate of the default optimizer (AdamW, no weight decay) when ``model.init_args.optimizer`` is not given
    default_lr: float = 5e-5

    def __init__(self, student: str, dtype: str = "float32", trust_remote_code: bool = False,
                 export_dir: str | None = None, gradient_checkpointing: bool = False,
                 fsdp_mixed_precision: str | None = None, optimizer: OptimizerCallable | None = None,
                 lr_scheduler: LRSchedulerCallable | None = None, max_nonfinite_steps: int = 3,
                 lora: LoRAConfig | None = None) -> None:
        super().__init__()
        check_dtype(dtype, "model.init_args.dtype")
        #: F28: skips and counts optimizer updates with a non-finite loss or gradient, stops after a streak
        self.nonfinite = NonFiniteGuard(max_nonfinite_steps)
        self.student_path = student
        self.dtype_name = dtype
        self.trust_remote_code = trust_remote_code
        self.export_dir = export_dir
        self.gradient_checkpointing = gradient_checkpointing
        self.fsdp_mixed_precision = fsdp_mixed_precision
        self.tokenizer = load_tokenizer(student, trust_remote_code=trust_remote_code)
        self.optimizer_factory = optimizer if optimizer is not None else functools.partial(default_optimizer,
                                                                                            lr=self.default_lr)
        check_optimizer(self.optimizer_factory)
        self.lr_scheduler_factory = lr_scheduler
        #: the LoRA student's configuration (``None``: full fine-tuning)
        self.lora = lora
        self.student = None
        #: the connected DataModule's weight sync (``None`` until :meth:`setup` binds one, or without one)
        self.weight_sync: WeightSync | None = None
        #: rollout iterations trained on so far (docs/algorithms.md §3.1 note); stamped on every rollout
        self.policy_version = 0
        self.eval_metrics = torch.nn.ModuleDict({k: MeanMetric() for k in ("success", "turns", "invalid_actions", "reward")})
        self.eval_metrics["episodes"] = SumMetric()
        self.eval_metrics["policy_version"] = MinMetric()
        self.eval_metrics["version_gap"] = MaxMetric()

    def setup(self, stage: str) -> None:
        """Resolve a LoRA student's ``push: auto`` for the trainer's device (before any generator sees it), then hand
        the trainer's DataModule (if any) to :meth:`connect_data`."""
        if self.lora is not None and self._trainer is not None:
            self.lora = self.lora.resolved(self.trainer.strategy.root_device.type)
        dm = self.trainer.datamodule if self._trainer is not None else None
        if dm is not None:
            self.connect_data(dm)

    def connect_data(self, datamodule) -> None:
        """Bind ``datamodule`` to this policy (called by :meth:`setup`, every stage): ``datamodule.connect(self)``
        where it has ``connect`` (``RolloutDataModule``, which binds once), keeping the weight sync it returns. The
        one place a learner reads its DataModule: a subclass that needs a fact about the rollouts takes it here
        (``ATODModule``: group size and temperature)."""
        if hasattr(datamodule, "connect"):  # hasattr: only a RolloutDataModule binds (SFT's expert data does not)
            self.weight_sync = datamodule.connect(self)

    @property
    def max_allowed_lag(self) -> int:
        """The largest lag a batch may have (versions): the connected weight sync's ``max_allowed_lag`` (0
        unconnected)."""
        return self.weight_sync.max_allowed_lag if self.weight_sync is not None else 0

    def _notify_policy_update(self) -> None:
        """Report the current ``policy_version`` to the connected weight sync (snapshots, pushes)."""
        if self.weight_sync is not None:
            self.weight_sync.on_policy_update(self.policy_version, self.policy_state_dict)

    # ------------------------------------------------------------------------------------------ model
    @property
    def policy_model(self):
        """The student ``PreTrainedModel`` (what generators sample from)."""
        return self.student

    def configure_model(self) -> None:
        if self.student is not None:
            return
        self.student = load_causal_lm(self.student_path, self.dtype_name, self.trust_remote_code)
        self.check_loaded_student(self.student)  # before sharding: a plain model on one device
        self.student.train()  # from_pretrained returns eval mode; Lightning toggles modes from here on
        if self.gradient_checkpointing:
            self.student.gradient_checkpointing_enable()
            self.student.config.use_cache = False
        mesh = self.data_parallel_mesh()
        if self.lora is not None:
            if mesh is not None:
                raise ValueError("model.init_args.lora with an FSDP strategy: a LoRA student trains on one device here "
                                 "(its point: a frozen base plus an adapter of ~1% of the bytes fits where full "
                                 "fine-tuning does not); drop trainer.strategy, or drop model.init_args.lora to shard "
                                 "full fine-tuning")
            self.student = apply_lora(self.student, self.lora)
        if mesh is not None:
            shard_causal_lm(self.student, mesh, mixed_precision_policy(self.fsdp_mixed_precision))

    def precision_weights_dtype(self) -> torch.dtype | None:
        """The dtype frozen weights left at ``dtype: auto`` (in-process teacher, vLLM engine) take under this run's
        ``trainer.precision`` (:func:`~lightning_opd.models.precision.weights_dtype_for`: bfloat16 for ``bf16-*``),
        ``None`` for fp32 and without a trainer."""
        return weights_dtype_for(self.trainer.precision) if self._trainer is not None else None

    def follow_precision(self, frozen):
        """Hand :meth:`precision_weights_dtype` to ``frozen.set_weights_dtype`` (a teacher or generator left at
        ``dtype: auto`` takes it; an explicit dtype stays) when the run is bf16 and ``frozen`` has the setter.
        Returns ``frozen``."""
        dtype = self.precision_weights_dtype()
        if dtype is not None and hasattr(frozen, "set_weights_dtype"):  # hasattr: only in-process weights follow
            frozen.set_weights_dtype(dtype)
        return frozen

    def check_loaded_student(self, model) -> None:
        """Called on the freshly loaded, not yet sharded student; a subclass that cannot train some
        architectures raises here (at setup), naming ``model.init_args.student``. Default: accept."""

    def data_parallel_mesh(self):
        """The 1-D data-parallel ``DeviceMesh`` of a ``ModelParallelStrategy`` run (``None`` otherwise).

        Raises:
            ValueError: the mesh has a tensor-parallel dimension larger than 1.
        """
        mesh = self.device_mesh  # set by ModelParallelStrategy (FSDP2Strategy) before configure_model
        if mesh is None:
            return None
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(f"device mesh {dict(zip(names, mesh.shape))}: OPDModule shards data-parallel only; use "
                             "strategy lightning_opd.models.fsdp.FSDP2Strategy (conf/trainer/fsdp.yaml) or "
                             "ModelParallelStrategy with tensor_parallel_size=1 and data_parallel_size=<processes>")
        return mesh["data_parallel"] if "data_parallel" in names else mesh

    def configure_optimizers(self):
        """The optimizer over the student's trainable parameters (``optimizer_factory``: all of them in full
        fine-tuning, the adapter's with ``lora``) and, with an ``lr_scheduler``, its scheduler, stepped once per
        optimizer step (``interval: step``). The learners step both themselves (manual optimization in ``OPDModule``;
        ``SFTModule`` through Lightning's automatic optimization)."""
        opt = self.optimizer_factory([p for p in self.student.parameters() if p.requires_grad])
        if self.lr_scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.lr_scheduler_factory(opt), "interval": "step"}}

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """What generators load: the student's full ``state_dict`` on CPU (a collective on every rank when the
        student is sharded: a full-state gather; detached copies otherwise), or with ``lora`` its adapter alone
        (:class:`~lightning_opd.models.lora.AdapterState`, ~1% of the bytes at rank 16 on SmolLM2-135M), or with
        ``lora.push: merged`` the base with the adapter merged in, named as the base model names its tensors."""
        if self.lora is not None:
            if not self.lora.pushes_adapter:
                return merged_state_dict(self.student)
            return adapter_state(self.student, self.student_path)
        return full_state_dict(self.student)

    # ------------------------------------------------------------------------------------ collectives
    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum ``value`` over data-parallel ranks (through the trainer's strategy, or plain
        ``torch.distributed`` when used without a trainer); identity on one process."""
        return self._all_reduce(value, "sum")

    def reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        """Maximum of ``value`` over data-parallel ranks, like :meth:`reduce_sum`."""
        return self._all_reduce(value, "max")

    def _all_reduce(self, value: torch.Tensor, op: str) -> torch.Tensor:
        if self._trainer is not None:
            return self.trainer.strategy.reduce(value, reduce_op=op)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            value = value.clone()
            reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
            torch.distributed.all_reduce(value, op=reduce_op)
        return value

    # ------------------------------------------------------------------------- F28 and the update
    def grad_norm(self) -> tuple[list[torch.nn.Parameter], torch.Tensor, torch.Tensor]:
        """``(params, norm, full)``: the student's parameters that hold a gradient, the global gradient L2 norm over
        them before clipping (what ``clip_grad_norm_`` computes; a DTensor under FSDP2) and that norm as a plain 0-d
        tensor (``full_tensor()`` of a DTensor, a collective)."""
        params = [p for p in self.student.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # clip_grad_norm_ = this + the clip
        full = norm.full_tensor() if isinstance(norm, DTensor) else norm  # FSDP2
        return params, norm, full

    def check_update(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> str | None:
        """F28: the first non-finite quantity of this update on any rank (``loss``: this rank's, detached, 0-d;
        ``grad_norm``: the global norm, 0-d), or ``None``; one all-reduce every rank reaches
        (:meth:`NonFiniteGuard.check <lightning_opd.learner.nonfinite.NonFiniteGuard.check>`)."""
        return self.nonfinite.check(loss, grad_norm, self.student.named_parameters, self.reduce_sum,
                                    self.global_rank, self.trainer.world_size)

    def apply_update(self, opt, sched, loss: torch.Tensor, clip: float, filtered: bool) -> torch.Tensor:
        """Manual optimization: clip the accumulated gradients and take the optimizer and LR-scheduler step, unless the
        update is skipped.

        Skipped (:meth:`skip_update`: no gradients reach the optimizer and no scheduler step is taken, so weights,
        AdamW's moments and step count and the LR stay as they are; Lightning still counts the step: ``global_step``,
        so ``max_steps`` ends the run):

        * ``filtered``: no supervised token on any rank: the freshness filter kept none (§1.5), or the update had none
          (an empty step; AdamW's moments would otherwise move the weights on zero gradients);
        * F28: this rank's ``loss`` or the global gradient norm is NaN/inf on any rank (one all-reduce, so every
          rank skips together), counted by :attr:`nonfinite`, which raises after ``max_nonfinite_steps`` in a row.

        After an applied step, :meth:`after_optimizer_step` runs (before the scheduler step).

        Returns:
            the global gradient L2 norm before clipping (a plain tensor, also under FSDP2).
        """
        params, norm, full = self.grad_norm()
        bad = self.check_update(loss.detach(), full)
        if filtered or bad is not None:
            if bad is not None:  # may raise NonFiniteUpdateError (on every rank alike)
                self.nonfinite.skip(self.trainer.global_step, bad)
            self.skip_update(opt)
            return full
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        with record_function("opd.optimizer"):
            opt.step()
        self.after_optimizer_step()
        if sched is not None:
            sched.step()
        self.nonfinite.applied()
        return full

    def after_optimizer_step(self) -> None:
        """Called by :meth:`apply_update` right after an applied optimizer step (before the scheduler's). Default:
        nothing."""

    @staticmethod
    def skip_update(opt) -> None:
        """Take a skipped optimizer update through Lightning's public manual-optimization API: the gradients are
        dropped (``zero_grad(set_to_none=True)``), then ``opt.step()`` (the ``LightningOptimizer``) is called, so
        Lightning counts the update (``trainer.global_step``, hence ``max_steps``) while the optimizer changes
        nothing: ``torch.optim`` optimizers skip every parameter whose ``.grad`` is ``None`` (AdamW: no moment, no
        step count, no weight decay; weights bit-identical). Callbacks' ``on_before_optimizer_step`` hooks run, with
        no gradients. No LR-scheduler step: the caller does not take one.

        Args:
            opt: the ``LightningOptimizer`` of :meth:`~lightning.pytorch.core.LightningModule.optimizers`.
        """
        opt.zero_grad(set_to_none=True)
        opt.step()

    # ------------------------------------------------------------------------------------- evaluation
    def _eval_step(self, batch: RolloutBatch, prefix: str) -> None:
        trajs = batch.trajectories
        n = len(trajs)
        if n == 0:
            return
        values = {"success": [float(t.success) for t in trajs], "turns": [float(t.num_turns) for t in trajs],
                  "invalid_actions": [float(t.invalid_actions) for t in trajs], "reward": [t.total_reward for t in trajs],
                  "episodes": [1.0] * n}
        for key, vals in values.items():
            metric = self.eval_metrics[key]
            metric.update(torch.tensor(vals, dtype=torch.float32, device=self.device))
            self.log(f"{prefix}/{key}", metric, on_step=False, on_epoch=True, batch_size=n, prog_bar=key == "success")
        self._log_played_version(batch, prefix)

    def _log_played_version(self, batch: RolloutBatch, prefix: str) -> None:
        """Log which weights played the held-out episodes (F29): ``{prefix}/policy_version``, the oldest version
        that played a turn, and ``{prefix}/version_gap``, ``policy_version`` (the learner's) minus it (0 when the
        learner's current weights played). Episodes without a turn (behaviour version -1) are left out."""
        played = batch.behaviour_version.to(self.device)
        played = played[played >= 0].float()
        if played.numel():
            self.eval_metrics["policy_version"].update(played)
            self.eval_metrics["version_gap"].update(float(self.policy_version) - played)
        for key in ("policy_version", "version_gap"):
            self.log(f"{prefix}/{key}", self.eval_metrics[key], on_step=False, on_epoch=True,
                     batch_size=max(1, played.numel()))

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    # ----------------------------------------------------------------------------------------- export
    def on_train_end(self) -> None:
        if self.export_dir:
            self.export(self.export_dir)

    def export(self, path: str) -> None:
        """Save the student as a Hugging Face directory (safetensors, tokenizer and chat template) at
        ``path``, atomically (F16). Call it on every rank: a sharded student is gathered first (a
        collective); rank 0 writes. A LoRA student: the adapter merged into a copy of the base at ``path`` (what
        ``lightning-opd evaluate`` and vLLM load as any model) and the adapter alone at ``<path>/adapter``
        (``adapter_config.json``, bf16 safetensors; ``lightning-opd merge-adapter`` rebuilds the merge from it);
        the live student keeps its adapter."""
        if self.lora is not None:
            if self._trainer is None or self.trainer.is_global_zero:
                import copy

                merged = copy.deepcopy(self.student).merge_and_unload()
                save_hf_atomic(merged, self.tokenizer, path)
                save_adapter_atomic(self.student, f"{path}/adapter")
                log.info("exported the LoRA student to %s (merged) and %s/adapter", path, path)
            return
        if not is_sharded(self.student):
            if self._trainer is None or self.trainer.is_global_zero:
                log.info("exported the student to %s", save_hf_atomic(self.student, self.tokenizer, path))
            return
        plain = unsharded_copy(self.student, "cpu")  # a collective: every rank gathers
        if self.trainer.is_global_zero:
            log.info("exported the student to %s", save_hf_atomic(plain, self.tokenizer, path))
        del plain
        self.trainer.strategy.barrier("export")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Saves the policy version, a LoRA student's configuration (``lora``, a plain dict), the non-finite update counts (``nonfinite_steps``: skipped, in_a_row; the same
        on every rank, F28) and every rank's random states (``rng_states``, a list indexed by rank: a collective,
        reached on every rank as Lightning saves on every rank, F21)."""
        checkpoint["policy_version"] = int(self.policy_version)
        if self.lora is not None:  # what evaluation needs to rebuild the student from the checkpoint alone
            checkpoint["lora"] = dataclasses.asdict(self.lora)
        checkpoint["nonfinite_steps"] = self.nonfinite.state_dict()
        checkpoint["rng_states"] = gather_per_rank(rng_states(), self._trainer.world_size if self._trainer else 1)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Restores the policy version, the non-finite update counts (0 from a checkpoint without them) and this
        rank's random states. On a different number of ranks than the checkpoint's, every rank keeps the state seeded
        at start (a warning says so)."""
        self.policy_version = int(checkpoint.get("policy_version", 0))
        self.nonfinite.load_state_dict(checkpoint.get("nonfinite_steps", {}))
        states = checkpoint.get("rng_states")
        states = [states] if isinstance(states, dict) else states  # a checkpoint from before per-rank states
        world = self._trainer.world_size if self._trainer else 1
        if states and len(states) == world:
            set_rng_states(states[self.global_rank])
        elif states:
            log.warning("random states saved by %d ranks, this run has %d: not restored", len(states), world)


def frozen_dtype(student_dtype: str) -> str:
    """The default dtype of frozen weights beside a student of ``student_dtype`` (the in-process teacher): ``"auto"``
    for a float32 student (bfloat16 under ``trainer.precision: bf16-*``, float32 otherwise: :meth:`PolicyModule.
    follow_precision`), the student's own dtype for any other."""
    return "auto" if resolve_dtype(student_dtype) == torch.float32 else student_dtype


def check_dtype(dtype: str, key: str) -> None:
    """Refuse an unknown dtype name at construction.

    Raises:
        ValueError: naming ``key`` (as the user types it), the value and the accepted names.
    """
    try:
        resolve_dtype(dtype)
    except ValueError as err:
        raise ValueError(f"{key}={dtype!r} is not a dtype: {err}") from None


def default_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW over ``params`` with learning rate ``lr`` and no weight decay, torch's fused implementation (one kernel for
    all parameters; ``foreach`` cost 0.2-0.6 s per step for SmolLM2-135M on 2 cores, docs/benchmarks.md#update-profile):
    the optimizer of a learner whose ``model.init_args.optimizer`` is not given (``lr``: the class's
    :attr:`PolicyModule.default_lr`)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)


def check_optimizer(factory, key: str = "model.init_args.optimizer") -> None:
    """Build the optimizer once on a dummy parameter (before any weights load) and refuse a learning rate <= 0.

    Raises:
        ValueError: naming ``<key>.init_args.lr`` and its value (also when the optimizer itself refuses it).
    """
    try:
        groups = factory([torch.nn.Parameter(torch.zeros(1))]).param_groups
    except ValueError as err:
        raise ValueError(f"{key}: {err} (check {key}.init_args.lr and the other optimizer arguments)") from err
    lrs = [float(torch.as_tensor(g["lr"])) for g in groups if "lr" in g]
    bad = [lr for lr in lrs if not lr > 0]
    if bad:
        raise ValueError(f"{key}.init_args.lr={bad[0]} must be > 0 (the optimizer's learning rate)")


def rng_states() -> dict:
    """The process's random states (torch CPU and CUDA, Python ``random``, NumPy) as plain tensors,
    numbers and lists, so a checkpoint holding them loads with ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_states(state: dict) -> None:
    """Restore what :func:`rng_states` returned."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
