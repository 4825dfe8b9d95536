"""The shared memory a killed child leaves in /dev/shm: found and removed (`Child.kill`).

A process killed with SIGKILL cannot unlink the segments it created (vLLM's tensor-parallel message queues,
160-240 MiB each, held in RAM by /dev/shm until the machine restarts). gspo notes the segments there before a child
starts, the ones its processes are seen holding, and after the kill removes those that no living process maps or
holds open (`unlink_orphans`): another program's live segment is kept.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

SHM = Path("/dev/shm")


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that still run (zombies, which hold no memory, left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    """Wait up to `timeout_s` for every process of group `pgid` to end (after a SIGKILL: the kernel frees a killed
    process's memory asynchronously); whether they did."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def shm_segments() -> set[str]:
    """The names of Python's shared-memory segments (`multiprocessing.shared_memory`: `psm_*`) in /dev/shm now."""
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith("psm_")}
    except OSError:  # no /dev/shm (not Linux)
        return set()


def held(pids: Optional[list[int]] = None) -> set[str]:
    """The /dev/shm segments processes `pids` (None: every process) map or hold open (/proc/PID/maps and fd)."""
    used, prefix = set(), str(SHM) + "/"
    procs = Path("/proc").glob("[0-9]*") if pids is None else (Path("/proc") / str(pid) for pid in pids)
    for proc in procs:
        try:
            maps = (proc / "maps").read_text()
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone meanwhile, or not ours to read
            continue
        used.update(line.split(prefix, 1)[1].split()[0] for line in maps.splitlines() if prefix in line)
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:  # closed meanwhile (the listing's own descriptor among them)
                continue
            if target.startswith(prefix):
                used.add(target[len(prefix):])
    return used


def unlink_orphans(before: set[str], owned: Optional[set[str]] = None) -> list[str]:
    """Unlink the segments created since `before` that no living process maps or holds open (another program's live
    ones are kept) and, given `owned`, that are among those: the names removed. A child's `kill` gives the segments
    its processes were seen holding, so that a segment another program made meanwhile and holds by name alone (made,
    closed, to be opened again later) is not taken for the child's; without `owned` (a test's check that nothing
    was leaked) every such segment counts."""
    new = shm_segments() - before
    if owned is not None:
        new &= owned
    orphans = sorted(new - held()) if new else []
    for name in orphans:
        try:
            (SHM / name).unlink()
        except OSError:
            pass  # someone else removed it
    return orphans
