"""Everything the loop needs before its first step, built by one call: `setup(cfg, run_dir)`.

Hardware and torch.distributed, the resume point, the task and its held-out split, the warm-started
base, LoRA, the reference policy, the optimizer and schedule (restored on resume), the MoE step
component, the sampler and the metrics logger. `gspo.train.trainer.train` reads as the loop it runs.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from gspo.config.errors import ConfigError
from gspo.models import adapters
from gspo.models.build import load_pretrained, tokenizer_encode
from gspo.rollout import engine
from gspo.rollout.batch import Share, collect
from gspo.rollout.generate import stop_ids
from gspo.rollout.multiturn import ToolUse
from gspo.rollout.params import SamplingParams
from gspo.rollout.sampler import Sampler, old_logprobs_mode, sampler_dtype, separate
from gspo.rollout.source import Inline, describe, pending_of
from gspo.rollout.workers import WorkerPool
from gspo.tasks import Task, build_task
from gspo.tasks.rewards import probe
from gspo.train import checkpoint, distributed
from gspo.train.checks import warn_task_on_chat_model
from gspo.train.critic import Critic
from gspo.train.heldout import eval_params, evaluate, heldout_problems
from gspo.train.logging import MetricsLogger
from gspo.train.moe_step import MoEStep
from gspo.train.preemption import Stopped, resume_command
from gspo.train.reference import RefSync
from gspo.train.teacher import Teacher
from gspo.train.warm_start import base_model


@dataclass
class Setup:
    """What `train` needs: the run's parts, ready, and where it starts from."""

    dist: Any  # gspo.train.distributed: one process, or a rank of a torchrun group
    dtype: torch.dtype  # the training precision (hardware.dtype)
    summary: "_Summary"  # RUN_DIR/summary.json
    start: int  # the last step already done (0 for a new run)
    finished: bool = False  # the run already did its train.steps: nothing else below is built
    stopped: Optional[str] = None  # a stop signal came during the warm start (saved): nothing else is built
    task: Optional[Task] = None
    model: Any = None  # the policy's module (a PeftModel under LoRA)
    tokenizer: Any = None
    policy: Any = None  # what the update trains through: DDP(model), fully_shard(model), or model
    ref: Any = None  # the KL reference, or None (beta 0)
    ref_sync: Optional[RefSync] = None  # its resets (algo.sync_ref_model), or None
    teacher: Optional[Teacher] = None  # on-policy distillation's frozen teacher (teacher.path), or None
    critic: Optional[Critic] = None  # where advantages come from: the group's rewards, or PPO's value model
    opt: Optional[torch.optim.Optimizer] = None
    sched: Any = None
    recompute: bool = False  # the old policy's log-probs are recomputed by the trainer
    moe_step: Optional[MoEStep] = None  # a no-op on dense models
    sampler: Optional[Sampler] = None  # the trainer's model, or a copy in rollout.dtype
    source: Any = None  # where each step's batch comes from (gspo/rollout/source.py): in process, or workers
    pending: Optional[dict] = None  # a resumed run's batches sampled ahead (rollout.staleness), for source.start
    logger: Any = None  # MetricsLogger on rank 0, a NullLogger elsewhere
    evaluate: Optional[Callable[[int], dict]] = None  # held-out evaluation of the policy after a step (every rank a share)


