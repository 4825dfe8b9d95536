"""The sampler/trainer mismatch: how far the log-probs recorded while sampling are from the
trainer's own forward pass, and the truncated importance-sampling (TIS) correction for it.

Sampling (a KV-cache decode, one token at a time) and training (one full forward) run the
same weights through different kernels, so in bf16 they disagree slightly; with an
inference engine (vLLM, SGLang) they disagree more. The tokens were drawn from the
sampler's distribution mu, while the loss's ratio is taken against the trainer's pi_old.
TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
2025; TRL's `vllm_importance_sampling_correction`, verl's rollout IS) reweights each
token's policy term by min(pi_old / mu, C), or each sequence's by min(prod_t pi_old / mu, C).

Notation: trainer = pi_old's log-probs of the sampled tokens (the old-policy pass),
sampler = mu's (recorded while sampling), mask (B, T) on completion tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

TIS_LEVELS = ("none", "token", "sequence")


@torch.no_grad()
def mismatch_metrics(trainer: Tensor, sampler: Tensor, mask: Tensor) -> dict[str, float]:
    """`rollout/logprob_abs_diff_{mean,max}` per token, `rollout/mismatch_kl` (k3 estimate of
    KL(mu || pi_old) per token) and `rollout/seq_logratio_abs_mean` (mean over sequences of
    |mean_t log pi_old/mu|: how far GSPO's length-normalised sequence ratio sits from 1 before any update)."""
    m = mask.bool()
    d = (trainer - sampler).float()  # log pi_old/mu per token
    if not m.any():
        return {}
    diff = d[m].abs()
    k3 = torch.exp(d) - 1 - d  # E_mu[r - 1 - log r], r = pi_old/mu: an unbiased, non-negative KL(mu || pi_old)
    lens = mask.sum(-1)
    has = lens > 0
    seq = ((d * mask).sum(-1)[has] / lens[has]).abs()
    return {
        "rollout/logprob_abs_diff_mean": float(diff.mean()),
        "rollout/logprob_abs_diff_max": float(diff.max()),
        "rollout/mismatch_kl": float(k3[m].mean()),
        "rollout/seq_logratio_abs_mean": float(seq.mean()),
    }


def tis_weights(trainer: Tensor, sampler: Tensor, mask: Tensor, level: str, cap: float) -> Tensor:
    """Truncated importance weights (B, T) for the policy term; 1 on padding.

    token:    w_t = min(pi_old(y_t) / mu(y_t), C)
    sequence: w_i = min(prod_t pi_old(y_t) / mu(y_t), C) on every token of sequence i
    """
    if level not in TIS_LEVELS:
        raise ValueError(f"TIS level {level!r}: valid levels are {', '.join(TIS_LEVELS)}")
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    d = torch.where(mask.bool(), (trainer - sampler).float(), torch.zeros_like(trainer, dtype=torch.float32))
    if level == "none":
        return torch.ones_like(d)
    if level == "sequence":
        d = d.sum(-1, keepdim=True).expand_as(d)
    w = torch.exp(d).clamp(max=cap)  # exp(d) <= cap <=> d <= log cap: no overflow matters after the clamp
    return torch.where(mask.bool(), w, torch.ones_like(w))
