"""The program every code verdict runs in the sandbox, and the plain-data codec it shares with the caller.

Stdlib only and self-contained: ``polyrl.rewards.code_verdict`` hands this file's text to ``run_python`` as
``main.py`` (where ``__name__ == "__main__"`` runs ``_main``) and imports it for the same codec. A job comes
on stdin as JSON; the harness answers on a channel of its own (a duplicate of fd 1 taken before any other
code runs), while whatever the loaded code prints goes to stderr. Modes:

- ``record`` (trusted: the problem's prompt, canonical solution and test): runs ``check`` with a stand-in for
  the candidate that records every call's arguments and the canonical return value; answers the plan.
- ``solve`` (untrusted: the model's solution): calls the entry point on each recorded argument list, in order,
  and answers each return value as plain data. Nothing here is trusted by the caller: the solution shares
  this interpreter and can rewrite any of it. It can only ever choose the bytes it sends back, which the
  caller decodes into plain values and judges outside this process; it never sees an expected value.
- ``replay`` (trusted): runs the problem's own ``check`` with a stand-in that checks each call's arguments
  against the plan and returns the solution's decoded value; answers whether the test ran to its end.

Plain data is None, bool, int, float, str, list, tuple, dict, set and frozenset, checked with ``type(x) is``
(no subclass, so no overridden ``__eq__``, ``__hash__`` or ``__repr__`` crosses a process). In JSON, None,
bools, numbers, strings and lists are themselves (json keeps 1 and 1.0 apart, and NaN/Infinity); a tuple is
``{"t": [...]}``, a dict ``{"d": [[k, v], ...]}``, a set ``{"s": [...]}`` and a frozenset ``{"f": [...]}``,
their items sorted by their JSON text so the same set always encodes the same.
"""

import json
import linecache
import os
import random
import sys
import traceback

MAX_DEPTH = 100  # deeper values are not plain data here: bounds the recursion on both sides
_SEQ = {"t": tuple, "s": set, "f": frozenset}


class NotPlain(TypeError):
    pass


def to_json(x, depth=0):
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    t = type(x)
    if x is None or t is bool or t is int or t is float or t is str:
        return x
    if t is list:
        return [to_json(v, depth + 1) for v in x]
    if t is tuple:
        return {"t": [to_json(v, depth + 1) for v in x]}
    if t is dict:
        return {"d": [[to_json(k, depth + 1), to_json(v, depth + 1)] for k, v in x.items()]}
    if t is set or t is frozenset:
        items = [to_json(v, depth + 1) for v in x]
        return {"s" if t is set else "f": sorted(items, key=_text)}
    raise NotPlain(f"a {t.__name__} is not plain data")


def from_json(j, depth=0):
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    t = type(j)
    if j is None or t is bool or t is int or t is float or t is str:
        return j
    if t is list:
        return [from_json(v, depth + 1) for v in j]
    if t is dict and len(j) == 1:
        ((tag, body),) = j.items()
        if type(body) is list and tag in _SEQ:
            return _SEQ[tag](from_json(v, depth + 1) for v in body)
        if type(body) is list and tag == "d" and all(type(p) is list and len(p) == 2 for p in body):
            return {from_json(k, depth + 1): from_json(v, depth + 1) for k, v in body}
    raise NotPlain("not an encoding of plain data")


def _text(j):
    return json.dumps(j, separators=(",", ":"))


def encode(x):
    """Plain value -> one line of ASCII JSON; NotPlain for anything else (subclasses, cycles, huge ints)."""
    try:
        return _text(to_json(x))
    except (ValueError, RecursionError) as exc:  # an int past the str-digits limit; a cycle
        raise NotPlain(str(exc)) from None


def decode(text):
    """JSON text -> a fresh plain value; NotPlain for text that does not encode one."""
    try:
        return from_json(json.loads(text))
    except (ValueError, TypeError, RecursionError) as exc:  # bad JSON, unhashable key, too deep
        raise NotPlain(f"not an encoding of plain data ({type(exc).__name__})") from None


def strict_equal(a, b):
    """Equal and of the same type all the way down: 1, 1.0 and True are three different answers."""
    t = type(a)
    if t is not type(b):
        return False
    if t is list or t is tuple:
        return len(a) == len(b) and all(map(strict_equal, a, b))
    if t is dict:
        keys = {k: k for k in b}  # b's own key objects, to compare the keys' types too
        return len(a) == len(b) and all(
            k in keys and strict_equal(k, keys[k]) and strict_equal(v, b[k]) for k, v in a.items())
    if t is set or t is frozenset:
        return encode(a) == encode(b)
    return a == b


