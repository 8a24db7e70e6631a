"""Golden numbers of the advantage stage and the learner: scenarios that between them take every path of a
token's advantage and of the loss (group estimators, task normalisation, step credit, ARPO attribution,
GAE, epochs, KL in the loss and in the reward, entropy, distillation, off-policy corrections, replayed and
cross-policy rows, PCGrad over two tasks, LoRA, the zero-gradient shortcut), each run on a tiny random model
for two updates. ``tests/test_golden_learner.py`` compares a fresh run with ``tests/data/golden_learner.json``.

    python tests/golden_learner.py record [FILE]       # write the numbers of the code as it is
    python tests/golden_learner.py compare A.json B.json  # bit-for-bit comparison of two recordings
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

from polyrl.config import AgentsConfig, AlgorithmConfig, LoraConfig, OptimConfig
from polyrl.learner.advantage_stage import assign_advantages
from polyrl.learner.batch import collate
from polyrl.learner.learner import Learner
from polyrl.learner.logprobs import token_logprobs
from polyrl.models.loading import load_model, tiny_random_model
from polyrl.types import Trajectory

GOLDEN = Path(__file__).resolve().parent / "data" / "golden_learner.json"
TEMPERATURE = 0.8
PAD = 2

# name -> algorithm, agents, batch and model settings. Every batch: 3 groups of 4 over two tasks.
SCENARIOS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "grpo_no_reference": {"algo": {"regularisers": {"track_kl": False}}},
    "zero_gradient": {"algo": {"regularisers": {"track_kl": False}}, "batch": {"equal_rewards": True}},
    "rloo_seq_mean_dual_clip": {"algo": {"advantage": "rloo", "loss": {"name": "dual_clip", "kwargs": {"c": 3.0},
                                                                       "agg": "seq-mean-token-mean"}}},
    "gspo_seq_sum": {"algo": {"advantage": "dr_grpo", "loss": {"name": "gspo", "clip_low": 3e-4, "clip_high": 4e-4,
                                                               "agg": "seq-mean-token-sum"}}},
    "gdpo_components": {"algo": {"advantage": "gdpo"}},
    "gae": {"algo": {"critic": {"width": 16}}},
    "gae_epochs2_kl_reward": {"algo": {"critic": {"width": 16}, "loss": {"epochs": 2},
                                       "regularisers": {"kl_coef": 0.05, "kl_in": "reward"}}},
    "epochs2_kl_entropy": {"algo": {"loss": {"epochs": 2}, "regularisers": {"kl_coef": 0.05, "entropy_coef": 0.01,
                                                                            "kl_estimator": "k2"}}},
    "kl_in_reward": {"algo": {"regularisers": {"kl_coef": 0.1, "kl_in": "reward"}}},
    "distill": {"algo": {"regularisers": {"distill_coef": 0.5}, "loss": {"pg_coef": 0.5}}, "teacher": True},
    "off_policy_tis": {"algo": {"off_policy": {"correction": "tis", "tis_cap": 1.5}},
                       "batch": {"replayed": True, "cross": True}},
    "off_policy_icepop": {"algo": {"off_policy": {"correction": "icepop", "kwargs": {"alpha": 0.8, "beta": 1.25}}}},
    "off_policy_m2po": {"algo": {"off_policy": {"correction": "m2po", "m2po_tau": 0.01}}},
    "replay_and_cross_policy": {"batch": {"replayed": True, "cross": True}, "replay_is_cap": 0.9, "is_cap": 1.3},
    "replay_with_step_credit": {"batch": {"replayed": True, "multi_turn": True},
                                "agents": {"step_credit": {"mode": "gigpo", "weight": 0.5}}},
    "step_credit_gigpo": {"batch": {"multi_turn": True}, "agents": {"step_credit": {"mode": "gigpo"}}},
    "step_credit_turn_discount": {"batch": {"multi_turn": True},
                                  "agents": {"step_credit": {"mode": "turn_discount", "gamma": 0.9}}},
    "arpo": {"batch": {"arpo": True}, "agents": {"arpo": {"enabled": True}}},
    "arpo_step_credit_kl_reward": {"algo": {"regularisers": {"kl_coef": 0.05, "kl_in": "reward"}},
                                   "batch": {"arpo": True, "multi_turn": True},
                                   "agents": {"arpo": {"enabled": True}, "step_credit": {"mode": "turn_discount"}}},
    "task_norm": {"algo": {"advantage": {"task_norm": True}}},
    "mask_truncated": {"algo": {"loss": {"mask_truncated": True}}, "batch": {"truncated": True}},
    "pcgrad": {"algo": {"gradients": {"surgery": "pcgrad"}}},
    "task_grad_metrics_epochs2": {"algo": {"gradients": {"task_grad_every": 1}, "loss": {"epochs": 2}}},
    "lora_kl": {"algo": {"regularisers": {"kl_coef": 0.1}}, "lora": True},
    "schedule_micro2": {"optim": {"schedule": "cosine", "warmup_steps": 1, "micro_batch_size": 2}},
}


def make_trajectories(seed: int, equal_rewards: bool = False, multi_turn: bool = False, arpo: bool = False,
                      replayed: bool = False, cross: bool = False, truncated: bool = False) -> list[Trajectory]:
    """Three groups of four (tasks a, b, a) of random tokens below 64; behaviour log-probs are set later."""
    rng = random.Random(seed)
    out: list[Trajectory] = []
    for g, task in enumerate(("a", "b", "a")):
        prompt = [rng.randrange(3, 64) for _ in range(rng.randint(3, 5))]
        leaves: list[Trajectory] = []
        for k in range(4):
            if multi_turn:  # two model turns with an env turn between them
                t1, env, t2 = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 3)
                mask = [1] * t1 + [0] * env + [1] * t2
                p = len(prompt)
                spans = [(p, p + t1), (p + t1 + env, p + t1 + env + t2)]
            else:
                mask = [1] * rng.randint(2, 6)
                spans = []
            response = [rng.randrange(3, 64) for _ in mask]
            if arpo and k >= 2:  # leaf k branches from leaf k - 2 after its first model token
                parent = leaves[k - 2]
                at = len(prompt) + 1
                response = parent.input_ids[len(prompt): at] + response[1:]
                mask = parent.loss_mask[len(prompt): at] + mask[1:]
            reward = 1.0 if equal_rewards else rng.choice([0.0, 0.5, 1.0])
            fmt = 0.0 if equal_rewards else rng.choice([0.0, 0.2])
            info: dict[str, Any] = {"score": reward}
            if multi_turn:
                first = rng.choice([0.0, reward / 2])
                info["turn_rewards"] = [first, reward + fmt - first]
                info["turn_states"] = [f"s{g}", f"s{g}-{rng.randrange(2)}"]
            if arpo:
                info["branch_id"] = k
                if k >= 2:
                    info.update(parent_id=k - 2, branch_at=len(prompt) + 1)
            if cross and g == 1:
                info["cross_policy"] = True
            t = Trajectory(
                task=task, item_id=g, group_id=g, input_ids=prompt + response, loss_mask=[0] * len(prompt) + mask,
                logprobs=[0.0] * (len(prompt) + len(mask)), versions=[0] * (len(prompt) + len(mask)),
                turn_spans=spans, rewards={task: reward, "format": fmt}, reward=reward + fmt,
                truncated=truncated and k == 1, replayed=replayed and g == 2 and k == 3, info=info,
            )
            leaves.append(t)
        out += leaves
    return out


def set_behaviour(model: Any, trajectories: list[Trajectory], seed: int) -> None:
    """Behaviour log-probs: the model's own, plus noise (an engine's numerics, or an older policy)."""
    batch = collate(trajectories, PAD)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, TEMPERATURE, False)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    for i, t in enumerate(trajectories):
        s = t.prompt_len
        values = (logp[i] + noise[i]).tolist()
        t.logprobs = t.logprobs[:s] + [v if m else 0.0 for v, m in zip(values, t.loss_mask[s:], strict=False)]


def episode_stage(trajectories: list[Trajectory], algo: AlgorithmConfig, agents: AgentsConfig) -> dict[str, float]:
    """The advantage stage of ``produce_batch`` on a step's kept (here: all sampled) trajectories."""
    return assign_advantages(trajectories, algo, agents)


