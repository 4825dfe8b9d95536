"""Run a function on W gloo ranks of spawned processes, inside one test (no torchrun, no CLI): what a
piece of the loop computes under several ranks, against what it computes in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init: str, fn: Callable, args: tuple, out: str) -> None:
    torch.set_num_threads(1)  # W processes share the machine's cores
    tdist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), f"{out}/{rank}.pt")
    finally:
        tdist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, tmp: Path, *args) -> list[Any]:
    """`fn(rank, world, *args)` on each of `world` gloo ranks; their results in rank order.

    `fn` must be importable (a module-level function of a test module): spawn pickles it by name.
    """
    out = tmp / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    mp.spawn(_entry, args=(world, str(tmp / "init"), fn, args, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(world)]
