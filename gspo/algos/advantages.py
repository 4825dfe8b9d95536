"""Per-completion advantages from scalar rewards, computed within each prompt's group.

    adv = compute_advantages(name, rewards, group_size)      # (N,) -> (N,)

Rewards are laid out group-contiguous: rows [g*G:(g+1)*G] are the G completions
of prompt g. Every estimator works on the (N/G, G) view of that layout.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable

import torch
from torch import Tensor

from gspo.core.errors import ConfigError

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
def grpo(r: Tensor, eps: float = STD_EPS) -> Tensor:
    """(r - mean_group) / (std_group + 1e-4), DeepSeekMath arXiv 2402.03300 §4.1.

    std is the unbiased (n - 1) estimator, as torch.std, TRL and verl compute it; a group whose
    rewards are all equal gets advantage exactly 0 (`compute_advantages`).
    """
    return (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)


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
def batch_std(r: Tensor, eps: float = STD_EPS) -> Tensor:
    """(r - mean_group) / (std_batch + 1e-4): group baseline, scale from all N rewards (unbiased std).

    A batch-level scale keeps a near-uniform group's few differences from being blown up to +-1.
    """
    return (r - r.mean(dim=1, keepdim=True)) / (r.std() + eps)


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


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(r: Tensor, eps: float = STD_EPS) -> Tensor:
    """(r - mean_batch) / (std_batch + 1e-4): REINFORCE++ (arXiv 2501.03262) with outcome rewards, no group baseline.

    The global batch normalisation of the paper, over completions (verl whitens over tokens, see
    docs/algorithms.md); works with group_size 1. The paper's KL-in-reward is not part of it here.
    """
    return (r - r.mean()) / (r.std() + eps)


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(r: Tensor, eps: float = STD_EPS) -> Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): subtract the group mean, then normalise over the whole batch.

    Over completions the centred rewards already have batch mean 0, so this is (r - mean_group) / (std_batch(r - mean_group) + 1e-4).
    """
    c = r - r.mean(dim=1, keepdim=True)
    return (c - c.mean()) / (c.std() + eps)


@register_advantage("gpg")
def gpg(r: Tensor) -> Tensor:
    """GPG (arXiv 2504.02546): alpha (r - mean_group), F_norm = 1, alpha = N / (N - M).

    M counts the completions of groups whose rewards are all equal (their advantage is 0): the gradient
    is rescaled as if only the N - M informative completions had been averaged (all equal: alpha = 1).
    """
    centred = r - r.mean(dim=1, keepdim=True)
    n = r.numel()
    m = r.shape[1] * int((r == r[:, :1]).all(dim=1).sum())
    return centred * (n / (n - m) if m < n else 1.0)


@register_advantage("gdpo")
def _gdpo_summed(r: Tensor, eps: float = STD_EPS) -> Tensor:
    """`gdpo` of the summed reward alone (one component); `compute_advantages` passes each function's (`gdpo`)."""
    return gdpo(r.unsqueeze(-1), torch.ones(1, device=r.device), eps)


@register_advantage("grpo_passk")
def grpo_passk(r: Tensor, eps: float = STD_EPS) -> Tensor:
    """verl's `grpo_passk` (it cites arXiv 2503.19595): only each group's best completion (the first on ties) learns,
    with (r_max - r_second) / (std_group + 1e-4); every other completion gets 0."""
    top = torch.topk(r, 2, dim=1)
    out = torch.zeros_like(r)
    gap = (top.values[:, :1] - top.values[:, 1:2]) / (r.std(dim=1, keepdim=True) + eps)
    return out.scatter_(1, r.argmax(dim=1, keepdim=True), gap)