def _params(learner: Learner) -> list[torch.Tensor]:
    heads = list(learner.value_head.parameters()) if learner.value_head is not None else []
    return [p for p in learner.model.parameters()] + heads


def run_scenario(name: str) -> dict[str, Any]:
    """Two updates of the scenario's learner on two fresh batches; the advantages, metrics and weights."""
    spec = SCENARIOS[name]
    torch.manual_seed(0)
    algo = AlgorithmConfig(**spec.get("algo", {}))
    agents = AgentsConfig(**spec.get("agents", {}))
    optim = OptimConfig(**{"lr": 1e-2, "micro_batch_size": 4, **spec.get("optim", {})})
    if spec.get("lora"):
        model = load_model("tiny-random", LoraConfig(r=4, alpha=8), seed=1)
    else:
        model = tiny_random_model(seed=1, vocab_size=64)
    teachers = {"a": tiny_random_model(seed=7, vocab_size=64)} if spec.get("teacher") else None
    learner = Learner(model, algo, optim, TEMPERATURE, False, PAD, total_steps=4, teachers=teachers,
                      is_cap=spec.get("is_cap", 2.0))
    learner.replay_is_cap = spec.get("replay_is_cap", 1.0)
    before = [p.detach().clone() for p in _params(learner)]
    out: dict[str, Any] = {"updates": []}
    for update in range(2):
        trajectories = make_trajectories(10 * update + 1, **spec.get("batch", {}))
        set_behaviour(model, trajectories, update)
        stage = episode_stage(trajectories, algo, agents)
        metrics = learner.update(trajectories)
        out["updates"].append({
            "stage": stage,
            "advantages": [[t.advantage, t.token_advantages] for t in trajectories],
            "metrics": metrics,
        })
    after = [p.detach() for p in _params(learner)]
    delta = torch.cat([(a.double() - b.double()).flatten() for a, b in zip(after, before, strict=True)])
    gen = torch.Generator().manual_seed(0)
    out["delta"] = {"norm": float(delta.norm()),
                    "projections": [float(delta @ torch.randn(delta.numel(), generator=gen, dtype=torch.float64))
                                    for _ in range(3)]}
    weights = b"".join(a.float().contiguous().numpy().tobytes() for a in after)
    out["weights_sha256"] = hashlib.sha256(weights).hexdigest()
    return out


