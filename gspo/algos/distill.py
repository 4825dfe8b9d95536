"""On-policy distillation: a teacher's per-token reverse KL on the student's own samples, as a loss component.

    total, n = reverse_kl_term(logp, old_logp, teacher_logp, mask)   # loss += coef * total / n (its own count)

The student pi_theta samples y (through the sampler mu, pi_old's copy); the teacher pi_T scores the same tokens.
The reverse KL(pi_theta || pi_T) = E_{y ~ pi_theta}[sum_t log pi_theta(y_t) - log pi_T(y_t)] is estimated per token
by k_t = log pi_theta(y_t) - log pi_T(y_t), and minimised by the policy gradient with -k_t as each token's
advantage (Thinking Machines' "On-Policy Distillation"; prime-rl's `ref_kl` loss component of its `opd` algorithm;
NeMo-RL's MOPD; TRL's GKD trainers with lambda = 1 and beta = 1):

    J_t = sg(log pi_T(y_t) - log pi_theta(y_t)) * w_t,      w_t = pi_theta(y_t) / pi_old(y_t)

w_t is 1 in value at the old weights and carries the gradient (w_t grad log pi_theta): later minibatches of a
step are importance-weighted to the policy that sampled, as prime-rl weights by trainer / inference. Normalised
per component as prime-rl does: the sum over the minibatch's completion tokens divided by their count, apart from
the RL term's own aggregation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gspo.algos.kl import kl_penalty


def reverse_kl_term(logp: Tensor, old_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(the sum over the tokens of `mask` of -J_t, with grad through `logp`; their count). logp, old_logp,
    teacher_logp, mask: (B, T) log-probs of the sampled tokens under the student, the policy that sampled and the
    teacher. Padding may hold anything."""
    m = mask.bool()
    zero = torch.zeros_like(logp)
    lp = torch.where(m, logp, zero)
    old = torch.where(m, old_logp.detach().to(logp.dtype), zero)
    teacher = torch.where(m, teacher_logp.detach().to(logp.dtype), zero)
    objective = (teacher - lp).detach() * torch.exp(lp - old)
    return -(objective * m).sum(), m.sum().to(logp.dtype)


@torch.no_grad()
def distill_metrics(old_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """`distill/reverse_kl`: the mean over completion tokens of the k3 estimate of KL(pi_old || pi_T) per token,
    exp(x) - 1 - x with x = log pi_T(y_t) - log pi_old(y_t) (unbiased on the policy's own samples, never negative,
    as `kl/ref`; 0 when the student is the teacher)."""
    m = mask.bool()
    if not m.any():
        return {}
    return {"distill/reverse_kl": float(kl_penalty(old_logp.float(), teacher_logp.float(), "k3")[m].mean())}
