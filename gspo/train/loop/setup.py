"""Everything the loop needs before its first step, built by one call: `setup(cfg, run_dir)`.

Hardware and torch.distributed, the run's record (the resume point, summary.json), the task and its
held-out split, the warm-started base, LoRA, the reference policy, the optimizer and schedule (restored
on resume), the MoE step component, the sampler and batch source, the metrics logger, the held-out
evaluator and the checkpointer. `gspo.train.loop.trainer.train` reads as the loop it runs.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from gspo.core.errors import ConfigError
from gspo.models import adapters, packing
from gspo.models.build import enable_checkpointing, load_pretrained, tokenizer_encode
from gspo.rollout.batch import Share, collect
from gspo.rollout.decoding.generate import stop_ids
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.sampler import Sampler, old_logprobs_mode, sampler_dtype, separate
from gspo.rollout.engine import client as engine
from gspo.rollout.source import Inline, describe
from gspo.rollout.workers import WorkerPool
from gspo.tasks import Task, build_task
from gspo.tasks.rewards import probe
from gspo.train.evaluation.evaluator import Evaluator
from gspo.train.evaluation.heldout import heldout_problems
from gspo.train.loop.checkpointer import Checkpointer, RunRecord
from gspo.train.loop.components import BatchSource
from gspo.train.loop.critic import Critic
from gspo.train.loop.logging import MetricsLogger, NullLogger
from gspo.train.loop.moe_step import MoEStep
from gspo.train.loop.reference import RefSync
from gspo.train.loop.teacher import Teacher
from gspo.train.preflight import warn_task_on_chat_model
from gspo.train.ranks import distributed
from gspo.train.ranks.distributed import Dist
from gspo.train.run.preemption import Stopped, StopSignals, resume_command
from gspo.train.start.warm_start import base_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Setup:
    """What `train` needs: the run's parts, ready, and where it starts from (`run.start`)."""

    dist: Dist  # one process, or a rank of a torchrun group
    dtype: torch.dtype  # the training precision (hardware.dtype)
    run: RunRecord  # the resume point, summary.json, and a finished run's recorded end
    finished: bool = False  # the run already did its train.steps: nothing else below is built
    stopped: Optional[str] = None  # a stop signal came during the warm start (saved): nothing else is built
    task: Optional[Task] = None
    model: Optional[torch.nn.Module] = None  # the policy's module (a PeftModel under LoRA)
    tokenizer: Optional[PreTrainedTokenizerBase] = None
    policy: Optional[torch.nn.Module] = None  # what the update trains through: DDP(model), fully_shard(model), or model
    ref: Optional[torch.nn.Module] = None  # the KL reference, or None (beta 0)
    ref_sync: Optional[RefSync] = None  # its resets (algo.sync_ref_model), or None
    teacher: Optional[Teacher] = None  # on-policy distillation's frozen teacher (teacher.path), or None
    critic: Optional[Critic] = None  # where advantages come from: the group's rewards, or PPO's value model
    opt: Optional[torch.optim.Optimizer] = None
    sched: Optional[torch.optim.lr_scheduler.LRScheduler] = None
    recompute: bool = False  # the old policy's log-probs are recomputed by the trainer
    moe_step: Optional[MoEStep] = None  # a no-op on dense models
    sampler: Optional[Sampler] = None  # the trainer's model, or a copy in rollout.dtype
    source: Optional[BatchSource] = None  # where each step's batch comes from: in process, or workers
    logger: MetricsLogger | NullLogger | None = None  # metrics.jsonl (and W&B) on rank 0, nothing elsewhere
    evaluator: Optional[Evaluator] = None  # held-out evaluation of the policy, when due (every rank a share)
    checkpointer: Optional[Checkpointer] = None  # the checkpoints, and when to save


