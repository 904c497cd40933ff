"""``lightning-opd evaluate``: held-out evaluation of exported students or training checkpoints, one JSON per run.

    lightning-opd evaluate --students artifacts/models/smollm2-135m after=artifacts/models/student-opd \\
        --games artifacts/games/quest3 --seeds 0 1 2 --avg-k 4 --temperature 0.7 \\
        --teacher artifacts/models/teacher-textworld --out results.json
    lightning-opd compare results.json                       # one arm per student, paired by (task, seed)

For every student (a Hugging Face directory, e.g. an ``export_dir``, or a Lightning ``.ckpt`` written while
training ``OPDModule``, a file or an FSDP run's folder of shards, whose ``student.*`` weights are loaded into
``--base``), on the tasks of one split:

* **greedy**: every task played once with greedy decoding (``success``, ``turns``, ``invalid_actions``,
  ``reward`` per episode). Greedy decoding does not use the episode seed and the environments are
  deterministic, so the episode is played once per task and recorded under every seed of ``--seeds``:
  the same (task, seed) keys as the sampled episodes and as other arms, so runs pair in ``compare``;
* **sampled** (``--avg-k k`` > 0): ``k`` episodes per task and seed at ``--temperature``, episode seeds
  ``seed * 1_000_003 + task_index * k + j``; Avg@k is their mean success;
* **teacher-trajectory KL** (``--teacher``): the student's teacher-forced reverse KL on the teacher's own
  greedy trajectories of the same tasks (nats/token, mean and per turn; :mod:`.teacher_kl`). The teacher's
  trajectories are cached (``--cache-dir``) and reused by later runs; the teacher's greedy episodes are kept
  too (``teacher.episodes``, keyed like the students', so a student can be compared with the teacher);
* **own-trajectory KL by outcome** (``--teacher``; ``--no-own-traj-kl`` skips it): the same reverse KL on the
  student's *own* greedy episodes, per turn, split into won and failed episodes
  (:func:`.teacher_kl.kl_by_outcome`): where on its own trajectories the student departs from the teacher, in
  episodes it wins and in those it loses. It costs a student and a teacher forward over every greedy episode
  (on 2 CPU cores about 7 of the 20 minutes of a 50-game evaluation whose episodes all run 8 turns).

No work is done twice: a student that is the ``--teacher`` directory reuses the teacher's greedy episodes played
in the same run (not read from the cache) and scores KL 0 on its trajectories without a forward pass; the
teacher's hidden states on its trajectories are computed once for all students; one vLLM engine serves every
policy of the same architecture (weights pushed, prefix cache emptied, between policies).

Episodes go through the training stack unchanged: the agent loop of a
:class:`~lightning_opd.rollout.session.RolloutSession`, as in training (same chat rendering, stop ids, context
limit), with the vLLM generator when vLLM is importable
(``--backend auto``; an in-process engine, reused across checkpoints of one ``--base`` by pushing their
weights) or the HF generator.

Output (``--out``, written atomically at the end)::

    {"format": "lightning-opd-evaluate/1", "config": {...}, "tasks": [...],
     "teacher": {"path", "cache", "greedy": {summary of the teacher's own greedy episodes},
                 "episodes": [{"task_id", "seed", "success", ...}]} | null,
     "students": [{"name", "path", "kind": "hf" | "ckpt", "policy_version", "global_step",
                   "train_seconds",       # a .ckpt's training seconds (its Timer), else null
                   "rollouts",            # a .ckpt's {"generated", "used"} episodes so far, else null
                   "seconds",
                   "greedy": [{"task_id", "seed", "success", "turns", "invalid_actions", "reward", ...}],
                   "sampled": [{... , "sample", "episode_seed"}],
                   "teacher_traj_kl": [{"task_id", "seed", "kl", "tokens"}],      # per task, under every seed
                   "summary": {"greedy": {...}, "sampled": {"avg_at_k", ...}, "teacher_traj_kl": {mean, per_turn, ...},
                               "own_traj_kl": {"won" | "failed": {episodes, mean, per_turn, tokens_per_turn, tokens}}}}],
     "engine_starts": vLLM engines started (one while consecutive policies share an architecture)}

Values per episode: ``success``/``failure``/``truncated``/``env_error`` 0 or 1, ``turns`` replies,
``invalid_actions`` count, ``reward`` points, ``cut_replies`` count; greedy records also keep the
decoded ``replies`` (what the student said, turn by turn).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from lightning_opd.files import json_safe, write_text_atomic
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.session import RolloutSession
from lightning_opd.rollout.generator import Generator, SamplingParams
from lightning_opd.rollout.types import Trajectory
from lightning_opd.rollout.vllm import DEFAULT_BLOCK_SIZE

log = logging.getLogger(__name__)

FORMAT = "lightning-opd-evaluate/1"
DEFAULT_ENV = "lightning_opd.envs.textworld_env.TextWorldEnvFactory"
SEED_STRIDE = 1_000_003


@dataclass
class EvalSettings:
    """What ``evaluate`` plays, with the command-line flag of each knob.

    Attributes:
        seeds: ``--seeds``: episode keys; sampled episodes are drawn per seed.
        avg_k: ``--avg-k``: sampled episodes per task and seed (0: none).
        temperature: ``--temperature``: sampling temperature of those episodes (> 0).
        max_turns: ``--max-turns``: turn limit per episode (turns).
        max_new_tokens: ``--max-new-tokens``: reply limit per turn (tokens).
        max_context_tokens: ``--max-context-tokens``: context limit per episode (tokens).
        batch_size: ``--batch-size``: episodes played together.
        backend: ``--backend``: ``auto`` (vLLM if importable, else HF), ``hf`` or ``vllm``.
        device: ``--device``: ``auto`` (cuda if available), ``cpu``, ``cuda``, ...: where HF models run.
        dtype: ``--dtype``: parameter dtype of every model (HF and vLLM).
        vllm_kv_cache_bytes: ``--vllm-kv-cache-bytes``: KV cache of a vLLM engine (bytes); ``None``: room for
            ``batch_size x max_context_tokens`` tokens of the engine's model, at least 1 GiB
            (:meth:`kv_cache_bytes`), so the prefix cache keeps every episode's earlier turns (a smaller cache
            re-prefills whole contexts every turn: benchmarks/eval_kv_cache.py).
        vllm_block_size: ``--vllm-block-size``: tokens per KV block of a vLLM engine; the prefix cache reuses whole
            blocks only, so each turn re-prefills up to one block of its context. Default
            :data:`~lightning_opd.rollout.vllm.DEFAULT_BLOCK_SIZE` (32, as training rollouts): the demo's
            evaluation prefills 22% fewer tokens than at vLLM's CPU default of 128 and takes 17% less time
            (benchmarks/eval_throughput.py); ``None``: vLLM's default.
        own_traj_kl: ``--no-own-traj-kl`` sets it ``False``: no own-trajectory KL by outcome (with ``--teacher``).
        privileged_context: ``--privileged-context``: every policy sees each task's privileged text before its first
            observation (:class:`~lightning_opd.envs.privileged.WithPrivilegedContext`).

    Raises:
        ValueError: a bad value; the message names the flag.
    """

    seeds: list[int] = field(default_factory=lambda: [0])
    avg_k: int = 4
    temperature: float = 0.7
    max_turns: int = 8
    max_new_tokens: int = 16
    max_context_tokens: int = 2048
    batch_size: int = 50
    backend: str = "auto"
    device: str = "auto"
    dtype: str = "float32"
    vllm_kv_cache_bytes: int | None = None
    vllm_block_size: int | None = DEFAULT_BLOCK_SIZE
    own_traj_kl: bool = True
    privileged_context: bool = False

    def __post_init__(self) -> None:
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds {self.seeds}: give at least one seed, each once")
        if self.avg_k < 0:
            raise ValueError(f"--avg-k {self.avg_k} must be >= 0 (0: no sampled episodes)")
        if self.avg_k and not self.temperature > 0:
            raise ValueError(f"--temperature {self.temperature} must be > 0 for sampled episodes (--avg-k {self.avg_k})")
        for flag, value in (("--max-turns", self.max_turns), ("--max-new-tokens", self.max_new_tokens),
                            ("--max-context-tokens", self.max_context_tokens), ("--batch-size", self.batch_size)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be >= 1")
        if self.backend not in ("auto", "hf", "vllm"):
            raise ValueError(f"--backend {self.backend!r}: use auto, hf or vllm")
        if self.vllm_block_size is not None and (self.vllm_block_size < 1 or self.vllm_block_size % 16):
            raise ValueError(f"--vllm-block-size {self.vllm_block_size}: use a positive multiple of 16 (vLLM's KV "
                             "block sizes), or leave it unset for vLLM's default")
        if self.vllm_kv_cache_bytes is not None and self.vllm_kv_cache_bytes < 1:
            raise ValueError(f"--vllm-kv-cache-bytes {self.vllm_kv_cache_bytes} must be >= 1 (or leave it unset: "
                             "sized for --batch-size x --max-context-tokens)")

    def kv_cache_bytes(self, engine_path: str) -> int:
        """The vLLM KV cache size (bytes) for an engine of ``engine_path``: ``vllm_kv_cache_bytes`` if set,
        else enough for ``batch_size x max_context_tokens`` tokens in ``dtype``, at least 1 GiB."""
        if self.vllm_kv_cache_bytes is not None:
            return self.vllm_kv_cache_bytes
        from lightning_opd.rollout.vllm import kv_cache_bytes_for

        return max(1 << 30, kv_cache_bytes_for(engine_path, self.batch_size * self.max_context_tokens, self.dtype))

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        try:
            importlib.import_module("lightning_opd.rollout.vllm")._import_vllm()
        except ImportError:
            return "hf"
        return "vllm"


# ---------------------------------------------------------------------------------------- environment
def make_env(class_path: str = DEFAULT_ENV, init_args: dict | None = None, data_dir: str | None = None):
    """The environment factory ``class_path(**init_args)``; ``data_dir`` (``--games``), if given, is passed
    as the factory's first argument (``games_dir`` for TextWorld, ``data_dir`` for Search-QA).

    Returns:
        ``(factory, env_id)``, ``env_id`` = ``{"class_path", "init_args"}`` as used (directories resolved).

    Raises:
        ValueError: ``class_path`` is not ``module.Class`` or cannot be imported.
    """
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"--env {class_path!r}: cannot import it ({err}); give module.Class") from err
    args = dict(init_args or {})
    if data_dir is not None:
        params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
        if not params:
            raise ValueError(f"--games: {class_path} takes no data directory argument")
        args[params[0].name] = str(Path(data_dir).resolve())
    return cls(**args), {"class_path": class_path, "init_args": args}


# -------------------------------------------------------------------------------------------- students
@dataclass
class PolicyHandle:
    """What the generators and the agent loop need from a policy (``PolicySource``)."""

    tokenizer: object
    policy_model: object | None
    student_path: str
    policy_version: int = 0
    trust_remote_code: bool = False


@dataclass
class LoadedStudent:
    """A student to evaluate: its HF model (on ``device``), tokenizer and where it came from."""

    name: str
    path: str
    kind: str  # "hf" or "ckpt"
    model: torch.nn.Module
    tokenizer: object
    engine_path: str  # directory a vLLM engine starts from (the student's own, or --base for a .ckpt)
    policy_version: int | None = None
    global_step: int | None = None
    train_seconds: float | None = None
    rollouts: dict[str, int] | None = None  # a .ckpt's rollout_totals: {"generated", "used"} episodes


def parse_student(spec: str) -> tuple[str, str]:
    """``[LABEL=]PATH`` -> ``(label, path)`` (a ``LABEL`` has no ``/``; an existing path is never split);
    default label: the directory name, or for a ``.ckpt`` ``<run directory>/<file stem>`` (the folder
    above ``checkpoints/``)."""
    label, sep, path = spec.partition("=")
    if sep and label and "/" not in label and not Path(spec).exists():  # not a path like .../step=10.ckpt
        return label, path
    p = Path(spec)
    if p.suffix == ".ckpt":
        run = p.parent.parent if p.parent.name == "checkpoints" else p.parent
        return f"{run.name}/{p.stem}", spec
    return p.name or str(p), spec


def load_student(name: str, path: str, base: str | None, dtype: str, device: torch.device) -> LoadedStudent:
    """Load a student from a Hugging Face directory or an ``OPDModule`` checkpoint.

    A checkpoint is a ``.ckpt`` file or the folder of shards an FSDP run writes (its ``last.ckpt``, F30),
    read by :func:`~lightning_opd.models.checkpoints.read_policy_checkpoint` (shards consolidated in this
    process; ``torch.load(weights_only=True)``, F15); its ``state_dict`` entries ``student.*`` are loaded
    (strict) into the model at ``base`` (the ``model.init_args.student`` the run started from; a LoRA student's
    checkpoint, which names its ``lora``, into ``base`` with that adapter, then merged), whose tokenizer is used; its training seconds come from its ``Timer`` state
    (:func:`~lightning_opd.models.checkpoints.train_seconds`), its rollouts generated and used so far from
    ``rollout_totals`` (``OPDModule.log_rollout_counts``).

    Raises:
        FileNotFoundError: ``path`` is neither a model directory nor a checkpoint.
        ValueError: a checkpoint without ``base`` or without ``student.*`` weights.
    """
    from lightning_opd.models.checkpoints import is_checkpoint, read_policy_checkpoint, train_seconds
    from lightning_opd.models.loading import load_causal_lm, load_tokenizer

    p = Path(path)
    if p.is_dir() and not is_checkpoint(p):
        model = load_causal_lm(p, dtype).to(device).eval()
        return LoadedStudent(name, str(p), "hf", model, load_tokenizer(p), engine_path=str(p))
    if not p.exists():
        raise FileNotFoundError(f"--students {path!r}: no such model directory or checkpoint")
    if base is None:
        raise ValueError(f"--students {path!r} is a checkpoint: pass --base DIR, the student directory the run "
                         "started from (its model.init_args.student), for the architecture and tokenizer")
    try:
        state, ckpt = read_policy_checkpoint(p)
    except ValueError as err:
        raise ValueError(f"--students {path!r}: {err}") from None
    model = load_causal_lm(base, dtype)
    if ckpt.get("lora") is not None:  # a LoRA student (issue 65): base + adapter, merged for evaluation
        from lightning_opd.models.lora import LoRAConfig, apply_lora

        model = apply_lora(model, LoRAConfig(**ckpt["lora"]))
        model.load_state_dict(state, strict=True)
        model = model.merge_and_unload()
    else:
        model.load_state_dict(state, strict=True)
    model.to(device).eval()
    rollouts = ckpt.get("rollout_totals")
    return LoadedStudent(name, str(p), "ckpt", model, load_tokenizer(base), engine_path=str(base),
                         policy_version=ckpt.get("policy_version"), global_step=ckpt.get("global_step"),
                         train_seconds=train_seconds(ckpt),
                         rollouts=({k: int(v) for k, v in rollouts.items()} if rollouts is not None else None))


# ------------------------------------------------------------------------------------------ generators
def model_config(path: str) -> dict:
    """A model directory's ``config.json`` without the keys that do not change the network (its name, the
    transformers version and the stored dtype): two directories with equal dicts hold the same architecture."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in ("_name_or_path", "transformers_version", "torch_dtype", "dtype")}


