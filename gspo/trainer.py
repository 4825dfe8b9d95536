"""The shared training loop: rollout -> rewards -> advantages -> N minibatch updates -> log.

The loop never knows which algorithm it runs: the algorithm is the loss name,
the advantage estimator and a few switches in `cfg.algo`, all passed through.
Read `train` first; everything else in this file is a helper it calls.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from gspo import checkpoint, distributed, moe
from gspo.advantages import compute_advantages
from gspo.evaluate import evaluate
from gspo.logging import MetricsLogger
from gspo.losses import get_loss, policy_loss
from gspo.models import base_model, load_pretrained
from gspo.rewards import score
from gspo.rollout import Rollout, cat_rollouts, generate, token_logprobs
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

    Returns the summary (also written to RUN_DIR/summary.json): base and final
    held-out accuracy, steps done, wall time.
    """
    t_start = time.time()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = _setup_hardware(cfg.hardware)
    dist = distributed.setup(cfg, device)  # one process, or a rank of a torchrun group (gspo/distributed.py)
    device = dist.device
    if dist.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    task = build_task(cfg.task)
    eval_problems = task.eval_set(cfg.task.eval_size)
    with dist.main_first():  # rank 0 builds the warm-started base, the others then load it
        base_dir = base_model(cfg, task)
    model, tokenizer = load_pretrained(base_dir, dist.storage_dtype(dtype), cfg.model.attn_implementation)
    model.to(device)
    if cfg.model.gradient_checkpointing:  # transformers 5 renames the switch; take whichever this version has
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ref = _frozen_copy(model) if cfg.algo.beta > 0 else None  # beta 0: no reference model in memory
    use_moe = moe.is_moe(model)
    start, resume_ckpt = 0, checkpoint.latest(run_dir) if cfg.resume else None
    if resume_ckpt is not None:  # every rank loads the same checkpoint, before wrapping
        model.load_state_dict(load_pretrained(resume_ckpt, dist.storage_dtype(dtype))[0].state_dict())
    policy = dist.wrap(model, dtype)  # what the update trains through: DDP(model), fully_shard(model), or model
    ref = dist.wrap(ref, dtype, frozen=True) if ref is not None else None
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, cfg.train.warmup_steps)))
    if resume_ckpt is not None:
        state = checkpoint.load_state(resume_ckpt)
        dist.load_optimizer_state(policy, opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start = int(state["step"])
    logger = (MetricsLogger(run_dir, cfg, resume_step=start if resume_ckpt is not None else None) if dist.is_main
              else distributed.NullLogger())
    ev = lambda: dist.evaluate(lambda problems: evaluate(  # noqa: E731  (each rank scores a share)
        model, tokenizer, task, problems, cfg.rollout.max_new_tokens, cfg.eval.pass_k, cfg.rollout.temperature,
        cfg.model.use_chat_template), eval_problems, model)
    summary = _read_summary(run_dir) if start else {}
    progress = _Progress(cfg.train.steps, start, enabled=cfg.logger.progress and dist.is_main)
    try:
        if start == 0:
            base = ev()
            summary["base_accuracy"] = base["eval/accuracy"]
            logger.log(base, step=0)
        for step in range(start + 1, cfg.train.steps + 1):
            t0 = time.time()
            batch, metrics = _collect(cfg, model, tokenizer, task, step, use_moe, dist)  # seeded by (seed, step): resumable
            t_roll = time.time() - t0
            metrics |= _update(cfg, policy, ref, opt, sched, batch, step, use_moe, dist)
            metrics["time/rollout_s"], metrics["time/update_s"] = t_roll, time.time() - t0 - t_roll
            metrics["time/step_s"] = time.time() - t0
            metrics["throughput/tokens_per_s"] = float(batch.rollout.completion_mask.sum()) / metrics["time/step_s"]
            metrics = dist.reduce_metrics(metrics, rows=len(batch.rewards))  # over ranks; as is in one process
            if step == cfg.train.steps or (cfg.eval.every and step % cfg.eval.every == 0):
                metrics |= ev()
            logger.log(metrics, step=step)
            if logger.should_log_samples(step):
                logger.log_samples(step, _samples(batch))
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                dist.save_checkpoint(run_dir, step, policy, tokenizer, opt, sched)  # rank 0 writes
            progress.update(step, metrics)
            if not math.isfinite(metrics["train/loss"]):
                raise FloatingPointError(f"step {step}: loss is {metrics['train/loss']}; stopping (metrics up to here are saved)")
        summary |= {"status": "finished", "steps": cfg.train.steps, "final_accuracy": metrics.get("eval/accuracy")}
    finally:
        progress.close()
        logger.close(exit_code=0 if summary.get("status") == "finished" else 1)
        summary["wall_s"] = summary.get("wall_s", 0.0) + time.time() - t_start
        summary.setdefault("status", "stopped")
        if dist.is_main:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# --------------------------------------------------------------------------- rollout


def _collect(cfg, model, tokenizer, task, step: int, use_moe: bool, dist) -> tuple[Batch, dict]:
    """One scored rollout batch (refilled by dynamic sampling when the algorithm asks for it).

    Every rank draws the same prompt list and samples its own share; each group samples
    with its own generator, so the completions do not depend on the number of ranks.
    """
    capture_r3 = use_moe and cfg.moe.routing_replay == "R3"
    draws = iter(range(10**6))

    def draw() -> tuple[Batch, torch.Tensor]:
        d = next(draws)
        rng = random.Random(f"{cfg.seed}-{step}-{d}")
        lo, hi = dist.share(cfg.rollout.prompts_per_step)
        problems = task.sample_train(rng, cfg.rollout.prompts_per_step)[lo:hi]  # this rank's share of the prompts
        gens = [distributed.group_generator(cfg.seed, step, d, i, dist.device) for i in range(lo, hi)]
        model.eval()
        with dist.gathered(model):
            r = generate(model, tokenizer, [p.prompt for p in problems], cfg.rollout.group_size,
                         cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p, generator=gens,
                         chat_template=cfg.model.use_chat_template, capture_routing=capture_r3)
        rows = [problems[i] for i in r.prompt_index.tolist()]
        r.prompt_index += lo  # index in the step's whole prompt list: keys the group's minibatch shuffle
        rewards, parts = score(task, cfg.reward, r.texts, rows, r.ill_formed)
        if cfg.algo.overlong_buffer > 0:
            parts["overlong"] = overlong_penalty(r.lengths, cfg.rollout.max_new_tokens, cfg.algo.overlong_buffer,
                                                 cfg.algo.overlong_penalty)
            rewards = rewards + parts["overlong"]
        b = Batch(r, rows, rewards, parts)
        return b, b.rewards

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
    metrics |= {f"reward/{k}/mean": v.mean().item() for k, v in batch.parts.items()}
    return batch, metrics


# --------------------------------------------------------------------------- update


def _update(cfg, model, ref, opt, sched, batch: Batch, step: int, use_moe: bool, dist) -> dict:
    """Advantages, then `train.minibatches` off-policy gradient steps on the batch.

    `model` is what gradients flow through (DDP / FSDP under several ranks); the no-grad
    passes use the bare module, so they never wait on the other ranks.
    """
    ro, algo, temp = batch.rollout, cfg.algo, cfg.rollout.temperature
    bare = checkpoint.unwrap(model)
    mask = ro.completion_mask.clone()
    if algo.overlong_filter:
        mask[ro.truncated] = 0.0  # DAPO: truncated completions carry no signal about the answer
    adv = compute_advantages(algo.advantage, batch.rewards, cfg.rollout.group_size)
    model.eval()  # no dropout in these models, but keep the old-policy pass deterministic anyway
    with torch.no_grad():
        with moe.capture_routing(bare) if use_moe else contextlib.nullcontext() as old_trace:
            old_logp, _, _ = token_logprobs(bare, ro, temp)
        ref_logp = token_logprobs(ref, ro, temp)[0] if ref is not None else None
    old_routing = old_trace.indices(len(ro.texts)) if use_moe else None
    old_router_lp = old_trace.logprobs(len(ro.texts)) if use_moe else None
    agg = algo.agg or get_loss(algo.loss).agg
    rspo = algo.loss == "rspo" and use_moe
    replay = {"R2": old_routing, "R3": ro.routing}.get(cfg.moe.routing_replay) if use_moe else None
    aux_coef = cfg.model.router_aux_loss_coef if use_moe else 0.0

    model.train()
    per_mb: dict[str, list[float]] = {}
    # rows shuffled within their group, dealt by global slot: one process's minibatch = the union of the ranks'
    chunks = distributed.minibatches(ro.prompt_index, cfg.rollout.group_size, cfg.train.minibatches, cfg.seed, step,
                                     offset=dist.rank * len(ro.texts))
    for rows in chunks:
        sub = ro.select(rows)
        with contextlib.ExitStack() as replaying:
            if replay is not None:  # open through backward: gradient checkpointing re-runs the forward there
                replaying.enter_context(moe.replay_routing(model, replay[rows]))
            # router log-probs only when the loss needs them: the capture sits on the update's hot path
            with moe.capture_routing(model, logprobs=rspo) if use_moe else contextlib.nullcontext() as upd_trace:
                logp, entropy, out = token_logprobs(model, sub, temp, with_entropy=True,
                                                    **({"output_router_logits": True} if aux_coef > 0 else {}))
            shift = None
            if rspo:  # router shift at the positions that predict each completion token
                shift = moe.router_shift(old_router_lp[rows], upd_trace.logprobs(len(rows)),
                                         old_routing[rows], sub.attention_mask)[0][:, ro.prompt_len - 1 : -1]
            loss, stats = policy_loss(
                algo.loss, logp, old_logp[rows], adv[rows], mask[rows],
                eps_low=algo.eps_low, eps_high=algo.eps_high, clip_ratio_c=algo.clip_ratio_c, agg=algo.agg,
                max_tokens=cfg.rollout.max_new_tokens, tau_pos=algo.tau_pos, tau_neg=algo.tau_neg,
                ref_logp=None if ref_logp is None else ref_logp[rows], beta=algo.beta, kl_estimator=algo.kl_estimator,
                router_shift=shift, router_shift_floor=algo.router_shift_floor,
            )
            loss = loss * dist.loss_scale(mask[rows], agg)  # 1 in one process
            if aux_coef > 0:
                loss = loss + aux_coef * out.aux_loss
                stats["moe/aux_loss"] = out.aux_loss.item()
            opt.zero_grad(set_to_none=True)
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        sched.step()
        m = mask[rows]
        stats |= {
            "train/loss": loss.item(),
            "train/grad_norm": distributed.scalar(grad_norm),
            "policy/entropy": ((entropy * m).sum() / m.sum().clamp(min=1)).item(),
        }
        if use_moe:  # what the update pass routed, against the old policy: 0 under replay
            stats["moe/update_mismatch"] = moe.routing_volatility(old_routing[rows], upd_trace.indices(len(rows)),
                                                                  sub.attention_mask)[0]
        for k, v in stats.items():
            per_mb.setdefault(k, []).append(float(v))
    # extremes stay extremes; everything else is the mean over minibatches
    metrics = {k: min(v) if k.endswith("_min") else max(v) if k.endswith("_max") else sum(v) / len(v)
               for k, v in per_mb.items()}
    metrics["train/lr"] = sched.get_last_lr()[0]
    if use_moe:
        model.eval()
        with torch.no_grad(), moe.capture_routing(bare) as new_trace:
            token_logprobs(bare, ro, temp)
        metrics |= moe.moe_metrics(old_routing, new_trace.indices(len(ro.texts)), old_router_lp,
                                   new_trace.logprobs(len(ro.texts)), ro.attention_mask, bare.config.num_experts)
    return metrics


# --------------------------------------------------------------------------- helpers


def _setup_hardware(hw) -> tuple[torch.device, torch.dtype]:
    if hw.threads:
        torch.set_num_threads(hw.threads)
    name = hw.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from gspo.errors import ConfigError

        raise ConfigError("hardware.device=cuda but no CUDA device is visible; use hardware=cpu")
    return torch.device(name), DTYPES[hw.dtype]


def _frozen_copy(model):
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _read_summary(run_dir: Path) -> dict:
    p = run_dir / "summary.json"
    return {k: v for k, v in json.loads(p.read_text()).items() if k != "status"} if p.is_file() else {}


def _samples(batch: Batch, n: int = 8) -> list[dict]:
    return [
        {"prompt": batch.problems[i].prompt, "completion": batch.rollout.texts[i], "reward": batch.rewards[i].item()}
        for i in range(min(n, len(batch.problems)))
    ]


class _Progress:
    """Step, reward, clip fraction and ETA: a live bar on a terminal, a line every 10% in a log."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.bar, self.total, self.start, self.t0 = None, total, start, time.time()
        self.enabled, self.every = enabled, max(1, total // 10)
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
        elif step % self.every == 0 or step == self.total:
            eta = (time.time() - self.t0) / (step - self.start) * (self.total - step)
            print(f"step {step}/{self.total}  {info}  eta {eta:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
