"""The run's record and its checkpointer: where a run starts, when it saves, what a save holds, RUN_DIR/summary.json.

Two objects, each built complete when set-up has what it needs:

    RunRecord     first, before anything is built: where the run starts (`start`, `resume_from`: the newest readable
                  checkpoint of a resumed run), summary.json, and what a run with nothing left to train recorded of
                  its end. It restores the resumed state into what set-up builds: `restore_weights` before the model
                  is wrapped, `restore` into the optimizer and schedule (whose answer, `Restored`, the checkpointer
                  is built with: there is no checkpointer of parts a resume has not restored)
    Checkpointer  once the parts a checkpoint holds are built: the policy's (`Restored`), the batch source's pending
                  batches, PPO's critic, a reset reference

The loop asks the checkpointer two things and never decides their timing itself:

    maybe_save(step, metrics)   the step's checkpoint, if due (every train.checkpoint_every steps and the last;
                                after the last, a LoRA run's merged export), and summary.json's `steps`
    save_stopped(step)          a stopped run's last finished step, unless already saved

A resume with nothing left to train finishes the run's record if a stop (kill -9) came between the last
checkpoint and the run's end (RunRecord's `complete`, `final`, `finish`): the summary an uninterrupted run ends with.

The format on disk is gspo/train/run/checkpoint.py's; rank 0 alone writes (FSDP: full tensors gathered first).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from omegaconf import DictConfig

from gspo.core import provenance
from gspo.core.errors import ConfigError
from gspo.core.files import replace_text
from gspo.models import adapters
from gspo.rollout.source import pending_of
from gspo.train.loop.components import BatchSource, Saved
from gspo.train.ranks.distributed import Dist
from gspo.train.run import checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def resume_point(run_dir: Path | str, log=lambda msg: None) -> tuple[int, Optional[Path]]:
    """(the step to continue after, its checkpoint): the newest readable checkpoint's, else (0, None)."""
    ckpt = checkpoint.resumable(run_dir, log=log)
    return (int(checkpoint.load_state(ckpt)["step"]), ckpt) if ckpt is not None else (0, None)


def _step_of(line: str) -> Optional[int]:
    """The step of a metrics.jsonl line (None: unreadable)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def next_step(run_dir: Path | str) -> int:
    """The first step a resume of `run_dir` trains: after its newest readable checkpoint."""
    return resume_point(run_dir)[0] + 1


class Summary:
    """RUN_DIR/summary.json, true after any stop: written at step 0, at every checkpoint and at the end.

    `status` is running (also after a kill -9: then `steps` is the last checkpoint), finished,
    preempted (SIGTERM), stopped (Ctrl-C) or failed; `wall_s` adds up the time of every session of
    a resumed run, a restart from step 0 included.
    """

    def __init__(self, run_dir: Path, is_main: bool, resumed: bool, restarted: bool = False):
        self.path, self.is_main, self.t0 = run_dir / "summary.json", is_main, time.time()
        old: dict = json.loads(self.path.read_text()) if (resumed or restarted) and self.path.is_file() else {}
        # a restart from step 0 keeps the record of what its resumes changed (gspo/train/run/resume.py)
        self.data = old if resumed else {k: old[k] for k in ("resumes",) if k in old}
        # this session's machine, packages and code (a resume on another is in `resumes`, recorded before this:
        # gspo/train/run/resume.py); torch's threads are set by now
        self.data["machine"] = provenance.machine(threads=torch.get_num_threads())
        self.wall0 = float(old.get("wall_s", 0.0))  # a restart from step 0 still counts the sessions before it

    def write(self, **values) -> None:
        self.data |= values
        self.data["wall_s"] = self.wall0 + time.time() - self.t0
        if self.is_main:
            try:
                replace_text(self.path, json.dumps(self.data, indent=2))
            except OSError as e:  # a full disk: keep the previous summary, do not hide the error that stopped the run
                print(f"gspo: warning: cannot write {self.path}: {e}", file=sys.stderr)


@dataclass(frozen=True)
class Restored:
    """The policy's parts that each checkpoint saves, a resumed run's state loaded into them (`RunRecord.restore`),
    and what else of this rank's the resumed checkpoint held: the parts a `Checkpointer` is built with."""

    policy: torch.nn.Module  # what the update trains through: DDP(model), fully_shard(model), or the model
    tokenizer: PreTrainedTokenizerBase
    opt: torch.optim.Optimizer  # a resumed run's optimizer state loaded
    sched: torch.optim.lr_scheduler.LRScheduler  # a resumed run's schedule loaded
    pending: dict[int, dict]  # a resumed run's batches sampled ahead (rollout.staleness), this rank's share ({}: none)


