"""When one process of a multi-process run fails: every process ends, and one line says which and why.

Under `gspo train hardware=cpu-ddp` (or gpu-ddp, gpu-fsdp) an exception on one rank, a rank killed
with -9 and a rank that hangs must all end the run within a bounded time, with one line naming the
rank, the step and the cause, and nothing else to read: no traceback of the secondary errors the
other ranks then meet in their collectives ("Connection closed by peer").

How:
- every collective has a time limit (`hardware.collective_timeout_s`): a rank waiting for one that
  hung gets an error instead of waiting for ever; gspo's own long waits (the warm start that rank 0
  builds, a checkpoint it writes) use a group without that limit (`distributed.Dist.barrier`);
- a rank that fails writes a record (`record`: rank, step, exception type and message, and whether
  it is secondary, i.e. an error of the collective itself) to RUN_DIR/.failures/ and exits quietly,
  2 for a ConfigError (a user's reward function or data, as in one process), else 1;
- torchrun sees the exit and stops the other ranks with SIGTERM; a rank that receives it while a
  record exists leaves at once, silently (`preemption.StopSignals`): there is no step to finish;
- the launcher reads the records (`explain`): the primary error (not secondary; the first one), else
  the ranks that left no record (killed by a signal, or hung while the others timed out), and says it
  in one line; `summary.json` says `failed`. The last checkpoint is written atomically, so it stays intact;
- a worker dies with its launcher (Linux: PR_SET_PDEATHSIG, `gspo.core.processes`), as if preempted: no rank
  is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Optional

DIR = ".failures"
DIR_ENV = "GSPO_FAILURES_DIR"  # set by the launcher for its workers


def is_secondary(e: BaseException) -> bool:
    """An error of a collective itself (a peer gone, a time-out), which another rank's failure causes."""
    import torch.distributed as tdist

    if isinstance(e, getattr(tdist, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out waiting", "timed out", "Broken pipe",
        "NCCL", "gloo", "c10d"))


def record(e: BaseException, step: Optional[int], rank: int) -> None:
    """Write this rank's failure for the launcher (a no-op outside a gspo-launched worker)."""
    where = os.environ.get(DIR_ENV)
    if not where:
        return
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    data = {"rank": rank, "step": step, "type": type(e).__name__, "message": " ".join(str(e).split()),
            "secondary": is_secondary(e), "config_error": _is_config_error(e), "time": time.time()}
    tmp = out / f".rank{rank}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(out / f"rank{rank}.json")


def any_recorded() -> bool:
    """Whether some rank of this run has already failed (then a SIGTERM from torchrun means: leave now)."""
    where = os.environ.get(DIR_ENV)
    return bool(where) and Path(where).is_dir() and any(Path(where).glob("rank*.json"))


def _is_config_error(e: BaseException) -> bool:
    from gspo.core.errors import ConfigError

    return isinstance(e, ConfigError)


def records(run_dir: Path) -> list[dict]:
    d = Path(run_dir) / DIR
    return sorted((json.loads(p.read_text()) for p in d.glob("rank*.json")), key=lambda r: r["time"])


def clear(run_dir: Path) -> Path:
    """An empty failures directory for a new launch; its path (the workers' DIR_ENV)."""
    d = Path(run_dir) / DIR
    for p in d.glob("*"):
        p.unlink(missing_ok=True)
    return d


def explain(run_dir: Path, exit_codes: dict[int, int], timeout_s: float) -> tuple[str, bool]:
    """One line saying which rank failed, at which step, and why; and whether it is the user's to fix
    (a ConfigError: exit code 2). `exit_codes`: each rank's exit code as torchrun saw it (negative: a signal)."""
    recs = records(run_dir)
    primary = [r for r in recs if not r["secondary"]]
    if primary:
        r = primary[0]
        return f"rank {r['rank']}, {_at(r['step'], run_dir)}: {r['type']}: {r['message']}", r["config_error"]
    silent = sorted(set(exit_codes) - {r["rank"] for r in recs})
    step = _at(recs[0]["step"] if recs else None, run_dir)
    who = f"rank {silent[0]}" if silent else "another rank"
    if any("imed out" in r["message"] for r in recs):  # a collective's time limit: someone never came
        r = next(r for r in recs if "imed out" in r["message"])
        return (f"rank {r['rank']}, {step}: waited more than hardware.collective_timeout_s={timeout_s:g} s in a "
                f"collective for {who}, which hung or fell far behind; every rank was stopped"), False
    dead = [k for k in silent if exit_codes[k] < 0]
    if dead:
        k = dead[0]
        return (f"rank {k}, {step}: killed by {signal.Signals(-exit_codes[k]).name}, with no error of its own; "
                "the other ranks were stopped"), False
    if recs:
        r = recs[0]
        return f"rank {r['rank']}, {step}: lost {who}: {r['type']}: {r['message'][:200]}", False
    codes = ", ".join(f"rank {k}: {v}" for k, v in sorted(exit_codes.items()))
    return f"{step}: a worker failed without saying why (exit codes {codes})", False


def _at(step: Optional[int], run_dir: Path) -> str:
    """'step N' (from the record, else the step after the last one logged)."""
    if step is None:
        path = Path(run_dir) / "metrics.jsonl"
        try:
            lines = path.read_text().splitlines() if path.is_file() else []
            step = int(json.loads(lines[-1])["step"]) + 1 if lines else None
        except (ValueError, KeyError):
            step = None
    return f"step {step}" if step is not None else "before the first step"
