"""The learner's token grid and response mask line up with the rollout engine's log-probs."""

import pytest
import torch

from minite_megatron.rl.policy import scatter_response_values, token_grid


def test_grid_and_mask_by_hand():
    tokens, mask = token_grid([[5, 6, 7], [8]], [[1, 0], [2, 3, 0]], pad_id=0)
    assert tokens.tolist() == [[5, 6, 7, 1, 0], [8, 2, 3, 0, 0]]
    # entry t scores token t + 1: the response of row 0 is tokens 3..4 -> entries 2..3
    assert mask.tolist() == [[False, False, True, True], [True, True, True, False]]


def test_scatter_places_per_response_values_in_order():
    _, mask = token_grid([[5, 6, 7], [8]], [[1, 0], [2, 3, 0]], pad_id=0)
    out = scatter_response_values([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0, -5.0])], mask)
    assert out.tolist() == [[0, 0, -1, -2], [-3, -4, -5, 0]]
    with pytest.raises(ValueError, match="sequence 1: 2 values for 3 response tokens"):
        scatter_response_values([torch.zeros(2), torch.zeros(2)], mask)


def test_empty_pieces_are_refused():
    with pytest.raises(ValueError, match="sequence 0: empty response"):
        token_grid([[1]], [[]], pad_id=0)
    with pytest.raises(ValueError, match="need >= 1 each"):
        token_grid([], [], pad_id=0)
