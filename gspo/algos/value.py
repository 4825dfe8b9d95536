"""PPO's learned value function: GAE advantages and returns, the clipped value loss, explained variance.

Pure tensor math on the completion tokens, shapes (B, T) with a mask (B, T) of 1 on tokens; position t
holds the value V(s_t) of the state before completion token t (the prompt and tokens < t), the token's
reward r_t (the outcome reward on a completion's last token, minus a KL penalty per token when the KL is
in the reward), and its advantage. Notation and defaults follow verl 0.9.1 (`verl/trainer/ppo/core_algos.py`:
`compute_gae_advantage_return`, `compute_value_loss`; `verl/trainer/ppo/metric_utils.py`: the explained
variance), which tests/algos/test_value.py runs side by side when verl's source is at hand.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

GAE = "gae"  # algo.advantage: advantages from a learned value model (the trainer's critic), not from the group

AllSum = Callable[[Tensor], Tensor]  # a sum over ranks (gspo.train.ranks.distributed.Dist.all_sum); identity in one process


def _identity(x: Tensor) -> Tensor:
    return x


def outcome_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """(B,) scores -> (B, T) token rewards: each completion's score on its last token, 0 elsewhere (verl's layout).

    The last token is the row's last position with mask 1, wherever its gaps are (a multi-turn rollout's tool
    replies sit between the model's tokens, mask 0): never a masked position, whose reward GAE does not carry."""
    out = torch.zeros_like(mask, dtype=scores.dtype)
    on = mask > 0
    last = torch.where(on, torch.arange(mask.shape[1], device=mask.device), -1).amax(dim=1)
    has = last >= 0
    out[has, last[has]] = scores[has]
    return out


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., arXiv 1506.02438), unwhitened: (advantages, returns).

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t)        A_t = delta_t + gamma lam A_{t+1}        R_t = A_t + V(s_t)

    with V and A after a completion's last token taken as 0; masked positions are skipped (they carry the
    next token's value and advantage back unchanged), as verl's loop does.
    """
    B, T = rewards.shape
    m = mask.to(values.dtype)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a, next_adv)
        adv[:, t] = next_adv
    return adv, adv + values


@torch.no_grad()
def whiten(x: Tensor, mask: Tensor, all_sum: AllSum = _identity, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the masked tokens (var with Bessel's correction over tokens): verl's
    `masked_whiten`, the statistics summed over every rank's tokens with `all_sum` (so several ranks whiten
    exactly as one process would)."""
    m = mask.to(x.dtype)
    n, s = all_sum(torch.stack([m.sum(), (x * m).sum()]))
    mean = s / n
    ss = all_sum(((x - mean) ** 2 * m).sum())
    var = ss / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> tuple[Tensor, Tensor]:
    """PPO's clipped value loss (arXiv 1707.06347's value term, as verl and TRL clip it), summed over tokens.

        L_t = 0.5 max((V_t - R_t)^2, (clip(V_t, V_old,t - c, V_old,t + c) - R_t)^2)

    Returns (the masked SUM of L_t, to be divided by the token count: verl's `token-mean`; the clipped mask
    (B, T): where the clipped branch is the larger one, verl's `vf_clipfrac`). Rows are independent, so a
    sum lets several ranks share a minibatch and still compute the one token mean.
    """
    clipped = torch.maximum(torch.minimum(values, old_values + clip), old_values - clip)
    unclipped_loss, clipped_loss = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    m = mask > 0
    return torch.where(m, per_token, torch.zeros_like(per_token)).sum(), (clipped_loss > unclipped_loss) & m


@torch.no_grad()
def explained_variance(returns: Tensor, values: Tensor, mask: Tensor, all_sum: AllSum = _identity) -> float:
    """1 - Var(R - V) / (Var(R) + 1e-5) over the masked tokens of every rank (unbiased variances): verl's
    `critic/vf_explained_var`. 1: the values predict the returns; 0: no better than their mean; < 0: worse."""
    m = mask.to(torch.float64)
    r, d = returns.double() * m, (returns - values).double() * m
    n, sr, sd, srr, sdd = all_sum(torch.stack([m.sum(), r.sum(), d.sum(), (r * r).sum(), (d * d).sum()]))
    if n < 2:
        return float("nan")
    var_r, var_d = (srr - sr * sr / n) / (n - 1), (sdd - sd * sd / n) / (n - 1)
    return float(1.0 - var_d / (var_r + 1e-5))
