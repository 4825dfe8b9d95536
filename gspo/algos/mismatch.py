"""The sampler/trainer mismatch: how far the log-probs recorded while sampling are from the
trainer's own forward pass, and the corrections for it (one registry, `CORRECTIONS`).

Sampling (a KV-cache decode, one token at a time) and training (one full forward) run the
same weights through different kernels, so in bf16 they disagree slightly; with an
inference engine (vLLM, SGLang) they disagree more. The tokens were drawn from the
sampler's distribution mu, while the loss's ratio is taken against the trainer's pi_old.
TIS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training",
2025; TRL's `vllm_importance_sampling_correction`, verl's rollout IS) reweights each
token's policy term by min(pi_old / mu, C), or each sequence's by min(prod_t pi_old / mu, C).

Notation: trainer = pi_old's log-probs of the sampled tokens (the old-policy pass),
sampler = mu's (recorded while sampling), mask (B, T) on completion tokens, and
rho_t = pi_old(y_t) / mu(y_t) the per-token sampler/trainer ratio.

The corrections, each a small function of a `MismatchBatch` returning a (B, T) weight that
multiplies the policy term (0 = masked) and what it did, named as the peers name them:

  tis_token        min(rho_t, C)                           TIS (Yao et al. 2025); verl rollout_is=token,
                                                           TRL vllm_importance_sampling_mode=token_truncate
  tis_sequence     min(prod_t rho_t, C)                    verl rollout_is=sequence; TRL sequence_truncate
  mask_token       1[a <= rho_t <= b], default [0.5, 5]    masked IS / IcePop (arXiv 2510.18855); verl
                                                           rollout_rs=token; TRL token_mask
  mask_geometric   1[lo <= exp(mean_t log rho_t) <= hi],   geometric sequence masking; verl rollout_rs=seq_mean_k1
                   default [0.99, 1.01]                    (decoupled_geo_rs); SkyRL sequence_mask_metric=geometric
  mask_sequence    1[lo <= prod_t rho_t <= hi],            sequence masking on the whole ratio; verl rollout_rs=
                   default [0.5, 2]                        seq_sum_k1 (decoupled_seq_is_rs); SkyRL product; TRL
                                                           sequence_mask (with tis=sequence)
  mask_outlier     1[lo <= rho_t <= hi for every t],       a sequence with one outlier token dropped whole; SkyRL
                   default [0.5, 5]                        outlier_token_is_threshold_low/high
  mask_offpolicy   0 where A < 0 and mean_t log(mu/pi_theta) > delta: DeepSeek-V3.2's off-policy sequence
                   masking (its technical report, Eq. 9), against the policy being updated (per minibatch)

A TIS weight and masks combine by multiplication (`rollout.tis` + `rollout.mask` +
`rollout.offpolicy_mask_delta`); `active` lists what a config turns on.

top_p < 1: the sampler records each token's log-prob BEFORE the nucleus cut (as the trainer
computes its own, over the whole vocabulary), so the kept mass Z cancels from rho. The peers'
bias (TRL #6789 / #7269: an engine's log-prob renormalised over the kept support S against the
trainer's full-vocabulary one gives rho ~ Z, ~0.9 at top_p 0.8) cannot arise. Against the
ratio on S with both sides renormalised there, rho_S = rho * mu(S) / pi_old(S), and
pi_old(S) / mu(S) is the mu-weighted mean of rho over S: the two differ by a factor within the
ratios' own range, never by the kept mass. `rollout/top_p_kept_mass` logs Z.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

TIS_LEVELS = ("none", "token", "sequence")
# the peers' defaults: IcePop's; SkyRL's geo_mask; verl's decoupled_seq_is_rs and SkyRL's product_mask; SkyRL has none
# for its outlier mask, so the token mask's
MASK_DEFAULTS = {"token": (0.5, 5.0), "geometric": (0.99, 1.01), "sequence": (0.5, 2.0), "outlier": (0.5, 5.0)}


@torch.no_grad()
def mismatch_metrics(trainer: Tensor, sampler: Tensor, mask: Tensor,
                     kept_mass: Optional[Tensor] = None) -> dict[str, float]:
    """`rollout/logprob_abs_diff_{mean,max}` per token, `rollout/mismatch_kl` (k3 estimate of
    KL(mu || pi_old) per token), `rollout/seq_logratio_abs_mean` (mean over sequences of
    |mean_t log pi_old/mu|: how far GSPO's length-normalised sequence ratio sits from 1 before any
    update), `rollout/ratio_min|max` (extremes of rho_t = pi_old/mu) and, given the sampler's
    nucleus kept mass (B, T), `rollout/top_p_kept_mass` (its mean over tokens).

    Under NeMo-RL's names, as its ClippedPGLossFn computes them (nemo_rl/algorithms/loss/loss_functions.py):
    `rollout/token_mult_prob_error` = mean_t exp(|log mu - log pi_old|) (1 when they agree) and
    `rollout/gen_kl_error` = mean_t of its k3 KL(P_gen || P_train) = exp(log pi_old - log mu) - 1 - (log pi_old -
    log mu), the same number as `rollout/mismatch_kl`."""
    m = mask.bool()
    d = (trainer - sampler).float()  # log pi_old/mu per token
    if not m.any():
        return {}
    diff = d[m].abs()
    k3 = torch.exp(d) - 1 - d  # E_mu[r - 1 - log r], r = pi_old/mu: an unbiased, non-negative KL(mu || pi_old)
    lens = mask.sum(-1)
    has = lens > 0
    seq = ((d * mask).sum(-1)[has] / lens[has]).abs()
    out = {
        "rollout/logprob_abs_diff_mean": float(diff.mean()),
        "rollout/logprob_abs_diff_max": float(diff.max()),
        "rollout/mismatch_kl": float(k3[m].mean()),
        "rollout/seq_logratio_abs_mean": float(seq.mean()),
        "rollout/ratio_min": float(d[m].min().exp()),
        "rollout/ratio_max": float(d[m].max().exp()),
        "rollout/token_mult_prob_error": float(diff.exp().mean()),
    }
    out["rollout/gen_kl_error"] = out["rollout/mismatch_kl"]
    if kept_mass is not None:
        out["rollout/top_p_kept_mass"] = float(kept_mass[m].mean())
    return out


@torch.no_grad()
def routing_mismatch(sampler_idx: Tensor, trainer_idx: Tensor, mask: Tensor) -> float:
    """Share of (token, MoE layer) top-k expert SETS that differ between two passes on the same tokens.

    sampler_idx, trainer_idx: (B, T, L, k) expert ids (-1: not routed); mask (B, T). The R3 paper's
    measure of router disagreement between an inference engine and the trainer (arXiv 2510.11370).
    Slot order does not matter; (token, layer) pairs not routed in either pass are left out.
    """
    valid = mask.bool()[..., None] & (sampler_idx >= 0).all(-1) & (trainer_idx >= 0).all(-1)  # (B, T, L)
    same = (sampler_idx[..., :, None] == trainer_idx[..., None, :]).any(-1).all(-1)  # every expert found
    n = valid.sum()
    return float((~same & valid).sum() / n) if n else 0.0


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


# --------------------------------------------------------------------------- corrections


@dataclass
class MismatchBatch:
    """What a correction sees, all (B, T) but `advantages` (B,): log-probs of the sampled tokens."""

    trainer: Tensor  # log pi_old (the old-policy pass; = sampler with rollout.old_logprobs=sampler)
    sampler: Tensor  # log mu, recorded while sampling
    mask: Tensor  # 1 on the completion tokens the loss counts
    advantages: Tensor  # (B,)
    current: Optional[Tensor] = None  # log pi_theta of the policy being updated, detached (per minibatch)

    def log_rho(self) -> Tensor:
        """log rho_t = log pi_old/mu, 0 on padding."""
        return torch.where(self.mask.bool(), (self.trainer - self.sampler).float(), 0.0)

    def seq_mean(self, x: Tensor) -> Tensor:
        """(B,) mean over each sequence's tokens of x (B, T); 0 for an empty row."""
        return (x * self.mask).sum(-1) / self.mask.sum(-1).clamp(min=1)


