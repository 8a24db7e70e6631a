"""The run plan (``polyrl/plan.py``): the run's shape resolved once from the config (and the joined rank), checked
by hand for representative configs; and no library code asks torch.distributed for its rank on its own."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from polyrl.config import ConfigError, parse_config
from polyrl.plan import Ranks, RunPlan, resolve_plan
from tests.conftest import SMOKE

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "polyrl"


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


def _calls_of_current(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each call ``current()`` or ``<module>.current()`` in the file."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == "current") or (isinstance(f, ast.Attribute)
                                                                       and f.attr == "current"):
                    found.append((function, child.lineno))
            walk(child, name)

    walk(ast.parse(path.read_text(), filename=str(path)), "<module>")
    return found


def test_library_code_takes_its_ranks_from_the_plan():
    """``parallel.group.current()`` asks torch.distributed which rank this process is: only ``join_group``
    does, and the plan carries its answer everywhere else."""
    calls = {f"{path.relative_to(PACKAGE_DIR.parent)}:{fn}:{line}"
             for path in sorted(PACKAGE_DIR.rglob("*.py")) for fn, line in _calls_of_current(path)}
    assert calls, "the walk found no call at all: join_group's own is expected"
    outside = sorted(c for c in calls if not c.startswith("polyrl/parallel/group.py:join_group:"))
    assert not outside, "current() called outside join_group: " + ", ".join(outside)


def test_the_call_finder_sees_calls_in_nested_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from x import group, current\n"
                      "def a():\n    def b():\n        return group.current()\n    return current()\n"
                      "current_device()\n")
    assert sorted(_calls_of_current(source)) == [("a", 5), ("b", 4)]
