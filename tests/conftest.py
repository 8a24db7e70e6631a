import os
from pathlib import Path

import pytest
import torch

from polyrl.models.loading import load_tokenizer
from tests.forkserver import ForkServer

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"

LONGEST_FIRST = (
    "test_kill_resume_two_ranks.py",
    "test_native_capped_builds.py",  # compiles two builds of the native kernels when the cache is cold (CI)
    "test_runtime_ray.py",
    "test_resume_runtimes.py",
    "test_retention.py",
    "test_kill_resume.py",
    "test_gpu_check.py",
    "test_weight_sync.py",
    "test_real_model.py",
    "test_fail_fast.py",
    "test_pipeline.py",
    "test_faults.py",
    "test_code_verdict.py",
    "test_determinism.py",
    "test_sharded_checkpoint.py",
    "test_sharded_learner.py",
    "test_architectures.py",
    "test_native_f32.py",  # builds this machine's kernels when the cache is cold
    "test_runtime_async.py",
    "test_cli_e2e.py",
    "test_viewer.py",
    "test_agent_tasks.py",
)
"""The modules that take longest, longest first. scripts/test.sh hands whole modules to two workers in collection
order (``--dist loadfile --no-loadscope-reorder``): these start first, and the many short modules after them fill
in at the end, so that the two workers finish together instead of one starting a long module as the other ends.
A name here that no longer exists fails tests/test_suite_order.py."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


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
