"""polyrl: reinforcement-learning post-training of language models with verifiable rewards.

The public Python API is the names of ``PUBLIC``, imported from the package itself::

    from polyrl import build_run, load_config, rl_step

docs/api.md says what each is for. Everything else under ``polyrl.`` is the implementation and may change
shape without notice. Each name is imported from its module on first use, so ``import polyrl`` (which every
process of a run does) loads nothing more.
"""

from __future__ import annotations

import importlib
from typing import Any

PUBLIC: dict[str, str] = {
    # name: "module" when the module defines it under that name, "module:attribute" when it does not
    # config
    "load_config": "polyrl.config_check",
    "parse_config": "polyrl.config",
    "apply_override": "polyrl.config",
    "Config": "polyrl.config",
    "ConfigError": "polyrl.config",
    "AlgorithmConfig": "polyrl.config",
    "OptimConfig": "polyrl.config",
    "LearnerConfig": "polyrl.config",
    "TaskConfig": "polyrl.config",
    "VllmConfig": "polyrl.config",
    # whole runs
    "run_training": "polyrl.run.loop:train",
    "run_pipeline": "polyrl.run.pipeline",
    "train_sft": "polyrl.run.sft",
    "evaluate_domains": "polyrl.run.pipeline",
    "best_per_task": "polyrl.run.pipeline:registry",
    "table_markdown": "polyrl.run.pipeline",
    # one step at a time
    "Run": "polyrl.train.step",
    "build_run": "polyrl.train.step",
    "rl_step": "polyrl.train.step",
    "produce_batch": "polyrl.train.step",
    "learn_batch": "polyrl.train.step",
    "evaluate_all": "polyrl.train.step",
    "keep_freed_memory": "polyrl.train.glibc_malloc",
    # models
    "load_model": "polyrl.models.loading",
    "load_tokenizer": "polyrl.models.loading",
    "resolve_model_path": "polyrl.models.loading",
    "smollm2_dir": "polyrl.models.loading",
    "cache_dir": "polyrl.models.loading",
    "SMOLLM2_ALIAS": "polyrl.models.loading",
    "TINY_ALIAS": "polyrl.models.loading",
    "ModelNotFoundError": "polyrl.models.loading",
    "synthetic_model_config": "polyrl.models.synthetic:make_config",
    "resolve_device": "polyrl.models.device",
    "native_bf16": "polyrl.models.device",
    "model_bf16": "polyrl.models.device",
    "engine_bf16": "polyrl.models.device",
    "forward_logits": "polyrl.models.forward",
    "use_float32_attention": "polyrl.models.forward",
    # engines
    "make_engine": "polyrl.engines",
    "HFEngine": "polyrl.engines.hf",
    "VLLMEngine": "polyrl.engines.vllm",
    "Completion": "polyrl.engines.hf",
    "sample_tokens": "polyrl.engines.hf",
    # the fused decode path's parts, for work on its kernels
    "native_kernels_available": "polyrl.engines.native:available",
    "native_ops": "polyrl.engines.native:ops",
    "KVBuffers": "polyrl.engines.decode_kv",
    "PromptSharedKV": "polyrl.engines.decode_kv",
    "rms_norm": "polyrl.engines.llama_decode",
    "rotate_half": "polyrl.engines.llama_decode",
    "rescore_top": "polyrl.engines.rescored_head",
    "native_linear": "polyrl.engines.llama_decode",
    # tasks and environments
    "make_task": "polyrl.envs",
    "register_env": "polyrl.envs",
    "Task": "polyrl.envs",
    "Env": "polyrl.envs",
    "SingleTurnEnv": "polyrl.envs",
    "StepResult": "polyrl.envs",
    "ToolEnv": "polyrl.envs",
    "Tool": "polyrl.envs",
    "last_number": "polyrl.envs.reasoning_gym",
    "calculate": "polyrl.envs.tool_math",
    "TOOL_MATH_INSTRUCTIONS": "polyrl.envs.tool_math:INSTRUCTIONS",
    "run_agent": "polyrl.adapters.agents_sdk",
    # rollouts
    "rollout_episodes": "polyrl.rollout.multi_turn:rollout",
    "greedy": "polyrl.rollout.multi_turn",
    "evaluate": "polyrl.rollout.multi_turn",
    "Trajectory": "polyrl.types",
    # the learner
    "Learner": "polyrl.learner.learner",
    "Batch": "polyrl.learner.batch",
    "collate": "polyrl.learner.batch",
    "token_logprobs": "polyrl.learner.logprobs",
    "pass_costs": "polyrl.learner.forward_pass",
    "record_passes": "polyrl.learner.forward_pass",
    # algorithms
    "ADVANTAGES": "polyrl.algorithms",
    "LOSSES": "polyrl.algorithms",
    "grpo_advantages": "polyrl.algorithms.advantages",
    "PolicyLossInputs": "polyrl.algorithms.losses",
    "ppo_clip_loss": "polyrl.algorithms.losses",
    "aggregate": "polyrl.algorithms",
    "ratio_metrics": "polyrl.algorithms.losses",
    "kl_estimate": "polyrl.algorithms",
    # rewards
    "run_python": "polyrl.rewards.sandbox",
    "isolation_level": "polyrl.rewards.sandbox",
    "score_humaneval": "polyrl.rewards.code",
    "humaneval_problems": "polyrl.rewards.code",
    "build_program": "polyrl.rewards.code",
    "VerdictLimits": "polyrl.rewards.code_verdict:Limits",
    "record_plan": "polyrl.rewards.code_verdict",
    # checkpoints
    "latest_checkpoint": "polyrl.checkpoint.store",
    "list_checkpoints": "polyrl.checkpoint.store",
    "save_sharded": "polyrl.checkpoint.sharded",
    "load_sharded": "polyrl.checkpoint.sharded",
    "export_hf": "polyrl.checkpoint.export",
    # learner ranks and weight sync
    "Ranks": "polyrl.plan",
    "launch_ranks": "polyrl.parallel.launch",
    "free_port": "polyrl.parallel.launch",
    "join_group": "polyrl.parallel.group",
    "leave_group": "polyrl.parallel.group",
    "barrier": "polyrl.parallel.group",
    "RankFailedError": "polyrl.parallel.group",
    "gather_into": "polyrl.parallel.fsdp",
    "full_tensor": "polyrl.parallel.shard_gather",
    "join_sync_group": "polyrl.parallel.sync_group",
    "WeightSender": "polyrl.parallel.weight_sync",
    "WeightReceiver": "polyrl.parallel.weight_sync",
    "canonical_name": "polyrl.parallel.weight_sync",
    "iter_full_state": "polyrl.parallel.weight_sync",
    # the Tinker API server
    "serve_tinker": "polyrl.tinker_api.serve:serve",
    "tinker_sampler_policy": "polyrl.tinker_api.serve",
}

__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    """``polyrl.<public name>``: the object, imported from its module on first use and kept."""
    target = PUBLIC.get(name)
    if target is None:
        raise AttributeError(f"module 'polyrl' has no attribute '{name}' (docs/api.md lists the public names)")
    module, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