class Backends:
    """Generators for one run: a fresh ``HFGenerator`` per policy, or one vLLM engine kept while
    consecutive policies have the same architecture (:func:`model_config`: checkpoints of one run, or a
    base model, its LoRA-merged teacher and its distilled student). Every policy gets a new version, so the
    engine (``follow_policy``) loads that policy's weights before its first reply (and empties its prefix
    cache); a policy of another architecture starts a new engine from its own directory.

    Attributes:
        engine_starts: vLLM engines started so far (count).
    """

    def __init__(self, settings: EvalSettings) -> None:
        self.kind = settings.resolved_backend()
        self.settings = settings
        self._engine = None
        self._engine_path: str | None = None
        self._engine_config: dict | None = None
        self._version = 0  # distinct version per policy: the engine pushes weights when it changes
        self.engine_starts = 0

    def loop(self, env, handle: PolicyHandle, engine_path: str) -> AgentLoop:
        """The agent loop of a :class:`~lightning_opd.rollout.session.RolloutSession` for ``handle``, the same
        wiring as training (stop ids F23, context limit F24); environment errors counted, never raised."""
        s = self.settings
        self._version += 1
        handle.policy_version = self._version
        session = RolloutSession(env, self._generator(engine_path), max_context_tokens=s.max_context_tokens,
                                 max_turns=s.max_turns, max_env_error_rate=1.0)
        session.connect(handle)
        return session.loop

    def _generator(self, engine_path: str) -> Generator:
        if self.kind == "hf":
            from lightning_opd.rollout.hf import HFGenerator

            return HFGenerator()
        config = model_config(engine_path)
        if self._engine is not None and (self._engine_path == engine_path or self._engine_config == config):
            return self._engine
        self.close()
        from lightning_opd.rollout.vllm import VLLMGenerator

        s = self.settings
        self._engine = VLLMGenerator(model=engine_path, dtype=s.dtype, kv_cache_memory_bytes=s.kv_cache_bytes(engine_path),
                                     max_model_len=s.max_context_tokens,
                                     block_size=s.vllm_block_size)  # None: vLLM's default
        self._engine_path, self._engine_config = engine_path, config
        self.engine_starts += 1
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
        self._engine, self._engine_path, self._engine_config = None, None, None


