"""Agent features: ARPO branching, success/prompt replay, step-level credit, early termination."""

import json

import pytest
import torch
from conftest import ROOT, SMOKE

import polyrl.endpoint.rollout
from polyrl.algorithms.step_credit import (
    apply_step_credit,
    attribute_tree_advantages,
    discounted_returns,
    gigpo_step_advantages,
    shared_prefix_advantages,
    turn_discount_advantages,
)
from polyrl.config import ArpoConfig, RolloutConfig, TaskConfig
from polyrl.config_check import load_config
from polyrl.data.replay import PromptReplay, SuccessBuffer
from polyrl.engines.hf import Completion, HFEngine
from polyrl.envs import make_task
from polyrl.envs.tool_parsers import SmolLM2Parser, ToolCall
from polyrl.learner.batch import collate
from polyrl.models.loading import load_model, load_tokenizer
from polyrl.rollout.arpo import arpo_rollout
from polyrl.rollout.early_stop import EarlyStopper, spike_index
from polyrl.rollout.multi_turn import rollout, start_episode
from polyrl.types import Trajectory

TOOL_MATH = TaskConfig(
    name="tool_math", env="tool_math", max_turns=3,
    params={"dataset": "chain_sum", "dataset_params": {"min_terms": 2, "max_terms": 2, "min_digits": 2}},
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine():
    tok = load_tokenizer("tiny-random")
    return HFEngine(load_model("tiny-random", None, seed=0), tok, bf16=False)


class ForcedToolCall:
    """The tiny engine, except that first-turn replies are a calculate call (with the model's own log-probs),
    so a random model reaches the turns after a tool result where ARPO branches."""

    def __init__(self, engine: HFEngine, first_prompts: set[int]):
        self.engine, self.tokenizer, self.stop_ids = engine, engine.tokenizer, engine.stop_ids
        self.first_prompts = first_prompts
        self.call = self.tokenizer(SmolLM2Parser().format_calls([ToolCall("calculate", {"expression": "6 * 7"})]),
                                   add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]

    def sync(self):
        self.engine.sync()

    def release_memory(self, until_used=False):
        self.engine.release_memory(until_used)

    def generate(self, prompts, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, seed=0, **kw):
        out = self.engine.generate(prompts, n, max_new_tokens, temperature, top_p, seed, **kw)
        for p, group in zip(prompts, out, strict=True):
            if len(p) in self.first_prompts:
                with torch.no_grad():
                    logits = self.engine.policy(torch.tensor([p + self.call])).logits[0, len(p) - 1 : -1].float()
                lp = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(self.call)[:, None])
                group[:] = [Completion(self.call, lp.squeeze(-1).tolist(), True) for _ in group]
        return out


def _task(tok):
    return make_task(TOOL_MATH, 0, None, tok)


