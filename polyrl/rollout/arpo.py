"""ARPO's entropy-guided branching rollout (Dong et al. 2025, "Agentic Reinforced Policy Optimization",
Sec. 3.2, entropy-based adaptive rollout).

Each group starts with M full ("global") rollouts. The mean entropy of the first k tokens of a rollout's
first turn is its initial entropy. After every tool result, the first k tokens the model generates are
measured the same way; where their entropy exceeds the initial one by more than a threshold, Z partial
rollouts branch from that point: each copies the episode as it stood right after the tool result (tokens,
behaviour log-probs, versions, env state) and samples the turn afresh. A group holds at most ``group_size``
leaves; budget left when every rollout has ended is filled with more global rollouts, as in the paper.

Leaves record ``branch_id``, ``parent_id`` and ``branch_at`` (the first token not copied) in ``info``, which
the viewer draws as a tree and ``polyrl.algorithms.step_credit.attribute_tree_advantages`` reads.
The paper samples the branch decision with probability alpha + beta * dH; this module uses the deterministic
limit of that rule (branch when dH > threshold), so runs stay reproducible from the seed alone.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from polyrl.config import ArpoConfig, RolloutConfig
from polyrl.engines.hf import Completion
from polyrl.engines.protocol import Engine
from polyrl.envs.base import Task
from polyrl.rollout.early_stop import EarlyStopper
from polyrl.rollout.multi_turn import TURN_SEED_STRIDE, Episode, advance_all, start_episode, to_trajectory
from polyrl.types import Trajectory


@dataclass
class Leaf:
    episode: Episode
    branch_id: int
    parent_id: int | None = None
    branch_at: int = 0
    initial_entropy: float | None = None


def fork(e: Episode) -> Episode:
    """A copy of an episode in progress that evolves on its own: token lists, messages and env state are
    copied; the task, renderer and tool parser (read-only, and large) are shared."""
    child = copy.copy(e)
    memo = {id(e.task): e.task, id(e.renderer): e.renderer, id(e.item): e.item}
    child.env = copy.deepcopy(e.env, memo)
    for name in ("ids", "loss_mask", "logprobs", "versions", "spans", "rewards", "messages", "tool_errors",
                 "states"):
        setattr(child, name, list(getattr(e, name)))
    child.last_info = dict(e.last_info)
    return child


def head_entropy(completion: Completion, k: int) -> float:
    """Mean entropy of the first ``k`` tokens; the mean surprise (-log-prob, an unbiased sample estimate of
    the entropy) when the engine did not report entropies."""
    values = completion.entropies if completion.entropies is not None else [-lp for lp in completion.logprobs]
    head = values[:k]
    return sum(head) / len(head) if head else 0.0


def should_branch(initial: float | None, entropy: float, threshold: float) -> bool:
    """The branching rule: the entropy after a tool result exceeds the initial entropy by ``threshold``."""
    return initial is not None and entropy - initial > threshold


def arpo_rollout(
    engine: Engine,
    requests: list[tuple[Task, int, dict[str, Any]]],
    config: RolloutConfig,
    cfg: ArpoConfig,
    seed: int,
    version: int,
    first_group_id: int = 0,
    stopper: EarlyStopper | None = None,
) -> list[Trajectory]:
    """Roll out one branching tree of ``config.group_size`` leaves per request, sampled as ``config`` says;
    returns the leaves, group by group."""
    tok = engine.tokenizer
    group_size, max_new_tokens = config.group_size, config.max_new_tokens
    temperature, top_p = config.temperature, config.top_p
    m = cfg.global_samples or max(1, group_size // 2)
    trees: list[list[Leaf]] = []
    for g, (task, item_id, item) in enumerate(requests):
        trees.append([Leaf(start_episode(task, item_id, item, first_group_id + g, tok), j) for j in range(m)])
    branch_points = 0
    it = 0
    while True:
        active = [(g, leaf) for g, tree in enumerate(trees) for leaf in tree if not leaf.episode.done]
        if not active:  # every rollout ended: spend what budget is left on global rollouts
            fresh = 0
            for g, (task, item_id, item) in enumerate(requests):
                for _ in range(group_size - len(trees[g])):
                    episode = start_episode(task, item_id, item, first_group_id + g, tok)
                    trees[g].append(Leaf(episode, len(trees[g])))
                    fresh += 1
            if not fresh:
                break
            continue
        limits = [leaf.episode.turn_limit(max_new_tokens) for _, leaf in active]
        extra = {"stop": stopper.predicate([id(leaf.episode) for _, leaf in active])} if stopper else {}
        turn_seed = seed + it * TURN_SEED_STRIDE
        if it == 0:  # the M global rollouts of a group share its prompt: prefill it once
            groups = engine.generate([tree[0].episode.ids for tree in trees], m, max(limits), temperature, top_p,
                                     turn_seed, entropy=True, **extra)
            outs = [(c,) for group in groups for c in group]
        else:
            outs = engine.generate([leaf.episode.ids for _, leaf in active], 1, max(limits), temperature, top_p,
                                   turn_seed, entropy=True, **extra)
        it += 1
        # Forks copy an episode before its turn is appended, so every leaf branches first, then all advance.
        for (g, leaf), (c,) in zip(active, outs, strict=True):
            e = leaf.episode
            entropy = head_entropy(c, cfg.entropy_tokens)
            if e.turns == 0:
                leaf.initial_entropy = entropy
            elif len(e.ids) > leaf.branch_at and should_branch(leaf.initial_entropy, entropy,
                                                               cfg.entropy_threshold):
                # Branch from right after the tool result: copy the episode before this turn is appended.
                width = min(cfg.branch_width, group_size - len(trees[g]))
                if width > 0:
                    branch_points += 1
                for _ in range(width):
                    child = Leaf(fork(e), len(trees[g]), leaf.branch_id, len(e.ids), leaf.initial_entropy)
                    trees[g].append(child)
        advance_all([leaf.episode for _, leaf in active], [c for (c,) in outs], limits, version, engine, stopper)
    out = []
    for tree in trees:
        for leaf in tree:
            t = to_trajectory(leaf.episode, tok)
            t.info["branch_id"] = leaf.branch_id
            if leaf.parent_id is not None:
                t.info.update(parent_id=leaf.parent_id, branch_at=leaf.branch_at)
            t.info["arpo_branch_points"] = branch_points
            out.append(t)
    return out