def setup(cfg: DictConfig, run_dir: Path, stop=None) -> Setup:
    """Build what the loop needs for `cfg` in `run_dir`, restoring a resumed run's weights and optimizer.

    `stop` (preemption.StopSignals): a stop signal during the warm start saves it and returns a Setup with
    `stopped` set (the next run continues the warm start)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = _setup_hardware(cfg.hardware, cfg)
    dist = distributed.setup(cfg, device)  # one process, or a rank of a torchrun group (gspo/train/distributed.py)
    device = dist.device
    start, resume_ckpt = _resume_point(cfg, run_dir, dist)
    summary = _Summary(run_dir, dist.is_main, resumed=resume_ckpt is not None, restarted=bool(cfg.resume))
    if start >= cfg.train.steps:  # a finished run: leave everything as it is
        if dist.is_main:
            print(f"gspo: {run_dir} already finished its {start} steps (train.steps={cfg.train.steps}); nothing to do")
        return Setup(dist, dtype, summary, start, finished=True)
    if dist.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    task = build_task(cfg.task)
    if cfg.reward.name in ("python", "model"):  # each function (reward model) on one real sample, before any work
        probe(task, cfg, tokenizer_encode(cfg, task))
    eval_problems = heldout_problems(task, cfg.task)  # warns when the held-out split is short
    stopped = None  # rank 0 builds the warm-started base (minutes, preemptible), the others then load it
    if dist.is_main:
        try:
            base_dir = base_model(cfg, task, stop=stop)
        except Stopped as e:
            stopped = e
    dist.barrier(long=True)
    if not dist.all_true(stopped is None):  # a stop during the warm start: every rank leaves, nothing lost
        status = stopped.status if stopped else (stop.requested() if stop else None) or "preempted"
        if dist.is_main:
            print(f"gspo: {status} {stopped.where}; resume with: {resume_command(run_dir)}", flush=True)
        summary.write(status=status)
        return Setup(dist, dtype, summary, 0, stopped=status)
    if not dist.is_main:
        base_dir = base_model(cfg, task)
    model, tokenizer = load_pretrained(base_dir, dist.storage_dtype(dtype), cfg.model.attn_implementation,
                                       device=device, log=print if dist.is_main else None)
    model.to(device)
    if dist.is_main:
        warn_task_on_chat_model(task, tokenizer, cfg)
    if cfg.model.gradient_checkpointing:  # transformers 5 renames the switch; take whichever this version has
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model = adapters.apply(model, cfg.model.lora, base_dir, cfg.seed)  # LoRA: model.lora.r > 0 -> PeftModel, base frozen
    if separate(cfg) or cfg.rollout.workers or cfg.model.lora.save_merged:  # merged weights are served or saved
        adapters.check_mergeable(model)  # (not an adapter on a tied LM head)
    # beta 0: no reference model in memory; LoRA: the reference is the base, i.e. adapters off (no copy)
    ref = _frozen_copy(model) if cfg.algo.beta > 0 and not adapters.is_adapted(model) else None
    if resume_ckpt is not None:  # every rank loads the same checkpoint, before wrapping
        checkpoint.load_weights(model, resume_ckpt, dist.storage_dtype(dtype))  # LoRA: the adapter only
    ref_sync = RefSync.for_run(cfg, ref, dist, resume_ckpt)  # algo.sync_ref_model (a resumed run's reset reference)
    policy = dist.wrap(model, dtype)  # what the update trains through: DDP(model), fully_shard(model), or model
    ref = dist.wrap(ref, dtype, frozen=True) if ref is not None else None
    if cfg.algo.beta > 0 and adapters.is_adapted(model):  # LoRA: reference = same weights, adapters disabled
        ref = adapters.reference(model)
    teacher = Teacher.for_run(cfg, tokenizer, dist, dtype)  # teacher.path: a frozen checkpoint beside the reference
    # fused: one kernel for all the tensors' updates (~5x foreach's speed at the tiny models' sizes on a CPU,
    # docs/benchmarks.md); FSDP2's sharded parameters keep the default (foreach) path
    fused = {"fused": True} if dist.strategy != "fsdp" else {}
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],  # LoRA: the adapters only
                            lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, **fused)
    # warmup counts RL steps, like train.steps: the scheduler steps once per rollout batch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.train.warmup_steps)))
    pending: dict = {}
    if resume_ckpt is not None:
        state = checkpoint.load_state(resume_ckpt)
        dist.load_optimizer_state(policy, opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        pending = pending_of(state, dist.rank)
        if state.get("pending") and int(state.get("pending_world", dist.world)) != dist.world:
            raise ConfigError(f"{resume_ckpt} holds batches sampled ahead (rollout.staleness={cfg.rollout.staleness}) "
                              f"by {state['pending_world']} ranks' shares of the prompts; resume with "
                              f"hardware.nproc={state['pending_world']}")
    critic = Critic.for_run(cfg, base_dir, dist, dtype, resume_ckpt)  # PPO's value model (algo.advantage=gae)
    recompute = old_logprobs_mode(cfg) == "recompute"
    moe_step = MoEStep.for_model(model, cfg, dist, old_pass=recompute)  # a no-op for dense models
    # where batches come from: sampled in this process (the trainer's model, or a copy in rollout.dtype), or by
    # rollout.workers processes; rollout.staleness steps behind either way (gspo/rollout/source.py)
    sampler = None if cfg.rollout.workers else Sampler.for_run(
        model, cfg, engine=lambda: _engine(cfg, dist, model, tokenizer, base_dir, moe_step))
    try:
        source = _source(cfg, dist, model, sampler, tokenizer, task, moe_step, base_dir)
        if dist.is_main and describe(cfg.rollout.staleness, cfg.rollout.workers):
            print(f"gspo: {describe(cfg.rollout.staleness, cfg.rollout.workers)}", flush=True)
        # a resumed run drops what was logged after its checkpoint; one with no checkpoint starts over
        kept = (start if resume_ckpt is not None else -1) if cfg.resume else None
        logger = MetricsLogger(run_dir, cfg, resume_step=kept) if dist.is_main else distributed.NullLogger()
    except BaseException:  # the engine started above stops here (train() called in-process: no exit to end it)
        if sampler is not None:
            sampler.close()
        raise
    ev = lambda step: dist.evaluate(lambda problems: evaluate(  # noqa: E731  (each rank scores a share)
        model, tokenizer, task, problems, eval_params(cfg), cfg.eval.pass_k, timeout_s=cfg.reward.timeout_s,
        key=(cfg.seed, step), tools=ToolUse.of(cfg)), eval_problems, model)
    summary.data["eval_n"] = len(eval_problems)  # the true held-out count: a small data file has fewer than task.eval_size
    return Setup(dist, dtype, summary, start, task=task, model=model, tokenizer=tokenizer,
                 policy=policy, ref=ref, ref_sync=ref_sync, teacher=teacher, critic=critic, opt=opt, sched=sched,
                 recompute=recompute, moe_step=moe_step,
                 sampler=sampler, source=source, pending=pending, logger=logger, evaluate=ev)


def _source(cfg, dist, model, sampler, tokenizer, task, moe_step, base_dir):
    """The batch source: `Inline` (rollout.workers=0) or a `WorkerPool`, `rollout.staleness` steps behind."""
    r = cfg.rollout
    lo, hi = dist.share(r.prompts_per_step)
    share = Share(lo, hi, dist.world, dist.device)
    if not r.workers:
        agree = dist.all_true if dist.world > 1 else None
        step_batch = lambda step: collect(cfg, step, lambda: sampler.serve(model, dist), tokenizer, task,  # noqa: E731
                                          share, SamplingParams.of(cfg, **moe_step.sample_kwargs()), agree)
        return Inline(step_batch, sampler, r.staleness, cfg.train.steps, r.worker_threads)
    threads = worker_threads(cfg, dist.world)
    spec = {"config": OmegaConf.to_container(cfg, resolve=True), "base_dir": str(base_dir), "threads": threads,
            "lo": lo, "hi": hi, "world": dist.world, "device": str(dist.device),
            "sample_kwargs": moe_step.sample_kwargs()}
    if r.engine == "vllm":  # each worker hosts its own engine (gspo/rollout/worker.py)
        spec["engine"] = engine.spec(cfg, base_dir, stop_ids(model, tokenizer), (hi - lo) * r.group_size, threads,
                                     moe_step.sample_kwargs().get("capture_routing", False), dist.device.type == "cpu")
    return WorkerPool(spec, r.workers, r.staleness, cfg.train.steps, getattr(torch, sampler_dtype(cfg)), r.timeout_s,
                      dist.rank)


def _engine(cfg, dist, model, tokenizer, base_dir, moe_step):
    """The vLLM engine as this rank's sampler (rollout.workers=0): its process started, sharing this rank's cores
    with the trainer, which waits while it samples (rollout.worker_threads sets its threads)."""
    lo, hi = dist.share(cfg.rollout.prompts_per_step)
    return engine.start(cfg, model, tokenizer, base_dir, (hi - lo) * cfg.rollout.group_size,
                        int(cfg.rollout.worker_threads) or max(1, _cores() // dist.world),
                        moe_step.sample_kwargs().get("capture_routing", False), dist.device.type == "cpu")


def worker_threads(cfg, world: int) -> int:
    """Each rollout worker's torch threads: rollout.worker_threads, or the cores split evenly between the
    trainers and their workers (one each on a 2-core machine with one worker)."""
    if cfg.rollout.worker_threads:
        return int(cfg.rollout.worker_threads)
    return max(1, _cores() // (world * (cfg.rollout.workers + 1)))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _setup_hardware(hw, cfg=None) -> tuple[torch.device, torch.dtype]:
    if hw.threads:
        torch.set_num_threads(hw.threads)
    elif cfg is not None and cfg.rollout.workers and distributed.device_of(hw).type == "cpu":
        # the trainer's share of the cores, beside its workers' (rollout.worker_threads each)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, _cores() // world - cfg.rollout.workers * worker_threads(cfg, world)))
    device = distributed.device_of(hw)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware.device=cuda but no CUDA device is visible; use hardware=cpu")
    return device, DTYPES[hw.dtype]


def _frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _resume_point(cfg, run_dir: Path, dist) -> tuple[int, Optional[Path]]:
    """(step to continue after, its checkpoint): (0, None) for a new run or one killed before its first checkpoint."""
    if not cfg.resume:
        return 0, None
    ckpt = checkpoint.resumable(run_dir, log=print if dist.is_main else lambda msg: None)
    if ckpt is None:
        if dist.is_main:
            print(f"gspo: {run_dir} has no checkpoint yet: restarting it from step 0 (its metrics so far are dropped)")
        return 0, None
    step = int(checkpoint.load_state(ckpt)["step"])
    if dist.is_main and step < cfg.train.steps:
        print(f"gspo: resuming from step {step} of {cfg.train.steps} (checkpoint {ckpt})", flush=True)
    return step, ckpt


class _Summary:
    """RUN_DIR/summary.json, true after any stop: written at step 0, at every checkpoint and at the end.

    `status` is running (also after a kill -9: then `steps` is the last checkpoint), finished,
    preempted (SIGTERM), stopped (Ctrl-C) or failed; `wall_s` adds up the time of every session of
    a resumed run, a restart from step 0 included.
    """

    def __init__(self, run_dir: Path, is_main: bool, resumed: bool, restarted: bool = False):
        self.path, self.is_main, self.t0 = run_dir / "summary.json", is_main, time.time()
        old: dict = json.loads(self.path.read_text()) if (resumed or restarted) and self.path.is_file() else {}
        self.data = old if resumed else {}
        self.wall0 = float(old.get("wall_s", 0.0))  # a restart from step 0 still counts the sessions before it

    def write(self, **values) -> None:
        self.data |= values
        self.data["wall_s"] = self.wall0 + time.time() - self.t0
        if self.is_main:
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                tmp.write_text(json.dumps(self.data, indent=2))
                tmp.replace(self.path)
            except OSError as e:  # a full disk: keep the previous summary, do not hide the error that stopped the run
                print(f"gspo: warning: cannot write {self.path}: {e}", file=sys.stderr)
