"""Per-token estimators of KL(pi || ref) from the log-probs of sampled tokens.

With tokens sampled from pi and the log-ratio x = ref_logp - logp (Schulman,
"Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html):

    k1 = -x = logp - ref               unbiased, high variance, can be negative
    k2 = 0.5 * x^2                     biased, low variance, always >= 0
    k3 = exp(x) - x - 1                unbiased, low variance, always >= 0

GRPO (DeepSeekMath, arXiv 2402.03300, §4.1) adds beta * k3 to every token's
loss. No clamping here: peers clamp x to +-20 and k3 to +-10 for stability; we
keep the formula exact and let a diverging run show up in the metrics.
"""

from __future__ import annotations

import torch

from gspo.config.checks import CHOICES
from gspo.core.errors import ConfigError

KL_KINDS = CHOICES["algo.kl_estimator"]  # the schema's (k1, k2, k3)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs (B, T).

    Args:
        logp: log-probs of the sampled tokens under the policy being trained.
        ref_logp: log-probs of the same tokens under the reference policy.
        kind: "k1" | "k2" | "k3".
    """
    if kind not in KL_KINDS:
        raise ConfigError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_KINDS)}")
    x = ref_logp - logp  # log(ref / pi)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x.square()
    return torch.exp(x) - x - 1.0


def reward_penalty(old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float,
                   kind: str) -> torch.Tensor:
    """(B, T) beta x KL_t(pi_old || ref) on each completion token (0 on padding): the KL in the reward.

    Classic RLHF PPO (InstructGPT; verl's `use_kl_in_reward` with `kl_penalty`, `apply_kl_penalty`) subtracts
    it from each token's reward; TRL's RLOOTrainer subtracts its sum over the completion from the
    completion's reward (k1, `old_per_token_logps - ref_per_token_logps`). pi_old is the policy that
    sampled (no gradient: the penalty is part of the reward, not of the loss).
    """
    return beta * kl_penalty(old_logp.detach(), ref_logp.detach(), kind) * mask
