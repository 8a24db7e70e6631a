"""Tool-call warm starts: the env's own demonstration as a token-faithful multi-turn SFT example."""

import json

import pytest
import torch

from polyrl.config import TaskConfig
from polyrl.config_check import load_config
from polyrl.envs.base import make_task
from polyrl.models.loading import load_tokenizer
from polyrl.rollout.multi_turn import start_episode
from polyrl.run.sft import sft_example, train_sft, training_example
from polyrl.train.demonstrations import demonstration_example

TOOL_TASK = {
    "name": "tool_math", "env": "tool_math", "max_turns": 3, "eval_size": 2,
    "params": {"dataset": "chain_sum", "dataset_params": {"min_terms": 3, "max_terms": 3, "min_digits": 2,
                                                          "max_digits": 2}},
}


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer("tiny-random")
    return tok, make_task(TaskConfig(**TOOL_TASK), 0, tokenizer=tok)


def test_demonstration_is_call_then_answer_with_loss_on_assistant_tokens_only(setup):
    tok, task = setup
    item = task.train_item(2)
    ex = demonstration_example(task, 2, item, tok)
    expression = item["metadata"]["expression"]
    assert ex.input_ids[: ex.prompt_len] == start_episode(task, 2, item, 0, tok).ids
    assert ex.info["score"] == 1.0 and ex.info["tool_calls"] == ex.info["valid_tool_calls"] == 1
    assert len(ex.turn_spans) == 2
    turns = [tok.decode(ex.input_ids[a:b]) for a, b in ex.turn_spans]
    call = '<tool_call>[{"name": "calculate", "arguments": {"expression": "' + expression + '"}}]</tool_call>'
    assert turns == [call + "<|im_end|>", item["answer"] + "<|im_end|>"]
    # Trained tokens are exactly the two turns; the tool result between them is context only.
    trained = [i for i, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    assert trained == [i for a, b in ex.turn_spans for i in ex.input_ids[a:b]]
    between = tok.decode(ex.input_ids[ex.turn_spans[0][1]: ex.turn_spans[1][0]])
    assert f"tool\n{item['answer']}" in between and "assistant" in between


def test_envs_without_demonstrations_keep_the_gold_answer_example():
    tok = load_tokenizer("tiny-random")
    task = make_task(TaskConfig(name="chain_sum", eval_size=2), 0, tokenizer=tok)
    item = task.train_item(0)
    assert demonstration_example(task, 0, item, tok) is None
    assert training_example(task, 0, item, tok).input_ids == sft_example(task, 0, item, tok).input_ids


def test_a_demonstration_the_env_rejects_is_an_error(setup):
    tok, task = setup
    item = task.train_item(1)
    wrong = {**item, "metadata": {**item["metadata"], "expression": "1 + 1"}}  # solves another problem
    with pytest.raises(ValueError, match="does not score its own demonstration 1"):
        demonstration_example(task, 1, wrong, tok)


@pytest.mark.slow
def test_sft_on_demonstrations_lowers_their_loss(tmp_path):
    cfg = load_config("demo", data={
        "model": {"name": "tiny-random", "bf16": False}, "tasks": [TOOL_TASK],
        "rollout": {"prompts_per_step": 2, "group_size": 2}, "optim": {"lr": 1e-3},
        "train": {"steps": 8, "seed": 0}, "logging": {"progress": False, "tensorboard": False, "report": False},
    })
    summary = train_sft(cfg, tmp_path)
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [json.loads(r)["loss/sft"] for r in rows]
    assert summary["steps"] == 8 and losses[-1] < losses[0]
    assert torch.isfinite(torch.tensor(losses)).all()
