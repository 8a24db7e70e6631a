"""Retrieval QA: questions about fictional people and towns, answered with a BM25 ``search`` tool.

The collection is generated from a seed (no download, no real-world knowledge helps): one document per
person (home town, occupation, instrument) and per town (province, river). One-hop questions need the
person's document; two-hop questions ("which river flows through the town where X was born?") need the
person's document and then the town's.
"""

from __future__ import annotations

import random
import re
import threading
from dataclasses import dataclass
from functools import cache
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.envs.base import Message, Task, TaskContext, register_env
from polyrl.envs.tool_env import ToolEnv
from polyrl.envs.tool_parsers import ToolParser

_ONSETS = ["b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "th", "v", "w", "z", "qu"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "m", "x"]
OCCUPATIONS = ["baker", "cartographer", "glassblower", "beekeeper", "clockmaker", "ferryman", "weaver",
               "astronomer", "potter", "lighthouse keeper", "herbalist", "bookbinder"]
INSTRUMENTS = ["lute", "harp", "fiddle", "flute", "drum", "horn", "zither", "bagpipe", "cello", "oboe"]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))


def _unique_names(rng: random.Random, n: int, make) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        name = make(rng).title()
        if name not in names:
            names.append(name)
    return names


# A corpus's index serves every episode, and tool envs are stepped from several threads at once. Module-level,
# so episodes forked by deepcopy (ARPO) still share it.
_SEARCH_LOCK = threading.Lock()


@dataclass
class Corpus:
    """The generated documents, the facts behind them, and a BM25 index over them."""

    documents: list[str]
    people: list[dict[str, str]]
    towns: dict[str, dict[str, str]]
    top_k: int = 2

    def __post_init__(self) -> None:
        import bm25s
        from bm25s.tokenization import Tokenizer

        self._tokenizer = Tokenizer(stopwords="en")
        self._index = bm25s.BM25()
        self._index.index(self._tokenizer.tokenize(self.documents, show_progress=False), show_progress=False)

    def search(self, query: str) -> str:
        """Search the document collection about people and towns.

        Args:
            query: Keywords to look for, such as a person's or a town's name.
        """
        # Words not in the collection map to bm25s's empty token, which scores 0 everywhere.
        k = min(self.top_k, len(self.documents))
        with _SEARCH_LOCK:
            tokens = self._tokenizer.tokenize([query], update_vocab=False, show_progress=False)
            ids, scores = self._index.retrieve(tokens, k=k, show_progress=False)
        hits = [self.documents[i] for i, s in zip(ids[0].tolist(), scores[0].tolist(), strict=True) if s > 0]
        return "\n".join(hits) if hits else "No documents found."


@cache
def build_corpus(seed: int = 0, num_people: int = 100, num_towns: int = 25, top_k: int = 2) -> Corpus:
    """The collection for ``seed``; the same arguments give the same documents (and one shared index)."""
    rng = random.Random(f"retrieval-corpus-{seed}")
    town_names = _unique_names(rng, num_towns, lambda r: _word(r, 2))
    provinces = _unique_names(rng, max(2, num_towns // 5), lambda r: _word(r, 3))
    rivers = _unique_names(rng, max(2, num_towns // 2), lambda r: _word(r, 2))
    towns = {t: {"province": rng.choice(provinces), "river": rng.choice(rivers)} for t in town_names}
    full_names = _unique_names(rng, num_people, lambda r: f"{_word(r, 2)} {_word(r, 2)}")
    people = [
        {"name": n, "town": rng.choice(town_names), "occupation": rng.choice(OCCUPATIONS),
         "instrument": rng.choice(INSTRUMENTS)}
        for n in full_names
    ]
    docs = [
        f"{p['name']} is a {p['occupation']} who was born in {p['town']}. "
        f"{p['name'].split()[0]} plays the {p['instrument']}."
        for p in people
    ]
    docs += [f"{t} is a town in the province of {f['province']}. The river {f['river']} flows through {t}."
             for t, f in towns.items()]
    return Corpus(docs, people, towns, top_k)


def make_question(corpus: Corpus, seed: int, two_hop_fraction: float = 0.5) -> dict[str, Any]:
    rng = random.Random(f"retrieval-question-{seed}")
    person = rng.choice(corpus.people)
    name, town = person["name"], person["town"]
    if rng.random() < two_hop_fraction:
        kind = rng.choice(["province", "river"])
        question = (f"In which province was {name} born?" if kind == "province"
                    else f"Which river flows through the town where {name} was born?")
        return {"question": question, "answer": corpus.towns[town][kind], "hops": 2}
    kind = rng.choice(["town", "occupation", "instrument"])
    question = {"town": f"In which town was {name} born?", "occupation": f"What is {name}'s occupation?",
                "instrument": f"Which instrument does {name} play?"}[kind]
    return {"question": question, "answer": person[kind], "hops": 1}


def _normalise(text: str) -> str:
    text = re.sub(r"[^a-z0-9 ]", " ", text.lower())
    return " ".join(w for w in text.split() if w not in {"the", "a", "an"})


def answer_matches(reply: str, answer: str, max_words: int = 8) -> bool:
    """Exact match after normalisation, or the answer inside a short reply (a long one could list
    every town)."""
    found = re.split(r"(?i)answer\s*:", reply)[-1]
    got, want = _normalise(found), _normalise(answer)
    if got == want:
        return True
    return len(got.split()) <= max_words and f" {want} " in f" {got} "


INSTRUCTIONS = (
    "Answer the question. You can use the search tool to look up documents about people and towns; "
    "some questions need two searches. When you know the answer, reply with just the answer and no tool call."
)


class RetrievalEnv(ToolEnv):
    def __init__(self, corpus: Corpus, tool_parser: ToolParser | None = None, tool_error_penalty: float = 0.0,
                 system_prompt: str | None = None, max_calls_per_turn: int = 4) -> None:
        super().__init__([corpus.search], tool_parser, tool_error_penalty, max_calls_per_turn)
        self.system_prompt = system_prompt
        self.item: dict[str, Any] = {}

    def reset(self, item: dict[str, Any]) -> list[Message]:
        self.item = item
        system = INSTRUCTIONS if not self.system_prompt else f"{self.system_prompt}\n\n{INSTRUCTIONS}"
        return [{"role": "system", "content": system}, {"role": "user", "content": item["question"]}]

    def score(self, answer: str) -> float:
        return float(answer_matches(answer, self.item["answer"]))


class RetrievalParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corpus_seed: int = 0
    num_people: int = Field(100, gt=0)
    num_towns: int = Field(25, ge=2)
    top_k: int = Field(2, gt=0)
    """Documents returned per search."""
    two_hop_fraction: float = Field(0.5, ge=0, le=1)
    tool_error_penalty: float = Field(0.0, ge=0)
    max_calls_per_turn: int = Field(4, gt=0)


@register_env("retrieval_qa", params=RetrievalParams)
def retrieval_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Questions about a generated collection of fictional people and towns, with a BM25 search tool."""
    p: RetrievalParams = ctx.params
    corpus = build_corpus(p.corpus_seed, p.num_people, p.num_towns, p.top_k)
    return Task(
        config,
        make_env=lambda: RetrievalEnv(corpus, ctx.tool_parser, p.tool_error_penalty, ctx.system_prompt,
                                      p.max_calls_per_turn),
        make_item=lambda seed: make_question(corpus, seed, p.two_hop_fraction),
        seed=ctx.seed,
    )
