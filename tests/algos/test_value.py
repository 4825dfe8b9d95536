"""PPO's value-function math (gspo/algos/value.py): GAE, the whitening, the clipped value loss and the explained
variance by hand-worked numbers and autograd, and side by side with verl 0.9.1's own functions when its source
is at hand (VERL_SRC=<unpacked verl wheel>, as scripts/peer_verl.py; verl itself is not installable here)."""

from __future__ import annotations

import math

import pytest
import torch

from gspo.algos.value import explained_variance, gae, outcome_rewards, value_loss, whiten


def test_gae_by_hand():
    """One row of 3 tokens and one of 2 (padded): gamma 0.9, lambda 0.5, reward 1 on each row's last token."""
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    values = torch.tensor([[0.5, 0.2, 0.4], [0.1, 0.3, 9.0]])  # 9.0 sits on padding: never read
    rewards = outcome_rewards(torch.tensor([1.0, 1.0]), mask)
    assert rewards.tolist() == [[0, 0, 1], [0, 1, 0]]
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 0: delta_2 = 1 - 0.4 = 0.6; delta_1 = 0.9 * 0.4 - 0.2 = 0.16; delta_0 = 0.9 * 0.2 - 0.5 = -0.32
    #        A_2 = 0.6, A_1 = 0.16 + 0.45 * 0.6 = 0.43, A_0 = -0.32 + 0.45 * 0.43 = -0.1265
    # row 1: delta_1 = 1 - 0.3 = 0.7, delta_0 = 0.9 * 0.3 - 0.1 = 0.17; A_1 = 0.7, A_0 = 0.17 + 0.45 * 0.7 = 0.485
    torch.testing.assert_close(adv[0], torch.tensor([-0.1265, 0.43, 0.6]))
    torch.testing.assert_close(adv[1, :2], torch.tensor([0.485, 0.7]))
    torch.testing.assert_close(ret, adv + values)
    # gamma = lambda = 1 (verl's defaults): every token's advantage is the outcome minus its own value
    adv1, ret1 = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv1[0], 1.0 - values[0])
    torch.testing.assert_close(ret1[0], torch.ones(3))