def same_types(a, b):
    """The same type as the reference wherever the two line up (a test with a tolerance judges values)."""
    t = type(a)
    if t is not type(b):
        return False
    if (t is list or t is tuple) and len(a) == len(b):
        return all(map(same_types, a, b))
    if t is dict:
        return all(same_types(v, b[k]) for k, v in a.items() if k in b)
    return True


def describe(exc, file=None):
    """``Type: message``, and where in ``file`` (the loaded code) it was raised: the test's failing line."""
    try:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except BaseException:  # noqa: BLE001 - a __str__ that raises still gets a name
        text = type(exc).__name__
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == file]
    if frames and frames[-1].line:
        text += f" (line {frames[-1].lineno}: {frames[-1].line.strip()})"
    return text[:400]


# ---------------------------------------------------------------------------------------------------------
# The sandboxed side.

def _main():
    channel = os.fdopen(os.dup(1), "w")  # taken before anything else runs; prints of loaded code go to stderr
    os.dup2(2, 1)
    job = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the code gets an empty stdin, as it would outside the harness
    os.close(null)

    def say(*item):
        channel.write(json.dumps(item) + "\n")
        channel.flush()

    # Tests that draw unseeded random inputs must draw the same ones when recorded and when replayed.
    random.seed(job["seed"])
    ns = {"__name__": "__main__"}
    file = job["file"]
    # Tracebacks and failure reports quote the code's lines, as they would from a file.
    linecache.cache[file] = (len(job["src"]), None, job["src"].splitlines(True), file)
    try:
        exec(compile(job["src"], file, "exec"), ns)  # noqa: S102 - what the sandbox is for
        fn = ns[job["entry"]]
        if job["mode"] != "solve":
            check = ns["check"]
    except BaseException as exc:  # noqa: BLE001 - the code's own failure, reported
        traceback.print_exc()
        say("load", describe(exc, file))
        return 1
    if job["mode"] == "solve":
        return _solve(fn, job["calls"], say, file)
    return _record(fn, check, say, file) if job["mode"] == "record" else _replay(check, job, say, file)


def _solve(fn, calls, say, file):
    for i, call in enumerate(calls):
        args, kwargs = decode(call)
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
            traceback.print_exc()
            say("raised", i, describe(exc, file))
            return 1
        try:
            text = encode(out)
        except BaseException as exc:  # noqa: BLE001 - whatever the value does while being looked at
            say("notplain", i, describe(exc))
            return 1
        say("ok", i, text)  # the text again as a JSON string: the caller decodes it with its own codec
    return 0


def _record(fn, check, say, file):
    plan = []

    def candidate(*args, **kwargs):
        call = encode((args, kwargs))  # before the call: a solution may mutate its arguments
        out = fn(*args, **kwargs)
        plan.append([call, encode(out)])
        return out

    try:
        check(candidate)
    except BaseException as exc:  # noqa: BLE001 - the reference fails its own test: the problem is broken
        traceback.print_exc()
        say("broken", describe(exc, file))
        return 1
    say("plan", plan)
    return 0


def _replay(check, job, say, file):
    calls, outs = job["calls"], job["outs"]
    state = {"n": 0, "diverged": None}

    def candidate(*args, **kwargs):
        n, call = state["n"], encode((args, kwargs))
        if n >= len(calls) or call != calls[n]:
            state["diverged"] = f"call {n + 1} was not the recorded one: {call[:200]}"
            raise RuntimeError(state["diverged"])
        state["n"] = n + 1
        return decode(outs[n])

    try:
        check(candidate)
    except BaseException as exc:  # noqa: BLE001 - the test failed on the solution's values
        traceback.print_exc()
        say("failed", state["diverged"] or describe(exc, file))
        return 1
    if state["diverged"] or state["n"] != len(calls):  # a test that swallowed the divergence, or stopped early
        say("failed", state["diverged"] or f"the test made {state['n']} of {len(calls)} recorded calls")
        return 1
    say("passed", state["n"])
    return 0


if __name__ == "__main__":
    sys.exit(_main())
