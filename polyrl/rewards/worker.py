"""The process a user's reward function runs in: ``python -m polyrl.rewards.worker``, started by ``RewardFn``.

A process of its own, started fresh rather than forked or spawned by ``multiprocessing``, so that neither the
trainer's threads nor its main script come along, and so that a reward past its timeout can be killed. The
first message names the function; the worker answers ``ready`` (or the import's error), then scores batches
of samples until its input closes. What the function prints goes to stderr, not into the replies.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from polyrl.loader import load_object
from polyrl.rewards.functions import call, first_line


def main() -> None:
    replies = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)  # print() in the user's code must not write into the replies
    requests = Connection(os.dup(0), writable=False)
    reference, path, convention, timeout_s = requests.recv()
    sys.path[:0] = [p for p in path if p not in sys.path]
    try:
        fn = load_object(reference, "reward")
    except Exception as exc:  # noqa: BLE001 - reported to the trainer as one line
        replies.send(("error", first_line(exc)))
        return
    replies.send(("ready", None))
    while True:
        try:
            samples = requests.recv()
        except EOFError:  # the trainer closed its end
            return
        results = call(fn, convention, samples, timeout_s)
        replies.send([r if not isinstance(r, BaseException) else ("__error__", first_line(r)) for r in results])


if __name__ == "__main__":
    main()
