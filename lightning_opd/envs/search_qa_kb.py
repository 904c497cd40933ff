"""A synthetic knowledge base of fictional entities and two-hop questions over it (Search-QA data).

Every name is made of invented syllables and used by exactly one entity, so no answer can come from
pretraining memory and a search for a name finds its entity's document first. Four entity kinds and
their facts (one document each; the name is repeated as a title so BM25 ranks the entity's own
document above the documents that merely mention it)::

    person   "<P>. <P> is a(n) <profession> born in <city>. <P> works for <org>."
    org      "<O>. <O> is a(n) <industry> company based in <city>. It was founded by <P>."
    city     "<C>. <C> is a city in <country>. Its mayor is <P>."
    country  "<K>. <K> is a country whose capital is <C>."

Questions follow six two-hop templates (:data:`TEMPLATES`): the first search finds the entity the
question names, its document names a second entity, the second search finds that entity's document,
which holds the answer. ``write_search_qa`` keeps only questions whose two expert searches retrieve
both gold documents in the top ``k`` (checked with the same retriever the environment uses), splits
them by a hash of the question text (train and held-out cannot overlap) and writes ``corpus.jsonl``,
``questions.jsonl`` and ``manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from lightning_opd.envs.textworld_games import in_eval_split as hash_in_eval_split
from lightning_opd.files import write_dir_atomic

PROFESSIONS = ("painter", "engineer", "sailor", "baker", "astronomer", "lawyer", "farmer", "poet", "chemist",
               "architect", "merchant", "doctor", "weaver", "pilot", "teacher", "sculptor", "banker", "miner",
               "librarian", "composer")
INDUSTRIES = ("shipping", "mining", "textile", "software", "banking", "brewing", "printing", "railway", "glass",
              "timber", "pottery", "insurance", "fishing", "clockmaking", "shipbuilding", "salt")
ORG_SUFFIXES = ("Works", "Guild", "Company", "Foundry", "Holdings", "Trading", "Mills", "Group")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "th", "st",
           "gr", "tr", "sh", "ch", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ei")
_CODAS = ("", "", "n", "r", "l", "s", "th", "x", "m", "nd")

#: (template id, question text with ``{x}``, kind of the named entity, hop 1 relation, hop 2 relation)
TEMPLATES = (
    ("founder_birthplace", "In which city was the founder of {x} born?", "org", "founder", "birth_city"),
    ("founder_profession", "What is the profession of the founder of {x}?", "org", "founder", "profession"),
    ("org_country", "In which country is {x} based?", "org", "city", "country"),
    ("mayor_employer", "Which company does the mayor of {x} work for?", "city", "mayor", "employer"),
    ("person_country", "In which country was {x} born?", "person", "birth_city", "country"),
    ("employer_city", "In which city is the employer of {x} based?", "person", "employer", "city"),
)


@dataclass(frozen=True)
class KBSpec:
    """Sizes of the knowledge base (documents = persons + orgs + cities + countries)."""

    persons: int = 1100
    orgs: int = 600
    cities: int = 300
    countries: int = 40

    @property
    def documents(self) -> int:
        """Documents in the knowledge base (one per entity)."""
        return self.persons + self.orgs + self.cities + self.countries


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables)]
    return ("".join(parts) + rng.choice(_CODAS)).capitalize()


def _unique_words(rng: random.Random, count: int, used: set[str]) -> list[str]:
    words = []
    while len(words) < count:
        w = _word(rng, rng.choice((2, 2, 3)))
        if w.lower() not in used:
            used.add(w.lower())
            words.append(w)
    return words


def build_kb(spec: KBSpec = KBSpec(), seed: int = 0) -> dict[str, dict[str, dict]]:
    """Entities and their facts: ``{kind: {name: {relation: value}}}`` for the four kinds.

    Every name word is unique across the whole KB. Deterministic in ``seed``.
    """
    rng, used = random.Random(seed), set()
    countries = _unique_words(rng, spec.countries, used)
    cities = _unique_words(rng, spec.cities, used)
    firsts, lasts = _unique_words(rng, spec.persons, used), _unique_words(rng, spec.persons, used)
    persons = [f"{a} {b}" for a, b in zip(firsts, lasts)]
    orgs = [f"{w} {rng.choice(ORG_SUFFIXES)}" for w in _unique_words(rng, spec.orgs, used)]
    kb: dict[str, dict[str, dict]] = {"person": {}, "org": {}, "city": {}, "country": {}}
    for k in countries:
        kb["country"][k] = {"capital": None}
    for i, c in enumerate(cities):
        # every country gets at least one city; its first city is its capital
        country = countries[i] if i < len(countries) else rng.choice(countries)
        kb["city"][c] = {"country": country, "mayor": None}
        if kb["country"][country]["capital"] is None:
            kb["country"][country]["capital"] = c
    for o in orgs:
        kb["org"][o] = {"industry": rng.choice(INDUSTRIES), "city": rng.choice(cities), "founder": None}
    for p in persons:
        kb["person"][p] = {"profession": rng.choice(PROFESSIONS), "birth_city": rng.choice(cities),
                           "employer": rng.choice(orgs)}
    # founders and mayors are distinct persons
    officials = rng.sample(persons, spec.orgs + spec.cities)
    for o, p in zip(orgs, officials[: spec.orgs]):
        kb["org"][o]["founder"] = p
    for c, p in zip(cities, officials[spec.orgs:]):
        kb["city"][c]["mayor"] = p
    return kb


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def document(kind: str, name: str, facts: dict) -> str:
    """The text of one entity's document (see the module docstring)."""
    if kind == "person":
        return (f"{name}. {name} is {_article(facts['profession'])} {facts['profession']} born in {facts['birth_city']}. "
                f"{name} works for {facts['employer']}.")
    if kind == "org":
        return (f"{name}. {name} is {_article(facts['industry'])} {facts['industry']} company based in {facts['city']}. "
                f"It was founded by {facts['founder']}.")
    if kind == "city":
        return f"{name}. {name} is a city in {facts['country']}. Its mayor is {facts['mayor']}."
    if kind == "country":
        return f"{name}. {name} is a country whose capital is {facts['capital']}."
    raise ValueError(f"unknown entity kind {kind!r}; expected person, org, city or country")