@register_advantage("passk")
def passk(r: Tensor, k: int = 4, eps: float = STD_EPS) -> Tensor:
    """Pass@k advantage, the analytic form of arXiv 2508.10751, generalised from 0/1 to any reward.

    A k-subset of the group scores the max reward in it. R = E[max] over all k-subsets, sigma its
    (population) std over them; completion i gets (E[max | i in subset] - R) / (sigma + 1e-4). For 0/1
    rewards with N_neg wrong of N this is the paper's A_pos = (1 - R) / sigma,
    A_neg = (1 - R - C(N_neg - 1, k - 1) / C(N - 1, k - 1)) / sigma, R = 1 - C(N_neg, k) / C(N, k);
    k = 1 is GRPO's (r - mean) / std with the population std.
    """
    n = r.shape[1]
    if not 1 <= k <= n:
        raise ConfigError(f"algo.passk_k must be in [1, group_size={n}], got {k}")

    def p_max(m: int, kk: int) -> Tensor:  # P(the max of a uniform kk-subset of m sorted values is the j-th smallest)
        return torch.tensor([math.comb(j - 1, kk - 1) for j in range(1, m + 1)], dtype=r.dtype,
                            device=r.device) / math.comb(m, kk)

    p = p_max(n, k)
    s = r.sort(dim=1).values
    mean = (s * p).sum(dim=1, keepdim=True)
    std = ((s * s * p).sum(dim=1, keepdim=True) - mean * mean).clamp(min=0.0).sqrt()
    if k == 1:
        cond = r
    else:  # E[max(r_i, max of the k-1 others)], the others a uniform (k-1)-subset of the remaining N-1
        q = p_max(n - 1, k - 1)
        cols = []
        for i in range(n):
            others = torch.cat([r[:, :i], r[:, i + 1:]], dim=1).sort(dim=1).values
            cols.append((torch.maximum(others, r[:, i:i + 1]) * q).sum(dim=1))
        cond = torch.stack(cols, dim=1)
    return (cond - mean) / (std + eps)


def _nanstd(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """The unbiased std of the non-NaN entries (TRL's `nanstd`): NaN where fewer than two are left."""
    mean = x.nanmean(dim=dim, keepdim=True)
    n = (~x.isnan()).sum(dim=dim, keepdim=keepdim)
    return ((x - mean) ** 2).nansum(dim=dim, keepdim=keepdim).div(n - 1).sqrt()


def gdpo(components: Tensor, weights: Tensor, eps: float = STD_EPS, whiten: str = "completions",
         lengths: Tensor | None = None) -> Tensor:
    """GDPO (arXiv 2601.05242; TRL's multi_objective_aggregation="normalize_then_sum", verl's `gdpo`), (n_groups, G, K)
    rewards of K functions -> (n_groups, G): each function's rewards normalised within the group, (r_k - mean) /
    (std + eps), summed with `weights`, then the sum normalised over the batch, (s - mean) / (std + eps) over
    completions (TRL) or whitened over tokens (`whiten="tokens"`, verl's masked_whiten, needs `lengths`).

    NaN (a function's None) is left out of its group's mean and std and of the sum (TRL's nanmean / nansum); a
    completion no function scored is left out of the batch's and gets 0. A function constant within a group
    contributes exactly 0 there, and a group where every function is constant gets exactly 0 (no signal; as GRPO's).
    """
    g = components.shape[1]
    mean = components.nanmean(dim=1, keepdim=True)
    std = _nanstd(components, dim=1, keepdim=True) if g > 1 else torch.zeros_like(mean)
    z = (components - mean) / (std + eps)
    scored = ~components.isnan()
    inf = torch.full_like(components, math.inf)
    hi = torch.where(scored, components, -inf).amax(dim=1, keepdim=True)
    lo = torch.where(scored, components, inf).amin(dim=1, keepdim=True)
    constant = hi <= lo  # (n_groups, 1, K): the function gave its group's scored rows one value (or scored none)
    z = torch.where(constant & scored, torch.zeros_like(z), z)
    s = (z * weights.to(z)).nansum(dim=-1)  # (n_groups, G); the weights on z's dtype and device
    none = ~scored.any(dim=-1)
    s = torch.where(none, torch.full_like(s, math.nan), s)
    if whiten == "tokens":
        if lengths is None:
            raise ValueError("whiten='tokens' needs the completions' lengths")
        keep = ~none.reshape(-1)
        flat_s = s.reshape(-1).clone()
        flat_s[keep] = whitened_over_tokens(flat_s[keep], lengths.reshape(-1)[keep])
        adv = flat_s.view_as(s)
    else:
        adv = (s - s.nanmean()) / (_nanstd(s) + eps)
    adv = torch.where(constant.squeeze(1).all(dim=-1, keepdim=True), torch.zeros_like(adv), adv)
    return adv.nan_to_num(nan=0.0)


# Estimators with a group baseline: a group whose rewards are all equal carries no signal, and its
# advantages are exactly 0 (a float32 group mean of equal values is not always that value: 8 x 0.1 sums
# to 0.8000001, so r - mean would be ~1e-8, and ~1e-4 once divided by std + 1e-4).
GROUP_BASELINED = frozenset({"grpo", "drgrpo", "rloo", "batch_std", "reinforce_plus_plus_baseline", "gpg",
                             "grpo_passk", "passk"})


def whitened_over_tokens(values: Tensor, lengths: Tensor, eps: float = 1e-8) -> Tensor:
    """(v - mean) / sqrt(var + eps) with each completion's value counted once per token (weights = lengths): what
    verl 0.9.1's `masked_whiten` computes on a per-token advantage that is one value per completion (Bessel's
    correction over tokens, eps inside the square root)."""
    w = lengths.to(values.dtype)
    n = w.sum()
    mean = (w * values).sum() / n
    var = (w * (values - mean) ** 2).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps)


