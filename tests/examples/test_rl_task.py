"""The addition task: prompts, answers, rewards and the held-out split."""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "rl"))

from rl_task import AdditionTask, CharTokenizer  # noqa: E402


def test_prompt_answer_and_reward_by_hand():
    task = AdditionTask(2)
    tok = task.tokenizer
    assert tok.decode(task.prompt(7, 95)) == "07+95="
    assert tok.decode(task.answer(7, 95)) == "201<eod>"  # 102, least significant digit first
    assert AdditionTask(2, reverse=False).tokenizer.decode(AdditionTask(2, reverse=False).answer(7, 95)) == "102<eod>"
    right = task.answer(7, 95)
    assert task.reward(7, 95, right) == 1.0
    assert task.reward(7, 95, right + [5, 5]) == 1.0  # what follows the EOD is not the answer
    assert task.reward(7, 95, right[:-1]) == 0.0  # no EOD: not an exact answer
    wrong = tok.encode("211") + [0]
    assert task.reward(7, 95, wrong) == 0.0
    assert AdditionTask(2, partial_credit=True).reward(7, 95, wrong) == pytest.approx(0.5 * 2 / 3)
    assert task.pair_of(task.prompt(7, 95)) == (7, 95)


def test_held_out_pairs_are_never_sampled_for_training():
    task = AdditionTask(2, eval_size=128)
    assert len(task.eval_pairs) == 128 and all(task.is_held_out(a, b) for a, b in task.eval_pairs)
    train = task.sample_pairs(4000, torch.Generator().manual_seed(0))
    assert not any(task.is_held_out(a, b) for a, b in train)
    held = sum(task.is_held_out(a, b) for a in range(100) for b in range(100))
    assert 800 < held < 1200  # about one pair in ten


def test_tokenizer_refuses_unknown_characters():
    with pytest.raises(ValueError, match="character 'x' is not in the vocabulary"):
        CharTokenizer().encode("1x2")
