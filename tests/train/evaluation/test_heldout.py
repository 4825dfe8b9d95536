"""The held-out evaluation's unbiased pass@k estimator, by hand."""

from math import comb

import pytest

from gspo.train.evaluation.heldout import pass_at_k


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # C(6,4) = 15, C(8,4) = 70
    assert pass_at_k(8, 7, 2) == 1.0  # fewer than k wrong: every k-subset has a correct one
    n, c, k = 10, 3, 5
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
