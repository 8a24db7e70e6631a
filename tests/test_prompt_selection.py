"""Prompt selection by predicted pass rate (``rollout.prompt_selection``, MoPPS): Beta posteriors worked by hand,
the choice among candidates, and a run that selects, checkpoints its estimates and resumes to the same draws."""

import json

import pytest
from conftest import SMOKE

from polyrl.config_check import load_config
from polyrl.data.selection import PromptSelector, item_key, mixed_group_chance, updated
from polyrl.train.step import build_run, rl_step


def test_posterior_update_decays_toward_the_prior_then_adds_the_group():
    # Beta(1, 1), 3 of 8, half the old evidence kept: (0.5 + 0.5 + 3, 0.5 + 0.5 + 5)
    assert updated((1.0, 1.0), 3, 8, 0.5) == (4.0, 6.0)
    # then 8 of 8: (0.5 * 4 + 0.5 + 8, 0.5 * 6 + 0.5 + 0)
    assert updated((4.0, 6.0), 8, 8, 0.5) == (10.5, 3.5)
    assert updated((4.0, 6.0), 0, 2, 1.0) == (4.0, 8.0)  # decay 1 keeps every count
    assert updated((40.0, 3.0), 1, 1, 0.0) == (2.0, 1.0)  # decay 0 forgets all but the new group


def test_mixed_group_chance():
    assert mixed_group_chance(0.5, 2) == pytest.approx(0.5)
    assert mixed_group_chance(0.1, 8) == pytest.approx(1 - 0.1**8 - 0.9**8)
    assert mixed_group_chance(0.0, 8) == 0.0 and mixed_group_chance(1.0, 8) == 0.0


def test_items_that_differ_only_in_metadata_share_an_estimate():
    a = {"question": "1 + 2 =", "answer": "3", "metadata": {"source_index": 0}}
    b = {"question": "1 + 2 =", "answer": "3", "metadata": {"source_index": 57}}
    c = {"question": "1 + 3 =", "answer": "4", "metadata": {"source_index": 0}}
    assert item_key("t", a) == item_key("t", b) != item_key("t", c)
    assert item_key("t", a) != item_key("u", a)


def test_the_choice_keeps_items_predicted_to_give_mixed_groups():
    selector = PromptSelector(candidates=3, target=0.5, decay=1.0, seed=0)
    for _ in range(10):
        selector.observe("solved", 8, 8)
        selector.observe("hopeless", 0, 8)
        selector.observe("half", 4, 8)
    for step in range(1, 20):  # posteriors this sharp leave no room for chance
        assert selector.choose(["solved", "half", "hopeless"], 1, step, 0).chosen == [1]
    choice = selector.choose(["hopeless", "new", "half", "solved"], 2, 1, 0)
    assert 2 in choice.chosen and 3 not in choice.chosen and 0 not in choice.chosen
    assert choice.known == 1 and choice.chosen == sorted(choice.chosen)


def test_choices_are_seeded_by_step_and_round_and_survive_a_state_round_trip():
    selector = PromptSelector(candidates=4, target=0.5, decay=0.5, seed=3)
    keys = [f"k{i}" for i in range(12)]
    for i, key in enumerate(keys):
        selector.observe(key, i % 5, 4)
    again = PromptSelector(candidates=4, target=0.5, decay=0.5, seed=3)
    again.load_state_dict(json.loads(json.dumps(selector.state_dict())))
    assert [selector.choose(keys, 3, s, r).chosen for s in range(5) for r in range(2)] == \
           [again.choose(keys, 3, s, r).chosen for s in range(5) for r in range(2)]
    assert len({tuple(selector.choose(keys, 3, s, 0).chosen) for s in range(10)}) > 1  # Thompson draws differ


def test_config_refuses_bad_values_naming_the_key():
    with pytest.raises(ValueError, match="rollout.prompt_selection.candidates"):
        load_config(SMOKE, ["rollout.prompt_selection.candidates=0"])
    with pytest.raises(ValueError, match="rollout.prompt_selection.target"):
        load_config(SMOKE, ["rollout.prompt_selection.target=1.5"])


@pytest.mark.slow
def test_a_step_draws_candidates_keeps_the_prompts_per_step_and_learns_estimates(tmp_path):
    cfg = load_config(SMOKE, ["rollout.prompt_selection.candidates=3", "logging.tensorboard=false",
                              "rollout.max_new_tokens=4"])
    run = build_run(cfg, tmp_path)
    metrics, kept = rl_step(run, 1)
    assert len({t.group_id for t in kept}) == cfg.rollout.prompts_per_step
    assert len(kept) == cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert run.sampler.cursors["chain_sum"] == 3 * cfg.rollout.prompts_per_step  # every candidate drawn
    assert metrics["selection/known_items"] == 0.0  # nothing seen yet at step 1
    assert 0.0 <= metrics["selection/expected_mixed_groups"] <= cfg.rollout.prompts_per_step
    assert len(run.selection.posteriors) == len({item_key("chain_sum", run.tasks["chain_sum"].train_item(t.item_id))
                                                 for t in kept})
    assert sum(a + b for a, b in run.selection.posteriors.values()) == pytest.approx(
        len(run.selection.posteriors) * 2 + len(kept))  # each item's prior Beta(1, 1), plus each sample once


@pytest.mark.slow
def test_a_resumed_run_selects_what_the_whole_run_did(tmp_path):
    from polyrl.run.loop import train

    def config(steps):
        return load_config(SMOKE, [f"train.steps={steps}", "rollout.prompt_selection.candidates=4",
                                   "eval.before=false", "eval.after=false", "logging.tensorboard=false",
                                   "logging.report=false", "rollout.max_new_tokens=4"])

    train(config(3), tmp_path / "a", log=lambda *_: None)
    train(config(1), tmp_path / "b", log=lambda *_: None)
    state = json.loads((tmp_path / "b" / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert len(state["selection"]) == 2  # the two items of step 1, with their posteriors
    train(config(3), tmp_path / "b", resume=True, log=lambda *_: None)
    items = [[(json.loads(x)["step"], json.loads(x)["item_id"]) for x in
              (tmp_path / d / "trajectories.jsonl").read_text().splitlines()] for d in "ab"]
    assert items[0] == items[1] and len({i for _, i in items[0]}) >= 6
