"""Waits on another process of the run, bounded: when one runs past its limit, the run ends with one line that
says what it waited for, for how long, and which setting bounds it (docs/systems.md, "When something is missing
or hangs"). A leaf module: the runtimes, the learner's process group and the CLI all import it."""

from __future__ import annotations

from collections.abc import Callable


class WaitTimeoutError(RuntimeError):
    """A wait on another process (a rank, a rollout worker or process, an engine) ran past its limit."""

    def __init__(self, what: str, seconds: float, key: str | None = None, hint: str = "") -> None:
        self.what, self.seconds, self.key = what, seconds, key
        bound = f" ({key})" if key else ""
        super().__init__(f"waited {seconds:g} s{bound} for {what}{'; ' + hint if hint else ''}")


def is_timeout(exc: BaseException) -> bool:
    """A torch.distributed rendezvous or collective that gave up waiting (gloo, the TCP store, NCCL's watchdog
    say so in their messages; their exception types are plain RuntimeErrors or ``DistError``s)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError | WaitTimeoutError) or "timed out" in text or "timeout" in text


def ray_get(ray: object, refs: object, timeout_s: float, what: str, key: str | None = None,
            hint: str | Callable[[], str] = "") -> object:
    """``ray.get(refs)`` bounded by ``timeout_s``; WaitTimeoutError naming ``what`` past it (``hint`` may be a
    function, asked only then: what is free in the cluster after the wait, not before)."""
    try:
        return ray.get(refs, timeout=timeout_s)  # type: ignore[attr-defined]
    except ray.exceptions.GetTimeoutError:  # type: ignore[attr-defined]
        raise WaitTimeoutError(what, timeout_s, key, hint() if callable(hint) else hint) from None
