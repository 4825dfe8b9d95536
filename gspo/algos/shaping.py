"""DAPO batch shaping (arXiv 2503.14476): soft overlong punishment and dynamic sampling.

Both act on rollout batches before advantages are computed; they know nothing of
models. Dynamic sampling takes the rollout as callables, so the trainer's batch
type (a dict of tensors, a dataclass, lists) stays its own business.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor

B = TypeVar("B")


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO soft overlong punishment (N,) to ADD to the rewards, from completion lengths (N,).

        0                                        if L <= max_len - buffer
        ((max_len - buffer) - L) / buffer * p    if max_len - buffer < L <= max_len   (linear, 0 -> -p)
        -p                                       if L > max_len

    max_len is the generation cap (L_max), buffer the punishment interval (L_cache); buffer 0 = off.
    """
    if buffer < 0:
        raise ValueError(f"overlong buffer must be >= 0, got {buffer}")
    lengths = torch.as_tensor(lengths)
    out = torch.zeros(lengths.shape, dtype=torch.get_default_dtype(), device=lengths.device)
    if buffer == 0:
        return out
    L = lengths.to(out.dtype)
    start = float(max_len - buffer)
    ramp = (start - L) / buffer * penalty
    out = torch.where(L > start, ramp, out)
    return torch.where(L > max_len, torch.full_like(out, -penalty), out)


def informative_groups(rewards: Tensor, group_size: int) -> Tensor:
    """Bool (n_groups,): True where a group's values (rewards) are not all equal (its advantages are not all 0)."""
    rewards = torch.as_tensor(rewards)
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.reshape(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def dynamic_sampling(
    draw: Callable[[], tuple[B, Tensor]],
    select: Callable[[B, list[int]], B],
    cat: Callable[[list[B]], B],
    num_groups: int,
    group_size: int,
    max_batches: int,
    agree: Callable[[bool], bool] = lambda done: done,
    signal: str = "rewards",
) -> tuple[B, dict[str, float]]:
    """DAPO dynamic sampling: keep drawing rollout batches, keep only groups with unequal signals.

    draw() -> (batch, signal (n*G,)) with group-contiguous rows, the signal being what must differ within
    a group for it to be kept (the rewards the advantages use, by default); select(batch, group_indices)
    -> the sub-batch of those groups; cat(list of batches) -> one batch. Stops once num_groups informative
    groups are kept (the batch is truncated to exactly num_groups) or after max_batches draws. When
    short it warns and returns what it kept; if nothing was kept, the last draw whole (its advantages
    are all 0, so the update is a no-op rather than a crash). `signal` names the signal in the warning.

    `agree(done) -> bool`: under several ranks, whether EVERY rank is done (an all-reduce), so all ranks
    draw the same number of batches: a rank whose share is full keeps drawing (and keeping nothing)
    while another's is not, and every collective inside `draw` (FSDP's weight gather) pairs up.

    stats: sampling/batches (draws), sampling/groups_drawn, sampling/groups_dropped (groups with equal
    rewards, filtered out), sampling/groups_kept.
    """
    if num_groups < 1 or max_batches < 1:
        raise ValueError(f"need num_groups >= 1 and max_batches >= 1, got {num_groups}, {max_batches}")
    kept: list[Any] = []
    n_kept = n_drawn = n_dropped = draws = 0
    last = None
    while draws < max_batches and not agree(n_kept >= num_groups):
        last, rewards = draw()
        draws += 1
        good = informative_groups(rewards, group_size)
        n_drawn += good.numel()
        n_dropped += int((~good).sum())
        idx = good.nonzero().flatten().tolist()[: num_groups - n_kept]  # surplus groups are not used
        if idx:
            kept.append(select(last, idx))
            n_kept += len(idx)
    stats = {
        "sampling/batches": float(draws),
        "sampling/groups_drawn": float(n_drawn),
        "sampling/groups_dropped": float(n_dropped),
        "sampling/groups_kept": float(n_kept),
    }
    if n_kept < num_groups:
        warnings.warn(
            f"dynamic sampling kept {n_kept} of {num_groups} wanted groups with unequal {signal} after "
            f"{draws} rollout batches ({n_dropped} of {n_drawn} groups had all-equal {signal}); training on "
            f"{'the last batch as drawn' if not kept else 'a smaller batch'}. Raise algo.max_sample_batches "
            "or make the task easier (or the policy better warm-started).",
            stacklevel=2,
        )
        if not kept:
            return last, stats
    return (kept[0] if len(kept) == 1 else cat(kept)), stats
