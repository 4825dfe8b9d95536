"""The sampler/trainer mismatch metrics and the TIS weights, against hand-computed numbers."""

import math

import pytest
import torch

from gspo.losses import policy_loss
from gspo.mismatch import mismatch_metrics, tis_weights

# two sequences: 3 tokens and 2 tokens (+1 padding); d = trainer - sampler per token
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]])
SAMPLER = torch.tensor([[-1.1, -1.8, -0.5], [-1.0, -0.2, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
D = [[0.1, -0.2, 0.0], [-0.5, 0.0]]


def test_mismatch_metrics_by_hand():
    m = mismatch_metrics(TRAINER, SAMPLER, MASK)
    diffs = [0.1, 0.2, 0.0, 0.5, 0.0]
    assert m["rollout/logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / 5)
    assert m["rollout/logprob_abs_diff_max"] == pytest.approx(0.5)
    k3 = [math.exp(d) - 1 - d for row in D for d in row]
    assert m["rollout/mismatch_kl"] == pytest.approx(sum(k3) / 5, rel=1e-5)
    assert m["rollout/seq_logratio_abs_mean"] == pytest.approx((abs(-0.1 / 3) + abs(-0.5 / 2)) / 2, rel=1e-5)


def test_token_tis_truncates_each_ratio():
    w = tis_weights(TRAINER, SAMPLER, MASK, "token", cap=1.05)
    expected = [[min(math.exp(0.1), 1.05), math.exp(-0.2), 1.0], [math.exp(-0.5), 1.0, 1.0]]  # padding: 1
    torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_sequence_tis_truncates_the_product():
    w = tis_weights(TRAINER, SAMPLER, MASK, "sequence", cap=2.0)
    s0, s1 = math.exp(0.1 - 0.2 + 0.0), math.exp(-0.5 + 0.0)
    torch.testing.assert_close(w, torch.tensor([[s0, s0, s0], [s1, s1, 1.0]]), rtol=1e-6, atol=1e-6)
    big = tis_weights(TRAINER + torch.tensor([[30.0, 30.0, 30.0], [0, 0, 0]]), SAMPLER, MASK, "sequence", cap=2.0)
    assert big[0].tolist() == [2.0, 2.0, 2.0]  # exp(90) would overflow float32: truncated at C


def test_tis_weights_multiply_the_policy_term():
    """With ratio 1 (logp = old), GRPO's per-token objective is A; TIS makes it w_t A, mean per sequence."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    w = torch.tensor([[0.5, 1.0, 2.0], [1.5, 1.0, 7.0]])  # the last entry sits on padding: ignored
    loss, _ = policy_loss("grpo", logp, logp.detach(), adv, MASK, is_weight=w)
    want = -((0.5 + 1.0 + 2.0) / 3 * 1.0 + (1.5 + 1.0) / 2 * -2.0) / 2
    assert loss.item() == pytest.approx(want)
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -w A exp(logp - old) / |y| / B at ratio 1: -w A / |y| / B
    torch.testing.assert_close(grad, torch.tensor([[-0.5 / 6, -1 / 6, -2 / 6], [1.5 / 2, 1 / 2, 0.0]]))
