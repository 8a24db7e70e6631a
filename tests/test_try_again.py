"""Try again (tasks[].attempts): a single-turn task as a multi-turn episode with feedback after a wrong answer."""

import pytest
from conftest import SMOKE

from polyrl.config import ConfigError
from polyrl.config_check import load_config
from polyrl.envs.base import SingleTurnEnv, TryAgainEnv


def _env(attempts=3, discount=0.5):
    inner = SingleTurnEnv(lambda item: [{"role": "user", "content": item["q"]}],
                          lambda item, reply: float(reply.strip() == item["a"]))
    return TryAgainEnv(inner, attempts, "Wrong, try again.", discount)


def test_a_wrong_answer_gets_feedback_and_a_later_success_is_discounted():
    env = _env()
    assert env.reset({"q": "2+2?", "a": "4"}) == [{"role": "user", "content": "2+2?"}]
    first = env.step("5")
    assert not first.done and first.reward == 0.0
    assert first.observations == [{"role": "user", "content": "Wrong, try again."}]
    assert not env.step("3").done
    last = env.step("4")  # third attempt: 1 * 0.5 ** 2
    assert last.done and last.reward == 0.25 and last.info["score"] == 1.0 and last.info["attempts"] == 3
    # a first-try success ends at once with the full reward; the reset starts the count again
    env.reset({"q": "2+2?", "a": "4"})
    ok = env.step("4")
    assert ok.done and ok.reward == 1.0 and ok.info["attempts"] == 1
    # out of attempts: the last (failed) attempt ends the episode
    env = _env(attempts=2)
    env.reset({"q": "2+2?", "a": "4"})
    env.step("1")
    end = env.step("2")
    assert end.done and end.reward == 0.0 and end.info["score"] == 0.0


def test_attempts_config_errors():
    with pytest.raises(ConfigError, match="tasks.0.max_turns: tasks\\[\\].attempts sets the turns"):
        load_config(SMOKE, ["tasks.0.attempts=3", "tasks.0.max_turns=2"])
    with pytest.raises(ConfigError, match="tasks.0.attempts"):
        load_config(SMOKE, ["tasks.0.attempts=0"])
    multi = SingleTurnEnv(lambda item: [], lambda item, reply: 0.0)
    multi.max_turns = 4
    with pytest.raises(ValueError, match="tasks\\[\\].attempts: needs a single-turn env"):
        TryAgainEnv(multi, 2, "again")


@pytest.mark.slow
def test_try_again_episodes_train(tmp_path):
    from polyrl.train.step import build_run, rl_step

    cfg = load_config(SMOKE, ["tasks.0.attempts=2", "tasks.0.attempt_feedback=Not quite. Once more."])
    run = build_run(cfg, tmp_path)
    _, kept = rl_step(run, 1)
    turns = [sum(1 for a, b in zip(t.loss_mask, t.loss_mask[1:], strict=False) if not a and b) for t in kept]
    assert max(turns) <= 2
    for t, n in zip(kept, turns, strict=True):
        if n == 2:  # the second attempt follows the feedback, which is not trained on
            assert "Not quite. Once more." in run.tokenizer.decode(t.input_ids)
