"""The shared training loop: rollout -> rewards -> advantages -> N minibatch updates -> log.

The loop never knows which algorithm it runs: the algorithm is the loss name,
the advantage estimator and a few switches in `cfg.algo`, all passed through.
Read `train` first; everything else in this file is a helper it calls.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from gspo.algos.distill import distill_metrics, reverse_kl_term
from gspo.algos.entropy import entropy_bonus, high_entropy_mask
from gspo.algos.losses import aggregate_denominator, get_loss, hyper_of, policy_loss
from gspo.algos.mismatch import MismatchBatch, active, correction_weights, mismatch_metrics
from gspo.core.errors import ConfigError, RunFailed, tidy_warnings
from gspo.core.processes import die_with_parent
from gspo.models.packing import for_forward as packed
from gspo.rollout.batch import Batch
from gspo.rollout.decoding.generate import NonFiniteLogits, Rollout, token_logprobs
from gspo.train.loop.checkpointer import Checkpointer
from gspo.train.loop.logging import MetricsLogger, NullLogger
from gspo.train.loop.setup import Setup, setup
from gspo.train.ranks import distributed
from gspo.train.run import checkpoint, failures, preemption


def train(cfg: DictConfig, run_dir: Path | str) -> dict:
    """Run RL training as configured, writing metrics and checkpoints to `run_dir`.

    `setup` builds what the loop needs (gspo/train/loop/setup.py); the loop is below. The checkpointer and the
    evaluator decide when they save and evaluate (gspo/train/loop/checkpointer.py, gspo/train/evaluation/evaluator.py).

    A resume with nothing left to train finishes the run's record if a stop came before its end (`_finish`).

    Returns the summary (also RUN_DIR/summary.json, kept current at every checkpoint):
    base and final held-out accuracy, steps done, wall time, status.
    """
    stop = preemption.StopSignals().install()  # SIGTERM / SIGINT: finish the step (or warm-start step), save, leave
    try:
        s = setup(cfg, Path(run_dir), stop)  # hardware, resume point, model, LoRA, reference, optimizer, sampler, ...
    except BaseException:
        stop.restore()  # a refused setup leaves the caller's handlers as they were (train() called in-process)
        raise
    dist, run, ckpt, logger, source = s.dist, s.run, s.checkpointer, s.logger, s.source
    if s.stopped or (s.finished and run.complete):
        stop.close()
        return run.summary.data
    if logger is None:  # nothing left to train, nothing built: the logger alone, to finish a W&B run left open
        logger = MetricsLogger(run_dir, cfg, resume_step=run.start) if dist.is_main else NullLogger()
    progress = _Progress(cfg.train.steps, run.start, enabled=cfg.logger.progress and dist.is_main)
    status, step = "failed", run.start  # the step in progress, for an error's message (0: the base's evaluation)
    try:
        if run.finished:  # nothing left to train: a stop came between its last checkpoint and its end
            _finish(s)
        else:
            base = s.evaluator.maybe_run(0) if run.start == 0 else None  # a new run: the base's held-out accuracy
            if base is not None:
                logger.log(base, step=0)
            run.running(base)  # summary.json: running (a resumed run: no longer `finished`)
            # samples ahead what the first steps need (staleness)
            source.start(run.start, s.model, ckpt.restored.pending)
        for step in range(run.start + 1, cfg.train.steps + 1):  # (none when finishing)
            if stop.agreed(dist):  # every rank the same answer, so all leave after the same step
                _leave(stop, ckpt, step - 1)
                break
            batch, metrics = _step(cfg, s, step)  # the batch, its update, the new weights pushed to the sampler
            metrics |= s.evaluator.maybe_run(step)  # eval.every steps, and the last
            logger.log(metrics, step=step)
            if logger.should_log_samples(step):
                logger.log_samples(step, _samples(batch))
            ckpt.maybe_save(step, metrics)  # train.checkpoint_every steps, and the last (rank 0 writes)
            progress.update(step, metrics)
            _check_finite(metrics, step)
        status = stop.status or "finished"
    except KeyboardInterrupt:
        status = "stopped"
        raise
    except Exception as e:
        e.gspo_step = step  # which step failed: a worker's failure record names it (gspo/train/run/failures.py)
        raise
    finally:
        if source is not None:  # (none when finishing a record without the model)
            source.close()  # rollout workers stop (and never outlive the trainer)
        progress.close()
        logger.close(exit_code=0 if status == "finished" else 1)
        run.summary.write(status=status)
        stop.close()  # in a submitit job, after a stop: submitit's own handler requeues the job
    return run.summary.data


def _finish(s: Setup) -> None:
    """A resume with nothing left to train, whose record did not end (killed after its last checkpoint, or
    train.steps lowered to where it stands): what the last step does after its checkpoint, as an uninterrupted
    run does it. The final evaluation as recorded, else run now (set-up built the model for it; never twice: it
    is recorded before anything else), the last step's loss checked as the loop checks it, the summary's steps
    and final accuracy, a LoRA run's merged export; `train`'s end then closes the logger (W&B's finish) and says
    `finished`."""
    run = s.run
    _check_finite(run.last_row, run.start)  # a run that failed at its last step stays failed
    final = run.final
    if final is None:
        final = s.evaluator.run(run.start)  # every rank: the evaluation is split over them
        run.record_final(final)
        if s.evaluator.record is not None:  # which problems it answered, as every evaluation records it
            s.logger.log_heldout(s.evaluator.record, run.start)
    run.finish(final)


def _leave(stop: preemption.StopSignals, ckpt: Checkpointer, done: int) -> None:
    """A stop signal before step `done` + 1: that step's checkpoint (unless saved), and how to resume."""
    ckpt.save_stopped(done)
    if ckpt.dist.is_main:
        kept = "checkpoint saved" if done > 0 else "no step finished yet"
        print(f"gspo: {stop.status} after step {done} of {ckpt.cfg.train.steps} ({kept}); "
              f"resume with: {preemption.resume_command(ckpt.run.run_dir)}", flush=True)


def _step(cfg, s: Setup, step: int) -> tuple[Batch, dict]:
    """One RL step: the step's batch (sampled now, or ahead by the policy rollout.staleness steps older, exactly),
    its update, the new weights pushed to the sampler; the step's metrics, reduced over ranks."""
    source, model, dist, t0 = s.source, s.model, s.dist, time.time()
    # anything that draws from torch's global generator (LoRA dropout, a user's code) draws a function
    # of (seed, step): the same in every run of the config, and after a resume
    torch.manual_seed(distributed.keyed_seed(cfg.seed, step, purpose="global"))
    batch, metrics = _sampled(lambda: source.batch(step, model), step)
    batch, metrics = _trimmed(cfg, batch, metrics, dist)
    t_update = time.time()
    metrics |= _update(cfg, s, batch, step)
    metrics["time/update_s"] = time.time() - t_update
    for k, v in _sampled(lambda: source.updated(step, model), step).items():  # push the weights, sample ahead
        metrics[k] = metrics.get(k, 0.0) + v
    metrics["time/step_s"] = time.time() - t0
    metrics["throughput/tokens_per_s"] = float(batch.rollout.completion_mask.sum()) / metrics["time/step_s"]
    if dist.device.type == "cuda":
        metrics["memory/peak_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
    return batch, dist.reduce_metrics(metrics, rows=len(batch.rewards))  # over ranks; as is in one process


def _check_finite(metrics: dict, step: int) -> None:
    """A loss that is NaN or infinite stops the run at once (train/loss: absent while only a critic warms up)."""
    for key in ("train/loss", "critic/value_loss"):
        if not math.isfinite(metrics.get(key, 0.0)):
            raise RunFailed(f"step {step}: {key} is {metrics[key]}; stopping (metrics up to here are saved)")


# --------------------------------------------------------------------------- rollout


def _sampled(fetch, step: int):
    """`fetch()` (the source's batch or push), with NaN logits said as the run's failure at `step`."""
    try:
        return fetch()
    except NonFiniteLogits as e:
        raise RunFailed(f"step {step}: {e} (metrics up to step {step - 1} are saved)") from None


def _trimmed(cfg, batch: Batch, metrics: dict, dist) -> tuple[Batch, dict]:
    """DAPO: every rank updates on as many groups as the one that kept the fewest (a collective)."""
    if not cfg.algo.dynamic_sampling:
        return batch, metrics
    G = cfg.rollout.group_size
    n_groups = dist.common_groups(len(batch.rewards) // G)
    if n_groups < len(batch.rewards) // G:
        batch = batch.select_groups(list(range(n_groups)), G)
    return batch, metrics | {"sampling/kept_reward_mean": batch.rewards.mean().item()}  # what the update trains on


# --------------------------------------------------------------------------- update


@dataclass(frozen=True)
class PolicyInputs:
    """What the policy's updates train on besides its weights: the step's rollout (this rank's rows) and its
    per-token tensors, computed once a step by `_update`; a minibatch's are `select`ed rows of them. Nothing here
    names an algorithm: the loss takes what its LossSpec reads."""

    rollout: Rollout
    mask: torch.Tensor  # (N, T) the tokens that train (DAPO's overlong filter drops the truncated rows')
    adv: torch.Tensor  # (N,) per row (the group's rewards) or (N, T) per token (PPO's value model)
    old_logp: torch.Tensor  # (N, T) the old policy's log-probs: the sampler's as drawn, or the trainer's recomputed
    behaviour: Optional[torch.Tensor]  # (N, T) the sampler's, which the mismatch corrections weigh against old_logp
    ref_logp: Optional[torch.Tensor]  # (N, T) the KL reference's (None: none, beta 0)
    teacher_logp: Optional[torch.Tensor]  # (N, T) a teacher's, whose reverse KL is a loss component (None: none)

    def select(self, rows: torch.Tensor, trim: bool) -> tuple[PolicyInputs, slice]:
        """The minibatch of `rows`, and the window of the batch's (P+T) columns it keeps. `trim` (train.trim_padding):
        the minibatch at its own width, not the whole batch's (the same log-probs, less work), every (N, T) tensor
        cut to its completion columns."""
        sub = self.rollout.select(rows)
        sub, window = sub.trimmed() if trim else (sub, slice(0, None))
        width = sub.completion_mask.shape[1]
        cut = lambda x: None if x is None else x[rows][:, :width] if x.dim() > 1 else x[rows]  # noqa: E731
        return PolicyInputs(sub, mask=cut(self.mask), adv=cut(self.adv), old_logp=cut(self.old_logp),
                            behaviour=cut(self.behaviour), ref_logp=cut(self.ref_logp),
                            teacher_logp=cut(self.teacher_logp)), window


def _update(cfg, s: Setup, batch: Batch, step: int) -> dict:
    """Advantages (the critic component's: the group's rewards, or PPO's value model), then `train.minibatches`
    off-policy gradient steps of the policy on the batch, then the critic's own.

    `s.policy` is what gradients flow through (DDP / FSDP under several ranks); the no-grad
    passes use the bare module, so they never wait on the other ranks.
    """
    model, ro, algo, temp = s.policy, batch.rollout, cfg.algo, cfg.rollout.temperature
    bare = checkpoint.unwrap(model)
    mask = ro.completion_mask.clone()
    if algo.overlong_filter:
        mask[ro.truncated] = 0.0  # DAPO: truncated completions carry no signal about the answer
    metrics: dict[str, float] = {}
    # the rollout policy's log-probs as sampled (None: an engine that gave none in gspo's convention, recomputed) ...
    old_logp = behaviour = ro.sampler_logp
    every = cfg.rollout.mismatch_every
    model.eval()  # no dropout in these models, but keep the no-grad passes deterministic anyway
    with torch.no_grad():
        if s.recompute or (every and step % every == 0):
            with s.moe_step.old_pass(bare, ro, record=s.recompute):  # MoE: also the sampler/trainer routing mismatch
                trainer_logp = token_logprobs(bare, ro, temp)[0]
            if behaviour is not None:
                metrics |= mismatch_metrics(trainer_logp, behaviour, ro.completion_mask, ro.kept_mass)
            if s.recompute:
                old_logp = trainer_logp  # ... or as the trainer's forward computes them
                behaviour = trainer_logp if behaviour is None else behaviour
        ref_logp = token_logprobs(s.ref, ro, temp)[0] if s.ref is not None else None
        teacher_logp = s.teacher.logprobs(ro, temp) if s.teacher is not None else None
    if teacher_logp is not None:
        metrics |= distill_metrics(old_logp, teacher_logp, mask)
    adv, stats = s.critic.advantages(batch, mask, old_logp, ref_logp)  # (N,) or, from a value model, (N, T)
    metrics |= stats
    # rows shuffled within their group, dealt by global slot: one process's minibatch = the union of the ranks'
    lo = s.dist.all_gather_rows(batch.rewards)[1]  # this rank's first row in the one-process batch
    parts = distributed.minibatches(ro.prompt_index, cfg.rollout.group_size, cfg.train.minibatches, cfg.seed, step,
                                    offset=lo)
    if cfg.train.sort_minibatches:  # rows of similar lengths together: less padding in each (other minibatches)
        parts = distributed.by_length(parts, ro.attention_mask.sum(-1), cfg.seed, step)
    if s.critic.trains_policy(step):  # (not during a critic's warm-up)
        inputs = PolicyInputs(ro, mask=mask, adv=adv, old_logp=old_logp, behaviour=behaviour, ref_logp=ref_logp,
                              teacher_logp=teacher_logp)
        metrics |= _policy_updates(cfg, s, inputs, parts, step)
    metrics |= s.critic.update(ro, mask, parts, step)
    return metrics | s.moe_step.end_step(bare, ro, step)


def _policy_updates(cfg, s: Setup, inputs: PolicyInputs, parts: list, step: int) -> dict:
    """One gradient step of the policy per minibatch `parts[i]` (rows of this rank's batch: `_minibatch_update`),
    then the schedule's step; the step's metrics over its minibatches."""
    s.policy.train()
    per_mb: dict[str, list[float]] = {"train/lr": [s.sched.get_last_lr()[0]]}  # the rate this step's updates use
    # the policy's optimizer updates before this step's: the schedule counts the steps it trained (not a critic's
    # warm-up), each of `train.minibatches` updates
    updates = s.sched.last_epoch * cfg.train.minibatches
    for i, rows in enumerate(parts):
        stats = _minibatch_update(cfg, s, inputs, rows, distributed.keyed_generator(cfg.seed, step, i, purpose="loss"))
        if s.ref_sync is not None:  # TRL's reference resets count optimizer updates
            s.ref_sync.after_update(s.policy, updates + i + 1)
        for k, v in stats.items():
            per_mb.setdefault(k, []).append(float(v))
    s.sched.step()  # the schedule counts the steps the policy trained (not a critic's warm-up: verl's too)
    # extremes stay extremes; everything else is the mean over minibatches
    return {k: min(v) if k.endswith("_min") else max(v) if k.endswith("_max") else sum(v) / len(v)
            for k, v in per_mb.items()}


def _minibatch_update(cfg, s: Setup, inputs: PolicyInputs, rows: torch.Tensor, generator: torch.Generator) -> dict:
    """One optimizer update of the policy on the minibatch `rows` of `inputs`: the policy's forward on it, its loss
    (`_minibatch_loss`; `generator`: the loss's own randomness), backward, the clipped gradients' step; its metrics."""
    model = s.policy
    mb, window = inputs.select(rows, cfg.train.trim_padding)
    sub = mb.rollout
    # train.shared_prefix: one forward of rows packed behind the prefix they share (None: nothing to share, or
    # a model whose packed forward would not give the plain numbers, said once: the plain forward)
    packing = packed(model, sub.input_ids, sub.attention_mask, sub.prompt_len, sub.pad_id) \
        if cfg.train.shared_prefix else None
    topk = get_loss(cfg.algo.loss).topk  # a loss that reads the sampler's top-k (DPPO-TopK) reads the policy's too
    with s.moe_step.minibatch(model, inputs.rollout, rows, window, packing) as moe:  # MoE: replay, capture, aux loss
        logp, entropy, _, *top = token_logprobs(model, sub, cfg.rollout.temperature, with_entropy=True, topk=topk,
                                                packing=packing)
        loss, stats, corr = _minibatch_loss(cfg, s.dist, mb, logp, entropy, top[0] if topk else None, moe, generator)
        loss.backward()  # into no gradients: each update frees its own after its step
        stats |= moe.stats() | corr
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    s.opt.step()
    # freed now, not before the next backward: otherwise a full set of gradients (the weights' size) lives
    # through the next minibatch's forward, beside its activations, and sets the step's peak memory
    s.opt.zero_grad(set_to_none=True)
    return stats | {
        "train/loss": loss.item(),
        "train/grad_norm": distributed.scalar(grad_norm),
        "policy/entropy": ((entropy * mb.mask).sum() / mb.mask.sum().clamp(min=1)).item(),
    }


def _minibatch_loss(cfg, dist, mb: PolicyInputs, logp: torch.Tensor, entropy: torch.Tensor,
                    topk_logp: Optional[torch.Tensor], moe, generator: torch.Generator
                    ) -> tuple[torch.Tensor, dict, dict]:
    """The loss of minibatch `mb` from the policy's forward on it (`logp`, `entropy`, and `topk_logp`: its log-probs
    of the sampler's top-k, for a loss that reads them), as gradients flow through it: the policy term (weighed by
    the mismatch corrections, on the high-entropy tokens only under algo.top_entropy_quantile), a teacher's reverse
    KL (teacher.coef, teacher.rl_coef), the MoE step's (`moe`) aux loss, the entropy bonus. Returns the loss, its
    stats and, apart, the corrections' (the step logs them after the MoE step's)."""
    algo, m, sub = cfg.algo, mb.mask, mb.rollout
    spec = get_loss(algo.loss)
    hyper = hyper_of(algo) | dict(max_tokens=cfg.rollout.max_new_tokens,  # the loss's keys from algo.*, and
                                  beta=0.0 if algo.kl_in_reward else algo.beta)  # the KL in the loss or the reward
    # TIS and masks of the mismatch (gspo/algos/mismatch.py), each off by default
    is_weight, corr = correction_weights(active(cfg.rollout), MismatchBatch(
        mb.old_logp, mb.behaviour, m, mb.adv, logp.detach()), cfg.rollout)
    kept, keep = m, None
    if algo.top_entropy_quantile < 1.0:  # the policy term on the high-entropy tokens only (TRL)
        gather = lambda x: dist.all_gather_rows(x)[0]  # noqa: E731  (every rank's tokens: the one-process minibatch's)
        keep = high_entropy_mask(entropy, m, algo.top_entropy_quantile, gather)
        kept = m * keep
        corr["policy/entropy_kept_frac"] = float(kept.sum() / m.sum().clamp(min=1))
    loss, stats = policy_loss(
        algo.loss, logp, mb.old_logp, mb.adv, m, router_shift=moe.router_shift(sub), ref_logp=mb.ref_logp,
        is_weight=is_weight, keep=keep, generator=generator,
        topk_old_logp=sub.topk_logp if spec.topk else None, topk_logp=topk_logp,
        gather=dist.all_gather_rows if dist.world > 1 else None, **hyper)
    # under several ranks: this rank's share of the one-process loss (1 x in one process)
    denominator = aggregate_denominator(m, algo.agg or spec.agg, cfg.rollout.max_new_tokens, clamp=False)
    loss = loss * dist.loss_scale(denominator)
    if mb.teacher_logp is not None:  # on-policy distillation: its own component, over its own token count
        total, n = reverse_kl_term(logp, mb.old_logp, mb.teacher_logp, m)
        stats["distill/loss"] = float(total.detach() / n.clamp(min=1))
        loss = cfg.teacher.rl_coef * loss + cfg.teacher.coef * total / n.clamp(min=1) * dist.loss_scale(n)
    loss = loss + moe.aux_loss(sub)
    if algo.entropy_coef:  # TRL's bonus: coef x the mean entropy of the tokens the policy term trains on
        total, n = entropy_bonus(entropy, kept)
        loss = loss - algo.entropy_coef * total / n.clamp(min=1) * dist.loss_scale(n)
    return loss, stats, corr


# --------------------------------------------------------------------------- helpers


def _samples(batch: Batch, n: int = 8) -> list[dict]:
    """samples.jsonl's rows: the completion, or with tools the whole conversation after the prompt."""
    shown = batch.rollout.texts if batch.rollout.conversations is None else batch.rollout.conversations
    return [
        {"prompt": batch.problems[i].prompt, "completion": shown[i], "reward": batch.rewards[i].item()}
        for i in range(min(n, len(batch.problems)))
    ]


class _Progress:
    """Step, reward, clip fraction and ETA: a live bar on a terminal; in a log, a line every 10% of
    the run or every 30 s, whichever comes first (and the first step, so a log shows life at once)."""

    def __init__(self, total: int, start: int, enabled: bool, seconds: float = 30.0) -> None:
        self.bar, self.total, self.start, self.t0 = None, total, start, time.time()  # t0: reset after the first step
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
        if m.get("rollout/staleness"):
            info += f"  staleness {m['rollout/staleness']:.0f}"
        if "eval/accuracy" in m:
            info += f"  held-out acc {m['eval/accuracy']:.1%}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif (step % self.every == 0 or step in (self.start + 1, self.total)
              or time.time() - self.last >= self.seconds):
            self.last = time.time()
            if step == self.start + 1:  # the first step pays for start-up (a rollout worker's): no rate yet
                self.t0 = time.time()
                print(f"step {step}/{self.total}  {info}", flush=True)
                return
            eta = (time.time() - self.t0) / (step - self.start - 1) * (self.total - step)
            print(f"step {step}/{self.total}  {info}  eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _worker(argv: list[str]) -> int:
    """A torchrun worker (`python -m gspo.train.loop.trainer RUN_DIR`): train RUN_DIR/config.yaml into RUN_DIR."""
    if len(argv) != 1:
        print("usage: python -m gspo.train.loop.trainer RUN_DIR  (started by torchrun)", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    tidy_warnings()
    die_with_parent(signal.SIGTERM)  # a killed launcher takes its workers with it (as a preemption: they checkpoint)
    try:
        train(OmegaConf.load(run_dir / "config.yaml"), run_dir)
    except Exception as e:  # the launcher says it, in one line, for the rank that failed first (gspo/train/run/failures.py)
        failures.record(e, getattr(e, "gspo_step", None), int(os.environ.get("RANK", "0")))
        sys.stdout.flush()
        sys.stderr.flush()
        # at once: tearing the process group down with a peer gone aborts in C++ ("terminate called ...")
        os._exit(2 if isinstance(e, ConfigError) else 1)
    distributed.shutdown()  # only on success: after a failure the peers may be stuck in another collective
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
