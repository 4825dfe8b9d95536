"""gspo's losses and advantage estimators side by side with verl's own functions, on the same tensors.

    pip download verl==0.9.1 --no-deps -d /tmp/verl && cd /tmp/verl && unzip -q verl-0.9.1-py3-none-any.whl
    VERL_SRC=/tmp/verl python scripts/peer_verl.py

verl is not a dependency (it pulls ray and a GPU stack): this imports its `verl/trainer/ppo/core_algos.py` from an
unpacked wheel, with the modules it imports but never uses here stubbed out, and calls its registered functions.
Each row applies the documented deviations first (docs/algorithms.md, "Where peers differ"): gspo's options that
give verl's choice (`std_eps=1e-6`, `whiten=tokens`), DPPO's truncation at verl's default c = 3, GPG's alpha, the
Dr. GRPO normaliser; what is left is printed as the largest difference in value and in gradient.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

import numpy as np
import torch
from omegaconf import OmegaConf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gspo.algos.advantages import compute_advantages  # noqa: E402
from gspo.algos.losses import policy_loss  # noqa: E402
from gspo.algos.value import gae, outcome_rewards, value_loss, whiten  # noqa: E402


class _Anything(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return type(k, (), {"__init__": lambda *a, **kw: None, "__call__": lambda *a, **kw: None})


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules verl imports at the top of its package that core_algos' functions never use."""

    names = ("ray", "tensordict", "codetiming", "pylatexenc", "orjson", "torchdata", "pybind11", "dill")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        m = _Anything(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


def verl_core():
    src = os.environ.get("VERL_SRC")
    if not src:
        raise SystemExit("set VERL_SRC to an unpacked verl wheel (see this script's docstring)")
    sys.path.insert(0, src)
    sys.meta_path.insert(0, _Stub())
    import verl
    import verl.trainer.ppo.core_algos as core

    return core, getattr(verl, "__version__", "?")


def batch(seed: int, B: int = 6, T: int = 5, probs: bool = False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 4, 5, 2, 5])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = (torch.rand(B, T, generator=g) * 0.9 + 0.05).log() if probs else -torch.rand(B, T, generator=g) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=g)).clamp(max=-1e-3 if probs else 10).requires_grad_()
    adv = torch.randn(B, generator=g)
    return logp, old, mask, adv


def actor_config(low: float = 0.2, high: float = 0.28, **policy_loss_kw):
    return OmegaConf.create({"clip_ratio": low, "clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": 3.0,
                             "global_batch_info": {}, "policy_loss": {"loss_mode": "vanilla", **policy_loss_kw}})


def compare_loss(core, name, ours_kw, cfg, agg_verl, seed, probs=False):
    logp, old, mask, adv = batch(seed, probs=probs)
    torch.manual_seed(seed)  # Clip-Cov: both draw torch.randperm from torch's global generator
    theirs, _ = core.get_policy_loss_fn(name)(old, logp, adv[:, None] * mask, mask, agg_verl, cfg)
    gt = torch.autograd.grad(theirs, logp)[0]
    torch.manual_seed(seed)
    ours, _ = policy_loss(name, logp, old, adv, mask, **ours_kw)
    go = torch.autograd.grad(ours, logp)[0]
    return float((ours - theirs).detach().abs()), float((go - gt).abs().max())