# ---------------------------------------------------------------------------------------------- playing
def episode_record(traj: Trajectory, seed: int) -> dict:
    """The per-episode outcome kept in the JSON (0/1 flags as ints)."""
    return {"task_id": traj.task_id, "seed": seed, "success": int(traj.success), "failure": int(traj.failure),
            "turns": traj.num_turns, "invalid_actions": traj.invalid_actions, "reward": traj.total_reward,
            "truncated": int(traj.truncated), "env_error": int(traj.env_error), "cut_replies": traj.cut_replies}


def _mean(records: list[dict], key: str) -> float:
    return sum(r[key] for r in records) / len(records) if records else math.nan


def summarise(records: list[dict]) -> dict:
    """Means over ``records`` of success, turns, invalid actions and reward, and their count."""
    return {k: _mean(records, k) for k in ("success", "turns", "invalid_actions", "reward")} | {"episodes": len(records)}


def play(loop: AgentLoop, specs: list[EpisodeSpec], sampling: SamplingParams, batch_size: int) -> list[Trajectory]:
    """``specs`` through ``loop``, ``batch_size`` at a time; trajectories in order."""
    out: list[Trajectory] = []
    for start in range(0, len(specs), batch_size):
        out += loop.run(specs[start:start + batch_size], sampling)
    return out


