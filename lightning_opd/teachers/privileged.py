"""``PrivilegedTeacher``: self-distillation, the student's own weights with privileged context as the teacher.

PROPOSED, docs/algorithms.md §6.3 (the self-distillation teacher of TRL's SDFT/SDPO, prime-rl's ``opsd``,
tinker-cookbook's SDFT recipe). The teacher is the student model itself (``weights``: its starting weights, its
current weights, or an EMA of them), shown a privileged text the student never sees (the environment's
:meth:`~lightning_opd.envs.base.EnvFactory.privileged_context`: a TextWorld walkthrough, Search-QA's gold documents
and answer), and it scores exactly the student's sampled tokens.

The teacher's view of an episode (``view``, :mod:`~lightning_opd.teachers.privileged_views`): ``"walkthrough"`` (the
default, :func:`~lightning_opd.teachers.privileged_views.teacher_view`): the student's first prompt re-rendered with
the privileged block inserted (``placement``), every later id unchanged at one constant offset; ``"next_action"``
(PROPOSED after PivotOPD arXiv 2609.40285, :func:`~lightning_opd.teachers.privileged_views.next_action_view`): each
user message with only the expert's next action for the turn that follows it, every reply token kept at a per-position
map. Either way the teacher scores the student's reply tokens at exactly their ids (F08), at the view's positions.
The privileged text only enters this copy: the rollouts, the student's forward and the loss's student side never
contain it.

Where the texts come from: the module hands the teacher its DataModule's environment factory
(:meth:`~lightning_opd.teachers.base.Teacher.attach_envs`, at setup); the teacher asks it for each task's text
once and keeps it (next_action: its expert actions). An environment without privileged context is refused there
(walkthrough view). Which row is which episode: each row of a batch is matched to its
:class:`~lightning_opd.rollout.types.Trajectory` in ``batch.trajectories`` by task id and token ids (its first
message is the environment's own text, rendered, never decoded ids).

Deliberate simplifications: the ``frozen`` and ``ema`` copies are plain ``copy.deepcopy``s of an unsharded student
in the student's dtype, kept out of the module tree (the EMA is saved in the checkpoint through
:meth:`PrivilegedTeacher.state_dict`, so a resumed run continues it); a sharded (FSDP2) student is refused for them (``live`` works: the student's own forward).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Collection

import torch

from lightning_opd.losses.base import TeacherSignal
from lightning_opd.models.fsdp import with_root_params
from lightning_opd.models.logits import output_head, trunk_hidden_states
from lightning_opd.models.lora import is_lora_model, merged_state_dict
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.rollout.chat import ChatFormat
from lightning_opd.rollout.types import Trajectory
from lightning_opd.serving import ServerWeightPush
from lightning_opd.teachers.base import Teacher, TeacherScores
from lightning_opd.teachers.in_process import scores_from_hidden
from lightning_opd.teachers.privileged_views import (PLACEMENTS, VIEWS, TeacherView, TeacherViewError,
                                                     expert_next_actions, next_action_view, row_trajectories,
                                                     walkthrough_view)

WEIGHTS = ("frozen", "live", "ema")


class PrivilegedTeacher(Teacher):
    """The student's own weights, shown the environment's privileged context, as the teacher (self-distillation).

    PROPOSED, docs/algorithms.md §6.3 (TRL SDFT/SDPO: teacher = base / live / EMA weights; prime-rl ``opsd``).
    Provides every :class:`~lightning_opd.losses.base.TeacherSignal`, computed like
    :class:`~lightning_opd.teachers.in_process.InProcessTeacher`'s on the teacher's view
    (:func:`~lightning_opd.teachers.in_process.scores_from_hidden`).

    Needs, from ``OPDModule``: :meth:`bind` (tokenizer, ``V``), :meth:`attach_envs` (at setup: the environment
    factory, refused without privileged context for the walkthrough view), :meth:`attach_student` (at
    ``configure_model``: the student,
    copied for ``frozen``/``ema``), :meth:`on_optimizer_step` (after each optimizer step: the EMA update).

    Served (``server``: a :class:`~lightning_opd.teachers.remote.RemoteTeacher` on a ``vllm serve`` process started
    from the student's starting directory, in dev mode for ``live``/``ema``): the teacher's views go over the wire
    as token ids (``prompt_logprobs``; the privileged prompt is what the server sees) and the student's weights stay
    out of a second copy in the learner for ``frozen``; ``live`` and ``ema`` push the student's (or the EMA's)
    weights to the server every ``push_every`` optimizer steps (:class:`~lightning_opd.serving.weight_push.
    ServerWeightPush`: disk snapshot + reload, as for a remote sampler; with several learner ranks, rank ``r`` of
    ``W`` writes only to the server's ``urls[r::W]``, one writer per server). It then provides what the server
    provides (``SAMPLED_TOKEN``, ``TOP_K``; temperature 1).

    Args:
        weights: ``"frozen"`` (a copy of the student's starting weights), ``"live"`` (the student module itself, run
            in eval mode under ``torch.no_grad``: no graph, the optimizer state untouched) or ``"ema"`` (a copy
            updated after each optimizer step, ``ema = ema_decay * ema + (1 - ema_decay) * student``).
        ema_decay: the EMA's decay in ``[0, 1)`` (used with ``weights="ema"``).
        placement: where the privileged text goes, ``"system"`` or ``"before_observation"``
            (:func:`~lightning_opd.teachers.privileged_views.privileged_messages`; the walkthrough view).
        view: ``"walkthrough"`` (the environment's privileged text in the first prompt) or ``"next_action"`` (only the
            expert's next action in the user message before each turn, from the environment's ``expert_actions``;
            PROPOSED after PivotOPD arXiv 2609.40285).
        server: score on this served teacher instead of in this process (``None``: in-process).
        push_every: ``live``/``ema`` with ``server``: push the weights every this many optimizer steps (>= 1).
        weights_dir, server_weights_dir: where pushed snapshots are written, and where the server sees them
            (:class:`~lightning_opd.serving.weight_push.ServerWeightPush`).

    Raises:
        ValueError: an unknown ``weights``, ``placement`` or ``view``, ``ema_decay`` outside ``[0, 1)``,
            ``push_every < 1``.
    """

    provides = frozenset(TeacherSignal)

    def __init__(self, weights: str = "frozen", ema_decay: float = 0.99, placement: str = "system",
                 server: Teacher | None = None, push_every: int = 1, weights_dir: str | None = None,
                 server_weights_dir: str | None = None, view: str = "walkthrough") -> None:
        if weights not in WEIGHTS:
            raise ValueError(f"PrivilegedTeacher weights={weights!r}: use one of {WEIGHTS} (frozen: the student's "
                             "starting weights; live: its current weights; ema: an EMA of them)")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"PrivilegedTeacher ema_decay={ema_decay} must be in [0, 1)")
        if placement not in PLACEMENTS:
            raise ValueError(f"PrivilegedTeacher placement={placement!r}: use one of {PLACEMENTS}")
        if view not in VIEWS:
            raise ValueError(f"PrivilegedTeacher view={view!r}: use one of {VIEWS} (walkthrough: the privileged text "
                             "in the first prompt; next_action: the expert's next action before each turn)")
        if push_every < 1:
            raise ValueError(f"PrivilegedTeacher push_every={push_every} must be >= 1 (optimizer steps between pushes)")
        if server is not None and weights != "frozen" and not hasattr(server, "pool"):  # pushes need its ServerPool
            raise ValueError(f"PrivilegedTeacher weights={weights!r} with server={type(server).__name__}: pushing "
                             "weights needs a served teacher (lightning_opd.teachers.remote.RemoteTeacher) as "
                             "model.init_args.teacher.init_args.server, or weights='frozen'")
        self.weights, self.ema_decay, self.placement, self.view = weights, float(ema_decay), placement, view
        self.server, self.push_every = server, int(push_every)
        if server is not None:
            self.provides = server.provides
        self._pusher = ServerWeightPush(weights_dir, server_weights_dir) if server is not None else None
        if self._pusher is not None and weights != "frozen":  # a server back from the dead gets the pushed weights
            pool, pusher = server.pool, self._pusher
            pool.on_rejoin = lambda client: pusher.restore(pool, client)
        self._steps = 0  # optimizer steps seen (the push schedule)
        self.pushed_version = 0  #: optimizer steps of the weights the server holds (0: the starting weights)
        self._pushes, self._push_s = 0, 0.0  # pushes and their seconds
        #: hint use (:meth:`hint_use`): turns scored with an expert next action, and those where the teacher's top-1
        #: first reply token is that action's first token; totals, and the window since ``stats`` was last read
        self.hint_totals = {"turns": 0, "top1_hits": 0}
        self._hint_window = [0, 0]
        self.tokenizer = None
        self.vocab_size: int | None = None
        self.student = None  #: the live student module (``attach_student``)
        self.model = None  #: the model that scores: the student (live) or its frozen / EMA copy
        self.envs = None
        self.chat: ChatFormat | None = None
        self._texts: dict[str, str] = {}
        self._experts: dict[str, list[str]] = {}  # task -> the expert's actions (next_action view)

    @property
    def name(self) -> str:
        where = f", server={self.server.name}" if self.server is not None else ""
        view = "" if self.view == "walkthrough" else f", view={self.view}"
        return f"{type(self).__name__}(weights={self.weights}, placement={self.placement}{view}{where})"

    def bind(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self._make_chat()
        if self.server is not None:
            self.server.bind(tokenizer, vocab_size)

    @property
    def stats(self) -> dict[str, float]:
        """``hint_top1``: over the turns scored since the last read (one optimizer step, as ``OPDModule`` logs it
        ``teacher/hint_top1``), the share whose teacher top-1 first reply token is the first token of the expert's
        next action (:func:`expert_next_actions`; NaN when none), and ``hint_turns`` (those turns); served: also
        the server's request totals, ``pushes`` and ``push_seconds``. Reading it starts a new window."""
        turns, hits = self._hint_window
        self._hint_window = [0, 0]
        out = {"hint_top1": hits / turns if turns else float("nan"), "hint_turns": float(turns)}
        if self.server is None:
            return out
        return {**self.server.stats, **out, "pushes": float(self._pushes),
                "push_seconds": self._push_s}

    def hint_use(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor,
                 top1: torch.Tensor) -> tuple[int, int]:
        """Count, for each turn of ``batch`` whose first reply token is scored at ``(rows[i], cols[i])``, whether the
        teacher's top-1 there (``top1[i]``, ``(N,)`` long) is the first token of the expert's next action
        (:func:`expert_next_actions`, from the environment's ``expert_actions``); returns ``(turns, hits)`` of this
        call and adds them to :attr:`hint_totals`. Environments without an expert count nothing."""
        at = {(int(r), int(c)): i for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist()))}
        turns = hits = 0
        for r, (task, traj) in enumerate(row_trajectories(batch)):
            if traj is None:
                continue
            expert = self._expert(task)
            if expert is None:
                continue
            first: dict[int, int] = {}
            for j, (m, k) in enumerate(zip(traj.assistant_mask, traj.turn_index)):
                if m and k >= 0 and k not in first:
                    first[k] = j
            for turn, action in expert_next_actions(traj, expert).items():
                i = at.get((r, first.get(turn, 0) - 1))
                ids = self.tokenizer(action, add_special_tokens=False)["input_ids"]
                if i is None or not ids:
                    continue
                turns += 1
                hits += int(top1[i]) == ids[0]
        self.hint_totals["turns"] += turns
        self.hint_totals["top1_hits"] += hits
        self._hint_window[0] += turns
        self._hint_window[1] += hits
        return turns, hits

    def close(self) -> None:
        """Close the served teacher's client and remove a temporary snapshot directory."""
        if self.server is not None:
            self.server.close()
        if self._pusher is not None:
            self._pusher.close()

    def attach_envs(self, envs) -> None:
        """Keep ``envs`` (the privileged texts or, next_action view, the expert's actions; the system prompt).

        Raises:
            ValueError: walkthrough view and ``envs`` does not provide privileged context (names the environment and
                this teacher).
        """
        if self.view == "walkthrough" and not getattr(envs, "provides_privileged_context", False):
            raise ValueError(
                f"teacher {self.name} needs privileged context from the environment, but {type(envs).__name__} "
                "provides none (EnvFactory.provides_privileged_context is False): implement "
                "EnvFactory.privileged_context for it, or use a trained teacher (model.init_args.teacher: a directory)")
        self.envs, self._texts, self._experts = envs, {}, {}
        self._make_chat()

    def _make_chat(self) -> None:
        if self.tokenizer is not None and self.envs is not None:
            self.chat = ChatFormat(self.tokenizer, self.envs.system_prompt)

    def attach_student(self, student) -> None:
        """Score with ``student`` (``live``) or a frozen copy of it (``frozen``, ``ema``), no grad, eval mode. The copy
        is taken once, on the first call with this student.

        Raises:
            NotImplementedError: ``frozen``/``ema`` with a sharded (FSDP2, DTensor) student.
        """
        if student is self.student and self.model is not None:
            return  # configure_model again (a second fit): keep the copy taken from the starting weights
        self.student = student
        if self.weights == "live" or (self.server is not None and self.weights == "frozen"):
            self.model = student  # live: the student itself; served frozen: the server holds the starting weights
            return
        if any(hasattr(p, "full_tensor") for p in student.parameters()):
            raise NotImplementedError(f"teacher {self.name}: a copy of a sharded (FSDP2) student is not supported; "
                                      "use weights=live, or train on one device")
        self.model = copy.deepcopy(student).eval().requires_grad_(False)

    def load(self) -> None:
        """Served: connect to the server (``RemoteTeacher.load``: health, model, F01 over HTTP). In-process: nothing
        (the weights come from :meth:`attach_student`)."""
        if self.server is not None:
            self.server.load()

    def to(self, device: torch.device | str) -> "PrivilegedTeacher":
        if self.model is not None and self.model is not self.student:
            self.model.to(device)
        return self

    @torch.no_grad()
    def on_optimizer_step(self) -> None:
        """``ema``: ``ema = ema_decay * ema + (1 - ema_decay) * student`` for every parameter (buffers copied);
        otherwise nothing."""
        self._steps += 1
        if self.weights == "ema" and self.model is not None:
            for e, s in zip(self.model.parameters(), self.student.parameters()):
                e.mul_(self.ema_decay).add_(s.detach().to(e.dtype), alpha=1.0 - self.ema_decay)
            for e, s in zip(self.model.buffers(), self.student.buffers()):
                e.copy_(s)
        if self.server is not None and self.weights != "frozen" and self._steps % self.push_every == 0:
            self.push()

    def push(self) -> float:
        """Served ``live``/``ema``: the scoring weights (the student's, or the EMA's; a LoRA student's merged into its
        base, :func:`~lightning_opd.models.lora.merged_state_dict`) to the server, stamped with the optimizer steps so
        far (:attr:`pushed_version`); seconds.

        Raises:
            RuntimeError: no server, or nothing attached.
            ServerError: the push failed on every server it writes (naming each and the step); a server that failed
                while another took the push is out until it rejoins with these weights (F34,
                :meth:`~lightning_opd.serving.weight_push.ServerWeightPush.push`).
        """
        if self.server is None or self.model is None:
            raise RuntimeError(f"teacher {self.name}: push needs a server and attach_student()")
        # a LoRA student's weights (live) or their EMA: the base with the adapter merged in, as the server names them
        state = merged_state_dict(self.model) if is_lora_model(self.model) else self.model.state_dict()
        breakdown = self._pusher.push(self.server.pool, state, self._steps)
        self.pushed_version = self._steps
        if self.server.pool.writers():  # a rank past the last URL writes nothing (one writer per server)
            self._pushes += 1
            self._push_s += breakdown["total"]
        return breakdown["total"]

    def state_dict(self) -> dict:
        """``ema``: the EMA copy's weights (``{"ema": state dict}``), so a resumed run continues the average;
        ``frozen`` (the starting weights, copied again at resume) and ``live`` (the student's): nothing."""
        out: dict = {"steps": self._steps}
        if self.weights == "ema" and self.model is not None:
            out["ema"] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore the EMA copy from :meth:`state_dict` (a checkpoint without one leaves the copy as it is).

        Raises:
            RuntimeError: the saved EMA does not fit the student (another model), or :meth:`attach_student` has not
                been called.
        """
        self._steps = int(state.get("steps", self._steps))
        if self.weights == "ema" and "ema" in state:
            if self.model is None:
                raise RuntimeError(f"teacher {self.name}: load_state_dict before attach_student (no EMA copy to "
                                   "restore)")
            self.model.load_state_dict(state["ema"])
        if self.server is not None and self.weights != "frozen" and self._steps:
            self.push()  # a restarted server holds the starting weights: serve the resumed ones

    def privileged_text(self, task_id: str) -> str:
        """The environment's privileged text for ``task_id`` (asked once, then kept).

        Raises:
            RuntimeError: no environment attached.
            ValueError: the environment gives none for this task.
        """
        if task_id not in self._texts:
            if self.envs is None:
                raise RuntimeError(f"teacher {self.name} has no environment: OPDModule attaches its DataModule's env "
                                   "at setup (attach_envs); call attach_envs(env_factory) when scoring by hand")
            text = self.envs.privileged_context(task_id)
            if not text:
                raise ValueError(f"teacher {self.name}: {type(self.envs).__name__} gives no privileged context for "
                                 f"task {task_id!r}")
            self._texts[task_id] = text
        return self._texts[task_id]

    def _expert(self, task_id: str) -> list[str] | None:
        """The environment's expert actions for ``task_id`` (asked once, then kept); ``None`` without an expert."""
        if task_id not in self._experts:
            try:
                self._experts[task_id] = list(self.envs.expert_actions(task_id))
            except (NotImplementedError, KeyError):
                self._experts[task_id] = None
        return self._experts[task_id]

    def episode_view(self, traj: Trajectory) -> TeacherView:
        """The teacher's view of one episode (``view``: :func:`walkthrough_view` or :func:`next_action_view` with
        :func:`expert_next_actions` as the hints).

        Raises:
            ValueError: ``next_action`` and an environment without an expert for the task (names both).
            TeacherViewError: see the view functions.
        """
        if self.view == "walkthrough":
            return walkthrough_view(traj, self.privileged_text(traj.task_id), self.chat, self.placement)
        expert = self._expert(traj.task_id)
        if expert is None:
            raise ValueError(f"teacher {self.name}: {type(self.envs).__name__} has no expert actions for task "
                             f"{traj.task_id!r} (EnvFactory.expert_actions); the next_action view hints them. Use "
                             "view=walkthrough, or an environment with an expert")
        return next_action_view(traj, expert_next_actions(traj, expert), self.chat)

    def view_batch(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The teacher's view of every row of ``batch``, right-padded, with each student position's place in it.

        A row with no task id (a padding row of ``masked_rows``) is kept as it is (positions unmoved, nothing kept).
        Student positions past a row's length (padding) keep the row's last shift.

        Returns:
            ``(input_ids, attention_mask, positions, kept)``: ``(B, T')`` long each; ``(B, T)`` long view position of
            each student position (:attr:`TeacherView.positions`) and ``(B, T)`` bool, the student's token is in the
            view verbatim there (:attr:`TeacherView.kept`).

        Raises:
            RuntimeError: a row whose trajectory is not in ``batch.trajectories``.
            TeacherViewError, ValueError: see :meth:`episode_view`.
        """
        if self.chat is None:
            raise RuntimeError(f"teacher {self.name} is not ready: it needs bind() (tokenizer) and attach_envs()")
        width_s = batch.input_ids.shape[1]
        views, positions = [], torch.arange(width_s).repeat(batch.size, 1)
        kept = torch.zeros((batch.size, width_s), dtype=torch.bool)
        for i, (task, traj) in enumerate(row_trajectories(batch)):
            if not task:
                views.append(batch.input_ids[i, :batch.lengths[i]].tolist())
                continue
            if traj is None:
                raise RuntimeError(f"teacher {self.name}: row {i} (task {task!r}) has no trajectory in "
                                   "batch.trajectories; the teacher's view needs its first message")
            view = self.episode_view(traj)
            n = traj.num_tokens
            views.append(view.ids)
            positions[i, :n] = torch.tensor(view.positions, dtype=torch.long)
            positions[i, n:] += len(view.ids) - n  # padding: the last shift
            kept[i, :n] = torch.tensor(view.kept, dtype=torch.bool)
        width = max((len(v) for v in views), default=1)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((len(views), width), pad, dtype=torch.long)
        mask = torch.zeros((len(views), width), dtype=torch.long)
        for i, v in enumerate(views):
            ids[i, :len(v)] = torch.tensor(v, dtype=torch.long)
            mask[i, :len(v)] = 1
        return ids, mask, positions.clamp(0, width - 1), kept

    @torch.no_grad()
    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        """See :meth:`Teacher.score`. One forward of the scoring model over the teacher's views (eval mode, no
        grad); position ``(r, c)`` of ``batch`` (scoring token ``c + 1``) is read at ``(r, positions[r, c + 1] - 1)``
        of the views (:meth:`view_batch`), in process and served alike.

        Raises:
            RuntimeError: called before :meth:`attach_student`, or not ready (see :meth:`view_batch`).
            ValueError: a bad request (:meth:`Teacher.check_request`).
            TeacherViewError: a view does not hold a scored student token (one it keeps) at its mapped position
                (names the row and the position; a bug in the view).

        A requested position whose token the view replaced (inside a first prompt or, with ``next_action``, a user
        turn) has no counterpart in the teacher's view; it is read inside the replacement (a finite, meaningless
        score: the loss masks such positions).
        """
        self.check_request(signals, top_k)
        if self.model is None and self.server is None:
            raise RuntimeError(f"teacher {self.name} has no weights: OPDModule.configure_model calls "
                               "attach_student(student); call it when scoring by hand")
        device = batch.input_ids.device
        ids, mask, positions, kept = (t.to(device) for t in self.view_batch(batch))
        tcols = positions[rows, cols + 1] - 1
        targets = batch.input_ids[:, 1:][rows, cols]  # (N,)
        self._check_kept(ids, rows, cols, tcols, targets, kept[rows, cols + 1])
        if self.server is not None:  # the views as token ids to the served teacher (the privileged prompt goes over)
            view = dataclasses.replace(batch, input_ids=ids, attention_mask=mask)
            out = self.server.score(view, rows, tcols, signals, temperature, top_k, chunk_size)
            if out.topk_ids is not None:  # hint use from the top-k the loss asked for (none with sampled tokens only)
                self.hint_use(batch, rows, cols, out.topk_ids[:, 0])
            return out
        model = self.model
        head = output_head(model, self.vocab_size)
        was_training = model.training
        model.eval()
        try:
            hidden = with_root_params(model, lambda: trunk_hidden_states(model, ids, mask)[rows, tcols])  # (N, D)
        finally:
            model.train(was_training)

        def frozen_head(h: torch.Tensor) -> torch.Tensor:  # live: no graph into the student's head either
            with torch.no_grad():
                return head(h)

        out = scores_from_hidden(hidden, targets, frozen_head, signals, temperature, top_k, chunk_size,
                                 self.vocab_size)
        self._hint_use_from_hidden(batch, rows, cols, hidden, frozen_head)
        return out

    def _check_kept(self, ids, rows, cols, tcols, targets, kept) -> None:
        """Every scored token the view keeps is the teacher-view token at its mapped position (F08).

        Raises:
            TeacherViewError: the first one that is not (row, student position, view position).
        """
        bad = (kept & (ids[:, 1:][rows, tcols] != targets)).nonzero(as_tuple=True)[0]
        if bad.numel():
            i = int(bad[0])
            raise TeacherViewError(f"teacher {self.name}: row {int(rows[i])}: the student's token at position "
                                   f"{int(cols[i]) + 1} is not in the teacher's view at its mapped position "
                                   f"{int(tcols[i]) + 1} (a bug in the {self.view} view: it must keep every reply id)")

    def _hint_use_from_hidden(self, batch, rows, cols, hidden, head) -> None:
        """:meth:`hint_use` with the top-1 of the head at the turns' first reply positions only (a few rows)."""
        starts = batch.turn_index[:, 1:] if batch.turn_index.shape[1] > 1 else None
        if starts is None or not batch.trajectories:
            return
        prev = batch.turn_index[:, :-1]
        first = (batch.loss_mask[:, 1:] > 0) & (starts >= 0) & (starts != prev)  # (B, T-1): predicts a turn's 1st token
        pick = first[rows, cols].nonzero(as_tuple=True)[0]
        if pick.numel() == 0:
            return
        top1 = torch.zeros(rows.numel(), dtype=torch.long, device=rows.device)
        top1[pick] = head(hidden[pick]).argmax(-1)
        self.hint_use(batch, rows, cols, top1)  # it reads top1 at the first reply positions only (all in pick)
