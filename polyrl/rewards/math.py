"""Math answers checked by ``math-verify``: the reply is parsed (LaTeX, ``\\boxed{}``, plain numbers and
expressions) and compared with the gold answer for mathematical equality, so ``1/2``, ``0.5`` and
``\\frac{1}{2}`` all match."""

from __future__ import annotations

import threading


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere run without one.
    return 5 if threading.current_thread() is threading.main_thread() else None


def _parse(text: str) -> list:
    from math_verify import parse

    return parse(text, parsing_timeout=_timeout())


def math_verify_score(gold: str | float | int, reply: str) -> float:
    """1.0 when the reply's final answer equals ``gold`` mathematically, else 0.0; never raises.

    A boxed answer wins when the reply has one; otherwise math-verify takes the last expression it finds.
    """
    from math_verify import verify

    try:
        gold_parsed = _parse(f"${gold}$" if not isinstance(gold, str) or "$" not in gold else gold)
        if not gold_parsed:
            gold_parsed = _parse(str(gold))
        answer = _parse(reply)
        if not gold_parsed or not answer:
            return 0.0
        return 1.0 if verify(gold_parsed, answer, timeout_seconds=_timeout()) else 0.0
    except Exception:  # noqa: BLE001 - a reply that chokes the parser is simply wrong
        return 0.0
