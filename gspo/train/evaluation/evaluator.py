"""Held-out evaluation during training: when it runs, and its split over ranks.

`maybe_run(step)` evaluates the policy on the held-out problems at step 0 (the base), every `eval.every`
steps and after the last step, and returns `eval/*` metrics ({} when not due). Each rank scores a strided
share of the problems (gspo/train/evaluation/heldout.py's `evaluate`, the same as `gspo eval`); the per-problem means
are recombined over ranks, so any world size gives the one-process numbers' mean, and `eval/n` is the
problems every rank scored together (the whole split, as in one process). The per-problem outcomes are
gathered to rank 0 in the split's order and handed to the logger (`HELDOUT`: RUN_DIR/heldout.jsonl).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from omegaconf import DictConfig

from gspo.rollout.decoding.multiturn import ToolUse
from gspo.tasks import Problem, Task
from gspo.train.evaluation.heldout import HELDOUT, eval_params, evaluate, outcome_record
from gspo.train.ranks.distributed import Dist

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Evaluator:
    """The held-out evaluation of one run's policy `model` (every rank calls it at the same steps)."""

    def __init__(self, cfg: DictConfig, dist: Dist, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                 task: Task, problems: list[Problem]):
        self.cfg, self.dist, self.model, self.tokenizer, self.task, self.problems = cfg, dist, model, tokenizer, task, problems
        self.params, self.tools = eval_params(cfg), ToolUse.of(cfg)
        self.record: Optional[dict] = None  # the latest evaluation's outcome record (rank 0; None elsewhere)

    def due(self, step: int) -> bool:
        """Step 0 (the base), every eval.every steps, and the last step."""
        every = self.cfg.eval.every
        return step == 0 or step == self.cfg.train.steps or bool(every and step % every == 0)

    def maybe_run(self, step: int) -> dict:
        """The held-out metrics after step `step` if due, else {}; on rank 0 with the evaluation's outcome record
        under `HELDOUT`, which the metrics logger writes to heldout.jsonl (and leaves out of metrics.jsonl)."""
        if not self.due(step):
            return {}
        metrics = self.run(step)
        if self.record is not None:
            metrics[HELDOUT] = self.record
        return metrics

    def run(self, step: int) -> dict:
        """`evaluate` on this rank's strided share of the problems, combined over ranks: per-problem means, and
        `eval/n` the total. The numbers only (what a row of metrics.jsonl holds); the outcome record is kept in
        `self.record` on rank 0."""
        cfg, dist, model = self.cfg, self.dist, self.model
        share = self.problems[dist.rank :: dist.world]
        with dist.gathered(model):  # FSDP: full weights once, not an all-gather per forward
            out = evaluate(model, self.tokenizer, self.task, share, self.params, cfg.eval.pass_k,
                           timeout_s=cfg.reward.timeout_s, key=(cfg.seed, step), tools=self.tools)
        self.record = self._record(out.pop("correct"))
        if dist.world == 1:
            return out
        keys = sorted(k for k, v in out.items() if isinstance(v, (int, float)) and k != "eval/n")
        x = torch.tensor([out[k] * len(share) for k in keys] + [len(share)], dtype=torch.float64, device=dist.device)
        x = dist.all_sum(x)
        # the means weighted by each rank's problem count; the count itself is the sum (what one process scores)
        return {k: (x[i] / x[-1].clamp(min=1)).item() for i, k in enumerate(keys)} | {"eval/n": int(x[-1].item())}

    def _record(self, mine: list[bool]) -> Optional[dict]:
        """The whole split's outcome record on rank 0 (None elsewhere): each rank's strided share put back at
        its positions, so the string is in the split's order whatever the world size (a collective)."""
        dist = self.dist
        shares = dist.gather_objects(mine)
        if shares is None:
            return None
        whole: list[bool] = [False] * len(self.problems)
        for rank, outcomes in enumerate(shares):
            whole[rank :: dist.world] = outcomes
        return outcome_record(self.problems, whole)
