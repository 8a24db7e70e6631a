import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"


@pytest.fixture(autouse=True, scope="session")
def _quiet_threads():
    # Two cores: keep intra-op threads fixed so timings and numerics are stable across tests.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield
