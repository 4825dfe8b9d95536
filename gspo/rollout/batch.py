"""A scored rollout batch, and how one is collected: sample, score, shape (DAPO), as one function.

`collect(...)` is what every batch source runs (gspo/rollout/source.py), in the trainer's process or in a
worker's: the same function, the same keyed seeds, so where a batch is sampled never changes what it holds.
A batch that waits in a checkpoint (sampled by older weights than the checkpoint's: `rollout.staleness`)
is stored as plain containers (`Batch.state` / `Batch.from_state`), loadable with `weights_only=True`.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from gspo.algos.shaping import dynamic_sampling, overlong_penalty
from gspo.rollout.decoding import multiturn
from gspo.rollout.decoding.generate import Rollout, cat_rollouts
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.rollouts import rollout
from gspo.tasks import Problem, timeouts
from gspo.tasks.rewards import completion_ids, score, trainer_state


@dataclass
class Batch:
    """A scored rollout batch: rows group-contiguous, one Problem per row."""

    rollout: Rollout
    problems: list[Problem]
    rewards: torch.Tensor  # (N,)
    parts: dict[str, torch.Tensor]  # per-part diagnostics (N,) each

    def select_groups(self, groups, group_size: int) -> "Batch":
        rows = (torch.as_tensor(groups)[:, None] * group_size + torch.arange(group_size)).reshape(-1)
        idx = rows.tolist()
        return Batch(
            self.rollout.select(rows),
            [self.problems[i] for i in idx],
            self.rewards[rows],
            {k: v[rows] for k, v in self.parts.items()},
        )

    @staticmethod
    def cat(batches: list["Batch"]) -> "Batch":
        return Batch(
            cat_rollouts([b.rollout for b in batches]),
            [p for b in batches for p in b.problems],
            torch.cat([b.rewards for b in batches]),
            {k: torch.cat([b.parts[k] for b in batches]) for k in batches[0].parts},
        )

    def state(self) -> dict:
        """The batch as plain containers (tensors, lists, str, numbers): what a checkpoint stores.

        A row's problem keeps its prompt and answer (what the loop logs); its other fields are not needed
        once the batch is scored."""
        ro = {f.name: getattr(self.rollout, f.name) for f in fields(self.rollout)}
        return {"rollout": {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ro.items()},
                "problems": [{"prompt": p.prompt, "answer": p.answer} for p in self.problems],
                "rewards": self.rewards.cpu(), "parts": {k: v.cpu() for k, v in self.parts.items()}}

    @staticmethod
    def from_state(state: dict, device: torch.device | str = "cpu") -> "Batch":
        ro = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state["rollout"].items()}
        return Batch(Rollout(**ro), [Problem(p["prompt"], p["answer"]) for p in state["problems"]],
                     state["rewards"], dict(state["parts"]))


@dataclass(frozen=True)
class Share:
    """What collecting needs of its process's place in the run: this rank's share [lo, hi) of the step's
    prompts, the number of ranks, and the device the sampling noise is drawn on."""

    lo: int
    hi: int
    world: int = 1
    device: torch.device = torch.device("cpu")


def collect(cfg, step: int, serve: Callable[[], AbstractContextManager], tokenizer, task, share: Share,
            params: SamplingParams, agree: Optional[Callable[[bool], bool]] = None) -> tuple[Batch, dict]:
    """The scored rollout batch of `step` (refilled by dynamic sampling when the algorithm asks for it).

    `serve()` enters a context that yields the model (or decoder) to sample with, as `params` say. Every rank
    draws the same prompt list and samples its own share; each group samples with its own generator, keyed by
    (seed, step, draw, prompt), so the completions depend neither on the number of ranks nor on where sampling
    runs.
    `agree(done)`: DAPO's refill, whether every rank is done (an all-reduce; None in one process).
    The rollout metrics (reward/*, response/*) are over everything sampled, the groups dynamic sampling
    dropped included, so every algorithm's reward/mean is over the same population.
    """
    draws = iter(range(10**6))
    drawn: list[Batch] = []
    tools = multiturn.ToolUse.of(cfg)

    def draw() -> tuple[Batch, torch.Tensor]:
        d = next(draws)
        rng = random.Random(f"{cfg.seed}-{step}-{d}")
        problems = task.sample_train(rng, cfg.rollout.prompts_per_step)[share.lo : share.hi]  # this rank's share
        keys = [(cfg.seed, step, d, i) for i in range(share.lo, share.hi)]  # the prompts' places in the whole step
        with serve() as sampler:  # with tools, each turn of each sample keyed as well (gspo/rollout/decoding/multiturn.py)
            r = rollout(sampler, tokenizer, [p.prompt for p in problems], cfg.rollout.group_size, params, keys,
                        device=share.device, tools=tools)
        rows = [problems[i] for i in r.prompt_index.tolist()]
        r.prompt_index += share.lo  # index in the step's whole prompt list: keys the group's minibatch shuffle
        rewards, parts = timeouts.call(
            lambda: score(task, cfg.reward, r.texts, rows, r.ill_formed, completion_ids=lambda: completion_ids(r),
                          state=lambda: trainer_state(step - 1, cfg.train.steps), clean_texts=r.clean_texts,
                          conversations=r.conversations),
            cfg.reward.timeout_s, f"scoring step {step}'s {len(r.texts)} completions (task verifier, reward)")
        # the length in the budget's unit: with tools, their replies count (verl); on the CPU, as the scores are
        if cfg.algo.overlong_buffer > 0:
            parts["overlong"] = overlong_penalty(r.tail_lengths.cpu(), cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer,
                                                 cfg.algo.overlong_penalty)
            rewards = rewards + parts["overlong"]
        b = Batch(r, rows, rewards, parts)
        drawn.append(b)
        # DAPO keeps the groups whose signal differs: by default the rewards the advantages use
        return b, b.rewards if cfg.algo.filter_metric == "reward" else b.parts[cfg.algo.filter_metric]

    G = cfg.rollout.group_size
    metrics: dict[str, float] = {}
    if cfg.algo.dynamic_sampling:
        signal = "rewards" if cfg.algo.filter_metric == "reward" else f"'{cfg.algo.filter_metric}' values"
        batch, metrics = dynamic_sampling(draw, lambda b, g: b.select_groups(g, G), Batch.cat,
                                          cfg.rollout.prompts_per_step // share.world, G, cfg.algo.max_sample_batches,
                                          agree=agree or (lambda done: done), signal=signal)
        population = Batch.cat(drawn) if len(drawn) > 1 else drawn[0]
    else:
        batch, _ = draw()
        population = batch
    return batch, metrics | population_metrics(cfg, population)


COUNT = "_count/"  # a metric key prefixed so: the row count of the mean under the rest of the key


def population_metrics(cfg, population: Batch) -> dict[str, float]:
    """reward/* and response/* over every completion sampled at the step."""
    r, G = population.rewards, cfg.rollout.group_size
    grouped = r.view(-1, G)
    metrics = {
        "reward/mean": r.mean().item(),
        "reward/std": r.std().item() if r.numel() > 1 else 0.0,
        f"reward/{cfg.reward.name}/mean": (r - population.parts.get("overlong", 0 * r)).mean().item(),
        "reward/frac_zero_std": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
        "response/len_mean": population.rollout.lengths.mean().item(),
        "response/truncated_frac": population.rollout.truncated.float().mean().item(),
    }
    for k, v in population.parts.items():  # NaN: a function's None, left out of its mean
        metrics[f"reward/{k}/mean"] = v.nanmean().item()
        metrics[f"{COUNT}reward/{k}/mean"] = float((~v.isnan()).sum())  # ranks weigh the means by it
    return metrics | tool_metrics(population.rollout)


def tool_metrics(r: Rollout) -> dict[str, float]:
    """rollout/* of trajectories with tools (none for a single-turn rollout): turns and tool calls per
    trajectory, the share of calls that failed (0 without calls, as TRL's `tools/failure_frequency`) and of the
    tokens after the prompt that the tools wrote; the last two weighed over ranks by what they are shares of."""
    if r.turns is None:
        return {}
    calls, written = float(r.tool_calls.sum()), float(r.attention_mask[:, r.prompt_len:].sum())
    return {"rollout/turns_mean": r.turns.float().mean().item(),
            "rollout/tool_calls_mean": r.tool_calls.float().mean().item(),
            "rollout/tool_errors_frac": float(r.tool_errors.sum()) / calls if calls else 0.0,
            f"{COUNT}rollout/tool_errors_frac": calls,
            "rollout/env_token_frac": 1.0 - float(r.completion_mask.sum()) / written if written else 0.0,
            f"{COUNT}rollout/env_token_frac": written}