def evaluate_student(loop: AgentLoop, tasks: Sequence[str], settings: EvalSettings,
                     greedy_trajs: list[Trajectory] | None = None) -> tuple[dict, list[Trajectory]]:
    """Greedy and sampled episodes of one student (module docstring); returns ``greedy``, ``sampled`` and
    their ``summary``, and the greedy trajectories (one per task). ``greedy_trajs``: this policy's greedy
    episodes of ``tasks`` already played in this run with the same settings (the teacher's, when the teacher is
    also a student), used instead of playing them again."""
    from lightning_opd.evaluation.teacher_kl import play_greedy

    s = settings
    if greedy_trajs is None:
        greedy_trajs = play_greedy(loop, list(tasks), s.max_turns, s.max_new_tokens, s.batch_size)
    replies = [[m["content"] for m in t.messages if m["role"] == "assistant"] for t in greedy_trajs]
    greedy = [episode_record(t, seed) | {"replies": r} for seed in s.seeds for t, r in zip(greedy_trajs, replies)]
    sampled: list[dict] = []
    if s.avg_k:
        specs = [EpisodeSpec(task_id=t, seed=seed * SEED_STRIDE + i * s.avg_k + j, max_turns=s.max_turns)
                 for seed in s.seeds for i, t in enumerate(tasks) for j in range(s.avg_k)]
        sampling = SamplingParams(temperature=s.temperature, top_p=1.0, top_k=0, max_new_tokens=s.max_new_tokens)
        trajs = play(loop, specs, sampling, s.batch_size)
        for n, (spec, traj) in enumerate(zip(specs, trajs)):
            seed = s.seeds[n // (len(tasks) * s.avg_k)]
            sampled.append(episode_record(traj, seed) | {"sample": n % s.avg_k, "episode_seed": spec.seed})
    summary = {"greedy": summarise([episode_record(t, s.seeds[0]) for t in greedy_trajs])}
    if s.avg_k:
        summary["sampled"] = summarise(sampled) | {"avg_at_k": _mean(sampled, "success"), "k": s.avg_k}
    return {"greedy": greedy, "sampled": sampled if s.avg_k else None, "summary": summary}, greedy_trajs


# ----------------------------------------------------------------------------------------------- run
def evaluate(students: Sequence[str], *, env_class: str = DEFAULT_ENV, env_args: dict | None = None,
             games: str | None = None, split: str = "eval", limit: int | None = None,
             settings: EvalSettings | None = None, teacher: str | None = None, base: str | None = None,
             cache_dir: str | None = "artifacts/cache/teacher_trajectories", out: str | os.PathLike | None = None) -> dict:
    """Evaluate ``students`` (``[LABEL=]PATH`` each) and return the result object (see the module
    docstring); written atomically to ``out`` when given.

    Raises:
        ValueError: an unknown ``split``, ``limit < 1``, no tasks, a student label used twice, a
            student/teacher tokenizer mismatch (F01), a model whose head path differs from its own
            forward (F20, ``UnsupportedArchitectureError``), or a bad setting (names the flag).
    """
    settings = settings or EvalSettings()
    env, env_id, tasks = _environment_and_tasks(env_class, env_args, games, split, limit, settings)
    specs = [parse_student(s) for s in students]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"--students: labels {names} repeat; name them LABEL=PATH")
    device = settings.resolved_device()
    backends = Backends(settings)
    config = {"env": env_id, "split": split, "limit": limit, "seeds": list(settings.seeds), "avg_k": settings.avg_k,
              "temperature": settings.temperature, "max_turns": settings.max_turns,
              "max_new_tokens": settings.max_new_tokens, "max_context_tokens": settings.max_context_tokens,
              "batch_size": settings.batch_size, "backend": backends.kind, "device": str(device),
              "dtype": settings.dtype, "teacher": teacher, "base": base}
    result: dict = {"format": FORMAT, "config": config, "tasks": list(tasks), "teacher": None, "students": []}
    side = None
    try:
        if teacher is not None:
            side, result["teacher"] = _teacher_side(teacher, env, env_id, tasks, settings, device, backends, cache_dir)
        for name, path in specs:
            result["students"].append(_evaluate_one(name, path, base, env, tasks, settings, device, backends, side))
    finally:
        backends.close()
    result["engine_starts"] = backends.engine_starts
    if out is not None:
        write_text_atomic(out, json.dumps(json_safe(result), indent=1))  # non-finite floats as null
    return result