# --- engine hook -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_stop_hook_off_or_silent_keeps_the_same_tokens(engine):
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    plain = engine.generate(prompts, 3, 12, 1.0, 1.0, seed=5)
    silent = engine.generate(prompts, 3, 12, 1.0, 1.0, seed=5, stop=lambda r, t, lp, e: [False] * len(r),
                             entropy=True)
    for a, b in zip(sum(plain, []), sum(silent, []), strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and not b.stopped
        assert b.entropies is not None and len(b.entropies) == len(b.token_ids) and min(b.entropies) > 0
    cut = engine.generate(prompts, 3, 12, 1.0, 1.0, seed=5, stop=lambda r, t, lp, e: [x == 4 for x in r])
    row4 = cut[1][1]
    assert row4.stopped and row4.token_ids == plain[1][1].token_ids[:1]
    # Other rows live on (their later tokens differ: the batch that shares one generator shrank).
    assert not any(c.stopped for c in cut[0]) and cut[0][0].token_ids[:1] == plain[0][0].token_ids[:1]


def test_spike_detector():
    flat = [1.0] * 30
    assert spike_index(flat, 0.3, 1.0, 5) is None
    assert spike_index(flat[:20] + [6.0, 6.0, 6.0], 0.5, 1.0, 5) == 20
    assert spike_index([9.0, 1.0, 1.0], 0.5, 1.0, 5) is None  # min_tokens guards the start


def test_early_stop_marks_trajectories(engine):
    task = _task(engine.tokenizer)
    # A threshold below any fluctuation stops every rollout right after min_tokens.
    stopper = EarlyStopper("surprise", 1.0, -1e9, 2, terminal_reward=-0.5)
    trajs = rollout(engine, [(task, 0, task.train_item(0))], RolloutConfig(group_size=4, max_new_tokens=24), seed=0,
                    version=0, stopper=stopper)
    for t in trajs:
        assert t.terminated_early and t.reward == -0.5 and t.num_model_tokens == 3
        assert t.info["tokens_saved"] == 24 - 3


# --- ARPO --------------------------------------------------------------------------------------------------

def test_arpo_leaves_share_exact_prefixes(engine):
    task = _task(engine.tokenizer)
    items = [(task, i, task.train_item(i)) for i in range(2)]
    forced = ForcedToolCall(engine, {len(start_episode(task, i, it, 0, engine.tokenizer).ids) for _, i, it in items})
    cfg = ArpoConfig(enabled=True, global_samples=2, entropy_threshold=-1e9, branch_width=2, entropy_tokens=4)
    trajs = arpo_rollout(forced, items, RolloutConfig(group_size=4, max_new_tokens=16), cfg, seed=3, version=7,
                         first_group_id=10)
    assert len(trajs) == 8 and {t.group_id for t in trajs} == {10, 11}
    for g in (10, 11):
        leaves = {t.info["branch_id"]: t for t in trajs if t.group_id == g}
        assert sorted(leaves) == [0, 1, 2, 3]
        branches = [t for t in leaves.values() if "parent_id" in t.info]
        assert len(branches) == 2
        for b in branches:
            parent, k = leaves[b.info["parent_id"]], b.info["branch_at"]
            assert b.input_ids[:k] == parent.input_ids[:k]
            assert b.logprobs[:k] == parent.logprobs[:k] and b.versions[:k] == parent.versions[:k]
            assert b.loss_mask[:k] == parent.loss_mask[:k] and sum(b.loss_mask[:k]) > 0  # the tool call
            assert b.info["tool_calls"] >= 1 and b.turn_spans[0] == parent.turn_spans[0]
    # The learner trains a copied prefix once: branch rows have no loss before branch_at.
    batch = collate(trajs, engine.pad_id)
    for i, t in enumerate(trajs):
        if "parent_id" in t.info:
            assert batch.loss_mask[i, : t.info["branch_at"] - t.prompt_len].sum() == 0


def test_shared_prefix_attribution():
    # Leaf 0 (root, 6 tokens); leaf 1 branches from 0 at 2; leaf 2 branches from 1 at 4.
    adv = [[1.0] * 6, [4.0] * 6, [7.0] * 6]
    out = shared_prefix_advantages(adv, [None, 0, 1], [0, 2, 4])
    assert out[0] == pytest.approx([4.0, 4.0, 1.0, 1.0, 1.0, 1.0])  # tokens 0-1 shared by all three
    assert out[1][:2] == out[0][:2] and out[1][2:4] == pytest.approx([5.5, 5.5]) and out[1][4:] == [4.0, 4.0]
    assert out[2][:4] == out[1][:4] and out[2][4:] == [7.0, 7.0]
    with pytest.raises(ValueError, match="leaf 1"):
        shared_prefix_advantages(adv[:2], [None, 5], [0, 2])


def _traj(group, reward, ids=(1, 2, 3, 4, 5, 6), info=None, score=None):
    n = len(ids)
    return Trajectory("t", 0, group, list(ids), [0, 0] + [1] * (n - 2), [0.0, 0.0] + [-0.5] * (n - 2),
                      [-1, -1] + [3] * (n - 2), turn_spans=[(2, n)], reward=reward,
                      info={"score": score if score is not None else reward, **(info or {})})


def test_tree_attribution_on_trajectories():
    root = _traj(0, 1.0, info={"branch_id": 0})
    child = _traj(0, 0.0, info={"branch_id": 1, "parent_id": 0, "branch_at": 4})
    root.advantage, child.advantage = 1.0, -1.0
    assert attribute_tree_advantages([root, child]) == 1
    assert root.token_advantages == pytest.approx([0, 0, 0, 0, 1, 1])  # prompt and copied part: mean 0
    assert child.token_advantages == pytest.approx([0, 0, 0, 0, -1, -1])


# --- step credit -------------------------------------------------------------------------------------------

def test_step_credit_functions():
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == pytest.approx([1.5, 1.0, 2.0])
    # Two episodes of one group meet the same state "s" at turn 1 with returns 2 and 0.
    step = gigpo_step_advantages([[1.0, 2.0], [3.0, 0.0]], [["a", "s"], ["b", "s"]], [0, 0], eps=0.0)
    # mean 1, unbiased std sqrt(2): +-1/sqrt(2)
    assert step[0] == pytest.approx([0.0, 2 ** -0.5]) and step[1][1] == pytest.approx(-(2 ** -0.5))
    assert step[0][0] == 0.0 and step[1][0] == 0.0  # states seen once
    td = turn_discount_advantages([[2.0, 1.0], [0.0]], [0, 0], eps=0.0)
    assert td[0] == pytest.approx([2 ** 0.5 / 2, 0.0]) and td[1] == pytest.approx([-(2 ** 0.5) / 2])


def test_apply_step_credit_spreads_turns_over_tokens():
    t = Trajectory("t", 0, 0, list(range(8)), [0, 1, 1, 0, 1, 1, 1, 0], [0.0] * 8, [0] * 8,
                   turn_spans=[(1, 3), (4, 7)], reward=1.0, advantage=0.5,
                   info={"turn_rewards": [0.0, 1.0], "turn_states": ["x", "y"]})
    u = Trajectory("t", 1, 0, list(range(8)), t.loss_mask, [0.0] * 8, [0] * 8, turn_spans=[(1, 3), (4, 7)],
                   reward=0.0, advantage=-0.5, info={"turn_rewards": [0.0, 0.0], "turn_states": ["x", "z"]})
    apply_step_credit([t, u], "gigpo", 1.0, 1.0)
    # Turn 0 shares state x: returns 1 vs 0 -> +-0.707; turn 1 states differ -> 0.
    assert t.token_advantages[1:3] == pytest.approx([0.5 + 0.7071] * 2, abs=1e-3)
    assert t.token_advantages[4:7] == pytest.approx([0.5] * 3) and t.token_advantages[0] == 0.0
    batch = collate([t, u], 0)
    assert batch.advantages.shape == (2, 7)


# --- replay ------------------------------------------------------------------------------------------------

def test_success_replay_mixes_into_all_fail_groups():
    buf = SuccessBuffer(size=2, score=1.0, ratio=1.0, seed=0)
    win = _traj(0, 1.0)
    win.logprobs = [0.0, 0.0, -0.1, -0.2, -0.3, -0.4]
    assert buf.mix_in([win, _traj(0, 0.0)], step=1) == {"replay/all_fail_groups": 0.0, "replay/replayed": 0.0}
    later = [_traj(5, 0.0), _traj(5, 0.0)]
    metrics = buf.mix_in(later, step=2)
    assert metrics == {"replay/all_fail_groups": 1.0, "replay/replayed": 1.0}
    assert later[1].replayed and later[1].group_id == 5 and later[1].logprobs == win.logprobs
    assert not later[0].replayed
    state = json.loads(json.dumps(buf.state_dict()))
    other = SuccessBuffer(2, 1.0, 1.0, 0)
    other.load_state_dict(state)
    assert other.store["t/0"][0].logprobs == win.logprobs
    # Pass rates near 0.5 are favoured.
    pr = PromptReplay(0.5, 1.0, 0)
    pr.update([_traj(0, 1.0), _traj(0, 0.0)] + [_traj(0, 0.0) for _ in range(2)])
    half = Trajectory("t", 9, 0, [1], [1], [0.0], [0], info={"score": 1.0})
    pr.update([half, Trajectory("t", 9, 0, [1], [1], [0.0], [0], info={"score": 0.0})])
    assert pr.weight("t/9") > pr.weight("t/0") and pr.count(4) == 2


# --- wired into the loop -----------------------------------------------------------------------------------

def _agents_config(tmp_path, steps):
    return load_config(SMOKE, [
        f"train.steps={steps}", "eval.before=false", "eval.after=false", "logging.tensorboard=false",
        "logging.report=false", "rollout.max_new_tokens=12",
        "agents.replay.success_buffer=2", "agents.replay.prompt_replay=0.5", "agents.replay.success_score=0.0",
        "agents.step_credit.mode=gigpo", "agents.early_stop.enabled=true", "agents.early_stop.threshold=0.5",
        "agents.early_stop.min_tokens=2",
    ])


@pytest.mark.slow
def test_loop_with_agent_features_resumes_exactly(tmp_path):
    from polyrl.run.loop import train

    train(_agents_config(tmp_path, 3), tmp_path / "a", log=lambda *_: None)
    train(_agents_config(tmp_path, 2), tmp_path / "b", log=lambda *_: None)
    train(_agents_config(tmp_path, 3), tmp_path / "b", resume=True, log=lambda *_: None)
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    assert [r["reward/mean"] for r in rows[0]] == [r["reward/mean"] for r in rows[1]]
    assert "early_stop/tokens_saved" in rows[0][-1] and "replay/all_fail_groups" in rows[0][-1]
    states = [json.loads((tmp_path / d / "checkpoints" / "step-3" / "trainer_state.json").read_text())["agents"]
              for d in "ab"]
    assert states[0] == states[1] and states[0]["prompts"]


@pytest.mark.slow
def test_rl_step_with_arpo_trains_on_trees(tmp_path):
    from polyrl.train.step import build_run, rl_step

    cfg = load_config(ROOT / "configs" / "tool_math.yaml", [
        "model.name=tiny-random", "model.bf16=false", "rollout.group_size=4", "rollout.max_new_tokens=16",
        "tasks.0.max_tokens=120", "logging.progress=false", "logging.tensorboard=false",
        "agents.arpo.enabled=true", "agents.arpo.global_samples=2", "agents.arpo.entropy_threshold=-1.0e9",
        "agents.step_credit.mode=turn_discount",
    ])
    run = build_run(cfg, tmp_path)
    firsts = {len(start_episode(run.tasks["tool_math"], i, run.tasks["tool_math"].train_item(i), 0,
                                run.tokenizer).ids) for i in range(4)}
    run.engine = ForcedToolCall(run.engine, firsts)
    metrics, trajectories = rl_step(run, 1)
    assert metrics["arpo/branch_leaves"] == 4 and len(trajectories) == 8
    assert metrics["tool_calls/mean"] >= 1 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(t.token_advantages is not None for t in trajectories)


def test_group_rollout_numbers_env_and_agent_groups_in_request_order(monkeypatch):
    """Env groups go to the rollout, agent groups to the endpoint; each keeps the id of its place in the
    request list, and the agent episodes' metrics are summed until read."""
    from polyrl.envs.agent import AgentTask
    from polyrl.train import agents

    def agent_run(client, item):  # never called: the endpoint's rollout is replaced below
        raise AssertionError

    env_task = make_task(TaskConfig(name="chain_sum"), seed=0)
    agent_task = AgentTask(TaskConfig(name="agent", agent="x:run", items=[{}]), agent_run, 0, items=[{}])
    seen = {}

    def env_rollout(engine, requests, config, seed, version, first_group_id=0, stopper=None):
        seen["env"] = [(task.name, i) for task, i, _ in requests]
        return [Trajectory(task.name, i, first_group_id + g, [1], [1], [0.0], [0])
                for g, (task, i, _) in enumerate(requests)]

    def endpoint_rollout(engine, model_name, requests, config, seed, version):
        return [Trajectory(task.name, i, gid, [1], [1], [0.0], [0]) for task, i, _, gid in requests], \
            {"agent/episodes": float(len(requests) * config.group_size)}

    monkeypatch.setattr(agents, "rollout", env_rollout)
    monkeypatch.setattr(polyrl.endpoint.rollout, "agent_rollout", endpoint_rollout)  # imported where used
    cfg = load_config(SMOKE, ["rollout.group_size=2"])
    group_rollout = agents.GroupRollout(cfg)
    requests = [(agent_task, 0, {}), (env_task, 5, {}), (agent_task, 1, {}), (env_task, 6, {})]
    out = group_rollout.roll_out(None, requests, seed=0, version=0, first_id=10)
    assert seen["env"] == [("chain_sum", 5), ("chain_sum", 6)]
    assert sorted((t.group_id, t.task, t.item_id) for t in out) == [
        (10, "agent", 0), (11, "chain_sum", 5), (12, "agent", 1), (13, "chain_sum", 6)]
    group_rollout.roll_out(None, requests[:1], seed=1, version=0, first_id=0)
    assert group_rollout.take_metrics() == {"agent/episodes": 6.0}  # 2 + 1 groups of 2 episodes
    assert group_rollout.take_metrics() == {}
    # without agent tasks the env groups are numbered from first_id directly
    (only,) = group_rollout.roll_out(None, requests[1:2], seed=0, version=0, first_id=7)
    assert only.group_id == 7
