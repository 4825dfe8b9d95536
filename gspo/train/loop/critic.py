"""The loop's advantage component: where a step's advantages come from, and PPO's critic when there is one.

The loop calls it at fixed points and never asks which algorithm it runs:

    advantages(batch, mask, old_logp, ref_logp)   the step's advantages, (N,) or (N, T), and their metrics
    trains_policy(step)                            whether the policy updates at this step (a critic warm-up)
    update(rollout, mask, minibatches, step)       the critic's own gradient steps, after the policy's
    checkpoint()                                   what a checkpoint carries of it (loaded back by `for_run`)

`Critic` itself is the group baseline: no learned critic, each completion's advantage comes from its group's
rewards (the estimators of gspo/algos/advantages.py: GRPO, RLOO, ...). `ValueCritic` is PPO's
(`algo.advantage=gae`): a value model V(s_t) (the policy's base with a scalar head, its own AdamW, learning
rate and warm-up) gives GAE advantages and returns over the completion tokens (gspo/algos/value.py), and
learns the returns with the clipped value loss. Both put the KL to the reference into the reward when
`algo.kl_in_reward` is on: the group baseline subtracts the completion's summed KL from its reward (TRL's
RLOO), the critic each token's from that token's reward (verl's `apply_kl_penalty`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from gspo.algos.advantages import compute_advantages
from gspo.algos.kl import kl_penalty, reward_penalty
from gspo.algos.value import GAE, explained_variance, gae, outcome_rewards, value_loss, whiten
from gspo.core.errors import ConfigError
from gspo.models.build import enable_checkpointing, load_pretrained
from gspo.rollout.batch import Batch
from gspo.rollout.decoding.generate import Rollout, position_ids
from gspo.tasks.rewards import components
from gspo.train.ranks import distributed
from gspo.train.run import checkpoint

CRITIC_FILE = "critic.safetensors"  # the value model's weights, in a checkpoint directory


class Critic:
    """No learned critic: group-relative advantages from the rewards (`algo.advantage`, a group estimator)."""

    @staticmethod
    def for_run(cfg, base_dir: Path, dist, dtype: torch.dtype, resume: Optional[Path] = None) -> "Critic":
        """The component for this run: `ValueCritic` for algo.advantage=gae (restored from `resume`, a
        checkpoint, when given), else this group baseline."""
        return ValueCritic(cfg, base_dir, dist, dtype, resume) if cfg.algo.advantage == GAE else Critic(cfg, dist)

    def __init__(self, cfg, dist):
        self.cfg, self.dist = cfg, dist

    def _penalty(self, batch: Batch, mask: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor]) -> tuple[Tensor, dict]:
        """algo.kl_in_reward: beta x KL_t(pi_old || ref) per token (zeros otherwise), and its metrics."""
        a = self.cfg.algo
        if not (a.kl_in_reward and ref_logp is not None):
            return torch.zeros_like(mask), {}
        pen = reward_penalty(old_logp, ref_logp, mask, a.beta, a.kl_estimator)
        k3 = kl_penalty(old_logp, ref_logp, "k3")
        return pen, {"reward/kl_penalty/mean": pen.sum(dim=1).mean().item(),
                     "kl/ref": float((k3 * mask).sum() / mask.sum().clamp(min=1))}

    def advantages(self, batch: Batch, mask: Tensor, old_logp: Tensor,
                   ref_logp: Optional[Tensor]) -> tuple[Tensor, dict[str, float]]:
        """(N,) advantages of this rank's rows from the WHOLE batch's rewards (every rank's: the batch-level
        estimators normalise over all of them), and metrics."""
        a, ro = self.cfg.algo, batch.rollout
        pen, metrics = self._penalty(batch, mask, old_logp, ref_logp)
        rewards = batch.rewards.float() - pen.sum(dim=1).cpu()
        # GDPO normalises each reward function's part apart (gspo.tasks.rewards.components)
        parts, weights = components(self.cfg.reward, rewards, batch.parts) if a.advantage == "gdpo" else (None, None)
        cols = [rewards[:, None], ro.lengths.float().cpu()[:, None]] + ([] if parts is None else [parts])
        both, lo = self.dist.all_gather_rows(torch.cat(cols, 1))
        adv = compute_advantages(a.advantage, both[:, 0], self.cfg.rollout.group_size, passk_k=a.passk_k,
                                 std_eps=a.std_eps, whiten=a.whiten, lengths=both[:, 1],
                                 components=None if parts is None else both[:, 2:], weights=weights)
        # on the rollout's device: the rewards are scored (and gathered) on the CPU, the loss runs where the policy is
        return adv[lo : lo + len(rewards)].to(mask.device), metrics

    def trains_policy(self, step: int) -> bool:
        return True

    def update(self, rollout: Rollout, mask: Tensor, minibatches: list[Tensor], step: int) -> dict[str, float]:
        return {}

    def checkpoint(self) -> tuple[dict, dict]:
        """(safetensors files {name: state dict}, trainer-state entries) for the step's checkpoint: none here."""
        return {}, {}


