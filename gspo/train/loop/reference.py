"""Reference-model resets (`algo.sync_ref_model`): TRL's `SyncRefModelCallback`, from TR-DPO (arXiv 2404.09656).

Every `algo.ref_model_sync_steps` optimizer updates (TRL's unit: its `global_step`; gspo makes
`train.minibatches` of them per RL step) the KL reference moves towards the policy:

    ref <- alpha * policy + (1 - alpha) * ref,        alpha = algo.ref_model_mixup_alpha

parameter by parameter, as TRL's `_sync_target_model` mixes them. The reference then differs from the base
weights, so a checkpoint carries it (REFERENCE_FILE) and a resume loads it back.
"""

from __future__ import annotations

from pathlib import Path

import torch

from gspo.train.run import checkpoint

REFERENCE_FILE = "reference.safetensors"  # the reset reference's weights, in a checkpoint directory


class RefSync:
    """Mixes the policy into the reference model every `every` optimizer updates."""

    def __init__(self, ref: torch.nn.Module, alpha: float, every: int, dist):
        self.ref, self.alpha, self.every, self.dist = ref, float(alpha), int(every), dist

    @staticmethod
    def for_run(cfg, ref, dist, resume: Path | None = None) -> "RefSync | None":
        """The resets of this run (None: algo.sync_ref_model off); a resumed run's reference loaded from `resume`."""
        if not cfg.algo.sync_ref_model:
            return None
        if resume is not None:  # before wrapping, as the policy's weights
            checkpoint.load_module(ref, resume / REFERENCE_FILE)
        return RefSync(ref, cfg.algo.ref_model_mixup_alpha, cfg.algo.ref_model_sync_steps, dist)

    @torch.no_grad()
    def after_update(self, policy: torch.nn.Module, update: int) -> None:
        """After optimizer update number `update` (1-based, counted over the run): reset when it is a multiple of
        `every`. Under FSDP both models are sharded alike: each rank mixes its own shards."""
        if update % self.every:
            return
        for r, p in zip(self.ref.parameters(), checkpoint.unwrap(policy).parameters(), strict=True):
            r.mul_(1.0 - self.alpha).add_(p.detach(), alpha=self.alpha)

    def checkpoint(self) -> tuple[dict, dict]:
        """({REFERENCE_FILE: the reference's weights}, {}) for the step's checkpoint."""
        return {REFERENCE_FILE: self.dist.full_state(self.ref)[0]}, {}