def _environment_and_tasks(env_class: str, env_args: dict | None, games: str | None, split: str, limit: int | None,
                           settings: EvalSettings) -> tuple[object, dict, list[str]]:
    """The environment factory, its identity (for the cache key and the output) and the tasks of ``split``.

    Raises:
        ValueError: an unknown ``split``, ``limit < 1`` or no tasks.
    """
    if split not in ("eval", "train"):
        raise ValueError(f"--split {split!r}: use eval (held-out tasks) or train")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit} must be >= 1")
    env, env_id = make_env(env_class, env_args, games)
    if settings.privileged_context:  # the policies see each task's privileged text (the privileged teacher acting)
        from lightning_opd.envs.privileged import WithPrivilegedContext

        env, env_id = WithPrivilegedContext(env), {**env_id, "privileged_context": True}
    tasks = env.eval_tasks() if split == "eval" else env.train_tasks()
    tasks = tasks[:limit] if limit is not None else tasks
    if not tasks:
        raise ValueError(f"{env_class} has no {split} tasks")
    return env, env_id, tasks


@dataclass
class _TeacherSide:
    """The teacher of one evaluation: its model and tokenizer, its greedy trajectories of the tasks, its hidden states
    on them (computed once for all students), whether its episodes were played here (``played`` non-empty; not read
    from the cache) and whether its head path was checked (F20)."""

    path: str
    model: torch.nn.Module
    tokenizer: object
    trajectories: list[Trajectory]
    played: list
    states: dict = field(default_factory=dict)
    checked: bool = False