class ValueModel(nn.Module):
    """A causal LM's backbone with a scalar head `score` on its last hidden state: V(s) at every position.

    Parameters are named `model.*` and `score.*`, the layout of transformers' `<Family>ForTokenClassification`
    with num_labels = 1 (the class verl's critic loads), whose head this initialises as transformers does
    (normal, std `initializer_range`; bias 0).
    """

    def __init__(self, lm: nn.Module, seed: int):
        super().__init__()
        if lm.base_model is lm:
            raise ConfigError(f"algo.advantage=gae: {type(lm).__name__} exposes no backbone (base_model) to put a "
                              "value head on")
        config = lm.config.get_text_config()
        self.model = lm.base_model
        self._no_split_modules = getattr(lm, "_no_split_modules", None)  # FSDP2 shards these blocks
        w = lm.get_input_embeddings().weight
        self.score = nn.Linear(config.hidden_size, 1, device=w.device, dtype=w.dtype)
        std, g = getattr(config, "initializer_range", 0.02), torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.score.weight.copy_(torch.randn(1, config.hidden_size, generator=g) * std)
            self.score.bias.zero_()

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
        """(B, T) float32 values of the states before each completion token: positions P-1 .. P+T-2."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids(attention_mask), use_cache=False).last_hidden_state
        return self.score(hidden[:, prompt_len - 1 : -1]).squeeze(-1).float()


class ValueCritic(Critic):
    """PPO's critic: GAE(gamma, lambda) advantages from a learned value model, which learns the returns."""

    def __init__(self, cfg, base_dir: Path, dist, dtype: torch.dtype, resume: Optional[Path] = None):
        super().__init__(cfg, dist)
        c = cfg.algo.critic
        lm, _ = load_pretrained(base_dir, dist.storage_dtype(dtype), cfg.model.attn_implementation, device=dist.device)
        bare = ValueModel(lm, distributed.keyed_seed(cfg.seed, 0, purpose="critic")).to(dist.device)
        if cfg.model.gradient_checkpointing:
            enable_checkpointing(bare.model)
        if resume is not None:  # before wrapping, as the policy's weights
            checkpoint.load_module(bare, resume / CRITIC_FILE)
        self.module = dist.wrap(bare, dtype)
        fused = {"fused": True} if dist.strategy != "fsdp" else {}
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=c.lr, weight_decay=c.weight_decay, **fused)
        warmup = max(1, c.lr_warmup_steps)  # RL steps, as train.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warmup))
        if resume is not None:
            state = checkpoint.load_state(resume)["critic"]
            checkpoint.load_optimizer(self.module, self.opt, state["optimizer"], fsdp=dist.strategy == "fsdp")
            self.sched.load_state_dict(state["scheduler"])
        self._old: Optional[Tensor] = None  # (N, T) the values before this step's updates
        self._returns: Optional[Tensor] = None  # (N, T) the GAE returns they learn

    @torch.no_grad()
    def _values(self, ro: Rollout) -> Tensor:
        bare = checkpoint.unwrap(self.module)
        bare.eval()
        with self.dist.gathered(bare):  # FSDP: full weights for the pass (no collective per forward)
            return bare(ro.input_ids, ro.attention_mask, ro.prompt_len)

    def advantages(self, batch: Batch, mask: Tensor, old_logp: Tensor,
                   ref_logp: Optional[Tensor]) -> tuple[Tensor, dict[str, float]]:
        """(N, T) whitened GAE advantages (verl's `compute_gae_advantage_return`), and the critic's metrics."""
        a = self.cfg.algo
        pen, metrics = self._penalty(batch, mask, old_logp, ref_logp)
        values = self._values(batch.rollout)
        rewards = outcome_rewards(batch.rewards.float().to(mask.device), mask) - pen
        adv, self._returns = gae(rewards, values, mask, a.gamma, a.lam)
        self._old = values
        n, total = self.dist.all_sum(torch.stack([mask.sum(), (values * mask).sum()]).double())
        metrics["critic/value_mean"] = float(total / n.clamp(min=1))
        metrics["critic/explained_variance"] = explained_variance(self._returns, values, mask, self.dist.all_sum)
        return whiten(adv, mask, self.dist.all_sum), metrics

    def trains_policy(self, step: int) -> bool:
        return step > self.cfg.algo.critic.warmup

    def update(self, rollout: Rollout, mask: Tensor, minibatches: list[Tensor], step: int) -> dict[str, float]:
        """One gradient step of the clipped value loss (token mean) per minibatch, the policy's minibatches."""
        self.module.train()
        lr, clip = self.sched.get_last_lr()[0], self.cfg.algo.critic.value_clip
        per: dict[str, list[float]] = {}
        for rows in minibatches:
            sub, m = rollout.select(rows), mask[rows]
            values = self.module(sub.input_ids, sub.attention_mask, sub.prompt_len)
            total, clipped = value_loss(values, self._old[rows], self._returns[rows], m, clip)
            n = m.sum()
            # under several ranks: this rank's share of the one-process token mean (1 x in one process)
            loss = total / n.clamp(min=1) * self.dist.loss_scale(n)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.train.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)  # freed before the next forward (as the policy's)
            for k, v in (("critic/value_loss", float(total.detach() / n.clamp(min=1))),
                         ("critic/clip_frac", float(clipped.sum() / n.clamp(min=1))),
                         ("critic/grad_norm", distributed.scalar(grad_norm))):
                per.setdefault(k, []).append(v)
        self.sched.step()
        return {k: sum(v) / len(v) for k, v in per.items()} | {"critic/lr": lr}

    def checkpoint(self) -> tuple[dict, dict]:
        model_state, optim_state = self.dist.full_state(self.module, self.opt)
        return {CRITIC_FILE: model_state}, {"critic": {"optimizer": optim_state, "scheduler": self.sched.state_dict()}}
