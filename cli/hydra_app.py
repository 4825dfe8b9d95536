"""Hydra's entry point for `gspo train`: one job of a run or of a multirun sweep.

`gspo train` has checked the config before calling this. A ConfigError that can only arise
here (a user's data or reward function, a worker's) is the user's to fix, so it must end as
one line and exit code 2, not as Hydra's report (a line of overrides, a traceback, exit 1); a
RunFailed (a diverged run, a lost rank) ends as one line and exit code 1:
a job running in this process records it in JOB_ERRORS for `cli.main` to print; a job a
launcher runs elsewhere (joblib, SLURM) raises it, with the job named, and Hydra hands it
back to `cli.main` (which sets HYDRA_FULL_ERROR so Hydra re-raises it).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from gspo.config.loading import _register_resolvers, load_run_config, resume_overrides
from gspo.config.schema import CONF_DIR, register_configs
from gspo.core.errors import ConfigError, RunFailed

register_configs()
_register_resolvers()

# ConfigErrors (exit code 2) and RunFailed (1) of the jobs run in this process, as (message, exit code)
JOB_ERRORS: list[tuple[str, int]] = []


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def hydra_train(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    in_process = hc.mode == RunMode.RUN or str(hc.launcher.get("_target_", "")).endswith("BasicLauncher")
    try:
        return _train_job(cfg, hc)
    except (ConfigError, RunFailed) as e:
        msg = str(e)
        if hc.mode == RunMode.MULTIRUN:  # say which job of the sweep
            msg = f"job {hc.job.num} ({' '.join(hc.overrides.task)}): {msg}"
        if not in_process:
            raise type(e)(msg) from None
        JOB_ERRORS.append((msg, 2 if isinstance(e, ConfigError) else 1))
        return float("nan")


def _train_job(cfg: DictConfig, hc) -> float:
    from gspo.train.loop import checkpointer
    from gspo.train.ranks import distributed, launcher
    from gspo.train.run import preemption, resume, rundir, sweep

    run_dir, before, requeued = Path(hc.runtime.output_dir), None, False
    if cfg.resume:  # continue the stopped run in its own directory, with its own config
        run_dir = Path(cfg.resume)
        before = load_run_config(run_dir)
        cfg = load_run_config(run_dir, resume_overrides(list(hc.overrides.task)))
        resume.check(before, cfg)  # (`gspo train` checked it already)
        cfg.resume = str(run_dir)
    elif hc.mode == RunMode.MULTIRUN:  # a sweep's job: start its run, or continue / skip the one its directory holds
        plan = sweep.plan(run_dir, cfg, list(hc.overrides.task))
        if plan.action == "skip":
            print(f"gspo: {run_dir}: finished its {plan.summary.get('steps')} steps; skipped", flush=True)
            final = plan.summary.get("final_accuracy")
            return final if final is not None else float("nan")
        if plan.action == "resume":
            print(f"gspo: continuing the run in {run_dir}", flush=True)
        cfg, before = plan.cfg, plan.before
    elif preemption.resume_requeued(run_dir):  # SLURM requeued this run (preempted): continue it
        print(f"gspo: requeued job: resuming {run_dir}", flush=True)
        before = load_run_config(run_dir)  # what the run saved: a requeue changing a setting is recorded too
        cfg.resume, requeued = str(run_dir), True
    elif launcher.is_main_process():  # a new run: never into a directory that holds one
        rundir.check_new(run_dir, "hydra.run.dir")
    launch = launcher.needs_launch(cfg.hardware)  # hardware=cpu-ddp|gpu-ddp|gpu-fsdp: torchrun the workers, wait
    if not launch:  # one process, or a worker of a torchrun started by hand (every rank takes rank 0's directory)
        run_dir = launcher.shared_run_dir(run_dir, cfg.hardware)
    with rundir.lock(run_dir) if launcher.is_main_process() else contextlib.nullcontext():
        if before is not None and launcher.is_main_process():
            entry = resume.entry(run_dir, before, cfg, checkpointer.next_step(run_dir))  # e.g. train.steps, from N on
            # e.g. hardware.threads or another CPU: the run would no longer be a function of its seed and config;
            # refused unless forced (a requeued job is: no one is there to say it)
            resume.refuse_numbers(entry, forced=bool(cfg.get("force_resume")) or requeued)
            resume.record(run_dir, entry)
            warning = resume.numbers_warning(entry)
            if warning:
                print(warning, file=sys.stderr, flush=True)
        if launch:  # a worker's failure comes back as one line (gspo/train/run/failures.py)
            summary = launcher.launch(cfg, run_dir)
        else:
            from gspo.train.loop.trainer import train  # (not in a launcher: its workers import it, ~2 CPU-s each)

            summary = train(cfg, run_dir)
    if not launch:
        distributed.shutdown()  # ranks leave the process group together (no-op in one process)
    if summary.get("status") in preemption.EXIT_CODES:  # stopped by a signal: the line saying how to resume is out
        raise SystemExit(preemption.EXIT_CODES[summary["status"]])
    if not launcher.is_main_process():
        return float("nan")
    base, final = summary.get("base_accuracy"), summary.get("final_accuracy")
    if base is not None and final is not None:
        print(f"held-out accuracy: base {base:.1%} -> trained {final:.1%} ({100 * (final - base):+.1f} points)")
    print(f"run directory: {run_dir}")
    return final if final is not None else float("nan")
