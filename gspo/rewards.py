"""Reward functions: map a task's verdict on a completion to a scalar.

A reward function is one small function in a registry; `reward=<name>` picks it.
Every completion is verified by the task; the reward function only decides what
a verdict is worth, so the same task can be scored TinyZero-style or binary.
"""

from __future__ import annotations

from typing import Callable

import torch

from gspo.errors import ConfigError
from gspo.tasks import Problem, Task, Verdict, judge

RewardFn = Callable[[Verdict, object], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        REWARDS[name] = fn
        return fn

    return deco


@register_reward("tinyzero")
def tinyzero(v: Verdict, cfg) -> float:
    """TinyZero's rule: `correct` for a right answer, `format_score` for a well-formed wrong one, else 0."""
    return cfg.correct if v.correct else (cfg.format_score if v.well_formed else 0.0)


@register_reward("binary")
def binary(v: Verdict, cfg) -> float:
    """`correct` for a right answer, 0 otherwise."""
    return cfg.correct if v.correct else 0.0


class RewardError(ConfigError):
    """A task verifier or reward function raised on a sample."""


def score(task: Task, cfg, texts: list[str], problems: list[Problem],
          ill_formed=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rewards (N,) for completions `texts` of `problems`, plus per-part diagnostics (N,) each.

    `ill_formed` (N,) bool, from the rollout: rows with a special token before their EOS (tasks.judge).
    """
    flags = [False] * len(texts) if ill_formed is None else [bool(x) for x in ill_formed]
    if cfg.name not in REWARDS:
        raise ConfigError(f"reward={cfg.name}: no such reward. Valid: {', '.join(sorted(REWARDS))}")
    fn = REWARDS[cfg.name]
    rewards, correct, formed = [], [], []
    for text, problem, bad in zip(texts, problems, flags):
        try:
            verdict = judge(task, text, problem, bad)
            rewards.append(float(fn(verdict, cfg)))
        except Exception as e:  # name the culprit: a user's verifier on a user's data
            raise RewardError(
                f"reward {cfg.name!r} (task {task.name!r}) raised {type(e).__name__}: {e} "
                f"on prompt {problem.prompt!r}, completion {text!r}"
            ) from e
        correct.append(float(verdict.correct))
        formed.append(float(verdict.well_formed))
    parts = {"correct": torch.tensor(correct), "format": torch.tensor(formed)}
    return torch.tensor(rewards), parts