def _teacher_side(teacher: str, env, env_id: dict, tasks: Sequence[str], settings: EvalSettings, device,
                  backends: Backends, cache_dir: str | None) -> tuple[_TeacherSide, dict]:
    """Load the teacher and play (or read from the cache) its greedy trajectories; returns them and the output's
    ``teacher`` record (its greedy summary and episodes, keyed like the students', and the seconds it took)."""
    from lightning_opd.evaluation.teacher_kl import teacher_trajectories
    from lightning_opd.models.loading import load_causal_lm, load_tokenizer

    t0 = time.perf_counter()
    teacher_tok = load_tokenizer(teacher)
    teacher_model = load_causal_lm(teacher, settings.dtype).to(device).eval()
    handle = PolicyHandle(teacher_tok, teacher_model, str(teacher))
    played: list = []

    def teacher_loop():
        played.append(True)
        return backends.loop(env, handle, str(teacher))

    teacher_trajs, path = teacher_trajectories(
        teacher_loop, teacher, env_id, tasks,
        max_turns=settings.max_turns, max_new_tokens=settings.max_new_tokens,
        max_context_tokens=settings.max_context_tokens, cache_dir=cache_dir, batch_size=settings.batch_size)
    record = {"path": str(teacher), "cache": None if path is None else str(path),
              "greedy": summarise([episode_record(t, settings.seeds[0]) for t in teacher_trajs]),
              "episodes": [episode_record(t, seed) for seed in settings.seeds for t in teacher_trajs],
              "seconds": round(time.perf_counter() - t0, 1)}
    return _TeacherSide(teacher, teacher_model, teacher_tok, teacher_trajs, played), record