def compute_advantages(name: str, rewards: Tensor, group_size: int, passk_k: int = 4, std_eps: float = STD_EPS,
                       whiten: str = "completions", lengths: Tensor | None = None, components: Tensor | None = None,
                       weights: Tensor | None = None) -> Tensor:
    """Advantages (N,) for group-contiguous rewards (N,) with G = group_size completions per prompt.

    passk_k: the k of the `passk` estimator (ignored by the others). The rewards are the WHOLE batch's:
    the batch-level estimators (`batch_std`, `reinforce_plus_plus*`, `gpg`'s alpha) normalise over all of
    them, so under several ranks the trainer gathers every rank's rewards first and keeps its own rows.
    std_eps: added to every std (`algo.std_eps`; gspo 1e-4 as TRL, verl 1e-6). whiten: the REINFORCE++
    estimators normalise over completions (gspo) or, `tokens`, over tokens as verl 0.9.1 does (needs the
    completions' `lengths`). components (N, K), weights (K,): `gdpo`'s rewards of each function and their weights
    (None: the rewards as the one component).
    """
    if name not in ADVANTAGES:
        raise ConfigError(f"unknown advantage estimator {name!r}; valid: {', '.join(advantage_names())}")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if group_size < 2 and name in ("grpo", "rloo", "grpo_passk"):
        raise ConfigError(f"advantage {name!r} needs group_size >= 2 (a std / a leave-one-out mean), got {group_size}")
    if name in ("batch_std", "reinforce_plus_plus", "reinforce_plus_plus_baseline") and rewards.numel() < 2:
        raise ValueError(f"advantage {name!r} needs at least 2 rewards for a batch std")
    r = rewards.to(torch.get_default_dtype() if not rewards.is_floating_point() else rewards.dtype)
    grouped = r.view(-1, group_size)
    fn = ADVANTAGES[name]
    if whiten == "tokens" and name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        if lengths is None:
            raise ValueError("whiten='tokens' needs the completions' lengths")
        centred = grouped if name == "reinforce_plus_plus" else grouped - grouped.mean(dim=1, keepdim=True)
        adv = whitened_over_tokens(centred.reshape(-1), lengths).view_as(grouped)
    elif name == "passk":
        adv = passk(grouped, passk_k, std_eps)
    elif name == "gdpo":
        comps = grouped.unsqueeze(-1) if components is None else components.to(r.dtype).view(*grouped.shape, -1)
        w = torch.ones(comps.shape[-1]) if weights is None else torch.as_tensor(weights)
        if w.numel() != comps.shape[-1]:
            raise ValueError(f"gdpo: {w.numel()} weights for {comps.shape[-1]} reward components")
        adv = gdpo(comps, w, std_eps, whiten, None if lengths is None else lengths.view_as(grouped))
    else:
        adv = fn(grouped, eps=std_eps) if "eps" in inspect.signature(fn).parameters else fn(grouped)
    if name in GROUP_BASELINED:
        adv = torch.where((grouped == grouped[:, :1]).all(dim=1, keepdim=True), torch.zeros_like(adv), adv)
    return adv.reshape(-1)
