"""SFT examples: the prompt as a rollout renders it, the gold answer as the only trained tokens."""

import pytest
import torch

from polyrl.config import TaskConfig
from polyrl.engines.hf import HFEngine
from polyrl.envs.base import make_task
from polyrl.learner.batch import collate
from polyrl.models.loading import load_tokenizer, tiny_random_model
from polyrl.rollout.multi_turn import start_episode
from polyrl.run.sft import sft_example, sft_loss


@pytest.fixture(scope="module")
def setup():
    tok = load_tokenizer("tiny-random")
    cfg = TaskConfig(name="chain_sum", params={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                     prompt_suffix=" Answer with just the number.", eval_size=2)
    return tok, make_task(cfg, 0, tokenizer=tok)


@pytest.mark.slow
def test_loss_mask_covers_the_gold_answer_and_stop_token_only(setup):
    tok, task = setup
    item = task.train_item(3)
    ex = sft_example(task, 3, item, tok)
    # The prompt is token for token what a rollout would prompt with.
    assert ex.input_ids[: ex.prompt_len] == start_episode(task, 3, item, 0, tok).ids
    trained = [i for i, m in zip(ex.input_ids, ex.loss_mask, strict=True) if m]
    assert tok.decode(trained) == f"{item['answer']}<|im_end|>"
    assert trained[-1] == tok.eos_token_id and set(ex.loss_mask[: ex.prompt_len]) == {0}


def test_item_without_gold_answer_is_a_one_line_error(setup):
    tok, task = setup
    with pytest.raises(ValueError, match="item 7 has no gold 'answer'"):
        sft_example(task, 7, {"question": "q"}, tok)


def test_sft_loss_is_the_mean_nll_of_the_answer_tokens(setup):
    tok, task = setup
    model = tiny_random_model(0)
    ex = sft_example(task, 0, task.train_item(0), tok)
    batch = collate([ex], HFEngine(model, tok, bf16=False).pad_id)
    n = float(batch.loss_mask.sum())
    loss = sft_loss(model, batch, bf16=False, num_tokens=n)
    # The same number from a plain full-sequence forward.
    logits = model(torch.tensor([ex.input_ids])).logits[0, :-1].log_softmax(-1)
    targets = torch.tensor(ex.input_ids[1:])
    nll = -logits.gather(-1, targets[:, None]).squeeze(-1)[ex.prompt_len - 1:]
    assert float(loss.detach()) == pytest.approx(float(nll.mean().detach()), rel=1e-4)