def _evaluate_one(name: str, path: str, base: str | None, env, tasks: Sequence[str], settings: EvalSettings, device,
                  backends: Backends, side: _TeacherSide | None) -> dict:
    """One student's entry of the output: its greedy and sampled episodes and, with a teacher, its KL on the
    teacher's trajectories and on its own (the student is freed when this returns)."""
    t0 = time.perf_counter()
    student = load_student(name, path, base, settings.dtype, device)
    handle = PolicyHandle(student.tokenizer, student.model, student.engine_path)
    entry = {"name": name, "path": student.path, "kind": student.kind,
             "policy_version": student.policy_version, "global_step": student.global_step,
             "train_seconds": student.train_seconds, "rollouts": student.rollouts}
    is_teacher = side is not None and student.kind == "hf" and Path(path).resolve() == Path(side.path).resolve()
    reuse = side.trajectories if is_teacher and side.played else None  # the same greedy episodes: not played twice
    records, own_trajs = evaluate_student(backends.loop(env, handle, student.engine_path), tasks, settings, reuse)
    entry |= records
    if side is not None:
        _score_against_teacher(entry, student, path, side, is_teacher, own_trajs, settings)
    entry["seconds"] = round(time.perf_counter() - t0, 1)
    return entry


def _score_against_teacher(entry: dict, student: LoadedStudent, path: str, side: _TeacherSide, is_teacher: bool,
                           own_trajs: list[Trajectory], settings: EvalSettings) -> None:
    """Add the student's reverse KL (nats/token) on the teacher's trajectories to ``entry`` (per task under every
    seed, and its summary), and on its own greedy episodes by outcome unless ``own_traj_kl`` is off.

    Raises:
        ValueError: the tokenizers differ (F01) or a head path differs from the model's forward (F20)."""
    from lightning_opd.evaluation.teacher_kl import kl_by_outcome, trajectory_kl, zero_kl
    from lightning_opd.models.logits import check_head_path
    from lightning_opd.models.tokenizers import check_tokenizers_compatible

    vocab = check_tokenizers_compatible(student.tokenizer, side.tokenizer, path, side.path)
    check_head_path(student.model, vocab, f"--students {path}")  # F20: the KL's head path is exact
    if not side.checked:
        check_head_path(side.model, vocab, f"--teacher {side.path}")
        side.checked = True
    pad = student.tokenizer.pad_token_id
    pad_id = int(pad if pad is not None else student.tokenizer.eos_token_id)
    if is_teacher:  # KL(teacher || teacher) = 0 on every token: counted, not computed
        kl = zero_kl(side.trajectories)
    else:
        kl = trajectory_kl(student.model, side.model, side.trajectories, vocab, pad_id, teacher_states=side.states)
    entry["teacher_traj_kl"] = [
        {"task_id": t, "seed": seed, "kl": v["kl_sum"] / v["tokens"], "tokens": v["tokens"]}
        for seed in settings.seeds for t, v in kl.per_task.items() if v["tokens"]]
    entry["summary"]["teacher_traj_kl"] = {"mean": kl.mean, "per_turn": kl.per_turn,
                                           "tokens_per_turn": kl.tokens_per_turn, "tokens": kl.tokens}
    if settings.own_traj_kl:
        entry["summary"]["own_traj_kl"] = kl_by_outcome(student.model, side.model, own_trajs, vocab, pad_id)
