"""Fail fast: a missing extra or a machine too small for the run is one line before any model loads, and every
wait on another process gives up with one line naming what it waited for and for how long (docs/systems.md,
"When something is missing or hangs"). Each wait is tested with a tiny limit and a peer that never answers.

Elsewhere: a reward function that hangs (tests/test_reward_functions.py), an agent episode past its timeout
(tests/test_agent_tasks.py), a weight-sync peer that dies or stalls (tests/test_weight_sync.py)."""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import time
from types import SimpleNamespace

import pytest
import torch

import polyrl.placement as placement
from polyrl.config import ConfigError
from polyrl.config_check import check_machine, load_config
from polyrl.models.loading import tiny_random_model
from polyrl.parallel.group import RankFailedError, join_group
from polyrl.parallel.launch import free_port
from polyrl.placement import PlacementError, check_ray_address, local_placement_problem, memory_problem
from polyrl.waits import WaitTimeoutError
from tests.conftest import SMOKE

RAY_RANKS = ["runtime.kind=ray", "runtime.engines=disaggregated", "runtime.num_workers=1", "learner.world_size=2"]


def _without(monkeypatch, *modules: str) -> None:
    """Make ``modules`` look uninstalled to the config checks."""
    import importlib.util

    import polyrl.config_check as config_check

    real = importlib.util.find_spec
    fake = lambda name, *args: None if name in modules else real(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", fake)  # the logging section's own check
    monkeypatch.setattr(config_check, "find_spec", fake)


@pytest.mark.parametrize(("overrides", "module", "line"), [
    (["runtime.kind=ray"], "ray", "runtime.kind: ray is not installed; pip install 'polyrl[ray]'"),
    (["logging.mlflow=true"], "mlflow", "logging.mlflow: mlflow is not installed; pip install 'polyrl[mlflow]'"),
    (["logging.wandb=true"], "wandb", "logging.wandb: wandb is not installed; pip install 'polyrl[wandb]'"),
])
def test_a_missing_extra_is_one_line_with_its_install_command_when_the_config_loads(monkeypatch, overrides, module,
                                                                                    line):
    _without(monkeypatch, module)
    with pytest.raises(ConfigError) as info:
        load_config(SMOKE, overrides)
    assert "\n" not in str(info.value) and line in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_vllm_config_loads_without_vllm_but_polyrl_train_refuses_it_before_the_model_loads(monkeypatch, device):
    _without(monkeypatch, "vllm")
    cfg = load_config(SMOKE, ["engine.kind=vllm", f"train.device={device}"])  # a plan, run on another machine
    with pytest.raises(ValueError, match=r"engine.kind is 'vllm' but vllm is not installed.*pip install"):
        check_machine(cfg)


def test_an_agent_using_the_agents_sdk_needs_the_sdk_when_the_config_loads(tmp_path, monkeypatch):
    (tmp_path / "sdk_agent.py").write_text(
        "from polyrl.adapters.agents_sdk import run_agent\n\n\nasync def run(client, item):\n    return 0.0\n")
    (tmp_path / "plain_agent.py").write_text("async def run(client, item):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _without(monkeypatch, "agents")
    data = {"model": {"name": "tiny-random"}, "tasks": [{"name": "t", "agent": "plain_agent:run", "items": [{}]}]}
    load_config(None, data=data)  # an agent of its own: no SDK needed
    data["tasks"][0]["agent"] = "sdk_agent:run"
    with pytest.raises(ConfigError, match=r"tasks.0.agent: 'sdk_agent:run' runs OpenAI Agents SDK agents, which "
                                          r"are not installed; pip install 'polyrl\[agents\]'"):
        load_config(None, data=data)


def test_ray_actors_a_machine_cannot_hold_are_refused_before_ray_starts():
    cfg = load_config(SMOKE, RAY_RANKS)
    assert local_placement_problem(cfg, cpus=2) == (
        "runtime: 2 learner ranks and 1 rollout workers need 3 CPUs (one each at least), a local Ray on this "
        "machine has 2: lower learner.world_size or runtime.num_workers, or add nodes")
    assert local_placement_problem(cfg, cpus=3) is None
    # What works today stays allowed: two colocated ranks on two cores, more Ray CPUs than cores if asked.
    assert local_placement_problem(load_config(SMOKE, ["runtime.kind=ray", "learner.world_size=2"]), cpus=2) is None
    assert local_placement_problem(load_config(SMOKE, [*RAY_RANKS, "runtime.ray_num_cpus=3"]), cpus=2) is None
    assert local_placement_problem(load_config(SMOKE, ["learner.world_size=2"]), cpus=1) is None  # gloo ranks
    # A remote cluster is checked once connected (runtime/ray_ranks.py, runtime/workers.py).
    remote = load_config(SMOKE, [*RAY_RANKS, "runtime.ray_address=10.0.0.1:6379"])
    assert local_placement_problem(remote, cpus=1) is None
    cuda = load_config(SMOKE, ["runtime.kind=ray", "train.device=cuda"])
    assert "1 rollout workers need 1 GPUs (one each at least), a local Ray on this machine has 0" in \
        local_placement_problem(cuda, cpus=16, gpus=0)


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_run_on_a_gpu_asks_ray_for_gpus_whatever_the_device_is_called(monkeypatch, device):
    """``train.device: auto`` on a GPU machine places its Ray actors on GPUs as ``cuda`` does (they used to ask
    for none, and the workers then ran on the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(SMOKE, ["runtime.kind=ray", f"train.device={device}"])
    assert "need 1 GPUs" in local_placement_problem(cfg, cpus=16, gpus=0)
    assert local_placement_problem(cfg, cpus=16, gpus=1) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (local_placement_problem(cfg, cpus=16, gpus=0) is None) == (device == "auto")  # auto: the CPU then


def test_the_parameter_count_comes_from_the_checkpoint_headers(tmp_path):
    model = tiny_random_model(seed=0)
    model.save_pretrained(tmp_path)
    assert placement.checkpoint_parameters(tmp_path) == sum(p.numel() for p in model.parameters())  # tied once
    assert placement.checkpoint_parameters(tmp_path / "nowhere") is None
    assert placement.model_parameters("tiny-random") is None
    assert placement.model_parameters(str(tmp_path)) == placement.checkpoint_parameters(tmp_path)
    assert placement.model_parameters(str(tmp_path / "nope")) is None  # the model's loading names it


def test_ranks_and_workers_a_machine_has_no_memory_for_are_refused_before_the_model_loads(monkeypatch):
    params = 500_000_000  # 16 bytes each for a full fine-tune: 8 GB in one process
    one = load_config(SMOKE)
    assert memory_problem(one, params, 9 * 10**9) is None
    assert memory_problem(one, params, 7 * 10**9) == (
        "runtime: 1 learner rank (full fine-tune) need at least 8.0 GB for the 500M parameters of tiny-random "
        "(weights, gradients and Adam states), this machine has 7.0 GB free: lower learner.world_size or "
        "runtime.num_workers, train LoRA adapters (model.lora), or free memory")
    # two FSDP2 ranks: half the trained state each, plus a whole bf16 copy to sample from: 2 x (4 + 1) GB
    two = load_config(SMOKE, ["learner.world_size=2"])
    assert "2 learner ranks (full fine-tune) need at least 10.0 GB" in memory_problem(two, params, 9 * 10**9)
    workers = load_config(SMOKE, RAY_RANKS[:3] + ["runtime.num_workers=3"])  # 8 GB + 3 x 1 GB of bf16 weights
    assert "1 learner rank (full fine-tune) and 3 rollout workers need at least 11.0 GB" in \
        memory_problem(workers, params, 10 * 10**9)
    assert memory_problem(load_config(SMOKE, ["model.lora.r=8"]), params, 2 * 10**9) is None  # frozen base
    assert memory_problem(one, params, 1, device="cuda") is None  # a GPU's memory is not this check's
    assert memory_problem(one, None, 1) is None and memory_problem(one, params, None) is None
    # polyrl train runs the check (check_machine) before any model loads
    monkeypatch.setattr(placement, "model_parameters", lambda name: params)
    monkeypatch.setattr(placement, "free_memory_bytes", lambda: 10**9)
    with pytest.raises(ValueError, match=r"^runtime: 1 learner rank \(full fine-tune\) need at least 8\.0 GB"):
        check_machine(one)


@pytest.mark.slow
def test_polyrl_train_refuses_what_this_machine_cannot_place_in_one_line_and_seconds(tmp_path, polyrl_cli):
    """The command line (forked, conftest): the config is read, and nothing is loaded or started."""
    t0 = time.perf_counter()
    run = polyrl_cli.run(["train", str(SMOKE), "-o", str(tmp_path / "run"), *RAY_RANKS[:-1],
                          f"learner.world_size={(os.cpu_count() or 1) + 1}"], timeout=120)
    seconds = time.perf_counter() - t0
    assert run.returncode == 2
    (line,) = [line for line in run.stderr.splitlines() if line.strip()]
    assert line.startswith("error: ") and "a local Ray on this machine has" in line, run.stderr
    assert not (tmp_path / "run").exists() and seconds < 30


def test_a_ray_address_that_refuses_or_never_answers_is_one_line():
    with pytest.raises(PlacementError, match=r"runtime.ray_address: nothing answers at 127.0.0.1:\d+"):
        check_ray_address(f"127.0.0.1:{free_port()}")
    # A listening socket whose accept queue is full drops new connections' SYNs: connect never completes.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    clients = [socket.socket() for _ in range(3)]
    try:
        for c in clients:
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
        t0 = time.perf_counter()
        with pytest.raises(WaitTimeoutError) as info:
            check_ray_address(f"127.0.0.1:{port}", timeout_s=0.5)
        assert time.perf_counter() - t0 < 3
        assert str(info.value) == (f"waited 0.5 s (runtime.ray_address) for the Ray cluster at 127.0.0.1:{port} to "
                                   "accept a connection; is the head node up and reachable?")
    finally:
        for s in [*clients, server]:
            s.close()
    check_ray_address("auto")  # left to Ray


@pytest.mark.slow
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_rank_rendezvous_nobody_else_joins_gives_up_after_learner_timeout_s(monkeypatch, rank):
    """Rank 0 hosts the rendezvous and waits for the others; rank 1 waits for rank 0 to host it."""
    port = free_port()
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    t0 = time.perf_counter()
    with pytest.raises(WaitTimeoutError) as info:
        join_group("gloo", 1.0, torch.device("cpu"))
    assert time.perf_counter() - t0 < 5
    assert str(info.value) == (f"waited 1 s (learner.timeout_s) for all 2 learner ranks to join the process group "
                               f"at 127.0.0.1:{port}; a rank did not start or hangs before joining")


def _hang_in_a_collective(timeout_s: float) -> None:
    """Rank 1 joins and then never takes part in rank 0's gather."""
    from polyrl.parallel.group import all_gather_objects, leave_group

    ranks = join_group("gloo", timeout_s, torch.device("cpu"))
    try:
        if ranks.rank == 1:
            time.sleep(60)
        all_gather_objects(ranks, "hello")
    finally:
        leave_group()


@pytest.mark.slow
def test_a_rank_that_hangs_in_a_collective_ends_the_run_after_learner_timeout_s():
    """About 8 s on two cores, most of it spawning the two ranks."""
    from polyrl.parallel.launch import launch_ranks

    t0 = time.perf_counter()
    with pytest.raises(RankFailedError) as info:
        launch_ranks(2, torch.device("cpu"), _hang_in_a_collective, 2.0)
    assert time.perf_counter() - t0 < 30
    assert str(info.value) == ("learner rank 0: waited 2 s (learner.timeout_s) for the other learner ranks in a "
                               "collective (rank 0); a rank died or hangs")


class _LiveProcess:
    exitcode = None

    def __init__(self) -> None:
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True


def test_an_async_rollout_process_that_sends_nothing_ends_the_run_after_learner_timeout_s():
    from polyrl.runtime.async_ import AsyncStepper

    stepper = AsyncStepper.__new__(AsyncStepper)  # the learner's side only: its rollout process hangs
    stepper.run = SimpleNamespace(config=SimpleNamespace(learner=SimpleNamespace(timeout_s=0.3)))
    stepper.batch_q, stepper.proc = queue.Queue(), _LiveProcess()
    t0 = time.perf_counter()
    with pytest.raises(WaitTimeoutError) as info:
        stepper._receive(3)
    assert time.perf_counter() - t0 < 3 and stepper.proc.killed
    assert str(info.value) == ("waited 0.3 s (learner.timeout_s) for the rollout process's batch of step 3; the "
                               "rollout process hangs")


@pytest.mark.slow
def test_a_verifiers_rubric_that_hangs_scores_its_reply_0_and_the_run_goes_on():
    pytest.importorskip("verifiers.types")  # imported by the first scoring: not part of the wait
    from polyrl.envs.verifiers_env import VerifiersEnv

    class SlowJudge:  # a rubric waiting on a judge model that never answers
        async def score_rollout(self, state):
            await asyncio.sleep(60)

    env = VerifiersEnv(SimpleNamespace(rubric=SlowJudge(), message_type="chat"), timeout_s=0.3)
    env.reset({"question": "What is 1 + 2?", "answer": "3"})
    t0 = time.perf_counter()
    result = env.step("3")
    assert time.perf_counter() - t0 < 3
    assert (result.reward, result.done) == (0.0, True)
    assert result.info["reward_error"] == "TimeoutError: the rubric ran past reward_timeout_s (0.3 s)"


@pytest.mark.slow
@pytest.mark.slow
def test_ray_waits_for_an_actor_or_a_placement_give_up_with_one_line(tmp_path, monkeypatch):
    """A Ray actor that sleeps instead of answering, and rank bundles a busy cluster cannot place. About 20 s on
    two cores, most of it starting Ray."""
    import tempfile

    ray = pytest.importorskip("ray")
    from polyrl.runtime import ray_ranks
    from polyrl.waits import ray_get

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="polyrl-ray-"))  # short: Ray's socket paths must fit
    try:
        @ray.remote(num_cpus=1)
        class Sleeper:
            def rollout(self) -> None:
                time.sleep(60)

        sleeper = Sleeper.remote()
        t0 = time.perf_counter()
        with pytest.raises(WaitTimeoutError) as info:
            ray_get(ray, sleeper.rollout.remote(), 1.0, "rollout worker 0's share of step 1", "learner.timeout_s",
                    "the worker hangs")
        assert time.perf_counter() - t0 < 5
        assert str(info.value) == ("waited 1 s (learner.timeout_s) for rollout worker 0's share of step 1; the "
                                   "worker hangs")
        # The sleeper holds one of the two CPUs: two rank bundles of one CPU each are never placed.
        monkeypatch.setattr(ray_ranks, "PLACEMENT_TIMEOUT_S", 1.0)
        cfg = load_config(SMOKE, ["runtime.kind=ray", "learner.world_size=2"])
        t0 = time.perf_counter()
        with pytest.raises(WaitTimeoutError, match=r"^waited 1 s \(learner.world_size\) for the Ray cluster to place "
                                                   r"2 learner ranks of \{'CPU': 1\}; free: "):
            ray_ranks._attempt(ray, cfg, tmp_path, print, resume=False)
        assert time.perf_counter() - t0 < 5
    finally:
        ray.shutdown()
