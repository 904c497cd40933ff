"""``RoutedTeacher``: several teachers, each episode scored by the one its task routes to (multi-teacher OPD).

The MOPD setting of TRL, verl and NeMo RL: one student distils several domain teachers, each task (episode) from
one of them. Routes map a task-id prefix to a teacher name; the longest matching prefix wins, so a route can name
a task family (``"cooking/"``) or a single task (its full id); a task no route matches goes to ``default`` (or is
refused, naming the task). Each teacher may be any :class:`~lightning_opd.teachers.base.Teacher` (a ``vllm serve``
endpoint, the in-process model), so the teachers need not fit in one process.

What it provides is what every teacher provides, without ``FULL_VOCAB`` (hidden states and heads of different
teachers do not merge into one head): the sampled-token and top-K losses train with it. It keeps, per teacher, the
step's supervised tokens and KL on them (:meth:`RoutedTeacher.observe_kl`, fed by the module after every
micro-batch) and gives the module, every step, each teacher's share of the step's supervised tokens and its mean
per-token KL (``teacher/<name>/token_share``, ``teacher/<name>/kl_sampled``; :meth:`RoutedTeacher.step_metrics`,
PROPOSED, docs/algorithms.md §6.4).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Collection, Mapping

import torch

from lightning_opd.losses.base import TeacherSignal
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.teachers.base import Teacher, TeacherScores


class RoutedTeacher(Teacher):
    """Route each episode row to one of several teachers by its task id.

    Args:
        teachers: ``{name: Teacher}`` (YAML: ``name: {class_path: ..., init_args: ...}``); names are used in the
            logged keys.
        routes: ``{task-id prefix: teacher name}``; the longest prefix of a row's task id wins.
        default: the teacher of a task no route matches (``None``: such a task is an error).

    Raises:
        ValueError: no teachers; a route or ``default`` naming an unknown teacher; teachers whose common signals
            do not include ``sampled_token``.
    """

    def __init__(self, teachers: Mapping[str, Teacher], routes: Mapping[str, str] | None = None,
                 default: str | None = None) -> None:
        if not teachers:
            raise ValueError("RoutedTeacher: teachers is empty; give {name: teacher} (e.g. two RemoteTeacher URLs)")
        self.teachers = dict(teachers)
        self.routes = dict(routes or {})
        self.default = default
        unknown = sorted({n for n in self.routes.values() if n not in self.teachers}
                         | ({default} if default is not None and default not in self.teachers else set()))
        if unknown:
            raise ValueError(f"RoutedTeacher: routes/default name {unknown}, not among the teachers "
                             f"{sorted(self.teachers)}")
        common = frozenset.intersection(*(frozenset(t.provides) for t in self.teachers.values()))
        self.provides = common - {TeacherSignal.FULL_VOCAB}
        if TeacherSignal.SAMPLED_TOKEN not in self.provides:
            raise ValueError(f"RoutedTeacher: the teachers {sorted(self.teachers)} have no common sampled_token signal "
                             f"(common: {sorted(s.value for s in common)})")
        #: ``(2, n_teachers)`` fp64 sums of the current step on this rank: per teacher, KL over its supervised tokens
        #: and the token count (:meth:`observe_kl` adds, :meth:`step_metrics` reduces and resets)
        self._step_sums: torch.Tensor | None = None

    @property
    def names(self) -> list[str]:
        """Teacher names in a fixed order (the index :meth:`route` returns)."""
        return list(self.teachers)

    @property
    def name(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={t.name}' for n, t in self.teachers.items())})"

    def teacher_for(self, task_id: str) -> str:
        """The teacher name of ``task_id`` (longest matching route prefix, else ``default``).

        Raises:
            KeyError: no route matches and there is no ``default`` (naming the task and the routes).
        """
        best = max((p for p in self.routes if str(task_id).startswith(p)), key=len, default=None)
        if best is not None:
            return self.routes[best]
        if self.default is None:
            raise KeyError(f"RoutedTeacher: no route matches task {task_id!r} (routes: {sorted(self.routes)}) and no "
                           "default teacher is set")
        return self.default

    def route(self, batch: RolloutBatch) -> torch.Tensor:
        """``(B,)`` long: the index in :attr:`names` of each row's teacher.

        Raises:
            ValueError: the batch does not carry one task id per row.
            KeyError: see :meth:`teacher_for`.
        """
        if len(batch.task_ids) != batch.size:
            raise ValueError(f"RoutedTeacher needs one task id per row: the batch has {batch.size} rows and "
                             f"{len(batch.task_ids)} task ids")
        index = {n: i for i, n in enumerate(self.names)}
        return torch.tensor([index[self.teacher_for(t)] for t in batch.task_ids], dtype=torch.long)

    def bind(self, tokenizer, vocab_size: int) -> None:
        for t in self.teachers.values():
            t.bind(tokenizer, vocab_size)

    def load(self) -> None:
        for t in self.teachers.values():
            t.load()

    def attach_student(self, student) -> None:
        for t in self.teachers.values():
            t.attach_student(student)

    def attach_envs(self, envs) -> None:
        for t in self.teachers.values():
            t.attach_envs(envs)

    def on_optimizer_step(self) -> None:
        for t in self.teachers.values():
            t.on_optimizer_step()

    def state_dict(self) -> dict:
        """The teachers' states (those that have one), keyed by name."""
        return {n: st for n, t in self.teachers.items() if (st := t.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        for n, st in state.items():
            self.teachers[n].load_state_dict(st)

    def to(self, device: torch.device | str) -> "RoutedTeacher":
        for t in self.teachers.values():
            t.to(device)
        return self

    def close(self) -> None:
        for t in self.teachers.values():
            t.close()

    @property
    def stats(self) -> dict[str, float]:
        """The teachers' request totals (those that keep them), keyed ``<name>/<total>``."""
        return {f"{n}/{k}": v for n, t in self.teachers.items() for k, v in t.stats.items()}

    def observe_kl(self, batch: RolloutBatch, kl: torch.Tensor, keep: torch.Tensor) -> None:
        """Add each row's ``(b, T-1)`` KL (nats) over its supervised positions ``keep`` and its supervised tokens to
        its teacher's step sums (:meth:`route`)."""
        if self._step_sums is None:
            self._step_sums = torch.zeros(2, len(self.names), dtype=torch.float64, device=kl.device)
        owner = self.route(batch).to(kl.device)  # (b,)
        self._step_sums[0].index_add_(0, owner, torch.where(keep, kl, 0.0).sum(1).double())
        self._step_sums[1].index_add_(0, owner, keep.sum(1).double())

    def step_metrics(self, reduce_sum, kl_name: str, device: torch.device | str) -> dict[str, float]:
        """Per teacher, ``teacher/<name>/token_share`` (fraction of the step's supervised tokens, all ranks) and
        ``teacher/<name>/<kl_name>`` (nats/token on its tokens, all ranks; NaN when it had none), then the teachers'
        request totals (:attr:`stats`, ``teacher/<name>/<total>``, this rank). One all-reduce every rank reaches;
        starts the next step's sums."""
        out: dict[str, float] = {}
        names = self.names
        sums = self._step_sums if self._step_sums is not None else torch.zeros(
            2, len(names), dtype=torch.float64, device=device)
        sums = reduce_sum(sums.to(device))
        total = float(sums[1].sum())
        for i, name in enumerate(names):
            tokens = float(sums[1, i])
            out[f"teacher/{name}/token_share"] = tokens / total if total else 0.0
            out[f"teacher/{name}/{kl_name}"] = float(sums[0, i]) / tokens if tokens else float("nan")
        self._step_sums = None
        out.update(super().step_metrics(reduce_sum, kl_name, device))
        return out

    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        """See :meth:`Teacher.score`: each teacher scores the positions of its rows (all teachers at once, in
        threads), and the answers are put back in position order.

        Raises:
            ValueError, KeyError: see :meth:`route`; whatever a teacher raises.
        """
        self.check_request(signals, top_k)
        owner = self.route(batch).to(rows.device)[rows]  # (N,)
        jobs = {i: (owner == i).nonzero(as_tuple=True)[0] for i in range(len(self.names))}
        jobs = {i: sel for i, sel in jobs.items() if sel.numel()}

        def run(i: int) -> TeacherScores:
            sel = jobs[i]
            return self.teachers[self.names[i]].score(batch, rows[sel], cols[sel], signals, temperature, top_k,
                                                      chunk_size)

        with ThreadPoolExecutor(max(1, len(jobs))) as pool:
            parts = dict(zip(jobs, pool.map(run, list(jobs))))
        n = rows.numel()
        out = TeacherScores()
        for i, part in parts.items():
            sel = jobs[i]
            for field in ("sampled_logprobs", "topk_ids", "topk_logprobs"):
                value = getattr(part, field)
                if value is None:
                    continue
                if getattr(out, field) is None:
                    setattr(out, field, value.new_zeros((n, *value.shape[1:])))
                getattr(out, field)[sel] = value
        return out
