"""The warm-started base: supervised steps on the task's reference solutions, cached.

A random-init model earns no reward, so `base_model` warm-starts it with supervised steps
on the task's reference solutions and caches the result by its config and the content of
the files it reads (a data file): every run of a sweep starts from the very same weights,
built once, and a changed file builds a new base.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import torch

from gspo.core.cache import file_sha256
from gspo.core.errors import ConfigError
from gspo.core.files import temp_dir, widen_to_open_modes
from gspo.models.build import build_model, char_tokenizer
from gspo.models.gguf import checkpoint_dir
from gspo.models.moe import is_moe
from gspo.rollout.decoding.chat import render_reference
from gspo.rollout.decoding.generate import encode_prompts
from gspo.rollout.decoding.multiturn import ToolUse
from gspo.rollout.decoding.params import SamplingParams
from gspo.tasks.tools import specs_of
from gspo.train.evaluation.heldout import evaluate
from gspo.train.run.preemption import Stopped
from gspo.train.start import split_moe

CACHE_VERSION = 3  # bump when warm-start code changes, so stale bases are rebuilt (3: canonical split, warm-start pool)


def _input_files(cfg) -> dict[str, str]:
    """The files the warm start reads, by the key naming them: `task.path` (a data file's reference answers).

    The reward is not among them: the warm start is supervised on the task's answers, never scored.
    """
    return {"task.path": str(cfg.task.path)} if cfg.task.get("path") else {}


def _base_key(cfg) -> str:
    from omegaconf import OmegaConf

    from gspo.config.keys import base_part

    # without the keys that do not change the weights the warm start produces (the schema's markings: e.g. LoRA and
    # full runs share a base); the rollout keys below are the schema's BASE keys
    m = base_part("model", OmegaConf.to_container(cfg.model, resolve=True))
    t = base_part("task", OmegaConf.to_container(cfg.task, resolve=True))
    files = {k: file_sha256(path) for k, path in _input_files(cfg).items() if Path(path).is_file()}  # content, not name
    key = {"v": CACHE_VERSION, "model": m, "task": t, "T": cfg.rollout.max_new_tokens}
    if cfg.rollout.tools is not None:  # the tools' names are in every prompt and their calls in the references
        key["tools"] = {"specs": list(specs_of(cfg.rollout.tools)), "max_turns": cfg.rollout.max_turns}
    blob = json.dumps(key | ({"files": files} if files else {}), sort_keys=True)  # no file: the key it always had
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def base_model(cfg, task, log=print, stop=None) -> Path:
    """The directory of the warm-started base for this config, building it on first use.

    Written to a temporary directory and renamed, so parallel sweep jobs never see
    a half-written base; the first one to finish wins and the others reuse it.
    `stop` (a preemption.StopSignals): a stop signal during the warm start saves it to
    `.partial-<name>` beside the base (never taken for a finished one) and raises
    `preemption.Stopped`; the next run with the same config continues it from there.
    """
    if cfg.model.arch == "hf":
        if not cfg.model.path:
            raise ConfigError("model=hf needs model.path=DIR (a local Hugging Face checkpoint directory)")
        dense = checkpoint_dir(cfg.model.path, cfg.cache_dir, log)  # a GGUF file: its dequantized copy
        if not cfg.model.split_experts.experts:
            return dense
        return split_moe.checkpoint(dense, cfg.model.split_experts, cfg.cache_dir, log)  # its MoE, built once
    target = Path(cfg.cache_dir) / f"base-{cfg.model.name}-{cfg.task.name}-{_base_key(cfg)}"
    if (target / "config.json").is_file():
        if int(os.environ.get("RANK", "0")) == 0:
            inputs = ", ".join(f"{k}={v}" for k, v in _input_files(cfg).items())
            log(f"gspo: reusing the warm-started base {target}" + (f" (built from {inputs}, same content)" if inputs else ""))
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tools = ToolUse.of(cfg)
    tokenizer = char_tokenizer(task.alphabet, chat=tools is not None)
    model = build_model(cfg.model, len(tokenizer), tokenizer, seed=cfg.model.warm_start.seed)
    t0 = time.time()
    partial = target.parent / f".partial-{target.name}"
    record = warm_start(model, tokenizer, task, cfg.model.warm_start, log=log, stop=stop, partial=partial, tools=tools)
    tmp = temp_dir(target.parent, ".tmp-")  # (mkdtemp's 0o700 would keep colleagues out of a shared cache)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    inputs = {k: {"path": path, "sha256": file_sha256(path)} for k, path in _input_files(cfg).items()}
    (tmp / "warm_start.json").write_text(json.dumps({"seconds": time.time() - t0, **record, "inputs": inputs}))
    widen_to_open_modes(tmp)  # (save_pretrained's safetensors are written owner-only)
    try:
        os.rename(tmp, target)
    except OSError:  # another job finished first: use its base
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(partial, ignore_errors=True)
    return target


def warm_start(model, tokenizer, task, wcfg, log=print, stop=None, partial: Optional[Path] = None,
               tools: Optional[ToolUse] = None) -> dict:
    """Supervised steps on (prompt, reference answer + EOS); loss on the answer tokens only.

    With `tools` (`rollout.tools`): on each problem's reference conversation after its prompt
    (`task.reference_conversation`, else the answer as one assistant message), rendered with the chat
    template and the tools as a rollout holds it; loss on the model's turns only, not the tools' replies.

    The data: `wcfg.problems` fixed training problems drawn once and sampled in batches, or
    (0) fresh training problems every step; never a held-out one. With `wcfg.target_accuracy`
    > 0 it stops at the first check (every `wcfg.check_every` steps) where greedy accuracy on
    200 fixed *training* problems reaches the target: a base of a known accuracy. Once a check
    reaches half the target, it checks every `wcfg.fine_check_every` steps: near the target,
    accuracy climbs over ten points in 25 steps, and a coarse check stopped at 52.5% for a 40%
    target (docs/results.md). Where the accuracy stands after a fixed number of steps is chaotic
    (float rounding, which differs with the thread count and the CPU's vector ISA, moves it by
    tens of points: docs/results.md), so a fixed step count alone does not give the same base
    on two machines.

    Returns what was done: {"steps", "train_accuracy" (at the last check, None without one)}.

    Preemptible: with `stop` (a preemption.StopSignals) a stop request at a step boundary saves the weights,
    optimizer, schedule and random states to `partial` and raises `preemption.Stopped`; called again with the
    same `partial`, it continues from there and ends with the weights an uninterrupted warm start ends with.
    """
    record = {"steps": 0, "train_accuracy": None}
    if wcfg.steps <= 0:
        return record
    rng = random.Random(wcfg.seed)
    torch.manual_seed(wcfg.seed)
    pool = task.sample_train(rng, wcfg.problems) if wcfg.problems > 0 else None
    check = _accuracy_check(model, tokenizer, task, wcfg, tools) if wcfg.target_accuracy > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=wcfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.0, 1 - s / wcfg.steps))
    moe_kwargs = {"output_router_logits": True} if is_moe(model) else {}
    model.train()
    every, first = wcfg.check_every, 0
    if partial is not None and (partial / "state.pt").is_file():  # a warm start a stop signal interrupted
        from safetensors.torch import load_model

        state = torch.load(partial / "state.pt", weights_only=True)
        load_model(model, partial / "model.safetensors")  # (tied weights: saved once, restored to both)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.setstate(_tuples(state["rng"]))
        torch.set_rng_state(state["torch_rng"])
        record, every, first = dict(state["record"]), int(state["every"]), int(state["step"])
        log(f"gspo: continuing the interrupted warm start from step {first} of {wcfg.steps} ({partial})")
    for step in range(first, wcfg.steps):
        if stop is not None and partial is not None and step > first and stop.requested():
            _save_partial(partial, model, opt, sched, rng, record, every, step)
            raise Stopped(stop.requested(), f"during the warm start, after its step {step} of {wcfg.steps} (saved)")
        problems = (task.sample_train(rng, wcfg.batch_size) if pool is None
                    else rng.sample(pool, min(wcfg.batch_size, len(pool))))
        ids, labels = [], []
        for p in problems:
            x, learn = _reference(tokenizer, task, p, tools)
            ids.append(x)
            labels.append([t if m else -100 for t, m in zip(x, learn)])
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_t = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        mask = torch.arange(width)[None, :] < torch.tensor([len(x) for x in ids])[:, None]
        # MoE: the load-balancing loss is on here as in RL, so RL starts from balanced experts
        # instead of spending its first steps re-routing tokens to satisfy the aux loss.
        out = model(input_ids=input_ids, attention_mask=mask.long(), labels=label_t, **moe_kwargs)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        record["steps"] = step + 1
        if step % 100 == 0 or step == wcfg.steps - 1:
            log(f"warm start {step + 1}/{wcfg.steps}: loss {out.loss.item():.3f}")
        if check is not None and (step + 1) % every == 0:
            record["train_accuracy"] = check()
            if record["train_accuracy"] >= wcfg.target_accuracy:
                log(f"warm start {step + 1}/{wcfg.steps}: greedy accuracy on training problems "
                    f"{record['train_accuracy']:.1%} >= target {wcfg.target_accuracy:.0%}: stopping")
                break
            if record["train_accuracy"] >= wcfg.target_accuracy / 2 and wcfg.fine_check_every > 0:
                every = wcfg.fine_check_every
    model.eval()
    return record


def _save_partial(partial: Path, model, opt, sched, rng: random.Random, record: dict, every: int, step: int) -> None:
    """What a continued warm start needs, written to a temporary directory and renamed (never half-written)."""
    from safetensors.torch import save_model

    partial.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(partial.parent, ".tmp-partial-")
    save_model(model, tmp / "model.safetensors")
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": rng.getstate(),
                "torch_rng": torch.get_rng_state(), "record": record, "every": every, "step": step}, tmp / "state.pt")
    widen_to_open_modes(tmp)
    shutil.rmtree(partial, ignore_errors=True)
    os.rename(tmp, partial)


def _tuples(x):
    """random.Random's state back from what torch.save kept of it (its tuples, possibly as lists)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _reference(tokenizer, task, problem, tools: Optional[ToolUse]) -> tuple[list[int], list[int]]:
    """(token ids, 1 where the model is taught) of a problem's prompt and reference solution."""
    if tools is None:
        prompt = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        answer = tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    make = getattr(task, "reference_conversation", None)
    messages = make(problem) if make is not None else [{"role": "assistant", "content": problem.answer}]
    prompt = problem.prompt if isinstance(problem.prompt, list) else [{"role": "user", "content": problem.prompt}]
    prompt_ids = encode_prompts(tokenizer, [prompt], True, tools.box.schemas)[0]
    return render_reference(tokenizer, prompt_ids, prompt, messages, {tokenizer.eos_token_id})


def _accuracy_check(model, tokenizer, task, wcfg, tools: Optional[ToolUse] = None, n: int = 200):
    """A function returning greedy accuracy on `n` fixed training problems (never held-out ones)."""
    problems = task.sample_train(random.Random(f"warm-start-check-{wcfg.seed}"), n)
    # room for the longest reference: its answer and EOS, or with tools every token after its prompt
    width = max(len(ids) - learn.index(1) for ids, learn in (_reference(tokenizer, task, p, tools) for p in problems))

    def check() -> float:
        return evaluate(model, tokenizer, task, problems, SamplingParams(width), tools=tools)["eval/accuracy"]

    return check
