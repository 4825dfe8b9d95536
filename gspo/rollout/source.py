"""Where each step's batch comes from: the seam between the sampler and the trainer.

`rollout.staleness = K`: the batch of step t is sampled by the policy after step t-1-K (the initial policy
while t-1-K <= 0). Exactly K, not "at most K" as in the peers' asynchronous trainers, whose lag depends on
timing: here the run is a function of the seed and the config alone. K = 0 is the synchronous loop.

`rollout.workers` says only WHERE sampling runs:
- 0 (`Inline`): in the trainer's process, serially. With K > 0 it samples step t+K+1's batch right after
  step t's update (the weights it needs are the current ones then) and holds the K+1 batches sampled ahead;
  with K = 0 it samples at the start of each step, as the loop always did.
- N >= 1 (`gspo.rollout.workers.WorkerPool`): in N worker processes that sample ahead while the trainer
  updates; the trainer pushes each update's weights to the worker that samples with them.
Both run the same `batch.collect` with the same keyed seeds: the same config gives the same run either way.

The loop calls, on every source: `start(start_step, model, pending)` once, `batch(step, model)` at the start
of each step, `updated(step, model)` after its update (its `time/*` metrics add to the step's), `pending()` when it checkpoints (the batches already
sampled by weights older than the checkpoint's, which a resume cannot sample again), `close()` at the end.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch

from gspo.rollout.batch import Batch

Collected = tuple[Batch, dict]


def version_of(step: int, staleness: int) -> int:
    """The update after which the policy that samples step `step`'s batch stands (0: the initial policy)."""
    return max(0, step - 1 - staleness)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block (0: unchanged)."""
    if not n:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Inline:
    """Sampling in the trainer's process (`rollout.workers=0`), `staleness` steps behind, exactly."""

    def __init__(self, collect_step: Callable[[int], Collected], sampler, staleness: int, last_step: int,
                 sample_threads: int = 0):
        self.collect_step, self.sampler, self.K, self.last = collect_step, sampler, staleness, last_step
        self.sample_threads = sample_threads
        self.ahead: dict[int, tuple[Batch, dict, int]] = {}  # step -> (batch, metrics, version)
        self.version = 0  # the update the current weights stand after

    def _sample(self, step: int, model) -> dict:
        """Sample step `step`'s batch with the current weights; the sync's metrics and the seconds it took."""
        t0 = time.time()
        synced = self.sampler.sync(model, step)
        with threads(self.sample_threads):
            batch, metrics = self.collect_step(step)
        self.ahead[step] = (batch, metrics, self.version)
        return synced | {"time/rollout_s": time.time() - t0}

    def start(self, start: int, model, pending: dict[int, dict]) -> None:
        self.version = start
        for step, item in pending.items():
            self.ahead[int(step)] = (Batch.from_state(item["batch"]), dict(item["metrics"]), int(item["version"]))
        if self.K:  # every step up to start+K+1 is sampled by the weights at hand (version `start`)
            for step in range(start + 1, min(start + self.K + 1, self.last) + 1):
                if step not in self.ahead:
                    self._sample(step, model)

    def batch(self, step: int, model) -> Collected:
        t0 = time.time()
        sampled = self._sample(step, model) if step not in self.ahead else {"time/rollout_s": 0.0}
        batch, metrics, version = self.ahead.pop(step)
        return batch, metrics | sampled | {"rollout/staleness": float(step - 1 - version),
                                           "time/sampler_wait_s": time.time() - t0}

    def updated(self, step: int, model) -> dict:
        self.version = step
        ahead = step + self.K + 1
        if self.K and ahead <= self.last:
            return self._sample(ahead, model)
        return {}

    def pending(self) -> dict[int, dict]:
        return {s: {"batch": b.state(), "metrics": m, "version": v} for s, (b, m, v) in self.ahead.items()
                if v < self.version}

    def close(self) -> None:
        self.ahead.clear()
        self.sampler.close()  # an inference engine's process stops with the run


def pending_of(state: dict, rank: int) -> dict[int, dict]:
    """This rank's batches sampled ahead, from a checkpoint's trainer state (none in an older checkpoint)."""
    return {int(k): v for k, v in (state.get("pending") or {}).get(rank, {}).items()}


def describe(staleness: int, workers: int) -> Optional[str]:
    """One line for the console: how this run samples (None for the synchronous default)."""
    if not staleness and not workers:
        return None
    where = f"{workers} worker process{'es' if workers > 1 else ''}" if workers else "the trainer's process"
    return f"rollouts: sampled in {where}, exactly {staleness} step{'s' if staleness != 1 else ''} behind the trainer"
