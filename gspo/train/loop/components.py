"""The interfaces the loop's components meet: typed, so a new one is checked against them, not found by trying.

The sources themselves are gspo/rollout/source.py's `Inline` and gspo/rollout/workers.py's `WorkerPool`
(tests/contracts/test_layout.py checks that both have these methods with these parameters).
"""

from __future__ import annotations

from typing import Protocol

import torch

from gspo.rollout.batch import Batch


class BatchSource(Protocol):
    """Where each step's batch comes from, `rollout.staleness` steps behind (gspo/rollout/source.py says how)."""

    def start(self, start: int, model: torch.nn.Module, pending: dict[int, dict]) -> None:
        """Once, before step `start` + 1: take a resumed run's batches sampled ahead, sample ahead what is due."""
        ...

    def batch(self, step: int, model: torch.nn.Module) -> tuple[Batch, dict]:
        """Step `step`'s batch and its metrics (sampled now, or ahead by older weights)."""
        ...

    def updated(self, step: int, model: torch.nn.Module) -> dict:
        """After step `step`'s update: the new weights taken in; its `time/*` metrics add to the step's."""
        ...

    def pending(self) -> dict[int, dict]:
        """The batches already sampled by weights older than a checkpoint's, which a resume cannot sample again."""
        ...

    def close(self) -> None:
        """Stop sampling (worker processes never outlive the trainer)."""
        ...


class Saved(Protocol):
    """A part with state of its own in a checkpoint (PPO's critic, a reset reference model)."""

    def checkpoint(self) -> tuple[dict, dict]:
        """({file name: state dict} written as safetensors, {key: value} added to the trainer state)."""
        ...
