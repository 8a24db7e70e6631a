"""What every generation engine provides: the interface the rollout, the step and the runtimes are written
against (``HFEngine``, ``VLLMEngine``, ``RecomputeLogprobs`` and the partial-rollout ``PartialEngine``).

- ``generate`` samples groups and returns, per prompt, its ``Completion`` objects: the token ids exactly as
  sampled and their behaviour log-probs (the hooks ``stop``, ``entropy`` and ``top_logprobs`` are the HF
  engine's; another engine refuses the ones it cannot honour with ``NotImplementedError``, and config loading
  refuses such a pairing before any model loads).
- ``sync`` loads the learner's current weights (the engine's "load weights"; it also wakes a sleeping engine).
- ``release_memory`` puts the engine to sleep for the learner's update: its own copy of the weights (or GPU
  memory) is freed until the next ``sync``; ``until_used`` lets a later ``generate`` wake it by itself.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

from polyrl.engines.hf import Completion


@runtime_checkable
class Engine(Protocol):
    tokenizer: PreTrainedTokenizerBase
    pad_id: int
    stop_ids: set[int]
    """Token ids that end a completion (the tokenizer's end of sequence and the chat template's end of turn)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int = 0,
        **hooks: Any,
    ) -> list[list[Completion]]:
        """``n`` completions for each prompt (token ids); result[i][j] is the j-th sample of prompt i."""
        ...

    def sync(self) -> None:
        """Load the policy's current weights (waking the engine if it sleeps)."""
        ...

    def release_memory(self, until_used: bool = False) -> None:
        """Sleep: free the engine's own weights or cache until ``sync`` (or, with ``until_used``, the next use)."""
        ...
