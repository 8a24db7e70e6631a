"""Per-turn credit for multi-turn episodes, and ARPO's attribution of shared prefixes: pure functions.

Each turn's advantage is spread over that turn's model tokens, so a trajectory gets per-token advantages
(``Trajectory.token_advantages``); the learner already takes [B, T] advantages.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

import torch

from polyrl.types import Trajectory


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """R_t = sum_{k >= t} gamma^(k - t) r_k for one episode's per-turn rewards."""
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def _normalise(values: list[float], eps: float) -> list[float]:
    if len(values) < 2:
        return [0.0] * len(values)
    x = torch.tensor(values, dtype=torch.float64)
    return ((x - x.mean()) / (x.std() + eps)).tolist()


def gigpo_step_advantages(
    returns: Sequence[Sequence[float]], states: Sequence[Sequence[Hashable]], group_ids: Sequence[int],
    eps: float = 1e-4,
) -> list[list[float]]:
    """GiGPO's step-level advantage (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
    Training", step relative advantage): turns of one group that start from the same environment state form
    a step group; a turn's advantage is its discounted return normalised within its step group
    ((R - mean) / (std + eps), unbiased std). A step group of one turn gets 0.
    """
    buckets: dict[tuple[int, Hashable], list[tuple[int, int]]] = defaultdict(list)
    for i, (g, st) in enumerate(zip(group_ids, states, strict=True)):
        for t, s in enumerate(st):
            buckets[(g, s)].append((i, t))
    out = [[0.0] * len(r) for r in returns]
    for members in buckets.values():
        for (i, t), a in zip(members, _normalise([returns[i][t] for i, t in members], eps), strict=True):
            out[i][t] = a
    return out


def turn_discount_advantages(
    returns: Sequence[Sequence[float]], group_ids: Sequence[int], eps: float = 1e-4
) -> list[list[float]]:
    """Turn-discounted credit: A_{i,t} = (R_{i,t} - mean_g R_{.,0}) / (std_g R_{.,0} + eps), the GRPO baseline
    of the episode returns applied to each turn's discounted return-to-go (REINFORCE with returns-to-go,
    Williams 1992, under a group baseline). Later turns of a failed episode are blamed less than with one
    episode-wide advantage when early turns earned partial reward."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for g, r in zip(group_ids, returns, strict=True):
        by_group[g].append(r[0] if r else 0.0)
    stats = {}
    for g, first in by_group.items():
        x = torch.tensor(first, dtype=torch.float64)
        stats[g] = (float(x.mean()), float(x.std()) if len(first) > 1 else 0.0)
    return [[(v - stats[g][0]) / (stats[g][1] + eps) for v in r] for g, r in zip(group_ids, returns, strict=True)]


def spread_over_turns(length: int, spans: Sequence[tuple[int, int]], turn_values: Sequence[float]) -> list[float]:
    """Per-token values for a trajectory of ``length`` tokens: each turn span gets its turn's value, 0 elsewhere."""
    out = [0.0] * length
    for (a, b), v in zip(spans, turn_values, strict=True):
        out[a:b] = [v] * (b - a)
    return out


def shared_prefix_advantages(
    token_advantages: Sequence[Sequence[float]], parents: Sequence[int | None], branch_at: Sequence[int]
) -> list[list[float]]:
    """ARPO's advantage attribution (Dong et al. 2025, "Agentic Reinforced Policy Optimization", Sec. 3.3):
    a token shared by several leaves of a branching tree gets the mean of those leaves' advantages.

    Leaves are rows of one tree: ``parents[i]`` is the row leaf i was branched from (None for a root) and
    leaf i copies its parent's first ``branch_at[i]`` tokens. Token j of leaf L, generated in L, is shared by
    L and every leaf descended from a child of L branched after j. Copied tokens get the value their owner's
    token gets, so all copies agree (the learner trains a shared token once, in its owner).
    """
    n = len(token_advantages)
    children: list[list[int]] = [[] for _ in range(n)]
    for i, p in enumerate(parents):
        if p is not None:
            if not 0 <= p < n or p == i:
                raise ValueError(f"leaf {i}: parent {p} is not another leaf of the tree")
            children[p].append(i)

    def subtree(i: int) -> list[int]:
        out, todo = [], [i]
        while todo:
            k = todo.pop()
            out.append(k)
            todo += children[k]
        return out

    out = [list(map(float, a)) for a in token_advantages]
    for leaf in range(n):
        start = branch_at[leaf] if parents[leaf] is not None else 0
        # Children sorted by branch point: token j is shared with every child branched after j.
        kids = sorted(children[leaf], key=lambda c: branch_at[c])
        for j in range(start, len(token_advantages[leaf])):
            members = [leaf] + [m for c in kids if branch_at[c] > j for m in subtree(c)]
            if len(members) > 1:
                out[leaf][j] = sum(token_advantages[m][j] for m in members) / len(members)
    for leaf in range(n):  # copies take their owner's value (parents before children: walk up the chain)
        for j in range(branch_at[leaf] if parents[leaf] is not None else 0):
            owner = leaf
            while parents[owner] is not None and j < branch_at[owner]:
                owner = parents[owner]
            out[leaf][j] = out[owner][j]
    return out


def apply_step_credit(trajectories: list[Trajectory], mode: str, weight: float, gamma: float) -> None:
    """Set ``token_advantages`` from per-turn returns (``info.turn_rewards``, with any reward shaping added to
    the last turn) on top of each trajectory's episode ``advantage``: gigpo adds ``weight`` x the step
    advantage; turn_discount replaces the episode advantage by the turn-discounted one."""
    if mode == "off" or not trajectories:
        return
    returns = []
    for t in trajectories:
        turn_rewards = list(t.info.get("turn_rewards") or [t.reward])
        turn_rewards[-1] += t.reward - sum(turn_rewards)  # shaping / early-stop reward sits on the last turn
        returns.append(discounted_returns(turn_rewards, gamma))
    groups = [t.group_id for t in trajectories]
    if mode == "gigpo":
        states = [t.info.get("turn_states") or [f"turn{k}" for k in range(len(r))]
                  for t, r in zip(trajectories, returns, strict=True)]
        step = gigpo_step_advantages(returns, states, groups)
        per_turn = [[t.advantage + weight * a for a in s] for t, s in zip(trajectories, step, strict=True)]
    elif mode == "turn_discount":
        per_turn = turn_discount_advantages(returns, groups)
    else:
        raise ValueError(f"agents.step_credit.mode: unknown mode '{mode}'")
    for t, values in zip(trajectories, per_turn, strict=True):
        spans = t.turn_spans or [(t.prompt_len, len(t.input_ids))]
        t.token_advantages = spread_over_turns(len(t.input_ids), spans, values[: len(spans)])


def attribute_tree_advantages(trajectories: list[Trajectory]) -> int:
    """Apply ``shared_prefix_advantages`` to every branching tree (leaves of one group with ``info.branch_id``);
    returns how many leaves were branches."""
    by_group: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        if "branch_id" in t.info:
            by_group[t.group_id].append(t)
    branches = 0
    for leaves in by_group.values():
        index = {t.info["branch_id"]: i for i, t in enumerate(leaves)}
        parents = [index.get(t.info.get("parent_id")) for t in leaves]
        branch_at = [int(t.info.get("branch_at", 0)) if p is not None else 0 for t, p in zip(leaves, parents,
                                                                                               strict=True)]
        branches += sum(p is not None for p in parents)
        token = [t.token_advantages or [t.advantage] * len(t.input_ids) for t in leaves]
        for t, adv in zip(leaves, shared_prefix_advantages(token, parents, branch_at), strict=True):
            t.token_advantages = adv
    return branches
