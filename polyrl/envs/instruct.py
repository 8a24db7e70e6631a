"""Instruction following with verifiable constraints, generated procedurally and offline (in the spirit of
IFEval, Zhou et al. 2023): a writing request plus 1-3 constraints that rules can check: word limits, a
keyword to include, JSON output, all lowercase, a number of bullet points, no commas, a closing phrase.

The reward is the fraction of the item's constraints the reply satisfies (partial credit); the item counts
as solved (score 1) only when all hold. Item ``i`` is a pure function of ``seed + i``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polyrl.config import TaskConfig
from polyrl.envs.base import Message, SingleTurnEnv, Task, TaskContext, register_env

TOPICS = [
    "the ocean", "a rainy day", "coffee", "the moon", "learning to cook", "a library", "winter mornings",
    "bicycles", "a city at night", "friendship", "gardening", "the history of maps", "trains", "honeybees",
    "a mountain hike", "music practice", "recycling", "the first day of school", "volcanoes", "chess",
]
KINDS = ["note", "poem", "short story", "product description", "letter", "summary"]
KEYWORDS = ["blue", "quiet", "window", "river", "light", "stone", "paper", "garden", "signal", "orange"]
CLOSINGS = ["Is there anything else?", "That is all.", "Thank you for reading."]

Check = Callable[[str], bool]


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def _bullets(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*[-*•]\s+\S", line))


def _json_with_key(key: str) -> Check:
    def check(text: str) -> bool:
        body = text.strip()
        fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL)
        try:
            data = json.loads(fenced.group(1) if fenced else body)
        except ValueError:
            return False
        return isinstance(data, dict) and key in data

    return check


# Each constraint family: (id, rng -> (instruction, checker, params)). Checkers are pure functions of the reply.
def _max_words(rng: random.Random) -> tuple[str, Check, dict]:
    n = rng.choice([10, 20, 30, 50])
    return f"Use at most {n} words.", lambda t: 0 < len(_words(t)) <= n, {"max_words": n}


def _min_words(rng: random.Random) -> tuple[str, Check, dict]:
    n = rng.choice([20, 40, 60])
    return f"Use at least {n} words.", lambda t: len(_words(t)) >= n, {"min_words": n}


def _keyword(rng: random.Random) -> tuple[str, Check, dict]:
    word = rng.choice(KEYWORDS)
    pattern = re.compile(rf"\b{word}\b", re.IGNORECASE)
    return f'Include the word "{word}".', lambda t: bool(pattern.search(t)), {"keyword": word}


def _lowercase(rng: random.Random) -> tuple[str, Check, dict]:
    del rng
    return "Write everything in lowercase letters only.", lambda t: t.strip() != "" and t == t.lower(), {}


def _bullet_points(rng: random.Random) -> tuple[str, Check, dict]:
    n = rng.choice([2, 3, 4])
    text = f'Answer with exactly {n} bullet points, each line starting with "- ".'
    return text, lambda t: _bullets(t) == n, {"bullets": n}


def _json(rng: random.Random) -> tuple[str, Check, dict]:
    key = rng.choice(["answer", "text", "title"])
    return f'Reply only with a JSON object that has the key "{key}".', _json_with_key(key), {"json_key": key}


def _no_commas(rng: random.Random) -> tuple[str, Check, dict]:
    del rng
    return "Do not use any commas.", lambda t: t.strip() != "" and "," not in t, {}


def _closing(rng: random.Random) -> tuple[str, Check, dict]:
    phrase = rng.choice(CLOSINGS)
    return f'End your reply with the exact phrase "{phrase}"', lambda t: t.strip().endswith(phrase), {"end": phrase}


CONSTRAINTS: dict[str, Callable[[random.Random], tuple[str, Check, dict]]] = {
    "max_words": _max_words, "min_words": _min_words, "keyword": _keyword, "lowercase": _lowercase,
    "bullets": _bullet_points, "json": _json, "no_commas": _no_commas, "closing": _closing,
}
# Pairs that cannot both hold (or make each other trivial) are never drawn together.
CONFLICTS = {frozenset({"max_words", "min_words"}), frozenset({"json", "bullets"}), frozenset({"json", "closing"}),
             frozenset({"json", "lowercase"}), frozenset({"json", "no_commas"})}


class InstructParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_constraints: int = Field(1, ge=1, le=3)
    max_constraints: int = Field(2, ge=1, le=3)
    constraints: list[str] = list(CONSTRAINTS)
    """The constraint families to draw from."""


def make_item(seed: int, params: InstructParams) -> dict[str, Any]:
    """Item ``seed``: a request and its constraints (ids plus the rng seed that rebuilds their checkers)."""
    rng = random.Random(seed)
    k = rng.randint(params.min_constraints, params.max_constraints)
    chosen: list[str] = []
    for name in rng.sample(params.constraints, len(params.constraints)):
        if len(chosen) < k and not any(frozenset({name, c}) in CONFLICTS for c in chosen):
            chosen.append(name)
    texts, specs = [], []
    for name in chosen:
        sub_seed = rng.randrange(2**31)
        text, _, details = CONSTRAINTS[name](random.Random(sub_seed))
        texts.append(text)
        specs.append({"id": name, "seed": sub_seed, **details})
    kind, topic = rng.choice(KINDS), rng.choice(TOPICS)
    question = f"Write a {kind} about {topic}. " + " ".join(texts)
    return {"question": question, "constraints": specs, "answer": None}


def check_reply(item: dict[str, Any], reply: str) -> list[bool]:
    """Whether the reply satisfies each of the item's constraints, in order."""
    return [CONSTRAINTS[c["id"]](random.Random(c["seed"]))[1](reply) for c in item["constraints"]]


class InstructEnv(SingleTurnEnv):
    def step(self, assistant_message: str):
        result = super().step(assistant_message)
        passed = check_reply(self.item, assistant_message)
        # score: all constraints hold (what evaluation counts); the reward keeps partial credit.
        return result._replace(info={**result.info, "score": float(all(passed)), "constraints_passed": passed})


class InstructTask(Task):
    def __init__(self, config: TaskConfig, params: InstructParams, seed: int, system_prompt: str | None) -> None:
        super().__init__(config, lambda: InstructEnv(self.messages, self.score),
                         lambda s: make_item(s, params), seed=seed)
        self.system_prompt = system_prompt

    def messages(self, item: dict[str, Any]) -> list[Message]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        msgs.append({"role": "user", "content": item["question"] + self.config.prompt_suffix})
        return msgs

    def score(self, item: dict[str, Any], reply: str) -> float:
        passed = check_reply(item, reply)
        return sum(passed) / len(passed)


def _check(config: TaskConfig, key: str) -> None:
    params = InstructParams.model_validate(config.params)
    unknown = [c for c in params.constraints if c not in CONSTRAINTS]
    if unknown:
        raise ValueError(f"{key}.params.constraints: unknown {unknown}; valid: {', '.join(CONSTRAINTS)}")
    if params.min_constraints > params.max_constraints:
        raise ValueError(f"{key}.params.min_constraints: {params.min_constraints} > max_constraints")


@register_env("instruct", params=InstructParams, check=_check)
def instruct_task(config: TaskConfig, ctx: TaskContext) -> Task:
    """Procedural instruction following with rule-checked constraints (word limits, keyword, JSON, ...)."""
    return InstructTask(config, ctx.params, ctx.seed, ctx.system_prompt)
