"""Early termination of rollouts whose per-token uncertainty spikes (ESPO-style; the issue's formulation).

A rollout that suddenly becomes very uncertain (a surprise or entropy spike relative to what it was so far)
is usually degenerating: looping, drifting into noise. Stopping it there saves the tokens it would have spent.
The test is our own, kept simple: an exponential moving average of the signal against the running mean of
the same rollout's earlier tokens, ``ema_t - baseline_t > threshold`` after ``min_tokens`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpikeState:
    """One rollout's running statistics (kept across its turns)."""

    count: int = 0
    total: float = 0.0
    ema: float | None = None


def spike_step(state: SpikeState, signal: float, alpha: float, threshold: float, min_tokens: int) -> bool:
    """Feed one token's signal; True when the smoothed signal exceeds the running baseline by ``threshold``.

    The baseline is the mean over the tokens before this one, so a spike cannot hide inside its own baseline.
    """
    baseline = state.total / state.count if state.count else signal
    state.ema = signal if state.ema is None else alpha * signal + (1 - alpha) * state.ema
    state.count += 1
    state.total += signal
    return state.count > min_tokens and state.ema - baseline > threshold


def spike_index(signal: list[float], alpha: float, threshold: float, min_tokens: int) -> int | None:
    """Pure form of the test: the index of the first token at which a rollout would stop, or None."""
    state = SpikeState()
    for i, s in enumerate(signal):
        if spike_step(state, s, alpha, threshold, min_tokens):
            return i
    return None


class EarlyStopper:
    """Builds the engine's per-row stop predicate for a batch of episodes, keeping each episode's state."""

    def __init__(
        self, signal: str, alpha: float, threshold: float, min_tokens: int, terminal_reward: float = 0.0
    ) -> None:
        self.signal, self.alpha, self.threshold, self.min_tokens = signal, alpha, threshold, min_tokens
        self.terminal_reward = terminal_reward
        self.states: dict[int, SpikeState] = {}

    def predicate(self, episode_keys: list[int]):
        """``stop`` for one ``generate`` call whose output row ``r`` plays episode ``episode_keys[r]``."""

        def stop(rows: list[int], tokens: list[int], logprobs: list[float], entropies: list[float] | None):
            flags = []
            for b, row in enumerate(rows):
                value = -logprobs[b] if self.signal == "surprise" or entropies is None else entropies[b]
                state = self.states.setdefault(episode_keys[row], SpikeState())
                flags.append(spike_step(state, value, self.alpha, self.threshold, self.min_tokens))
            return flags

        return stop
