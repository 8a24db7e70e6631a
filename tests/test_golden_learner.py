"""The numbers of the advantage stage and the learner do not drift: every scenario of ``golden_learner.py``
(each path a token's advantage and the loss can take) gives the advantages, metrics and weight changes
recorded in tests/data/golden_learner.json. A deliberate change of the numerics re-records that file
(``python tests/golden_learner.py record``) and says why in its commit. On the kind of CPU it was recorded on
the numbers must agree to RTOL; on another kind (AVX2 against AVX-512, or another vendor's MKL kernels)
float32 matmuls sum in another order, and two AdamW updates carry that rounding to about 1e-4 of a value, so
the comparison allows OTHER_CPU_RTOL: still a hundredth of what a change of a formula moves."""

import json
import math

import pytest
import torch
from golden_learner import GOLDEN, RECORDED_ON, SCENARIOS, float32_kind, run_scenario

RTOL = 1e-6
OTHER_CPU_RTOL, OTHER_CPU_ATOL = 5e-4, 1e-7


def tolerance(golden: dict) -> tuple[float, float]:
    """(relative, absolute) tolerance on this machine: tight where float32 rounds as on the recording's."""
    same_kind = golden[RECORDED_ON] == float32_kind()
    return (RTOL, 1e-9) if same_kind else (OTHER_CPU_RTOL, OTHER_CPU_ATOL)


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module", autouse=True)
def _two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as recorded
    yield
    torch.set_num_threads(threads)


def _close(got, want, where: str, tol: tuple[float, float] = (RTOL, 1e-9)) -> None:
    """Equal structure; floats within ``tol`` (relative, absolute) of the recorded value."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for k in want:
            _close(got[k], want[k], f"{where}/{k}", tol)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{where}[{i}]", tol)
    elif isinstance(want, float) and isinstance(got, float) and not (math.isnan(want) or math.isnan(got)):
        assert math.isclose(got, want, rel_tol=tol[0], abs_tol=tol[1]), (where, got, want)
    else:
        assert got == want or (got != got and want != want), (where, got, want)


def test_every_scenario_is_recorded(golden):
    assert sorted(golden) == sorted([*SCENARIOS, RECORDED_ON])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_learner_numbers_match_the_recording(golden, name):
    got = run_scenario(name)
    want = golden[name]
    _close(got["updates"], want["updates"], name, tolerance(golden))
    _close(got["delta"], want["delta"], f"{name}/delta", tolerance(golden))


def test_the_comparison_has_teeth(golden):
    # Another learning rate moves the weights differently; the scenarios' updates are not all zero.
    assert sum(golden[n]["delta"]["norm"] > 0 for n in SCENARIOS) >= len(SCENARIOS) - 1
    want = golden["grpo"]["updates"][0]["metrics"]
    with pytest.raises(AssertionError):
        _close({**want, "loss": want["loss"] * (1 + 10 * RTOL)}, want, "grpo")
    with pytest.raises(AssertionError):  # on another CPU kind a 1 % change still fails
        _close({**want, "loss": want["loss"] * 1.01}, want, "grpo", (OTHER_CPU_RTOL, OTHER_CPU_ATOL))