RECORDED_ON = "_recorded_on"
"""The key of the recording machine's float32 kind (``float32_kind``): where float32 matmuls sum in another
order, the comparison allows for rounding."""


@functools.cache
def float32_kind() -> str:
    """torch's CPU capability and a digest of the tiny model's float32 forward and backward on a batch shaped
    like the scenarios', on two threads. CPUs of one capability can still round apart (MKL picks its kernels by
    vendor and model), and the digest tells them apart without asking which they are."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = tiny_random_model(seed=1, vocab_size=64)
        tokens = torch.randint(3, 64, (12, 11), generator=torch.Generator().manual_seed(0))
        logits = model(tokens).logits
        torch.log_softmax(logits / TEMPERATURE, -1).sum().backward()
        digest = hashlib.sha256(logits.detach().numpy().tobytes())
        for p in model.parameters():
            digest.update(p.grad.numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    return f"{torch.backends.cpu.get_cpu_capability()}/{digest.hexdigest()[:16]}"


def record(path: Path) -> None:
    torch.set_num_threads(2)
    data: dict[str, Any] = {name: run_scenario(name) for name in SCENARIOS}
    data[RECORDED_ON] = float32_kind()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def compare(a: Path, b: Path) -> int:
    """Bit-for-bit: the two recordings' JSON (floats written exactly) must be equal, scenario by scenario."""
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for name in sorted(set(x) | set(y)):
        same = x.get(name) == y.get(name)
        bad += not same
        print(f"{name:32s} {'identical' if same else 'DIFFERENT'}")
    return bad


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(Path(sys.argv[2]) if len(sys.argv) > 2 else GOLDEN)
    else:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