_RELATION_KIND = {"founder": "person", "mayor": "person", "birth_city": "city", "city": "city",
                  "employer": "org", "country": "country", "capital": "city"}


def make_questions(kb: dict[str, dict[str, dict]], count: int, seed: int = 0) -> list[dict]:
    """Up to ``count`` distinct two-hop questions (all templates, entities drawn at random).

    Each question: ``{"question", "answer", "template", "hops": [name1, name2], "gold_docs": [id1, id2]}``,
    where ``hops`` are the expert's two search queries and document ids are ``"<kind>:<name>"``.
    """
    rng = random.Random(seed + 1)
    pool = [(t, name) for t in TEMPLATES for name in kb[t[2]]]
    rng.shuffle(pool)
    out = []
    for (tid, text, kind, rel1, rel2), name in pool[:count]:
        middle = kb[kind][name][rel1]
        answer = kb[_RELATION_KIND[rel1]][middle][rel2]
        out.append({"question": text.format(x=name), "answer": answer, "template": tid, "hops": [name, middle],
                    "gold_docs": [f"{kind}:{name}", f"{_RELATION_KIND[rel1]}:{middle}"]})
    return out


def in_eval_split(question: str, eval_fraction: float) -> bool:
    """A question is held out iff the sha256 of its text falls in ``eval_fraction`` (the rule of
    :func:`lightning_opd.envs.textworld_games.in_eval_split`; independent of how many questions are made)."""
    return hash_in_eval_split(hashlib.sha256(question.encode()).hexdigest(), eval_fraction)


def write_search_qa(out: str | Path, num_train: int = 600, num_eval: int = 50, spec: KBSpec = KBSpec(),
                    seed: int = 0, top_k: int = 2, eval_fraction: float = 0.2) -> Path:
    """Generate the corpus and questions into ``out`` (atomically); returns the manifest path.

    Args:
        out: output directory (``corpus.jsonl``, ``questions.jsonl``, ``manifest.json``).
        num_train, num_eval: questions per split.
        spec: knowledge-base sizes.
        seed: generation seed.
        top_k: documents shown per search; a question is kept only if each expert search retrieves its
            gold document within the top ``top_k``.
        eval_fraction: split rule of :func:`in_eval_split`.

    Raises:
        ValueError: a count is not positive, or the KB is too small for the requested questions.
    """
    from lightning_opd.envs.search_qa import BM25Retriever

    if num_train < 1 or num_eval < 1:
        raise ValueError(f"num_train={num_train} and num_eval={num_eval} must both be >= 1")
    kb = build_kb(spec, seed)
    docs = [{"id": f"{kind}:{name}", "text": document(kind, name, facts)}
            for kind, entities in kb.items() for name, facts in entities.items()]
    retriever = BM25Retriever([d["text"] for d in docs], [d["id"] for d in docs])
    split: dict[str, list[dict]] = {"train": [], "eval": []}
    for q in make_questions(kb, count=sum(len(v) for v in kb.values()) * 2, seed=seed):
        found = [gold in [i for i, _ in retriever.search(hop, top_k)] for hop, gold in zip(q["hops"], q["gold_docs"])]
        name = "eval" if in_eval_split(q["question"], eval_fraction) else "train"
        if all(found) and len(split[name]) < (num_eval if name == "eval" else num_train):
            split[name].append(q)
    if len(split["train"]) < num_train or len(split["eval"]) < num_eval:
        raise ValueError(f"the KB ({spec.documents} documents) gave only {len(split['train'])} train / "
                         f"{len(split['eval'])} held-out questions; ask for fewer or enlarge KBSpec")
    manifest = {"documents": len(docs), "train": num_train, "eval": num_eval, "seed": seed, "top_k": top_k,
                "spec": spec.__dict__, "templates": [t[0] for t in TEMPLATES]}
    rows = [{"id": f"{s}-{i:04d}", "split": s, **q} for s in ("train", "eval") for i, q in enumerate(split[s])]

    def write(tmp: Path) -> None:
        (tmp / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp / "questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))

    write_dir_atomic(out, write)
    return Path(out) / "manifest.json"
