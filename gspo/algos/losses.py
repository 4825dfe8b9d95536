"""Policy losses for group-based RL on language models: pure tensor math.

    loss, stats = policy_loss(name, logp, old_logp, advantages, mask, **hyper)

Shapes: logp, old_logp, mask (B, T) over completion tokens (mask 1 on tokens,
0 on padding; rows may have different lengths); advantages (B,) per sequence or
(B, T) per token. Notation follows design.md section 3: d_t = logp_t - old_logp_t,
|y_i| = sum_t m_{i,t}, sg = stop-gradient, A the advantage.

Every loss below is one short function that returns the per-token OBJECTIVE
J_{i,t} (B, T) to maximise (a per-sequence quantity is broadcast to all of that
sequence's tokens), the ratio as the algorithm defines it, and where its clip
was active. `policy_loss` negates the objective, adds beta * KL per token and
reduces with `aggregate` -- the single place where tokens become a scalar, so a
loss cannot silently ignore the aggregation it is given.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch
from torch import Tensor

from gspo.algos.kl import kl_penalty
from gspo.config.checks import CHOICES, check_keys
from gspo.config.schema import AlgoConfig
from gspo.core.errors import ConfigError

AGG_MODES = tuple(m for m in CHOICES["algo.agg"] if m is not None)  # the schema's, None (the loss's own) aside
LOG_1E8 = math.log(1e-8)  # VESPO's floor on its log sequence weight (TRL's clamp)


_ALGO = AlgoConfig()  # the schema's defaults: a setting read from `algo.<name>` has its default there, and only there


@dataclass(frozen=True)
class Hyper:
    """Keyword hyper-parameters of `policy_loss` (one set for every loss; each uses what it needs).

    A field named as a key of `algo` (ALGO_KEYS) is that key: its meaning, default and allowed values are the
    schema's (gspo/config/schema.py, gspo/config/checks.py). The others come from the batch or the trainer.
    """

    eps_low: float = _ALGO.eps_low  # ratio clipped below at 1 - eps_low (GMPO: log-ratio at -eps_low)
    eps_high: float = _ALGO.eps_high  # ratio clipped above at 1 + eps_high (GMPO: log-ratio at +eps_high)
    clip_ratio_c: Optional[float] = _ALGO.clip_ratio_c  # dual clip for A < 0 (arXiv 1912.09729); None = off
    delta: Optional[float] = _ALGO.delta  # two-sided clip (INTELLECT-2): unclipped ratio capped at delta; None: off
    agg: Optional[str] = _ALGO.agg  # aggregation override; None = the loss's own
    max_tokens: Optional[int] = None  # seq_mean_token_sum_norm constant (Dr. GRPO: generation cap)
    tau_pos: float = _ALGO.tau_pos  # SAPO gate temperature for A > 0
    tau_neg: float = _ALGO.tau_neg  # SAPO gate temperature for A <= 0
    ref_logp: Optional[Tensor] = None  # (B, T) reference-model log-probs for the KL term
    beta: float = _ALGO.beta  # KL coefficient; 0 = no KL term
    kl_estimator: str = _ALGO.kl_estimator  # k1 | k2 | k3
    router_shift: Optional[Tensor] = None  # (B, T) RSPO router-shift factor; None = ones
    router_shift_floor: float = _ALGO.router_shift_floor  # RSPO lower bound of the factor
    is_weight: Optional[Tensor] = None  # (B, T) truncated IS weights of the sampler/trainer mismatch (TIS); None = ones
    keep: Optional[Tensor] = None  # (B, T) 0/1: the tokens the policy term trains on (top_entropy_quantile); None = all
    clip_cov_ratio: float = _ALGO.clip_cov_ratio  # Clip-Cov: share of tokens whose gradient is cut (at least one)
    clip_cov_lb: float = _ALGO.clip_cov_lb  # Clip-Cov: only tokens with covariance in (lb, ub) are candidates
    clip_cov_ub: float = _ALGO.clip_cov_ub
    kl_cov_ratio: float = _ALGO.kl_cov_ratio  # KL-Cov: share of tokens (top covariance, at least one) given |d_t|
    kl_cov_coef: float = _ALGO.kl_cov_coef  # KL-Cov: coefficient of that penalty
    generator: Optional[torch.Generator] = None  # Clip-Cov's random pick (a CPU generator); None = torch's global one
    # every process's values of a (M,) tensor of this process's tokens, concatenated in rank order, and where this
    # process's begin (`Dist.all_gather_rows`): the batch statistics of M2PO, Clip-Cov and KL-Cov are over the
    # minibatch of every rank, as one process computes them; None = this process's tokens are the minibatch's
    gather: Optional[Callable[[Tensor], tuple[Tensor, int]]] = None
    topk_old_logp: Optional[Tensor] = None  # (B, T, k) DPPO top-k: the sampler's log-probs of its k most likely tokens
    topk_logp: Optional[Tensor] = None  # (B, T, k) the policy's log-probs of the same tokens (no grad needed)
    topk_divergence: str = _ALGO.topk_divergence  # DPPO top-k: tv | kl
    vespo_k_pos: float = _ALGO.vespo_k_pos  # VESPO: power k of the Gamma kernel for A >= 0 (the paper's c1)
    vespo_lambda_pos: float = _ALGO.vespo_lambda_pos  # VESPO: decay lambda for A >= 0 (the paper's c2)
    vespo_k_neg: float = _ALGO.vespo_k_neg  # VESPO: k for A < 0
    vespo_lambda_neg: float = _ALGO.vespo_lambda_neg  # VESPO: lambda for A < 0
    dro_beta: float = _ALGO.dro_beta  # DRO: coefficient of the quadratic log-ratio penalty (verl's dro_beta)
    m2_threshold: float = _ALGO.m2_threshold  # M2PO: the mean squared log-ratio the kept tokens may have


HYPER_NAMES = tuple(f.name for f in fields(Hyper))
ALGO_KEYS = tuple(n for n in HYPER_NAMES if hasattr(_ALGO, n))  # the fields that are `algo.<same name>`


@dataclass
class Terms:
    """What a loss function hands back to `policy_loss` (all (B, T))."""

    objective: Tensor  # J_{i,t}, maximised; carries the gradient
    ratio: Tensor  # the algorithm's ratio, for policy/ratio_* stats
    clip_low: Tensor  # bool: A < 0 side clipped (gradient cut / weight capped)
    clip_high: Tensor  # bool: A > 0 side clipped
    clip_dual: Optional[Tensor] = None  # bool: dual clip active (A < 0, ratio > c); DPPO: IS weight truncated at c
    clip_cov: Optional[Tensor] = None  # bool: Clip-Cov / KL-Cov picked the token (gradient cut / penalised)


LossFn = Callable[[Tensor, Tensor, Tensor, Tensor, Hyper], Terms]


@dataclass(frozen=True)
class LossSpec:
    fn: LossFn
    agg: str  # default aggregation (the paper's)
    seq_ratio: bool  # one ratio per sequence: token_mean would weight sequences by length
    ppo_clip: bool  # PPO's min(r A, clip(r) A) (`_ppo_clip`): the losses the two-sided clip `delta` applies to
    settings: tuple[str, ...] = ()  # the loss's own keys: fields of `Hyper`, read from `algo.<same name>`
    is_weight_in_ratio: bool = False  # the mismatch weight enters the loss's own ratio (VESPO), not multiplies it
    # what it reads from the batch beyond log-probs, advantages and mask (the trainer computes it for such a loss only)
    topk: bool = False  # the sampler's top-k log-probs and the policy's of those tokens (rollout.keep_topk)
    router_shift: bool = False  # the MoE router-shift factor (`Hyper.router_shift`; RSPO)


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, agg: str, seq_ratio: bool = False, ppo_clip: bool = False,
                  settings: tuple[str, ...] = (), is_weight_in_ratio: bool = False, topk: bool = False,
                  router_shift: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator: add a loss to the registry under `name` with its default aggregation; `ppo_clip`: its objective
    is PPO's clipped one (`_ppo_clip`), which the two-sided clip `delta` acts on; `settings`: the `algo` keys
    only this loss reads (fields of `Hyper` named as in ALGO_KEYS; `hyper_of` passes them, and a command line that
    sets one for another loss is told it would be ignored); `is_weight_in_ratio`: the loss folds the mismatch
    corrections' weight (`Hyper.is_weight`) into its own ratio instead of being multiplied by it; `topk`,
    `router_shift`: what it reads from the batch (LossSpec), which the trainer and the checks ask here."""
    if agg not in AGG_MODES:
        raise ValueError(f"loss {name!r}: unknown aggregation {agg!r}; valid: {', '.join(AGG_MODES)}")
    unknown = [k for k in settings if k not in ALGO_KEYS]
    if unknown:
        raise ValueError(f"loss {name!r}: settings {unknown} are not algo keys that are fields of Hyper")

    def decorator(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered (by {LOSSES[name].fn.__name__})")
        LOSSES[name] = LossSpec(fn, agg, seq_ratio, ppo_clip, tuple(settings), is_weight_in_ratio, topk, router_shift)
        return fn

    return decorator


def loss_names() -> list[str]:
    """Names of every registered loss, sorted."""
    return sorted(LOSSES)


def clipped_losses() -> list[str]:
    """The losses whose objective is PPO's clipped one (the ones `delta` applies to), sorted."""
    return sorted(n for n, spec in LOSSES.items() if spec.ppo_clip)


def get_loss(name: str) -> LossSpec:
    """The registry entry for `name`; ValueError (ConfigError) listing valid names otherwise."""
    if name not in LOSSES:
        raise ConfigError(f"unknown policy loss {name!r}; valid: {', '.join(loss_names())}")
    return LOSSES[name]


def readers(setting: str) -> list[str]:
    """The losses that name `setting` (an `algo` key) among their own settings, sorted ([] for a shared key)."""
    return sorted(n for n, spec in LOSSES.items() if setting in spec.settings)


def hyper_of(algo) -> dict:
    """The `policy_loss` keywords an `algo` config gives its loss `algo.loss`: the keys every loss shares and the
    loss's own settings, each read from `algo.<same name>` (the trainer adds what comes from elsewhere)."""
    spec = get_loss(algo.loss)
    return {k: algo[k] for k in ALGO_KEYS if k in spec.settings or not readers(k)}


def check_hyper(name: str, hyper: dict) -> None:
    """Refuse, in one line, `hyper` that loss `name` cannot take: the schema's rules for the `algo` keys among them
    (gspo/config/checks.py, the ones a config is checked with), and the two-sided clip on a loss without PPO's clip.
    `gspo.train.preflight.check` runs it on a config, `policy_loss` on its arguments."""
    check_keys({f"algo.{k}": v for k, v in hyper.items() if k in ALGO_KEYS})
    delta = hyper.get("delta")
    if delta is not None and not get_loss(name).ppo_clip:
        raise ConfigError(f"algo.delta={delta} caps the unclipped ratio of PPO's clipped objective, which "
                          f"algo.loss={name} does not have: delta acts on a PPO clip and loss {name!r} has none. "
                          f"It applies to {', '.join(clipped_losses())}")


# --------------------------------------------------------------------------- aggregation


def aggregate(per_token: Tensor, mask: Tensor, mode: str, max_tokens: Optional[int] = None) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar over the tokens where mask is 1.

    seq_mean_token_mean      (1/#seqs) sum_i (1/|y_i|) sum_t m x   (GRPO, GSPO); rows with no token are left out
    token_mean               sum_{i,t} m x / sum_{i,t} m           (DAPO): every token weighs the same
    seq_mean_token_sum_norm  sum_{i,t} m x / (B * max_tokens)      (Dr. GRPO): a constant, so no length bias
    seq_mean_token_sum       (1/#seqs) sum_i sum_t m x             (LUSPO; verl's seq-mean-token-sum): a sequence's
                                                                   tokens summed, so a per-sequence term weighs |y_i|

    Each mode is a sum over rows divided by `aggregate_denominator`, which is what lets
    several processes split a minibatch by rows and still compute this one loss.
    """
    m = mask.to(per_token.dtype)
    x = torch.where(m > 0, per_token, torch.zeros_like(per_token))  # padding may hold anything
    if mode == "seq_mean_token_mean":
        x = x / m.sum(dim=1, keepdim=True).clamp(min=1.0)  # each sequence's token mean
    return x.sum() / aggregate_denominator(mask, mode, max_tokens).to(per_token.dtype)


def aggregate_denominator(mask: Tensor, mode: str, max_tokens: Optional[int] = None, clamp: bool = True) -> Tensor:
    """What `aggregate` divides its row sum by: #sequences with a token, #tokens, or B * max_tokens.

    Clamped to >= 1 (an empty batch's loss is 0, not NaN); `clamp=False` gives the true count, which
    is what several ranks add up (a rank with no tokens adds 0, not 1: distributed.Dist.loss_scale).
    """
    m = mask.to(torch.float32)
    lo = 1.0 if clamp else 0.0
    if mode == "token_mean":
        return m.sum().clamp(min=lo)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return (m.sum(dim=1) > 0).sum().to(torch.float32).clamp(min=lo)
    if mode == "seq_mean_token_sum_norm":
        if max_tokens is None or max_tokens <= 0:
            raise ConfigError(
                "agg 'seq_mean_token_sum_norm' (Dr. GRPO) needs max_tokens > 0: the generation length cap"
            )
        return torch.tensor(float(mask.shape[0] * max_tokens), device=mask.device)
    raise ConfigError(f"unknown aggregation {mode!r}; valid: {', '.join(AGG_MODES)}")


# --------------------------------------------------------------------------- shared pieces


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B,): mean over each row's completion tokens (0 for an empty row)."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def _ppo_clip(ratio: Tensor, adv: Tensor, h: Hyper) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """PPO's clipped surrogate (arXiv 1707.06347) with the asymmetric range, plus optional dual clip.

    J = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); dual clip: J = max(J, c A) where A < 0.
    The clipped branch is a constant, so its tokens get no gradient: with A > 0 when r > 1 + eps_high,
    with A < 0 when r < 1 - eps_low (and, dual, when r > c).
    Two-sided clip (INTELLECT-2, arXiv 2505.07291; TRL's `delta`): J = min(min(r, delta) A, clip(r) A), the
    unclipped ratio capped at delta for every sign of A, as TRL computes it. With delta > 1 + eps_high
    (TRL's advice) it changes only A < 0 tokens with r > delta, whose J becomes delta A: the dual clip at
    c = delta. Its tokens are counted with the dual clip's.
    """
    clipped = ratio.clamp(1.0 - h.eps_low, 1.0 + h.eps_high)
    unclipped = ratio if h.delta is None else ratio.clamp(max=h.delta)
    objective = torch.minimum(unclipped * adv, clipped * adv)
    r = ratio.detach()
    dual = None
    if h.clip_ratio_c is not None:
        # Unbounded r with A < 0 makes -rA arbitrarily large; cap the loss at -cA (Ye et al. 2019).
        objective = torch.where(adv < 0, torch.maximum(objective, h.clip_ratio_c * adv), objective)
        dual = (adv < 0) & (r > h.clip_ratio_c)
    if h.delta is not None:
        capped = (adv < 0) & (r > h.delta)
        dual = capped if dual is None else dual | capped
    return objective, (adv < 0) & (r < 1.0 - h.eps_low), (adv > 0) & (r > 1.0 + h.eps_high), dual


def _no_clip(x: Tensor) -> Tensor:
    return torch.zeros_like(x, dtype=torch.bool)


# --------------------------------------------------------------------------- the losses


@register_loss("grpo", agg="seq_mean_token_mean", ppo_clip=True)
def grpo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """GRPO, DeepSeekMath arXiv 2402.03300 §4.1: PPO clip on per-token ratios, per-sequence mean."""
    w = torch.exp(logp - old_logp)  # w_{i,t} = pi(y_t) / pi_old(y_t)
    objective, low, high, dual = _ppo_clip(w, adv, h)  # min(w A, clip(w, 1-el, 1+eh) A)
    return Terms(objective, w, low, high, dual)


# DAPO (arXiv 2503.14476) and Dr. GRPO (arXiv 2503.20783) keep GRPO's token ratio and PPO clip;
# they differ in aggregation (token mean; tokens summed over the constant B * max_tokens) and
# in their presets (clip-higher 0.2/0.28; mean-centred advantage), so they reuse its function.
register_loss("dapo", agg="token_mean", ppo_clip=True)(grpo)
register_loss("dr_grpo", agg="seq_mean_token_sum_norm", ppo_clip=True)(grpo)


@register_loss("gspo", agg="seq_mean_token_mean", seq_ratio=True, ppo_clip=True)
def gspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """GSPO, arXiv 2507.18071: one length-normalised ratio per sequence, clipped per sequence."""
    # s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(sum_t m_t d_t / |y_i|), broadcast (B,) -> (B, T)
    s = torch.exp(_seq_mean(logp - old_logp, mask)).unsqueeze(1).expand_as(logp)
    objective, low, high, dual = _ppo_clip(s, adv, h)  # min(s_i A_i, clip(s_i, 1-el, 1+eh) A_i)
    return Terms(objective, s, low, high, dual)


# LUSPO, arXiv 2602.05261 (TRL's loss_type="luspo"): GSPO's objective with each sequence's term summed over its
# tokens instead of averaged, i.e. weighted by its length |y_i|. Under GSPO's per-sequence mean a long completion's
# gradient is divided by its length, which the paper finds shortens responses (up to collapse); LUSPO undoes that.
register_loss("luspo", agg="seq_mean_token_sum", seq_ratio=True, ppo_clip=True)(gspo)


@register_loss("gspo_token", agg="seq_mean_token_mean", seq_ratio=True, ppo_clip=True)
def gspo_token(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """GSPO-token, arXiv 2507.18071 §4.3: GSPO's ratio value, per-token advantages allowed."""
    # s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t)): equals s_i in value, d s_{i,t} = s_i d logp_t
    log_s = _seq_mean(logp - old_logp, mask).detach().unsqueeze(1)
    s_t = torch.exp(log_s + logp - logp.detach())
    objective, low, high, dual = _ppo_clip(s_t, adv, h)
    return Terms(objective, s_t, low, high, dual)


@register_loss("rloo", agg="seq_mean_token_mean", seq_ratio=True, ppo_clip=True)
def rloo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """TRL's RLOOTrainer loss (trl 1.16 `RLOOTrainer._compute_loss`): PPO's clip on the ratio of the whole
    completion's probability, w_i = pi(y_i) / pi_old(y_i) = exp(sum_t m_t d_t) (not length-normalised, unlike
    GSPO's), one objective per completion; with `seq_mean_token_mean` the loss is their mean over completions."""
    w = torch.exp(((logp - old_logp) * mask).sum(dim=1)).unsqueeze(1).expand_as(logp)
    objective, low, high, dual = _ppo_clip(w, adv, h)  # min(w_i A_i, clip(w_i, 1-el, 1+eh) A_i)
    return Terms(objective, w, low, high, dual)


@register_loss("gmpo", agg="seq_mean_token_mean", seq_ratio=True)
def gmpo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """GMPO, arXiv 2507.20673: geometric mean of token ratios, each clipped in log space by sgn(A).

    GMPO's advantage is per sequence: a (B, T) advantage is reduced to its mean over the row's tokens.
    """
    a = _seq_mean(adv, mask)  # A_i
    sgn = torch.sign(a).unsqueeze(1)
    d = logp - old_logp
    d_clip = d.clamp(-h.eps_low, h.eps_high)
    # A > 0: d capped at eps_high; A < 0: d floored at -eps_low (the PPO-pessimistic side only)
    d_min = sgn * torch.minimum(sgn * d, sgn * d_clip)
    ratio_i = torch.exp(_seq_mean(d_min, mask))  # (prod_t r_t^clipped)^(1/|y_i|)
    objective = (ratio_i * a).unsqueeze(1).expand_as(logp)  # J_i = ratio_i * A_i on every token
    ratio = torch.exp(_seq_mean(d, mask)).detach().unsqueeze(1).expand_as(logp)  # unclipped geo mean
    dd = d.detach()
    return Terms(objective, ratio, (sgn < 0) & (dd < -h.eps_low), (sgn > 0) & (dd > h.eps_high))


@register_loss("cispo", agg="token_mean")
def cispo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """CISPO, MiniMax-M1 arXiv 2506.13585: clip the stop-gradient IS weight, never drop a token."""
    w = torch.exp(logp - old_logp)
    w_hat = w.clamp(1.0 - h.eps_low, 1.0 + h.eps_high).detach()  # sg(clip(r_{i,t}, 1-el, 1+eh))
    objective = w_hat * adv * logp  # J = sg(r_hat) A log pi(y_t): REINFORCE with a capped IS weight
    wd = w.detach()
    return Terms(objective, wd, wd < 1.0 - h.eps_low, wd > 1.0 + h.eps_high)


@register_loss("sapo", agg="seq_mean_token_mean", settings=("tau_pos", "tau_neg"))
def sapo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """SAPO, arXiv 2511.20347: a soft sigmoid gate on the token ratio instead of a hard clip."""
    w = torch.exp(logp - old_logp)
    tau = torch.where(adv > 0, torch.full_like(adv, h.tau_pos), torch.full_like(adv, h.tau_neg))
    gate = torch.sigmoid(tau * (w - 1.0)) * (4.0 / tau)  # f(w) = sigma(tau (w - 1)) 4/tau; f'(1) = 1
    return Terms(gate * adv, w, _no_clip(w), _no_clip(w))  # J = f(w_{i,t}) A


@register_loss("rspo", agg="seq_mean_token_mean", ppo_clip=True, settings=("router_shift_floor",), router_shift=True)
def rspo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """RSPO, arXiv 2510.23027: GRPO's token ratio rescaled by the router-shift factor before clipping.

    RECONSTRUCTION: the paper describes a per-token router-shift ratio with stop-gradient and a
    lower floor that rescales importance ratios before clipping; its exact equation is not public in
    code, so this is w~ = w * max(sg(router_shift), floor) in GRPO's clip. router_shift=None -> GRPO.
    """
    rs = torch.ones_like(logp) if h.router_shift is None else h.router_shift.detach().to(logp.dtype)
    factor = torch.where(mask > 0, rs.clamp(min=h.router_shift_floor), torch.ones_like(rs))
    w = torch.exp(logp - old_logp) * factor  # w~_{i,t} = w_{i,t} * max(sg(gamma_{i,t}), floor)
    objective, low, high, dual = _ppo_clip(w, adv, h)
    return Terms(objective, w, low, high, dual)


@register_loss("nll", agg="seq_mean_token_mean")
def nll(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """Advantage-weighted log-likelihood J = A log pi(y_t): no ratio, no clip (RFT, reward-softmax baselines).

    policy/ratio_* still report exp(d_t), to show how far the update moved off the rollout policy.
    """
    w = torch.exp(logp - old_logp).detach()
    return Terms(adv * logp, w, _no_clip(w), _no_clip(w))


# GPG, arXiv 2504.02546: the plain policy gradient A log pi, averaged over all tokens; no ratio,
# no clip (the paper updates once per rollout batch). Its own part is the advantage (gspo.algos.advantages.gpg).
register_loss("gpg", agg="token_mean")(nll)


def _truncated_is(w: Tensor, h: Hyper) -> tuple[Tensor, Optional[Tensor]]:
    """sg(min(w, c)) with c = clip_ratio_c (None: no cap), and where the cap bit."""
    wd = w.detach()
    if h.clip_ratio_c is None:
        return wd, None
    return wd.clamp(max=h.clip_ratio_c), wd > h.clip_ratio_c


def _dppo(logp: Tensor, old_logp: Tensor, adv: Tensor, inside_pos: Tensor, inside_neg: Tensor, h: Hyper) -> Terms:
    """DPPO's masked policy gradient: J = M_t sg(min(w_t, c)) A log pi(y_t), M_t = 0 where the update left
    the trust region in the direction A pushes (A > 0: pi grew too much; A <= 0: pi shrank too much).

    Its gradient is the unclipped surrogate's, w A grad log pi, on the kept tokens (for w <= c).
    """
    w = torch.exp(logp - old_logp)
    w_bar, capped = _truncated_is(w, h)
    keep = torch.where(adv > 0, inside_pos, inside_neg)
    objective = keep.to(logp.dtype) * w_bar * adv * logp
    dual = None if capped is None else capped & keep
    return Terms(objective, w.detach(), ~keep & (adv < 0), ~keep & (adv > 0), dual)


@register_loss("pg_is", agg="token_mean")
def pg_is(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """REINFORCE with the sequence's truncated importance weight, verl's bypass_pg_is (rollout_correction loss_type=
    reinforce, rollout_is=sequence): J = sg(min(prod_t pi / pi_old, c)) A log pi(y_t), c = clip_ratio_c (verl's
    rollout_is_threshold, 2; None: no truncation), the sum of log-ratios clamped to [-20, 20] as verl's. In verl's
    bypass mode pi_old is the sampler's (rollout.old_logprobs=sampler). clip/frac_dual: tokens whose weight was cut."""
    w = torch.exp(((logp - old_logp) * mask).sum(dim=1, keepdim=True).clamp(-20.0, 20.0)).expand_as(logp)
    w_bar, capped = _truncated_is(w, h)
    return Terms(w_bar * adv * logp, w.detach(), _no_clip(w), _no_clip(w), capped)


@register_loss("dppo_tv", agg="seq_mean_token_sum_norm")
def dppo_tv(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """DPPO-Binary-TV, arXiv 2602.04879: trust region |pi(y_t) - pi_old(y_t)| (the binary TV) instead of the ratio.

    eps_high / eps_low are the TV thresholds: A > 0 tokens are masked once pi - pi_old > eps_high,
    A <= 0 tokens once pi - pi_old < -eps_low.
    """
    with torch.no_grad():
        dp = torch.exp(logp) - torch.exp(old_logp)
    return _dppo(logp, old_logp, adv, dp <= h.eps_high, dp >= -h.eps_low, h)


@register_loss("dppo_kl", agg="seq_mean_token_sum_norm")
def dppo_kl(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """DPPO-Binary-KL, arXiv 2602.04879: the trust region is the KL between the two Bernoulli distributions
    (y_t, not y_t) of pi_old and pi: D = p' log(p'/p) + (1 - p') log((1 - p')/(1 - p)), p' = pi_old(y_t).

    A > 0 tokens are masked where D > eps_high and pi grew; A <= 0 tokens where D > eps_low and pi shrank.
    """
    with torch.no_grad():
        p_old, p = torch.exp(old_logp), torch.exp(logp)
        # log(1 - p) as log(-expm1(log p)), exact near p = 1 (verl adds 1e-8 inside instead); xlogy: 0 log 0 = 0
        log1m = torch.log(-torch.expm1(logp))
        div = p_old * (old_logp - logp) + torch.xlogy(1 - p_old, 1 - p_old) - (1 - p_old) * log1m
        div = torch.where(p_old < 1, div, old_logp - logp)  # p_old = 1: D = -log p (avoids 0 * -inf)
    return _dppo(logp, old_logp, adv, (div <= h.eps_high) | (p <= p_old), (div <= h.eps_low) | (p >= p_old), h)


def topk_divergence(topk_old_logp: Tensor, topk_logp: Tensor, kind: str = "tv") -> Tensor:
    """(B, T) divergence between two distributions known on k tokens plus "the rest" (one bucket of 1 - their mass):
    P the sampler's (its top-k), Q the policy's on the same tokens. tv: (sum_i |p_i - q_i| + |p_rest - q_rest|) / 2;
    kl: KL(P || Q) = sum_i p_i log(p_i / q_i) + p_rest log(p_rest / q_rest). Masses clamped at 1e-12, as the
    authors' code (sail-sg/Stable-RL, verl/workers/actor/utils.py) does."""
    p, q = topk_old_logp.exp(), topk_logp.exp()
    p_rest = (1.0 - p.sum(-1)).clamp(min=1e-12)
    q_rest = (1.0 - q.sum(-1)).clamp(min=1e-12)
    if kind == "tv":
        return ((p - q).abs().sum(-1) + (p_rest - q_rest).abs()) / 2.0
    if kind == "kl":
        return (p * (topk_old_logp - topk_logp)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    raise ConfigError(f"topk_divergence={kind!r}: must be tv or kl")


@register_loss("dppo_topk", agg="seq_mean_token_sum_norm", settings=("topk_divergence",), topk=True)
def dppo_topk(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """DPPO-TopK, arXiv 2602.04879: the trust region is the divergence (TV or KL, `topk_divergence`) between the
    sampler's distribution on its top-k tokens plus the rest and the policy's on the same buckets
    (`topk_divergence()`), a closer approximation of the full divergence than the binary one of dppo_tv/dppo_kl.

    A > 0 tokens are masked where D > eps_high and pi(y_t) grew; A <= 0 tokens where D > eps_low and it shrank.
    Needs `topk_old_logp` and `topk_logp` (the rollout's rollout.keep_topk).
    """
    if h.topk_old_logp is None or h.topk_logp is None:
        raise ConfigError("loss dppo_topk needs topk_old_logp and topk_logp: the sampler's top-k (rollout.keep_topk)")
    with torch.no_grad():
        div = topk_divergence(h.topk_old_logp.float(), h.topk_logp.float(), h.topk_divergence)
        grew, shrank = logp > old_logp, logp < old_logp
    return _dppo(logp, old_logp, adv, ~((div > h.eps_high) & grew), ~((div > h.eps_low) & shrank), h)


def _every(x: Tensor, h: Hyper) -> tuple[Tensor, int]:
    """Every process's values of this process's (M,) token values `x` (one process: `x`), and where its begin."""
    return h.gather(x) if h.gather is not None else (x, 0)


def _token_cov(logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Tensor:
    """(A_t - mean A) (log pi_t - mean log pi) per token, means over the minibatch's tokens of every process
    (arXiv 2505.22617)."""
    m = mask > 0
    lp = logp.detach()
    both, _ = _every(torch.stack([adv.expand_as(lp)[m], lp[m]], 1), h)
    mean_adv, mean_lp = (both.mean(0) if len(both) else torch.zeros(2, dtype=lp.dtype, device=lp.device)).unbind()
    return (adv - mean_adv) * (lp - mean_lp)


@register_loss("clip_cov", agg="token_mean", ppo_clip=True, settings=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
def clip_cov(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """Clip-Cov, arXiv 2505.22617: GRPO's PPO clip, plus the gradient of a few high-covariance tokens cut.

    Of the tokens not already clipped whose covariance lies in (clip_cov_lb, clip_cov_ub),
    max(1, int(clip_cov_ratio * #tokens)) are drawn at random (`generator`: the trainer passes one keyed by
    (seed, step, minibatch), so a run is a function of its seed) and drop out. The count and the draw are over
    the minibatch's tokens of every process (`gather`), as one process draws them.
    """
    w = torch.exp(logp - old_logp)
    objective, low, high, dual = _ppo_clip(w, adv, h)
    with torch.no_grad():
        m = mask > 0
        cov = _token_cov(logp, adv, mask, h)
        cand = m & ~low & ~high & (cov > h.clip_cov_lb) & (cov < h.clip_cov_ub)
        every, lo = _every(cand[m].to(torch.uint8), h)  # each token of the minibatch: a candidate or not
        idx = every.bool().nonzero().squeeze(1)
        n_pick = max(int(h.clip_cov_ratio * every.numel()), 1)
        order = torch.randperm(idx.numel(), generator=h.generator) if h.generator is not None else \
            torch.randperm(idx.numel(), device=idx.device)
        chosen = torch.zeros(every.numel(), dtype=torch.bool, device=cand.device)
        chosen[idx[order.to(idx.device)[:n_pick]]] = True
        picked = torch.zeros_like(cand)
        picked[m] = chosen[lo : lo + int(m.sum())]
    objective = torch.where(picked, torch.zeros_like(objective), objective)
    return Terms(objective, w, low, high, dual, clip_cov=picked)


@register_loss("kl_cov", agg="token_mean", settings=("kl_cov_ratio", "kl_cov_coef"))
def kl_cov(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """KL-Cov, arXiv 2505.22617: the unclipped surrogate w A, minus kl_cov_coef |log pi - log pi_old| on the
    max(1, int(kl_cov_ratio * #tokens)) tokens of highest covariance among the minibatch's tokens of every
    process (`gather`). No ratio clip."""
    d = logp - old_logp
    w = torch.exp(d)
    with torch.no_grad():
        m = mask > 0
        every, lo = _every(_token_cov(logp, adv, mask, h)[m], h)
        chosen = torch.zeros(every.numel(), dtype=torch.bool, device=logp.device)
        if every.numel():
            n_pick = min(max(int(h.kl_cov_ratio * every.numel()), 1), every.numel())
            chosen[torch.topk(every, n_pick).indices] = True
        picked = torch.zeros_like(m)
        picked[m] = chosen[lo : lo + int(m.sum())]
    objective = w * adv - h.kl_cov_coef * picked.to(logp.dtype) * d.abs()
    return Terms(objective, w.detach(), _no_clip(w), _no_clip(w), clip_cov=picked)

@register_loss("topr", agg="seq_mean_token_sum_norm")
def topr(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """TOPR, arXiv 2503.14286: REINFORCE with the trajectory IS weight truncated to [0, 1] on negative samples only.

    J = sg(alpha_i) A log pi(y_t), alpha_i = 1 where A >= 0 (supervised-like, no IS weight) and
    min(pi(y_i) / pi_old(y_i), 1) where A < 0, the ratio of the whole completion (product over its tokens).
    """
    seq_w = torch.exp(((logp - old_logp) * mask).sum(dim=1, keepdim=True)).detach().expand_as(logp)
    alpha = torch.where(adv < 0, seq_w.clamp(max=1.0), torch.ones_like(seq_w))
    # clip/frac_low: negative samples whose weight was capped at 1 (scaled, never cut, like CISPO's cap)
    return Terms(alpha * adv * logp, seq_w, (adv < 0) & (seq_w > 1.0), _no_clip(seq_w))


@register_loss("vespo", agg="token_mean", settings=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                     "vespo_lambda_neg"), is_weight_in_ratio=True)
def vespo(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """VESPO (TRL's loss_type="vespo", TRL #5199; arXiv 2602.10693): J = sg(phi(W_i)) A log pi(y_t), a smooth Gamma
    kernel phi(W) = W^k exp(lambda (1 - W)) (phi(1) = 1, maximal at W = k / lambda) of the sequence's whole importance
    ratio W_i = prod_t pi / pi_old instead of a clip, with (k, lambda) by the sign of A.

    As TRL computes it: each token's log-ratio clamped to [-20, 20], their sum plus the log of the mismatch weight
    (`is_weight`, the sampler's truncated or masked pi_old / mu: W is then pi / mu) clamped to [log 1e-8, 20], the
    kernel taken in log space, lambda floored at 1e-4, a non-finite phi set to 0.
    """
    with torch.no_grad():
        log_w = ((logp - old_logp).clamp(-20.0, 20.0) * mask).sum(dim=1, keepdim=True)
        if h.is_weight is not None:  # log 0 (a masked token) clamps to log 1e-8: the sequence is all but dropped
            log_w = log_w + (h.is_weight.to(logp.dtype).log().clamp(LOG_1E8, 20.0) * mask).sum(dim=1, keepdim=True)
        log_w = log_w.clamp(LOG_1E8, 20.0).expand_as(logp)
        pos = adv >= 0
        k = torch.where(pos, h.vespo_k_pos, h.vespo_k_neg)
        lam = torch.where(pos, h.vespo_lambda_pos, h.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return Terms(phi * adv * logp, log_w.exp(), _no_clip(logp), _no_clip(logp))


@register_loss("dro", agg="token_mean", settings=("dro_beta",))
def dro(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """DRO as verl registers it (`dro`, verl #7245; Tinker's `dro` loss): J_t = A log pi(y_t) - (beta / 2)
    (log pi(y_t) - log pi_old(y_t))^2, the policy gradient with a quadratic penalty on the log-ratio instead of a
    clip (it acts on every token, A = 0 included). No ratio in the objective; policy/ratio_* report exp(d_t)."""
    d = logp - old_logp
    w = torch.exp(d).detach()
    return Terms(adv * logp - 0.5 * h.dro_beta * d * d, w, _no_clip(w), _no_clip(w))


def m2_keep(d: Tensor, mask: Tensor, threshold: float,
            gather: Optional[Callable[[Tensor], tuple[Tensor, int]]] = None) -> Tensor:
    """M2PO's mask (arXiv 2510.01161; AReaL's `_get_m2po_loss_mask`): over the tokens of `mask`, drop those of largest
    M2_t = d_t^2 one by one until the mean M2 of the rest is below `threshold`; at least one token is kept.
    Returns a bool (B, T), False on padding and on the dropped tokens. Ties are broken by position (a stable sort).
    `gather` (`Hyper.gather`): the tokens are the minibatch's of every process, as one process sees them; this
    process gets its own part of the mask."""
    m = mask.bool()
    keep = torch.zeros_like(m)
    local = (d.detach() ** 2)[m]
    m2, lo = gather(local) if gather is not None else (local, 0)
    n = m2.numel()
    if n == 0:
        return keep
    order = torch.argsort(m2, descending=True, stable=True)
    sorted_m2 = m2[order]
    # mean of sorted_m2[i:] for each i: the tokens left after dropping the i largest
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, device=m2.device, dtype=m2.dtype)
    below = (suffix_mean < threshold).nonzero()
    n_drop = int(below[0]) if below.numel() else n - 1
    kept = torch.ones(n, dtype=torch.bool, device=m.device)
    kept[order[:n_drop]] = False
    keep[m] = kept[lo : lo + local.numel()]
    return keep


@register_loss("m2po", agg="token_mean", settings=("m2_threshold",))
def m2po(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, h: Hyper) -> Terms:
    """M2PO, arXiv 2510.01161 (AReaL's `m2_threshold`): the unclipped surrogate J_t = M_t w_t A, w_t = exp(d_t), where
    M_t drops the tokens of largest d_t^2 until the mean second moment of the rest is below m2_threshold
    (`m2_keep`, over the tokens of the minibatch, every process's). A trust region on the second moment of the log-ratio: only the
    extreme tokens go, so stale batches keep training. Dropped tokens count in clip/frac_low (A < 0) and _high (A > 0).
    """
    w = torch.exp(logp - old_logp)
    keep = m2_keep(logp - old_logp, mask, h.m2_threshold, h.gather)
    gone = ~keep & (mask > 0)
    return Terms(keep.to(logp.dtype) * w * adv, w.detach(), gone & (adv < 0), gone & (adv > 0))


# --------------------------------------------------------------------------- entry point


def _parse_hyper(name: str, hyper: dict) -> Hyper:
    unknown = sorted(set(hyper) - set(HYPER_NAMES))
    if unknown:
        raise TypeError(f"policy_loss got unknown hyper-parameter(s) {unknown}; valid: {', '.join(HYPER_NAMES)}")
    check_hyper(name, hyper)  # (the defaults are the schema's, valid by its own test)
    return Hyper(**hyper)


def _check_shapes(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, h: Hyper) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be (B, T), got shape {tuple(logp.shape)}")
    others = {"old_logp": old_logp, "mask": mask, "ref_logp": h.ref_logp, "router_shift": h.router_shift,
              "is_weight": h.is_weight, "keep": h.keep}
    for label, t in others.items():
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{label} must have logp's shape {tuple(logp.shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(f"advantages must be (B,) or (B, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}")


def _masked_mean(x: Tensor, m: Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp(min=1.0))


def policy_loss(
    name: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, **hyper
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss (to minimise) of registered loss `name`, and its stats as python floats.

    loss = aggregate(-J_{i,t} + beta * KL_t(pi || ref), mask, agg). hyper: the fields of `Hyper`
    (unknown names raise TypeError). Stats: clip/frac_low, clip/frac_high, clip/frac (token
    fractions), clip/seq_frac, policy/ratio_mean|min|max (the loss's ratio), policy/token_ratio_min|max
    (pi/pi_old per token; with no token in `mask`, +inf and -inf: the identities of min and max), kl/old (k3 to
    the rollout policy) and,
    with the KL term on, kl/ref (k3 to the reference); clip/frac_dual when dual clip is on.
    """
    spec = get_loss(name)
    h = _parse_hyper(name, hyper)  # (agg among them: one of AGG_MODES)
    _check_shapes(logp, old_logp, advantages, mask, h)
    agg = h.agg if h.agg is not None else spec.agg
    if spec.seq_ratio and agg == "token_mean":
        warnings.warn(
            f"loss {name!r} has one ratio per sequence; agg='token_mean' weights each sequence by its length "
            "(a known peer bug), use 'seq_mean_token_mean' as in the paper",
            stacklevel=2,
        )

    m = mask.bool()
    mf = m.to(logp.dtype)
    zero = torch.zeros_like(logp)
    # Padding may hold -inf or garbage: zero it so exp() and its backward stay finite there.
    logp = torch.where(m, logp, zero)
    old = torch.where(m, old_logp.detach().to(logp.dtype), zero)
    adv = advantages.detach().to(logp.dtype)
    adv = torch.where(m, adv.unsqueeze(1).expand_as(logp) if adv.dim() == 1 else adv, zero)

    if h.is_weight is not None:  # (VESPO reads it on the tokens only, as 1 on padding)
        h = replace(h, is_weight=torch.where(m, h.is_weight.detach().to(logp.dtype), torch.ones_like(logp)))
    terms = spec.fn(logp, old, adv, mf, h)
    per_token = -terms.objective
    if h.is_weight is not None and not spec.is_weight_in_ratio:  # TIS: the policy term reweighted for tokens the
        per_token = per_token * torch.where(m, h.is_weight, zero)  # sampler drew, not pi_old
    if h.keep is not None:  # only these tokens train the policy term; the denominator stays every token's
        per_token = per_token * torch.where(m, h.keep.detach().to(logp.dtype), zero)

    stats: dict[str, float] = {}
    use_kl = h.beta != 0.0 and h.ref_logp is not None
    if h.beta != 0.0 and h.ref_logp is None:
        warnings.warn("beta > 0 but no ref_logp was given: the KL term is skipped", stacklevel=2)
    if use_kl:
        ref = torch.where(m, h.ref_logp.detach().to(logp.dtype), zero)
        per_token = per_token + h.beta * kl_penalty(logp, ref, h.kl_estimator)
        with torch.no_grad():
            stats["kl/ref"] = _masked_mean(kl_penalty(logp, ref, "k3"), mf)

    loss = aggregate(per_token, mf, agg, max_tokens=h.max_tokens)

    with torch.no_grad():
        n_tok = mf.sum().clamp(min=1.0)
        low, high = terms.clip_low & m, terms.clip_high & m
        stats["clip/frac_low"] = float(low.sum() / n_tok)
        stats["clip/frac_high"] = float(high.sum() / n_tok)
        stats["clip/frac"] = stats["clip/frac_low"] + stats["clip/frac_high"]
        stats["clip/seq_frac"] = float((low | high).any(dim=1).sum() / m.any(dim=1).sum().clamp(min=1))
        if terms.clip_dual is not None:
            stats["clip/frac_dual"] = float((terms.clip_dual & m).sum() / n_tok)
        if terms.clip_cov is not None:
            stats["clip/frac_cov"] = float((terms.clip_cov & m).sum() / n_tok)
        r = terms.ratio.detach()[m]
        empty = r.numel() == 0
        stats["policy/ratio_mean"] = 1.0 if empty else float(r.mean())
        # no tokens: the extremes are the identities of min and max (+inf, -inf), so that a minibatch or a rank
        # without tokens never enters the extremes over minibatches and ranks (the trainer leaves an extreme over
        # nothing out of the step's row: gspo.train.ranks.distributed.Dist.reduce_metrics)
        stats["policy/ratio_min"] = math.inf if empty else float(r.min())
        stats["policy/ratio_max"] = -math.inf if empty else float(r.max())
        # pi/pi_old per token whatever ratio the loss uses: a sequence-ratio loss (GSPO) hides in its
        # policy/ratio_* the single tokens whose probability moved by orders of magnitude.
        d = (logp.detach() - old)[m]
        stats["policy/token_ratio_min"] = math.inf if empty else float(d.min().exp())
        stats["policy/token_ratio_max"] = -math.inf if empty else float(d.max().exp())
        stats["kl/old"] = _masked_mean(kl_penalty(logp, old, "k3"), mf)
    return loss, stats