class RunRecord:
    """One run's resume point, summary.json and recorded end: read once, when built (before anything else is)."""

    def __init__(self, cfg: DictConfig, run_dir: Path, dist: Dist, dtype: torch.dtype):
        self.cfg, self.run_dir, self.dist, self.dtype = cfg, Path(run_dir), dist, dtype
        self.start, self.resume_from = self._resume_point()  # the last step already done (0: a new run), its checkpoint
        self.summary = Summary(self.run_dir, dist.is_main, resumed=self.resume_from is not None,
                               restarted=bool(cfg.resume))
        # nothing left to train: the row of metrics.jsonl for the last step, and the final evaluation's metrics as
        # the run recorded them (None: never run, e.g. train.steps lowered to where the run stands; run it again)
        self.last_row: dict = {}
        self.final: Optional[dict] = None
        if self.start >= cfg.train.steps:
            self.last_row, self.final = self._recorded_end()
            if dist.is_main:
                print(self._end_line(), flush=True)

    @property
    def finished(self) -> bool:
        """The run already did its train.steps (its record may still need finishing: `complete`, `final`)."""
        return self.start >= self.cfg.train.steps

    @property
    def complete(self) -> bool:
        """summary.json records the run's end at its last checkpoint: finished, with its final accuracy, and a
        LoRA run's merged export written if asked (the export is renamed into place whole, so one there is whole)."""
        d = self.summary.data
        return (d.get("status") == "finished" and d.get("steps") == self.start and "final_accuracy" in d
                and (not self.cfg.model.lora.save_merged or (self.run_dir / "merged").is_dir()))

    def _recorded_end(self) -> tuple[dict, Optional[dict]]:
        """(metrics.jsonl's row of step `start`, the final evaluation's metrics as recorded or None). The row is
        logged before the step's checkpoint is written, so a run stopped after it holds the evaluation of the last
        step there; summary.json's final accuracy counts too (the row may be gone with a lost metrics.jsonl)."""
        path, row = self.run_dir / "metrics.jsonl", {}
        for line in path.read_text().splitlines() if path.is_file() else []:
            if _step_of(line) == self.start:
                row = json.loads(line)  # the last one: the one the resume keeps
        d = self.summary.data
        if d.get("steps") == self.start and d.get("final_accuracy") is not None:
            return row, {"eval/accuracy": d["final_accuracy"]}
        evaluated = {k: v for k, v in row.items() if k.startswith("eval/")}
        return row, evaluated if "eval/accuracy" in evaluated else None

    def _end_line(self) -> str:
        """What a resume with nothing left to train does, in one line."""
        steps, status = self.cfg.train.steps, self.summary.data.get("status")
        if self.complete:
            return f"gspo: {self.run_dir} already finished its {self.start} steps (train.steps={steps}); nothing to do"
        todo = "running its final evaluation, then " if self.final is None else ""
        return (f"gspo: {self.run_dir} has trained {self.start} steps (train.steps={steps}) but its summary says "
                f"{status!r}: nothing left to train; {todo}finishing its record")

    def _resume_point(self) -> tuple[int, Optional[Path]]:
        """(0, None) for a new run or one killed before its first checkpoint."""
        if not self.cfg.resume:
            return 0, None
        main = self.dist.is_main
        step, ckpt = resume_point(self.run_dir, log=print if main else lambda msg: None)
        if ckpt is None:
            if main:
                print(f"gspo: {self.run_dir} has no checkpoint yet: restarting it from step 0 (its metrics so far are "
                      "dropped)")
            return 0, None
        if main and step < self.cfg.train.steps:
            print(f"gspo: resuming from step {step} of {self.cfg.train.steps} (checkpoint {ckpt})", flush=True)
        return step, ckpt

    # -- restoring a resumed run -------------------------------------------------
    def restore_weights(self, model: torch.nn.Module) -> None:
        """A resumed run's policy weights into `model` (LoRA: the adapter only), before it is wrapped; every rank
        loads the same checkpoint."""
        if self.resume_from is not None:
            checkpoint.load_weights(model, self.resume_from, self.dist.storage_dtype(self.dtype))

    def restore(self, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, opt: torch.optim.Optimizer,
                sched: torch.optim.lr_scheduler.LRScheduler) -> Restored:
        """The policy's parts that each checkpoint saves, as a `Checkpointer` is built with them: in a resumed run,
        its optimizer and schedule loaded into them, and this rank's batches sampled ahead (`pending`)."""
        if self.resume_from is None:
            return Restored(policy, tokenizer, opt, sched, pending={})
        state = checkpoint.load_state(self.resume_from)
        checkpoint.load_optimizer(policy, opt, state["optimizer"], fsdp=self.dist.strategy == "fsdp")
        sched.load_state_dict(state["scheduler"])
        if state.get("pending") and int(state.get("pending_world", self.dist.world)) != self.dist.world:
            raise ConfigError(f"{self.resume_from} holds batches sampled ahead (rollout.staleness="
                              f"{self.cfg.rollout.staleness}) by {state['pending_world']} ranks' shares of the "
                              f"prompts; resume with hardware.nproc={state['pending_world']}")
        return Restored(policy, tokenizer, opt, sched, pending=pending_of(state, self.dist.rank))

    # -- the loop's calls ----------------------------------------------------------
    def running(self, base: Optional[dict]) -> None:
        """summary.json at the start: `running`, with the base's held-out accuracy (`base`: a new run's step-0
        evaluation); a resumed run without its old final accuracy, not `finished` while it works."""
        if base is not None:
            self.summary.write(status="running", base_accuracy=base["eval/accuracy"], steps=0)
        else:
            self.summary.data.pop("final_accuracy", None)
            self.summary.write(status="running")

    def record_final(self, final: dict) -> None:
        """The final evaluation `final`, just run (the run had not recorded it: `self.final` is None), into
        metrics.jsonl's row of its step as the loop logs it (a second row of the step would make `gspo compare` refuse
        the run), the file replaced whole (rank 0). The logger's handle then writes to the replaced file: nothing is
        logged after."""
        if self.dist.is_main:
            path = self.run_dir / "metrics.jsonl"
            lines = path.read_text().splitlines() if path.is_file() else []
            row = {"step": self.start, **{k: v for k, v in self.last_row.items() if k != "step"}, **final}
            at = [i for i, line in enumerate(lines) if _step_of(line) == self.start]
            if at:
                lines[at[-1]] = json.dumps(row, allow_nan=True)
            else:
                lines.append(json.dumps(row, allow_nan=True))
            replace_text(path, "".join(line + "\n" for line in lines))

    def finish(self, final: dict) -> None:
        """A resume with nothing left to train: what the last step's `maybe_save` writes after its checkpoint, from
        the final evaluation `final` (the recorded one, or the one just run). The merged export is written again even
        when one is there: it may be an earlier end's (a finished run resumed for more steps)."""
        self.summary.write(steps=self.start, final_accuracy=final["eval/accuracy"])
        self.export_merged()

    def export_merged(self) -> None:
        """A LoRA run's merged export of its newest checkpoint, if asked (rank 0); what an export killed midway left
        (its temporary directory) goes first."""
        if self.cfg.model.lora.save_merged and self.dist.is_main:
            for left in self.run_dir.glob(".tmp-merged-*"):  # adapters.export_merged's temporary name
                shutil.rmtree(left, ignore_errors=True)
            adapters.export_merged(checkpoint.latest(self.run_dir), self.run_dir / "merged",
                                   self.dist.storage_dtype(self.dtype))