def main() -> None:
    core, version = verl_core()
    print(f"verl {version} from {os.environ['VERL_SRC']}; gspo at {os.popen('git rev-parse --short HEAD').read().strip()}\n")
    rows = []
    c3 = {"clip_ratio_c": 3.0}
    for seed in (0, 1, 2):
        rows += [
            ("dppo_tv (c = 3, verl's default)", *compare_loss(core, "dppo_tv", dict(eps_low=0.15, eps_high=0.15, agg="token_mean", **c3),
                                                              actor_config(0.15, 0.15), "token-mean", seed, probs=True)),
            ("dppo_kl (c = 3)", *compare_loss(core, "dppo_kl", dict(eps_low=0.05, eps_high=0.05, agg="token_mean", **c3),
                                              actor_config(0.05, 0.05), "token-mean", seed, probs=True)),
            ("clip_cov", *compare_loss(core, "clip_cov", dict(eps_low=0.2, eps_high=0.28, agg="token_mean", clip_cov_ratio=0.2),
                                       actor_config(clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0), "token-mean", seed)),
            ("kl_cov (ppo_kl_coef 0.1)", *compare_loss(core, "kl_cov", dict(agg="token_mean", kl_cov_ratio=0.2, kl_cov_coef=0.1),
                                                       actor_config(kl_cov_ratio=0.2, ppo_kl_coef=0.1), "token-mean", seed)),
            ("gpg loss", *compare_loss(core, "gpg", dict(agg="token_mean"), actor_config(), "token-mean", seed)),
        ]
    for seed in (0, 1, 2):  # Dr. GRPO's normaliser as verl's training path passes it: all the mini-batch's rows
        logp, old, mask, adv = batch(seed)
        mask[1] = 0.0  # a row with no tokens (the overlong filter dropped it): counted by both
        cfg = actor_config(0.2, 0.2)
        cfg.global_batch_info = {"global_batch_size": mask.shape[0], "loss_scale_factor": mask.shape[1]}
        theirs, _ = core.get_policy_loss_fn("vanilla")(old, logp, adv[:, None] * mask, mask, "seq-mean-token-sum-norm", cfg)
        ours, _ = policy_loss("grpo", logp, old, adv, mask, agg="seq_mean_token_sum_norm", max_tokens=mask.shape[1],
                              clip_ratio_c=3.0)
        gt, go = (torch.autograd.grad(x, logp)[0] for x in (theirs, ours))
        rows.append(("vanilla PPO, seq-mean-token-sum-norm (dual clip c = 3, max_tokens = T, an empty row)",
                     float((ours - theirs).detach().abs()), float((go - gt).abs().max())))
    print("| loss | |value difference| (max over 3 seeds) | max |gradient difference| |")
    print("|---|---:|---:|")
    names = dict.fromkeys(r[0] for r in rows)
    for n in names:
        vals = [r for r in rows if r[0] == n]
        print(f"| {n} | {max(v[1] for v in vals):.2e} | {max(v[2] for v in vals):.2e} |")
    print()
    print("| advantage | max |difference| |")
    print("|---|---:|")
    g = torch.Generator().manual_seed(0)
    G, n = 4, 12
    r = torch.rand(n, generator=g, dtype=torch.float64).round(decimals=1)
    lengths = torch.tensor([5, 3, 4, 5, 2, 5, 1, 4, 5, 3, 2, 4])
    mask = (torch.arange(5)[None] < lengths[:, None]).double()
    index = np.array([i // G for i in range(n)])
    tlr = torch.zeros(n, 5, dtype=torch.float64)
    tlr[torch.arange(n), lengths - 1] = r  # the score on the last token, as verl's reward managers place it
    algo = OmegaConf.create({"norm_adv_by_std_in_grpo": True, "gamma": 1.0})
    checks = {
        "grpo (std_eps=1e-6)": (core.compute_grpo_outcome_advantage(tlr, mask, index)[0][:, 0],
                                compute_advantages("grpo", r, G, std_eps=1e-6)),
        "grpo_passk (std_eps=1e-6)": (core.compute_grpo_passk_outcome_advantage(tlr, mask, index, config=algo)[0].sum(-1)
                                      / mask.sum(-1), compute_advantages("grpo_passk", r, G, std_eps=1e-6)),
        "reinforce_plus_plus_baseline (whiten=tokens)": (
            core.compute_reinforce_plus_plus_baseline_outcome_advantage(tlr, mask, index)[0][:, 0],
            compute_advantages("reinforce_plus_plus_baseline", r, G, whiten="tokens", lengths=lengths)),
    }
    gpg_verl = core.compute_gpg_outcome_advantage(tlr, mask, index)[0][:, 0]
    alpha_ratio = (n / torch.count_nonzero(r).clamp(min=1)) / (n / (n - G * int((r.view(-1, G) == r.view(-1, G)[:, :1]).all(1).sum())))
    checks["gpg (verl's alpha = N / nonzero rewards, gspo's N / (N - M))"] = (gpg_verl / alpha_ratio, compute_advantages("gpg", r, G))
    for name, (theirs, ours) in checks.items():
        print(f"| {name} | {float((theirs - ours).abs().max()):.2e} |")
    print()
    print(compare_critic(core))


def compare_critic(core) -> str:
    """PPO's critic math: verl's compute_gae_advantage_return (with its whitening) and compute_value_loss
    (token-mean) against gspo's gae + whiten and value_loss, 3 seeds x 3 (gamma, lambda), a KL penalty per token."""
    worst = {"GAE returns": 0.0, "GAE advantages, whitened": 0.0, "value loss": 0.0, "value loss gradient": 0.0}
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.tensor([6, 2, 4, 6, 1, 5])
        mask = (torch.arange(6)[None] < lengths[:, None]).float()
        values = torch.randn(6, 6, generator=g)
        rewards = outcome_rewards(torch.randn(6, generator=g), mask) - 0.05 * torch.randn(6, 6, generator=g) * mask
        for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.3)):
            adv_v, ret_v = core.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
            adv, ret = gae(rewards, values, mask, gamma, lam)
            worst["GAE returns"] = max(worst["GAE returns"], float(((ret - ret_v) * mask).abs().max()))
            worst["GAE advantages, whitened"] = max(worst["GAE advantages, whitened"],
                                                    float(((whiten(adv, mask) - adv_v) * mask).abs().max()))
        new = (values + 0.3 * torch.randn(6, 6, generator=g)).requires_grad_()
        theirs, _ = core.compute_value_loss(new, ret, values, mask, cliprange_value=0.5)
        total, _ = value_loss(new, values, ret, mask, clip=0.5)
        ours = total / mask.sum()
        worst["value loss"] = max(worst["value loss"], float((ours - theirs).detach().abs()))
        gv, go = (torch.autograd.grad(x, new)[0] for x in (theirs, ours))
        worst["value loss gradient"] = max(worst["value loss gradient"], float((gv - go).abs().max()))
    return "| PPO's critic | max |difference| |\n|---|---:|\n" + "\n".join(f"| {k} | {v:.2e} |" for k, v in worst.items())


if __name__ == "__main__":
    main()