def test_the_outcome_reward_sits_on_each_rows_last_model_token_whatever_the_gaps():
    """Rows with tool replies inside (mask 0 between the model's tokens), as multi-turn rollouts give: the score
    sits on the row's LAST model token (verl's convention), never on a masked tool token, whose reward GAE would
    never carry back. At gamma = lambda = 1 and values 0 every model token's advantage is then the score."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    rewards = outcome_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 2, 0, 0], [0, 0, 0, 0, 0, 3], [0, 0, 0, 0, 0, 0]]
    adv, _ = gae(rewards, torch.zeros(4, 6), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv[:3] * mask[:3], torch.tensor([1.0, 2.0, 3.0])[:, None] * mask[:3])


def test_gae_equals_the_recursion_per_row_over_its_own_tokens():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 4]
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).double()
    rewards = torch.randn(4, 5, generator=g, dtype=torch.float64) * mask
    values = torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv, _ = gae(rewards, values, mask, gamma=0.97, lam=0.8)
    for i, n in enumerate(lengths):
        a, nxt_v, nxt_a = [0.0] * n, 0.0, 0.0
        for t in reversed(range(n)):
            nxt_a = rewards[i, t].item() + 0.97 * nxt_v - values[i, t].item() + 0.97 * 0.8 * nxt_a
            nxt_v = values[i, t].item()
            a[t] = nxt_a
        torch.testing.assert_close(adv[i, :n], torch.tensor(a, dtype=torch.float64))


def test_whiten_over_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    w = whiten(x, mask)
    # tokens 1, 2, 3, 4: mean 2.5, unbiased variance 5/3
    torch.testing.assert_close(w[mask > 0], (torch.tensor([1.0, 2, 3, 4]) - 2.5) / math.sqrt(5 / 3 + 1e-8))


def test_value_loss_and_its_gradient_by_hand():
    """clip 0.2; old values 0; returns 1. V = 0.1: inside the clip, L = 0.5 (0.9)^2, dL/dV = -(0.9);
    V = 0.5: clipped to 0.2, (0.2 - 1)^2 = 0.64 > (0.5 - 1)^2 = 0.25, L = 0.32, no gradient;
    V = 1.5: clipped to 0.2 (0.64), unclipped (0.5)^2 = 0.25: max is the clipped one, L = 0.32, no gradient;
    V = -0.5 (padding): not counted."""
    values = torch.tensor([[0.1, 0.5, 1.5, -0.5]], requires_grad=True)
    old, returns = torch.zeros(1, 4), torch.ones(1, 4)
    mask = torch.tensor([[1.0, 1, 1, 0]])
    total, clipped = value_loss(values, old, returns, mask, clip=0.2)
    torch.testing.assert_close(total, torch.tensor(0.5 * 0.81 + 0.32 + 0.32))
    assert clipped.tolist() == [[False, True, True, False]]
    (grad,) = torch.autograd.grad(total, values)
    torch.testing.assert_close(grad, torch.tensor([[-0.9, 0.0, 0.0, 0.0]]))
    # pessimistic on both sides: V = -0.5 moved past old - clip towards the return -1, the clipped value -0.2 is
    # further from it, max(0.25, 0.64) is the clipped loss and the value gets no gradient
    v = torch.tensor([[-0.5]], requires_grad=True)
    total, clipped = value_loss(v, torch.zeros(1, 1), torch.full((1, 1), -1.0), torch.ones(1, 1), clip=0.2)
    torch.testing.assert_close(total, torch.tensor(0.5 * 0.64))
    assert clipped.item() and torch.autograd.grad(total, v)[0].item() == 0.0


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 9.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-5)
    assert explained_variance(returns, torch.full_like(returns, 2.0), mask) == pytest.approx(1 - 1 / (1 + 1e-5))
    values = torch.tensor([[1.5, 2.0, 2.5, 0.0]])  # residuals -0.5, 0, 0.5 on the tokens: var 0.25
    assert explained_variance(returns, values, mask) == pytest.approx(1 - 0.25 / (1 + 1e-5))


@pytest.fixture(scope="module")
def verl(verl_tree):
    """verl's `core_algos` (conftest's `verl_tree`, imported as scripts/peer_verl.py imports it; skipped without
    VERL_SRC, an unpacked verl 0.9.1 wheel)."""
    return verl_tree


def test_gae_and_value_loss_equal_verls(verl):
    """verl's compute_gae_advantage_return (its whitening included) and compute_value_loss (token-mean), on the
    same tensors: values, gradients, clip fractions and verl's explained variance."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 2, 4, 6, 1, 5])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    scores = torch.randn(6, generator=g)
    values = torch.randn(6, 6, generator=g)
    kl = 0.05 * torch.randn(6, 6, generator=g) * mask  # a KL penalty on every token, as use_kl_in_reward adds
    rewards = outcome_rewards(scores, mask) - kl
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.3)):
        theirs_adv, theirs_ret = verl.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
        adv, ret = gae(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(ret * mask, theirs_ret * mask, rtol=0, atol=1e-6)
        torch.testing.assert_close(whiten(adv, mask) * mask, theirs_adv * mask, rtol=0, atol=1e-5)
    new = (values + 0.3 * torch.randn(6, 6, generator=g)).requires_grad_()
    theirs, theirs_clip = verl.compute_value_loss(new, ret, values, mask, cliprange_value=0.5)
    total, clipped = value_loss(new, values, ret, mask, clip=0.5)
    ours = total / mask.sum()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert float(clipped.sum() / mask.sum()) == pytest.approx(float(theirs_clip), abs=1e-6)
    for a, b in zip(torch.autograd.grad(ours, new), torch.autograd.grad(theirs, new)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    m = mask.bool()
    r, v = ret[m], values[m]
    theirs_ev = 1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)  # verl's metric_utils.compute_data_metrics
    assert explained_variance(ret, values, mask) == pytest.approx(float(theirs_ev), abs=1e-6)
