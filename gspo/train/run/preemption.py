"""Stopping on a signal without losing a finished step: preemption, time limits, `docker stop`, Ctrl-C.

SIGTERM (SLURM preemption and time limits, `docker stop`, Kubernetes, `kill`), SIGINT (Ctrl-C)
and, in a submitit job, submitit's preemption signal (SIGUSR2, `SUBMITIT_PREEMPT_SIGNAL`) ask the
run to stop. The step in progress is finished (its rollout, updates, log line and evaluation: a
half-done update cannot be checkpointed), then a checkpoint of it is written, summary.json says
`preempted` (SIGTERM, SIGUSR2) or `stopped` (SIGINT), one line says how to resume, and the
process exits with PREEMPTED_EXIT or STOPPED_EXIT. A second signal ends the process at once
with the signal's default action: as after kill -9, a resume continues from the last checkpoint.
The same signal again within SAME_SIGNAL_S is the first one delivered twice (Ctrl-C and SLURM
signal every process, and torchrun passes on what it got to its workers), not a second one.

Under several processes every rank stops after the same step: each rank's request is
all-reduced once per step (`StopSignals.agreed`). The process that launched the workers
(`launcher.launch`, waiting on torchrun) cannot name them, so it passes a signal on
through a file the workers look for (STOP_FILE_ENV names it).

In a submitit job, the handler submitit had installed for the signal (its checkpoint-and-requeue)
runs once gspo's own checkpoint is written (`StopSignals.close`), so the job requeues itself and
the requeued job continues its run (gspo/train/run/sweep.py; a single run under SLURM: `resume_requeued`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Optional

from gspo.train.run import failures

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later", i.e. resume
STOPPED_EXIT = 130  # the shell's code for a Ctrl-C
EXIT_CODES = {"preempted": PREEMPTED_EXIT, "stopped": STOPPED_EXIT}
STOP_FILE_ENV = "GSPO_STOP_FILE"
SAME_SIGNAL_S = 1.0
_STATUS = {signal.SIGINT: "stopped"}  # any other handled signal: preempted
_RANK = {None: 0, "stopped": 1, "preempted": 2}  # all-reduced with MAX: preempted wins


def _signals() -> list[signal.Signals]:
    """SIGTERM, SIGINT, and submitit's preemption signal when submitit has a handler on it."""
    sigs = [signal.SIGTERM, signal.SIGINT]
    usr = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
    if usr is not None and usr not in sigs and callable(signal.getsignal(usr)):
        sigs.append(usr)
    return sigs


class Stopped(Exception):
    """A stop signal honoured before the RL loop (during the warm start): what was done is saved."""

    def __init__(self, status: str, where: str):
        super().__init__(f"{status} {where}")
        self.status, self.where = status, where


def resume_command(run_dir: Path | str) -> str:
    return f"gspo train resume={run_dir}"


class StopSignals:
    """Turns the first stop signal into a request the training loop honours at the next step boundary.

    `pass_to`: in the process that waits on torchrun's workers, the request is written to this file,
    which the workers read (STOP_FILE_ENV), and a second signal raises torchrun's SignalException with
    SIGKILL, so that torchrun kills them at once. A no-op outside the main thread (Python delivers
    signals there only).
    """

    def __init__(self, pass_to: Optional[Path] = None) -> None:
        self.signum: Optional[int] = None
        self._at = 0.0  # when the first signal came
        self.status: Optional[str] = None  # set by `agreed` once the ranks agree to stop
        self._previous: dict[int, object] = {}
        self._file = os.environ.get(STOP_FILE_ENV) if pass_to is None else None
        self._pass_to = pass_to

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in _signals():
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second signal: no more waiting
            if signum == self.signum and time.monotonic() - self._at < SAME_SIGNAL_S:
                return  # the first one, delivered twice
            if self._pass_to is not None:
                from torch.distributed.elastic.multiprocessing.api import SignalException

                raise SignalException(f"second {name}: stopping at once", sigval=signal.SIGKILL)
            self.kill(signum)
            return
        if self._file and failures.any_recorded():  # torchrun stopping the ranks after one failed: nothing to finish
            os._exit(1)
        self.signum, self._at = signum, time.monotonic()
        if not self._file:  # a worker of gspo's launcher stays quiet: the launcher says it once
            # os.write, not print: the handler may interrupt a print to the same stream
            os.write(2, f"gspo: {name}: finishing the step in progress, then saving a checkpoint "
                        f"(send {name} again to stop at once and lose that step)\n".encode())
        if self._pass_to is not None:
            tmp = self._pass_to.with_name(self._pass_to.name + ".tmp")
            tmp.write_text(_STATUS.get(signum, "preempted"))
            os.replace(tmp, self._pass_to)
            self.status = _STATUS.get(signum, "preempted")

    def requested(self) -> Optional[str]:
        """This process's request: None, "stopped" or "preempted"."""
        if self.signum is not None:
            return _STATUS.get(self.signum, "preempted")
        if self._file and os.path.exists(self._file):
            return Path(self._file).read_text().strip() or "preempted"
        return None

    def agreed(self, dist) -> Optional[str]:
        """Whether to stop now, the same answer on every rank (one all-reduce under several processes)."""
        want = self.requested()
        if dist.world > 1:
            import torch
            import torch.distributed as tdist

            x = torch.tensor([_RANK[want]], dtype=torch.float64, device=dist.device)
            tdist.all_reduce(x, op=tdist.ReduceOp.MAX)
            want = {v: k for k, v in _RANK.items()}[int(x.item())]
        self.status = want
        return want

    def kill(self, signum: Optional[int] = None) -> None:
        """End this process as the signal's default action would (the first signal's by default)."""
        signum = signum or self.signum
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._previous.items():
            signal.signal(sig, old)

    def close(self) -> None:
        """Put the previous handlers back; after a stop, run the one the stopping signal had (submitit's requeue)."""
        self.restore()
        old = self._previous.get(self.signum)
        if self.status is not None and callable(old) and old is not signal.default_int_handler:
            old(self.signum, None)


def resume_requeued(run_dir: Path | str) -> bool:
    """Whether this run is a requeued SLURM job (SLURM_RESTART_COUNT > 0) whose run directory already holds its
    run: then it resumes that run instead of starting over. (A sweep's jobs continue their runs whatever
    started them again: gspo/train/run/sweep.py.)"""
    run_dir = Path(run_dir)
    return (run_dir / "config.yaml").is_file() and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
