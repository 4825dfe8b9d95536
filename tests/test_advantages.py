"""Group-relative advantages, each against numbers worked by hand (two groups of G = 4)."""

import math

import pytest
import torch

from gspo.advantages import compute_advantages, register_advantage

# group 0: one right answer of four; group 1: rewards 0, 0.1, 1, 1 (TinyZero-style partial credit)
R = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.1, 1.0, 1.0])
G = 4


def test_grpo_zscore_unbiased_std():
    # group 0: mean 0.25, unbiased var = (0.5625 + 3 * 0.0625) / 3 = 0.25 -> std 0.5
    a = compute_advantages("grpo", R, G)
    assert a[:4].tolist() == pytest.approx([0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001])
    # group 1: mean 0.525, std = sqrt(sum (r - 0.525)^2 / 3)
    dev = [-0.525, -0.425, 0.475, 0.475]
    std = math.sqrt(sum(x * x for x in dev) / 3)
    assert a[4:].tolist() == pytest.approx([x / (std + 1e-4) for x in dev])


def test_grpo_equal_rewards_give_zero():
    assert compute_advantages("grpo", torch.ones(4), 4).tolist() == [0.0] * 4


def test_drgrpo_no_std():
    a = compute_advantages("drgrpo", R, G)
    assert a.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, -0.525, -0.425, 0.475, 0.475])


def test_rloo_leave_one_out():
    # r_i - mean of the other three
    a = compute_advantages("rloo", R, G)
    assert a[:4].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert a[4:].tolist() == pytest.approx([0 - 2.1 / 3, 0.1 - 2.0 / 3, 1 - 1.1 / 3, 1 - 1.1 / 3])


def test_batch_std():
    # group means removed, scale = unbiased std of all 8 rewards
    m = sum(R.tolist()) / 8
    std = math.sqrt(sum((x - m) ** 2 for x in R.tolist()) / 7)
    centred = [0.75, -0.25, -0.25, -0.25, -0.525, -0.425, 0.475, 0.475]
    assert compute_advantages("batch_std", R, G).tolist() == pytest.approx([c / (std + 1e-4) for c in centred])


def test_best_of_group_marks_first_argmax():
    # group 1 has a tie at 1.0: the first (index 6) wins
    assert compute_advantages("best_of_group", R, G).tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert compute_advantages("best_of_group", torch.zeros(4), 4).tolist() == [1, 0, 0, 0]


def test_softmax_within_group():
    a = compute_advantages("softmax", R, G)
    z0 = math.e + 3
    assert a[:4].tolist() == pytest.approx([math.e / z0, 1 / z0, 1 / z0, 1 / z0])
    z1 = 1 + math.exp(0.1) + 2 * math.e
    assert a[4:].tolist() == pytest.approx([1 / z1, math.exp(0.1) / z1, math.e / z1, math.e / z1])


def test_integer_rewards_accepted():
    assert compute_advantages("drgrpo", torch.tensor([1, 0]), 2).tolist() == [0.5, -0.5]


def test_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*grpo.*rloo"):
        compute_advantages("gae", R, G)
    with pytest.raises(ValueError, match="groups of 3"):
        compute_advantages("grpo", R, 3)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages("rloo", R, 1)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda r: r)
