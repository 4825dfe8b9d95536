"""Everything about a config that can be refused before work starts, refused here.

`gspo.config.checks.check_values` refuses what needs only the config; `check` adds what needs
the other parts: the names in their registries (losses, advantages, tasks, rewards), LoRA,
the data file, the reward functions and the sampler. One line each, a `ConfigError` (the CLI
prints it and exits 2). `gspo train` runs it for every job of a sweep before Hydra starts,
`train` once more at its start (a torchrun worker's config comes from a file).
"""

from __future__ import annotations

from typing import Any

from gspo.algos.advantages import ADVANTAGES
from gspo.algos.losses import LOSSES, clipped_losses
from gspo.algos.value import GAE
from gspo.config.checks import check_values
from gspo.config.errors import ConfigError
from gspo.models import adapters
from gspo.rollout.engine import check as check_engine
from gspo.rollout.sampler import check as check_sampler
from gspo.rollout.sampler import old_logprobs_mode
from gspo.tasks import TASKS, data, rewards, tools  # gspo.tasks registers every task on import
from gspo.train import distributed


def check(cfg: Any) -> None:
    """Refuse, with one line naming key, value and what is allowed, a config that cannot train.

    Machine-independent: `gspo.config.checks.check_machine` asks this machine.
    """
    from omegaconf import OmegaConf

    check_values(cfg)
    for key, registry in (("algo.loss", LOSSES), ("algo.advantage", [*ADVANTAGES, GAE]), ("task.name", TASKS),
                          ("reward.name", [*rewards.REWARDS, *rewards.FUNCTIONS])):
        if OmegaConf.select(cfg, key) not in registry:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)}: must be one of {', '.join(sorted(registry))}")
    if cfg.algo.delta is not None and not LOSSES[cfg.algo.loss].ppo_clip:
        raise ConfigError(f"algo.delta={cfg.algo.delta} caps the unclipped ratio of PPO's clipped objective, which "
                          f"algo.loss={cfg.algo.loss} does not have; it applies to {', '.join(clipped_losses())}")
    adapters.check(cfg)  # model.lora.*
    data.check(cfg)  # task=data|jsonl: the file reads, has rows and the columns
    rewards.check(cfg)  # reward=python: the files import, the functions exist, weights match
    tools.check(cfg)  # rollout.tools: the files import (in the tools' own process), the functions have schemas
    if cfg.rollout.tools is not None and cfg.model.arch == "hf":  # the tiny models' template has what tools need
        from transformers import AutoTokenizer

        from gspo.rollout.chat import check_template

        check_template(AutoTokenizer.from_pretrained(cfg.model.path))
    check_sampler(cfg)  # rollout.dtype
    if cfg.rollout.engine == "vllm":
        check_engine(cfg, on_cpu=distributed.device_of(cfg.hardware).type == "cpu")
    r = cfg.rollout
    for key, value in (("rollout.tis", r.tis), ("rollout.mask", r.mask)):
        if value != "none" and old_logprobs_mode(cfg) != "recompute":
            raise ConfigError(f"{key}={value} corrects the sampler/trainer mismatch, which exists only when the "
                              "old policy's log-probs are recomputed: set rollout.old_logprobs=recompute")
    if cfg.algo.dynamic_sampling:
        signals = ["reward", "correct", "format"]
        if cfg.reward.name in rewards.FUNCTIONS:
            signals += [rewards.USER + f.name for f in rewards.user_fns(cfg.reward)[0]]
        if cfg.algo.filter_metric not in signals:
            raise ConfigError(f"algo.filter_metric={cfg.algo.filter_metric}: must be one of {', '.join(signals)} "
                              "(what must differ within a group for dynamic sampling to keep it)")
