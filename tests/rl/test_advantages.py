"""Group-relative advantages against hand-computed values; a group of one is refused.

Pins the old example's failure: ``--group 1`` gave ``std = NaN`` and a NaN loss that was applied."""

import math

import pytest
import torch

from minite_megatron.rl import GroupSizeError, check_group_size, group_advantages, zero_variance_groups


def test_grpo_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4, eps=1e-6)
    s = math.sqrt(4 * 0.25 / 3) + 1e-6  # unbiased std of [1, 0, 0, 1], plus eps
    want = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0])
    torch.testing.assert_close(a, want, rtol=0, atol=1e-6)
    assert a.dtype == torch.float32


def test_no_std_normalization_is_mean_centering():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0])
    torch.testing.assert_close(group_advantages(r, 2, normalize_std=False), torch.tensor([1.0, -1.0, 0.0, 0.0]))


def test_identical_rewards_give_exact_zero_advantages():
    a = group_advantages(torch.tensor([0.7, 0.7, 0.7]), 3)
    assert torch.equal(a, torch.zeros(3))


@pytest.mark.parametrize("g", [1, 0, -2])
def test_group_of_one_is_refused(g):
    """Regression: --group 1 produced NaN advantages (0/0) that reached the optimizer."""
    with pytest.raises(GroupSizeError, match=f"--group {g}: .*at least 2 samples per prompt"):
        group_advantages(torch.tensor([1.0, 0.0]), g)
    with pytest.raises(GroupSizeError):
        check_group_size(g)


def test_bad_inputs_name_the_problem():
    with pytest.raises(GroupSizeError, match="5 samples do not split into groups of 2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"rewards\[1\] = nan is not finite"):
        group_advantages(torch.tensor([0.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)


def test_zero_variance_groups_mark_whole_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert zero_variance_groups(r, 2).tolist() == [True, True, False, False, True, True]