def _bounds(r: Any) -> tuple[float, float]:
    lo, hi = MASK_DEFAULTS[r.mask]
    return (lo if r.mask_low is None else float(r.mask_low)), (hi if r.mask_high is None else float(r.mask_high))


def _on_tokens(w: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), w, torch.ones_like(w))


def _share(dropped: Tensor, counted: Tensor) -> float:
    n = counted.sum()
    return float((dropped & counted).sum() / n) if n else 0.0


def tis_token(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    w = tis_weights(x.trainer, x.sampler, x.mask, "token", r.tis_cap)
    return w, {"rollout/tis_weight_mean": float(w[x.mask.bool()].mean()) if x.mask.any() else 1.0}


def tis_sequence(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    w = tis_weights(x.trainer, x.sampler, x.mask, "sequence", r.tis_cap)
    return w, {"rollout/tis_weight_mean": float(w[x.mask.bool()].mean()) if x.mask.any() else 1.0}


def mask_token(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    """Masked IS / IcePop: a token counts only while a <= rho_t <= b."""
    lo, hi = _bounds(r)
    rho = x.log_rho().exp()
    keep = (rho >= lo) & (rho <= hi)
    return _on_tokens(keep.float(), x.mask), {"rollout/mask_token_frac": _share(~keep, x.mask.bool())}


def mask_geometric(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    """Geometric sequence masking: a sequence counts only while lo <= exp(mean_t log rho_t) <= hi."""
    lo, hi = _bounds(r)
    g = x.seq_mean(x.log_rho()).exp()
    keep = (g >= lo) & (g <= hi)
    has = x.mask.sum(-1) > 0
    return _on_tokens(keep[:, None].float().expand_as(x.mask), x.mask), {"rollout/mask_geometric_frac": _share(~keep, has)}


def mask_sequence(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    """Sequence masking on the whole ratio: a sequence counts only while lo <= prod_t rho_t <= hi."""
    lo, hi = _bounds(r)
    log_w = (x.log_rho() * x.mask).sum(-1)
    keep = (log_w >= math.log(lo) if lo > 0 else torch.ones_like(log_w, dtype=torch.bool)) & (log_w <= math.log(hi))
    has = x.mask.sum(-1) > 0
    weight = _on_tokens(keep[:, None].float().expand_as(x.mask), x.mask)
    return weight, {"rollout/mask_sequence_frac": _share(~keep, has)}


def mask_outlier(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    """SkyRL's outlier-token mask: a sequence counts only while every one of its tokens has lo <= rho_t <= hi."""
    lo, hi = _bounds(r)
    rho = x.log_rho().exp()
    bad = ((rho < lo) | (rho > hi)) & x.mask.bool()
    keep = ~bad.any(-1)
    has = x.mask.sum(-1) > 0
    return _on_tokens(keep[:, None].float().expand_as(x.mask), x.mask), {"rollout/mask_outlier_frac": _share(~keep, has)}


def mask_offpolicy(x: MismatchBatch, r: Any) -> tuple[Tensor, dict[str, float]]:
    """DeepSeek-V3.2 off-policy sequence masking: drop a sequence with A < 0 whose mean_t log(mu/pi_theta) > delta."""
    if x.current is None:
        raise ValueError("mask_offpolicy needs the current policy's log-probs (MismatchBatch.current)")
    far = x.seq_mean(torch.where(x.mask.bool(), (x.sampler - x.current).float(), 0.0)) > float(r.offpolicy_mask_delta)
    drop = far & (x.advantages < 0)
    has = x.mask.sum(-1) > 0
    return _on_tokens((~drop)[:, None].float().expand_as(x.mask), x.mask), {"rollout/mask_offpolicy_frac": _share(drop, has)}


CORRECTIONS: dict[str, Callable[[MismatchBatch, Any], tuple[Tensor, dict[str, float]]]] = {
    "tis_token": tis_token,
    "tis_sequence": tis_sequence,
    "mask_token": mask_token,
    "mask_geometric": mask_geometric,
    "mask_sequence": mask_sequence,
    "mask_outlier": mask_outlier,
    "mask_offpolicy": mask_offpolicy,
}


def active(r: Any) -> list[str]:
    """The corrections the rollout config `r` turns on, in the order they multiply."""
    names = [f"tis_{r.tis}"] if r.tis != "none" else []
    if r.mask != "none":
        names.append(f"mask_{r.mask}")
    if r.offpolicy_mask_delta is not None:
        names.append("mask_offpolicy")
    return names


def correction_weights(names: list[str], x: MismatchBatch, r: Any) -> tuple[Optional[Tensor], dict[str, float]]:
    """The product of the named corrections' weights (B, T) (None when none is on) and their stats."""
    weight, stats = None, {}
    for name in names:
        w, s = CORRECTIONS[name](x, r)
        weight = w if weight is None else weight * w
        stats |= s
    return weight, stats
