import os
from pathlib import Path

import pytest
import torch

from polyrl.models.loading import load_tokenizer
from tests.forkserver import ForkServer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores: keep intra-op threads fixed so timings and numerics are stable across tests.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's matmuls are too small to split: extra threads only wait on each other (badly so when the
    two cores are busy). A module that uses this runs single-threaded and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tok():
    """The tiny random model's tokenizer (a module may define its own ``tok`` for another model)."""
    return load_tokenizer("tiny-random")


@pytest.fixture(scope="session")
def polyrl_cli():
    """``polyrl`` command lines, each in a process of its own forked from a server that imported polyrl once
    (tests/forkserver.py), one thread each: ``polyrl_cli.run(argv, env=None, cwd=None)``."""
    server = ForkServer({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    yield server
    server.close()