class Checkpointer:
    """RUN_DIR/checkpoints of one run: its saves and their timing. Built once set-up has built (and a resume
    restored) every part a checkpoint holds: the policy's (`restored`), the batch source's batches sampled ahead
    (`source`), and `parts` with state of their own (None: absent)."""

    def __init__(self, run: RunRecord, restored: Restored, source: BatchSource,
                 parts: tuple[Optional[Saved], ...] = ()):
        self.run, self.cfg, self.dist = run, run.cfg, run.dist  # (the run's, at hand)
        self.restored, self.source, self.parts = restored, source, parts
        self.saved = run.start  # the step of the newest checkpoint

    def maybe_save(self, step: int, metrics: dict) -> None:
        """The step's checkpoint every train.checkpoint_every steps and at the last (with the final accuracy; a
        LoRA run's merged export if asked)."""
        last = step == self.cfg.train.steps
        if step % self.cfg.train.checkpoint_every and not last:
            return
        self.save(step)
        self.run.summary.write(steps=step, **({"final_accuracy": metrics["eval/accuracy"]} if last else {}))
        if last:
            self.run.export_merged()

    def save_stopped(self, step: int) -> None:
        """A stopped run's last finished step `step`, unless its checkpoint is already written."""
        if step > self.saved:
            self.save(step)
            self.run.summary.write(steps=step)

    def save(self, step: int) -> None:
        """Step `step`'s checkpoint (rank 0 writes it; every rank calls it): the policy, its optimizer and schedule,
        every rank's batches sampled ahead (which a resume needs to compute what the uninterrupted run does),
        and the parts' own state."""
        files, extra = {}, {}
        for part in self.parts:
            if part is not None:
                f, e = part.checkpoint()
                files, extra = files | f, extra | e
        pending = self.source.pending()
        if pending:
            everyone = self.dist.gather_objects(pending)
            extra |= {"pending": dict(enumerate(everyone)) if self.dist.is_main else {},
                      "pending_world": self.dist.world}
        r, model_state, optim_state = self.restored, None, None
        if self.dist.strategy == "fsdp":  # full tensors gathered from every rank (a collective)
            model_state, optim_state = self.dist.full_state(r.policy, r.opt)
        if self.dist.is_main:
            checkpoint.save(self.run.run_dir, step, r.policy, r.tokenizer, r.opt, r.sched,
                            keep=self.cfg.train.keep_checkpoints, model_state=model_state,
                            optimizer_state=optim_state, extra=extra, files=files)
        self.dist.barrier(long=True)  # writing a large checkpoint may outlast the collective time limit
        self.saved = step
