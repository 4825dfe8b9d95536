"""The policy's entropy as a training signal: TRL's high-entropy token mask and the entropy bonus.

    keep = high_entropy_mask(entropy, mask, top=0.2)     # (B, T) bool: the policy term trains on these tokens
    bonus = entropy_bonus(entropy, mask & keep)           # scalar with grad: loss -= entropy_coef * bonus

`entropy` (B, T) is H(pi(. | s_t)) at each completion position, at the sampling temperature (as the
log-probs are), from the update's own forward pass (`gspo.models.logprobs`: it carries a gradient).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def high_entropy_mask(entropy: Tensor, mask: Tensor, top: float,
                      gather: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """(B, T) bool: the tokens whose entropy is at least the (1 - top) quantile of the entropies of every
    completion token of the batch ("Beyond the 80/20 Rule", arXiv 2506.01939: train on the top-rho
    high-entropy "forking" tokens only), as TRL's `GRPOTrainer.get_high_entropy_mask` (`top_entropy_quantile`)
    computes it: torch.quantile's linear interpolation over the tokens of every process (`gather`: this
    process's (M,) entropies -> every process's); top = 0 keeps the highest-entropy token(s), 1 every token."""
    local = entropy.detach()[mask > 0].float()
    every = gather(local) if gather is not None else local
    if every.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(every, 1.0 - top)
    return ((entropy.detach() * mask) >= threshold) & (mask > 0)


def entropy_bonus(entropy: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(sum of the entropy over the masked tokens (with grad), their count): the mean per-token entropy is
    sum / count. TRL's `entropy_coef` subtracts coef x that mean from the loss whatever the loss's own
    aggregation (verl's `entropy_coeff` aggregates it as the policy loss); the trainer divides by the count of
    every rank's minibatch tokens, so several ranks compute the one-process mean."""
    m = mask.to(entropy.dtype)
    return (entropy * m).sum(), m.sum()
