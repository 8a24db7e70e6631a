"""The run plan (``polyrl/plan.py``): the run's shape resolved once from the config (and the joined rank), checked
by hand for representative configs."""

from __future__ import annotations

import sys

import pytest

from polyrl.config import ConfigError, parse_config
from polyrl.plan import Ranks, RunPlan, resolve_plan
from tests.conftest import SMOKE


def _plan(*overrides: str, ranks: Ranks = Ranks()) -> RunPlan:
    return resolve_plan(parse_config(SMOKE, ["train.device=cpu", *overrides]), ranks)


def test_one_process_on_the_cpu():
    assert _plan() == RunPlan(device="cpu", world_size=1, sharded=False, ranks=Ranks(0, 1), runtime="local",
                              engine="hf", engines="colocated", rollout_workers=0, weight_sync="in_process")


def test_two_sharded_learner_ranks():
    plan = _plan("learner.world_size=2", ranks=Ranks(1, 2))
    assert plan == RunPlan(device="cpu", world_size=2, sharded=True, ranks=Ranks(1, 2), runtime="local",
                           engine="hf", engines="colocated", rollout_workers=0, weight_sync="gather")
    assert not plan.ranks.is_main and plan.ranks.distributed
    # The same run seen from a process outside the learners' group (a Ray rollout worker): it shards nothing.
    assert not _plan("learner.world_size=2").sharded


def test_async_runtime():
    assert _plan("runtime.kind=async", "runtime.eta=1") == RunPlan(
        device="cpu", world_size=1, sharded=False, ranks=Ranks(), runtime="async", engine="hf", engines="colocated",
        rollout_workers=1, weight_sync="host_copy")


def test_ray_with_disaggregated_engines():
    one = _plan("runtime.kind=ray", "runtime.num_workers=3")  # engines: auto is disaggregated at world size 1
    assert one == RunPlan(device="cpu", world_size=1, sharded=False, ranks=Ranks(), runtime="ray", engine="hf",
                          engines="disaggregated", rollout_workers=3, weight_sync="object_store")
    assert one.disaggregated
    ranks = _plan("runtime.kind=ray", "learner.world_size=2", "runtime.engines=disaggregated",
                  "runtime.num_workers=2", ranks=Ranks(0, 2))
    assert ranks == RunPlan(device="cpu", world_size=2, sharded=True, ranks=Ranks(0, 2), runtime="ray", engine="hf",
                            engines="disaggregated", rollout_workers=2, weight_sync="collective")


def test_ray_placed_ranks_with_colocated_engines():
    plan = _plan("runtime.kind=ray", "learner.world_size=2", ranks=Ranks(0, 2))
    assert (plan.engines, plan.rollout_workers, plan.weight_sync) == ("colocated", 0, "gather")
    assert not plan.disaggregated


def test_vllm_engine_resolves_without_importing_vllm():
    had_vllm = "vllm" in sys.modules
    plan = _plan("engine.kind=vllm")
    assert (plan.engine, plan.engines, plan.weight_sync) == ("vllm", "colocated", "in_process")
    assert ("vllm" in sys.modules) == had_vllm


def test_a_refused_shape_is_the_configs_error_before_any_plan():
    with pytest.raises(ConfigError, match="learner.world_size: the async runtime has one learner process"):
        _plan("runtime.kind=async", "learner.world_size=2")


def test_the_plan_is_a_frozen_value():
    plan = _plan()
    assert plan == _plan() and hash(plan) == hash(_plan())
    with pytest.raises(AttributeError):
        plan.world_size = 2  # type: ignore[misc]
