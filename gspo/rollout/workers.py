"""Rollout worker processes (`rollout.workers=N`): sampling ahead while the trainer updates, `staleness` exact.

Design (docs/scaling.md, "Asynchronous rollouts"):
- Each worker is a plain subprocess, `python -m gspo.rollout.worker` (not multiprocessing's spawn, which
  re-imports the parent's main module), holding its own copy of the sampling model: the base checkpoint's
  architecture in `rollout.dtype`, whose parameters are views of a weight slot (below). It builds the task
  and the reward functions itself and runs `batch.collect`, scoring included: the trainer never waits on a
  reward function. Messages (jobs, scored batches) are pickled over an authenticated Unix socket.
- Weight slots: files in /dev/shm (the temp dir elsewhere) holding every sampling weight, flat, in the
  sampler's dtype, mapped by the trainer and the workers alike (`torch.from_file(shared=True)`). The push
  after an update is one copy of the trainer's weights into a free slot, cast (LoRA: only the adapted
  weights, W0 + ΔW, after the slot's first use); a worker points its parameters at the slot its job names,
  without a copy. A slot is free again once every job that samples with it has delivered its batch. Workers
  hosting the vLLM engine with `rollout.vllm.lora_push=adapter` are sent the adapter alone: a slot is then a
  directory holding it, which the worker's engine loads on the base it started with.
- Steps go round-robin: worker (t - 1) mod N samples step t, with the weights after step t-1-K. Only a lag
  K >= 1 lets sampling overlap the update; with K = 0 the trainer waits for each batch (as it would sample
  it itself). With N > 1 and a sampler slower than the update, N steps are sampled at once.
- Faults: a worker that raises sends its error (one line), a worker that dies (kill -9) closes its socket,
  a worker that sends nothing for `rollout.timeout_s` (its start: at least STARTUP_S) is taken as hung:
  each ends the run in one line naming the worker and the step (`RunFailed`, or `ConfigError` for a user's
  reward function), and every worker is killed. Workers ignore SIGINT / SIGTERM (the trainer finishes its
  step and stops them) and die with the trainer (Linux PR_SET_PDEATHSIG): none outlives it.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Optional

import torch

from gspo.core.errors import RunFailed
from gspo.models import adapters
from gspo.rollout.batch import Batch
from gspo.rollout.engine.slots import PREFIX, layout_of, map_slot, remove, remove_stale_slots, slot_path
from gspo.rollout.engine.vllm_engine import environment
from gspo.rollout.processes.child import Child
from gspo.rollout.source import Collected

STARTUP_S = 300.0  # the least a worker is given to start (import torch, build its model) before it counts as hung


@dataclass
class _Slot:
    path: str
    views: Optional[dict[str, torch.Tensor]]  # None: an adapter slot (a directory)
    users: int = 0  # jobs sampling with it, not yet delivered
    written: bool = False  # the frozen (LoRA base) weights are in it


class WorkerPool:
    """`rollout.workers=N` processes sampling step t's batch with the weights after step t-1-`staleness`."""

    def __init__(self, spec: dict, n_workers: int, staleness: int, last_step: int, dtype: torch.dtype,
                 timeout_s: float, rank: int = 0):
        self.spec, self.N, self.K, self.last, self.dtype = spec, n_workers, staleness, last_step, dtype
        self.timeout_s, self.rank = timeout_s, rank
        self.workers: list[Child] = []
        self.slots: list[_Slot] = []
        self.layout: list = []
        self.version = 0
        self.done: dict[int, tuple[Batch, dict, int]] = {}  # step -> (batch, metrics, version)
        self.slot_of: dict[int, _Slot] = {}  # step in flight -> the slot its weights are in
        self.version_of: dict[int, int] = {}
        self._tag = f"{PREFIX}{os.getpid()}-{rank}-{secrets.token_hex(4)}"
        self.adapter = spec.get("engine", {}).get("max_lora_rank") is not None  # adapter pushes to their engines

    # -- lifetime ---------------------------------------------------------------
    def start(self, start: int, model, pending: dict[int, dict]) -> None:
        remove_stale_slots()
        self.version = start
        self.layout = layout_of(model)
        for i in range(self.N):
            self.workers.append(Child(f"rollout worker {i}", "gspo.rollout.worker", {
                **self.spec, "worker": i, "layout": self.layout, "dtype": str(self.dtype).removeprefix("torch.")},
                on_fail=self.kill, stopped="; every worker was stopped",
                env=environment(self.spec["engine"]["threads"], self.spec["engine"]["tensor_parallel_size"])
                if "engine" in self.spec else None))
        for w in self.workers:  # starting is importing torch and building the model: slow on a busy machine
            w.expect("ready", None, max(self.timeout_s, STARTUP_S), f"rollout.timeout_s={self.timeout_s:g}")
        for step, item in pending.items():
            self.done[int(step)] = (Batch.from_state(item["batch"]), dict(item["metrics"]), int(item["version"]))
        first = [s for s in range(start + 1, min(start + self.K + 1, self.last) + 1) if s not in self.done]
        if first:
            slot, _ = self._push(model)
            for s in first:
                self._job(s, slot)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
        self._free_slots()

    def kill(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []
        self._free_slots()

    def _free_slots(self) -> None:
        for slot in self.slots:
            remove(slot.path)
        self.slots = []

    # -- the loop's side --------------------------------------------------------
    def batch(self, step: int, model) -> Collected:
        t0 = time.time()
        while step not in self.done:
            self._receive(step)
        batch, metrics, version = self.done.pop(step)
        return batch, metrics | {"rollout/staleness": float(step - 1 - version), "time/sampler_wait_s": time.time() - t0}

    def updated(self, step: int, model) -> dict:
        self.version = step
        ahead = step + self.K + 1
        if ahead > self.last:
            return {}
        slot, synced = self._push(model)
        self._job(ahead, slot)
        return synced

    def pending(self) -> dict[int, dict]:
        """The batches sampled by weights older than the current ones (waiting for those still in flight)."""
        while any(v < self.version for s, v in self.version_of.items()):
            self._receive(min(s for s, v in self.version_of.items() if v < self.version))
        return {s: {"batch": b.state(), "metrics": m, "version": v} for s, (b, m, v) in self.done.items()
                if v < self.version}

    # -- internals --------------------------------------------------------------
    def _push(self, model) -> tuple[_Slot, dict]:
        """The current weights (adapter pushes: the adapter), cast, in a free slot (a new one if none is free);
        `time/weight_sync_s`."""
        t0 = time.time()
        slot = next((s for s in self.slots if s.users == 0), None)
        if slot is None:
            path = slot_path(f"{self._tag}-{len(self.slots)}", self.adapter)
            slot = _Slot(path, None if self.adapter else map_slot(path, self.layout, self.dtype, create=True))
            self.slots.append(slot)
        with torch.no_grad():
            if self.adapter:
                adapters.write_adapter(model, slot.path, self.dtype)
            else:
                for name, value, trained in adapters.merged_parameters(model):
                    if trained or not slot.written:
                        slot.views[name].copy_(value)
        slot.written = True
        return slot, {"time/weight_sync_s": time.time() - t0}

    def _job(self, step: int, slot: _Slot) -> None:
        w = self.workers[(step - 1) % self.N]
        slot.users += 1
        self.slot_of[step], self.version_of[step] = slot, self.version
        w.jobs.append(step)
        w.send(("job", step, self.version, slot.path), step)

    def _receive(self, step: int) -> None:
        """Wait for the next delivery from any worker (up to rollout.timeout_s for the one that owes `step`)."""
        owner = self.workers[(step - 1) % self.N]
        ready = wait([w.conn for w in self.workers], timeout=self.timeout_s)
        if not ready:
            raise owner.fail(RunFailed(f"{owner.name}: step {step}'s batch did not come within "
                                       f"rollout.timeout_s={self.timeout_s:g} s (hung?); every worker was stopped"))
        for w in self.workers:
            if w.conn in ready:
                _, got, version, state, metrics, timing = w.recv(w.jobs[0] if w.jobs else step)
                w.jobs.remove(got)
                self.slot_of.pop(got).users -= 1
                self.version_of.pop(got)
                self.done[got] = (Batch.from_state(state), metrics | timing, version)
