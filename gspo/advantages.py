"""Per-completion advantages from scalar rewards, computed within each prompt's group.

    adv = compute_advantages(name, rewards, group_size)      # (N,) -> (N,)

Rewards are laid out group-contiguous: rows [g*G:(g+1)*G] are the G completions
of prompt g. Every estimator works on the (N/G, G) view of that layout.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from gspo.errors import ConfigError

STD_EPS = 1e-4  # added to the std, as TRL and the GSPO/DAPO recipes do (verl uses 1e-6)

AdvantageFn = Callable[[Tensor], Tensor]  # (n_groups, G) rewards -> (n_groups, G) advantages

ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: add an estimator to the registry under `name` (duplicates are an error)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGES[name] = fn
        return fn

    return decorator


def advantage_names() -> list[str]:
    """Names of every registered estimator, sorted."""
    return sorted(ADVANTAGES)


@register_advantage("grpo")
def grpo(r: Tensor) -> Tensor:
    """(r - mean_group) / (std_group + 1e-4), DeepSeekMath arXiv 2402.03300 §4.1.

    std is the unbiased (n - 1) estimator, as torch.std, TRL and verl compute it; a group whose
    rewards are all equal gets advantage 0.
    """
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + STD_EPS)


@register_advantage("drgrpo")
def drgrpo(r: Tensor) -> Tensor:
    """r - mean_group: Dr. GRPO arXiv 2503.20783 drops the std, which favours too-easy/too-hard prompts."""
    return r - r.mean(dim=1, keepdim=True)


@register_advantage("rloo")
def rloo(r: Tensor) -> Tensor:
    """r_i - mean of the other G-1 rewards (REINFORCE leave-one-out, arXiv 2402.14740) = G/(G-1) (r - mean)."""
    g = r.shape[1]
    return r - (r.sum(dim=1, keepdim=True) - r) / (g - 1)


@register_advantage("batch_std")
def batch_std(r: Tensor) -> Tensor:
    """(r - mean_group) / (std_batch + 1e-4): group baseline, scale from all N rewards (unbiased std).

    A batch-level scale keeps a near-uniform group's few differences from being blown up to +-1.
    """
    return (r - r.mean(dim=1, keepdim=True)) / (r.std() + STD_EPS)


@register_advantage("best_of_group")
def best_of_group(r: Tensor) -> Tensor:
    """1 for the first argmax of each group, 0 elsewhere: rejection-sampling fine-tuning (RFT).

    No baseline: with the `nll` loss this is supervised learning on the best of G samples. A group
    whose rewards are all equal (e.g. all wrong) still marks its first completion.
    """
    out = torch.zeros_like(r)
    out.scatter_(1, r.argmax(dim=1, keepdim=True), 1.0)  # argmax returns the first maximal index
    return out


@register_advantage("softmax")
def softmax(r: Tensor) -> Tensor:
    """softmax(r) within the group (temperature 1): reward-softmax-weighted log-likelihood.

    All weights are positive and sum to 1 per group: nothing is pushed down, better samples more.
    """
    return torch.softmax(r, dim=1)


def compute_advantages(name: str, rewards: Tensor, group_size: int) -> Tensor:
    """Advantages (N,) for group-contiguous rewards (N,) with G = group_size completions per prompt."""
    if name not in ADVANTAGES:
        raise ConfigError(f"unknown advantage estimator {name!r}; valid: {', '.join(advantage_names())}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if group_size < 2 and name in ("grpo", "rloo"):
        raise ConfigError(f"advantage {name!r} needs group_size >= 2 (a std / a leave-one-out mean), got {group_size}")
    if name == "batch_std" and rewards.numel() < 2:
        raise ValueError("advantage 'batch_std' needs at least 2 rewards for a batch std")
    r = rewards.to(torch.get_default_dtype() if not rewards.is_floating_point() else rewards.dtype)
    return ADVANTAGES[name](r.view(-1, group_size)).reshape(-1)
