"""The shared training loop: rollout -> rewards -> advantages -> N minibatch updates -> log.

The loop never knows which algorithm it runs: the algorithm is the loss name,
the advantage estimator and a few switches in `cfg.algo`, all passed through.
Read `train` first; everything else in this file is a helper it calls.
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from gspo import adapters, checkpoint, distributed, preemption, timeouts
from gspo.advantages import compute_advantages
from gspo.errors import ConfigError, tidy_warnings
from gspo.evaluate import evaluate, heldout_problems
from gspo.logging import MetricsLogger
from gspo.losses import aggregate_denominator, get_loss, policy_loss
from gspo.mismatch import MismatchBatch, active, correction_weights, mismatch_metrics
from gspo.models import base_model, load_pretrained, tokenizer_encode
from gspo.moe_step import MoEStep
from gspo.rewards import completion_ids, probe, score, trainer_state
from gspo.rollout import Rollout, cat_rollouts, generate, token_logprobs
from gspo.sampler import Sampler, old_logprobs_mode
from gspo.shaping import dynamic_sampling, overlong_penalty
from gspo.tasks import Problem, build_task

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def train(cfg: DictConfig, run_dir: Path | str) -> dict:
    """Run RL training as configured, writing metrics and checkpoints to `run_dir`.

    Returns the summary (also RUN_DIR/summary.json, kept current at every checkpoint):
    base and final held-out accuracy, steps done, wall time, status.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = _setup_hardware(cfg.hardware)
    dist = distributed.setup(cfg, device)  # one process, or a rank of a torchrun group (gspo/distributed.py)
    device = dist.device
    start, resume_ckpt = _resume_point(cfg, run_dir, dist)
    summary = _Summary(run_dir, dist.is_main, resumed=resume_ckpt is not None, restarted=bool(cfg.resume))
    if start >= cfg.train.steps:  # a finished run: leave everything as it is
        if dist.is_main:
            print(f"gspo: {run_dir} already finished its {start} steps (train.steps={cfg.train.steps}); nothing to do")
        return summary.data
    if dist.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    task = build_task(cfg.task)
    if cfg.reward.name == "python":  # each function on one real sample, before any work
        probe(task, cfg, tokenizer_encode(cfg, task))
    eval_problems = heldout_problems(task, cfg.task)  # warns when the held-out split is short
    with dist.main_first():  # rank 0 builds the warm-started base, the others then load it
        base_dir = base_model(cfg, task)
    model, tokenizer = load_pretrained(base_dir, dist.storage_dtype(dtype), cfg.model.attn_implementation,
                                       device=device, log=print if dist.is_main else None)
    model.to(device)
    if cfg.model.gradient_checkpointing:  # transformers 5 renames the switch; take whichever this version has
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model = adapters.apply(model, cfg.model.lora, base_dir, cfg.seed)  # LoRA: model.lora.r > 0 -> PeftModel, base frozen
    # beta 0: no reference model in memory; LoRA: the reference is the base, i.e. adapters off (no copy)
    ref = _frozen_copy(model) if cfg.algo.beta > 0 and not adapters.is_adapted(model) else None
    if resume_ckpt is not None:  # every rank loads the same checkpoint, before wrapping
        checkpoint.load_weights(model, resume_ckpt, dist.storage_dtype(dtype))  # LoRA: the adapter only
    policy = dist.wrap(model, dtype)  # what the update trains through: DDP(model), fully_shard(model), or model
    ref = dist.wrap(ref, dtype, frozen=True) if ref is not None else None
    if cfg.algo.beta > 0 and adapters.is_adapted(model):  # LoRA: reference = same weights, adapters disabled
        ref = adapters.reference(model)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad],  # LoRA: the adapters only
                            lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    # warmup counts RL steps, like train.steps: the scheduler steps once per rollout batch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.train.warmup_steps)))
    if resume_ckpt is not None:
        state = checkpoint.load_state(resume_ckpt)
        dist.load_optimizer_state(policy, opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
    recompute = old_logprobs_mode(cfg) == "recompute"
    moe_step = MoEStep.for_model(model, cfg, dist, old_pass=recompute)  # a no-op for dense models
    sampler = Sampler.for_run(model, cfg)  # the trainer's model, or a copy in rollout.dtype (gspo/sampler.py)
    # a resumed run drops what was logged after its checkpoint; one with no checkpoint starts over
    kept = (start if resume_ckpt is not None else -1) if cfg.resume else None
    logger = MetricsLogger(run_dir, cfg, resume_step=kept) if dist.is_main else distributed.NullLogger()
    ev = lambda: dist.evaluate(lambda problems: evaluate(  # noqa: E731  (each rank scores a share)
        model, tokenizer, task, problems, cfg.rollout.max_new_tokens, cfg.eval.pass_k, cfg.rollout.temperature,
        cfg.model.use_chat_template, timeout_s=cfg.reward.timeout_s), eval_problems, model)
    summary.data["eval_n"] = len(eval_problems)  # the true held-out count: a small data file has fewer than task.eval_size
    progress = _Progress(cfg.train.steps, start, enabled=cfg.logger.progress and dist.is_main)
    status = "failed"
    stop = preemption.StopSignals().install()  # SIGTERM / SIGINT: finish the step, checkpoint it, leave
    saved = start  # the step of the newest checkpoint
    try:
        if start == 0:
            base = ev()
            logger.log(base, step=0)
            summary.write(status="running", base_accuracy=base["eval/accuracy"], steps=0)
        for step in range(start + 1, cfg.train.steps + 1):
            if stop.agreed(dist):  # every rank the same answer, so all leave after the same step
                if step - 1 > saved:
                    dist.save_checkpoint(run_dir, step - 1, policy, tokenizer, opt, sched, cfg.train.keep_checkpoints)
                    summary.write(steps=step - 1)
                if dist.is_main:
                    kept = "checkpoint saved" if step > 1 else "no step finished yet"
                    print(f"gspo: {stop.status} after step {step - 1} of {cfg.train.steps} ({kept}); "
                          f"resume with: {preemption.resume_command(run_dir)}", flush=True)
                break
            t0 = time.time()
            synced = sampler.sync(model)  # a separate sampler takes the trainer's weights, as an engine's weight sync
            batch, metrics = _collect(cfg, sampler, model, tokenizer, task, step, moe_step, dist)  # seeded by (seed, step)
            metrics |= synced
            t_roll = time.time() - t0
            metrics |= _update(cfg, policy, ref, opt, batch, step, moe_step, dist, recompute)
            sched.step()
            metrics["train/lr"] = sched.get_last_lr()[0]
            metrics["time/rollout_s"], metrics["time/update_s"] = t_roll, time.time() - t0 - t_roll
            metrics["time/step_s"] = time.time() - t0
            metrics["throughput/tokens_per_s"] = float(batch.rollout.completion_mask.sum()) / metrics["time/step_s"]
            if device.type == "cuda":
                metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            metrics = dist.reduce_metrics(metrics, rows=len(batch.rewards))  # over ranks; as is in one process
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                metrics |= ev()
            logger.log(metrics, step=step)
            if logger.should_log_samples(step):
                logger.log_samples(step, _samples(batch))
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                dist.save_checkpoint(run_dir, step, policy, tokenizer, opt, sched, cfg.train.keep_checkpoints)  # rank 0 writes
                saved = step
                summary.write(steps=step, **({"final_accuracy": metrics["eval/accuracy"]} if step == cfg.train.steps else {}))
                if step == cfg.train.steps and cfg.model.lora.save_merged and dist.is_main:  # LoRA: merged export
                    adapters.export_merged(checkpoint.latest(run_dir), run_dir / "merged", dist.storage_dtype(dtype))
            progress.update(step, metrics)
            if not math.isfinite(metrics["train/loss"]):
                raise FloatingPointError(f"step {step}: loss is {metrics['train/loss']}; stopping (metrics up to here are saved)")
        status = stop.status or "finished"
    except KeyboardInterrupt:
        status = "stopped"
        raise
    finally:
        progress.close()
        logger.close(exit_code=0 if status == "finished" else 1)
        summary.write(status=status)
        stop.close()  # in a submitit job, after a stop: submitit's own handler requeues the job
    return summary.data


# --------------------------------------------------------------------------- rollout


def _collect(cfg, sampler: Sampler, model, tokenizer, task, step: int, moe_step: MoEStep, dist) -> tuple[Batch, dict]:
    """One scored rollout batch (refilled by dynamic sampling when the algorithm asks for it).

    Every rank draws the same prompt list and samples its own share; each group samples
    with its own generator, so the completions do not depend on the number of ranks.
    """
    draws = iter(range(10**6))

    def draw() -> tuple[Batch, torch.Tensor]:
        d = next(draws)
        rng = random.Random(f"{cfg.seed}-{step}-{d}")
        lo, hi = dist.share(cfg.rollout.prompts_per_step)
        problems = task.sample_train(rng, cfg.rollout.prompts_per_step)[lo:hi]  # this rank's share of the prompts
        gens = [distributed.group_generator(cfg.seed, step, d, i, dist.device) for i in range(lo, hi)]
        with sampler.serve(model, dist) as sampling_model:
            r = generate(sampling_model, tokenizer, [p.prompt for p in problems], cfg.rollout.group_size,
                         cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, generator=gens,
                         chat_template=cfg.model.use_chat_template, compile=cfg.hardware.compile,
                         engine=cfg.rollout.engine, **moe_step.sample_kwargs())
        rows = [problems[i] for i in r.prompt_index.tolist()]
        r.prompt_index += lo  # index in the step's whole prompt list: keys the group's minibatch shuffle
        rewards, parts = timeouts.call(
            lambda: score(task, cfg.reward, r.texts, rows, r.ill_formed, completion_ids=completion_ids(r),
                          state=trainer_state(step - 1, cfg.train.steps)),
            cfg.reward.timeout_s, f"scoring step {step}'s {len(r.texts)} completions (task verifier, reward)")
        if cfg.algo.overlong_buffer > 0:
            parts["overlong"] = overlong_penalty(r.lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer,
                                                 cfg.algo.overlong_penalty)
            rewards = rewards + parts["overlong"]
        b = Batch(r, rows, rewards, parts)
        return b, b.parts["correct"]  # DAPO keeps the groups that are neither all right nor all wrong

    G = cfg.rollout.group_size
    metrics: dict[str, float] = {}
    if cfg.algo.dynamic_sampling:
        batch, metrics = dynamic_sampling(draw, lambda b, g: b.select_groups(g, G), Batch.cat,
                                          cfg.rollout.prompts_per_step // dist.world, G, cfg.algo.max_sample_batches)
        n_groups = dist.common_groups(len(batch.rewards) // G)  # ranks update on equal-sized batches
        if n_groups < len(batch.rewards) // G:
            batch = batch.select_groups(list(range(n_groups)), G)
    else:
        batch, _ = draw()
    r = batch.rewards
    grouped = r.view(-1, G)
    metrics |= {
        "reward/mean": r.mean().item(),
        "reward/std": r.std().item() if r.numel() > 1 else 0.0,
        f"reward/{cfg.reward.name}/mean": (r - batch.parts.get("overlong", 0 * r)).mean().item(),
        "reward/frac_zero_std": (grouped.max(-1).values == grouped.min(-1).values).float().mean().item(),
        "response/len_mean": batch.rollout.lengths.mean().item(),
        "response/truncated_frac": batch.rollout.truncated.float().mean().item(),
    }
    metrics |= {f"reward/{k}/mean": v.nanmean().item() for k, v in batch.parts.items()}  # NaN: a function's None
    return batch, metrics


# --------------------------------------------------------------------------- update


def _update(cfg, model, ref, opt, batch: Batch, step: int, moe_step: MoEStep, dist, recompute: bool) -> dict:
    """Advantages, then `train.minibatches` off-policy gradient steps on the batch.

    `model` is what gradients flow through (DDP / FSDP under several ranks); the no-grad
    passes use the bare module, so they never wait on the other ranks.
    """
    ro, algo, temp = batch.rollout, cfg.algo, cfg.rollout.temperature
    bare = checkpoint.unwrap(model)
    mask = ro.completion_mask.clone()
    if algo.overlong_filter:
        mask[ro.truncated] = 0.0  # DAPO: truncated completions carry no signal about the answer
    adv = compute_advantages(algo.advantage, batch.rewards, cfg.rollout.group_size, passk_k=algo.passk_k)
    metrics: dict[str, float] = {}
    old_logp = ro.sampler_logp  # the rollout policy's log-probs as sampled ...
    every = cfg.rollout.mismatch_every
    model.eval()  # no dropout in these models, but keep the no-grad passes deterministic anyway
    with torch.no_grad():
        if recompute or (every and step % every == 0):
            with moe_step.old_pass(bare, ro, record=recompute):  # MoE: also the sampler/trainer routing mismatch
                trainer_logp = token_logprobs(bare, ro, temp)[0]
            metrics |= mismatch_metrics(trainer_logp, ro.sampler_logp, ro.completion_mask, ro.kept_mass)
            if recompute:
                old_logp = trainer_logp  # ... or as the trainer's forward computes them
        ref_logp = token_logprobs(ref, ro, temp)[0] if ref is not None else None
    corrections = active(cfg.rollout)  # TIS and masks of the mismatch (gspo/mismatch.py), each off by default
    agg = algo.agg or get_loss(algo.loss).agg
    hyper = dict(eps_low=algo.eps_low, eps_high=algo.eps_high, clip_ratio_c=algo.clip_ratio_c, agg=algo.agg,
                 max_tokens=cfg.rollout.max_new_tokens, tau_pos=algo.tau_pos, tau_neg=algo.tau_neg, beta=algo.beta,
                 kl_estimator=algo.kl_estimator, router_shift_floor=algo.router_shift_floor,
                 **{k: algo[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "kl_cov_coef")})

    model.train()
    per_mb: dict[str, list[float]] = {}
    # rows shuffled within their group, dealt by global slot: one process's minibatch = the union of the ranks'
    for rows in distributed.minibatches(ro.prompt_index, cfg.rollout.group_size, cfg.train.minibatches, cfg.seed,
                                        step, offset=dist.rank * len(ro.texts)):
        sub, m = ro.select(rows), mask[rows]
        with moe_step.minibatch(model, ro, rows) as mb:  # MoE: replay, capture, aux loss; nothing for dense models
            logp, entropy, _ = token_logprobs(model, sub, temp, with_entropy=True)
            is_weight, corr = correction_weights(corrections, MismatchBatch(
                old_logp[rows], ro.sampler_logp[rows], m, adv[rows], logp.detach()), cfg.rollout)
            loss, stats = policy_loss(
                algo.loss, logp, old_logp[rows], adv[rows], m, router_shift=mb.router_shift(sub),
                ref_logp=None if ref_logp is None else ref_logp[rows],
                is_weight=is_weight, **hyper)
            # under several ranks: this rank's share of the one-process loss (1 x in one process)
            loss = loss * dist.loss_scale(aggregate_denominator(m, agg, cfg.rollout.max_new_tokens)) + mb.aux_loss(sub)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            stats |= mb.stats() | corr
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        stats |= {
            "train/loss": loss.item(),
            "train/grad_norm": distributed.scalar(grad_norm),
            "policy/entropy": ((entropy * m).sum() / m.sum().clamp(min=1)).item(),
        }
        for k, v in stats.items():
            per_mb.setdefault(k, []).append(float(v))
    # extremes stay extremes; everything else is the mean over minibatches
    metrics |= {k: min(v) if k.endswith("_min") else max(v) if k.endswith("_max") else sum(v) / len(v)
                for k, v in per_mb.items()}
    return metrics | moe_step.end_step(bare, ro, step)


# --------------------------------------------------------------------------- helpers


def _setup_hardware(hw) -> tuple[torch.device, torch.dtype]:
    if hw.threads:
        torch.set_num_threads(hw.threads)
    name = hw.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware.device=cuda but no CUDA device is visible; use hardware=cpu")
    return torch.device(name), DTYPES[hw.dtype]


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
    return int(checkpoint.load_state(ckpt)["step"]), ckpt


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


def _samples(batch: Batch, n: int = 8) -> list[dict]:
    return [
        {"prompt": batch.problems[i].prompt, "completion": batch.rollout.texts[i], "reward": batch.rewards[i].item()}
        for i in range(min(n, len(batch.problems)))
    ]


class _Progress:
    """Step, reward, clip fraction and ETA: a live bar on a terminal; in a log, a line every 10% of
    the run or every 30 s, whichever comes first (and the first step, so a log shows life at once)."""

    def __init__(self, total: int, start: int, enabled: bool, seconds: float = 30.0) -> None:
        self.bar, self.total, self.start, self.t0 = None, total, start, time.time()
        self.enabled, self.every, self.seconds, self.last = enabled, max(1, total // 10), seconds, 0.0
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("[bold]RL"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        info = f"reward {m['reward/mean']:.3f}  clip {m.get('clip/frac', 0.0):.2%}"
        if "eval/accuracy" in m:
            info += f"  held-out acc {m['eval/accuracy']:.1%}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif (step % self.every == 0 or step in (self.start + 1, self.total)
              or time.time() - self.last >= self.seconds):
            self.last = time.time()
            eta = (time.time() - self.t0) / (step - self.start) * (self.total - step)
            print(f"step {step}/{self.total}  {info}  eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _worker(argv: list[str]) -> int:
    """A torchrun worker (`python -m gspo.trainer RUN_DIR`): train RUN_DIR/config.yaml into RUN_DIR."""
    if len(argv) != 1:
        print("usage: python -m gspo.trainer RUN_DIR  (started by torchrun)", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    tidy_warnings()
    try:
        train(OmegaConf.load(run_dir / "config.yaml"), run_dir)
    except ConfigError as e:
        if distributed.is_main_process():  # every rank refuses the same config: one line, not one per rank
            print(f"gspo: error: {e}", file=sys.stderr)
        return 2
    distributed.shutdown()  # only on success: after a failure the peers may be stuck in another collective
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