def setup(cfg: DictConfig, run_dir: Path, stop: Optional[StopSignals] = None) -> Setup:
    """Build what the loop needs for `cfg` in `run_dir`, restoring a resumed run's weights and optimizer.

    `stop` (preemption.StopSignals): a stop signal during the warm start saves it and returns a Setup with
    `stopped` set (the next run continues the warm start)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = _setup_hardware(cfg.hardware, cfg)
    dist = distributed.setup(cfg, device)  # one process, or a rank of a torchrun group (gspo/train/ranks/distributed.py)
    device = dist.device
    run = RunRecord(cfg, run_dir, dist, dtype)  # the resume point; summary.json
    if run.finished and run.final is not None:  # nothing to train, its final evaluation recorded: no model to
        # build (its record may still need finishing: train() does it; the record said so in one line)
        return Setup(dist, dtype, run, finished=True)
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
        run.summary.write(status=status)
        return Setup(dist, dtype, run, stopped=status)
    if not dist.is_main:
        base_dir = base_model(cfg, task)
    model, tokenizer = load_pretrained(base_dir, dist.storage_dtype(dtype), cfg.model.attn_implementation,
                                       device=device, log=print if dist.is_main else None)
    model.to(device)
    if dist.is_main:
        warn_task_on_chat_model(task, tokenizer, cfg)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(model)
    model = adapters.apply(model, cfg.model.lora, base_dir, cfg.seed)  # LoRA: model.lora.r > 0 -> PeftModel, base frozen
    if separate(cfg) or cfg.rollout.workers or cfg.model.lora.save_merged:  # merged weights are served or saved
        adapters.check_mergeable(model)  # (not an adapter on a tied LM head)
    # beta 0: no reference model in memory; LoRA: the reference is the base, i.e. adapters off (no copy)
    ref = _frozen_copy(model) if cfg.algo.beta > 0 and not adapters.is_adapted(model) else None
    run.restore_weights(model)  # a resumed run's: every rank the same checkpoint, before wrapping
    ref_sync = RefSync.for_run(cfg, ref, dist, run.resume_from)  # algo.sync_ref_model (a resumed run's reset reference)
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
    restored = run.restore(policy, tokenizer, opt, sched)  # a resumed run's optimizer, schedule, batches sampled ahead
    critic = Critic.for_run(cfg, base_dir, dist, dtype, run.resume_from)  # PPO's value model (algo.advantage=gae)
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
        kept = (run.start if run.resume_from is not None else -1) if cfg.resume else None
        logger = MetricsLogger(run_dir, cfg, resume_step=kept) if dist.is_main else NullLogger()
    except BaseException:  # the engine started above stops here (train() called in-process: no exit to end it)
        if sampler is not None:
            sampler.close()
        raise
    ckpt = Checkpointer(run, restored, source, (critic, ref_sync))  # each save: the policy's parts and these
    evaluator = Evaluator(cfg, dist, model, tokenizer, task, eval_problems)
    run.summary.data["eval_n"] = len(eval_problems)  # the true held-out count: a small data file has fewer than task.eval_size
    # which forward the update runs (train.shared_prefix: packed only where exact; this model, this attention)
    run.summary.data["shared_prefix"] = packing.recorded(model, cfg.train.shared_prefix)
    return Setup(dist, dtype, run, task=task, model=model, tokenizer=tokenizer,
                 policy=policy, ref=ref, ref_sync=ref_sync, teacher=teacher, critic=critic, opt=opt, sched=sched,
                 recompute=recompute, moe_step=moe_step,
                 sampler=sampler, source=source, logger=logger, evaluator=evaluator, checkpointer=ckpt)


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
    with the trainer, which waits while it samples (rollout.worker_threads sets its threads). With
    rollout.vllm.mode=shared one engine, rank 0's, serves every rank, one rank's share at a time, with every
    core (the trainers wait)."""
    lo, hi = dist.share(cfg.rollout.prompts_per_step)
    ranks = dist.world if cfg.rollout.vllm.mode == "per_rank" else 1
    return engine.start(cfg, model, tokenizer, base_dir, (hi - lo) * cfg.rollout.group_size,
                        int(cfg.rollout.worker_threads) or max(1, _cores() // ranks),
                        moe_step.sample_kwargs().get("capture_routing", False), dist.device.type == "cpu",
                        weights=dist.merged_parameters, dist=dist)  # FSDP: gathered unit by unit


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
