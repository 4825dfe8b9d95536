"""The sampler: which model draws the rollouts, and where the old policy's log-probs come from.

By default the trainer's own model samples (`rollout.dtype` unset = `hardware.dtype`). With `rollout.dtype`
set to another precision, a copy of the policy in that precision samples, the way an inference engine (vLLM,
SGLang) serves a bf16 policy while the trainer keeps float32 weights. A LoRA run may sample with such a copy
in its own precision (`model.lora.sample_merged`): the adapters merged, so decoding runs the base's products
only, for one more model's weights in memory. Like an engine's weight sync, the copy is refreshed from the
trainer's weights before every rollout (`time/weight_sync_s`); a LoRA run's copy carries the adapters merged
into the base, as an engine that serves one merged checkpoint does. Under DDP every rank holds and syncs its
own copy from its own (identical) replica; FSDP2 shards the trainer's weights, so the combination is refused
(`check`).

The copy is built the way the trainer would be in that precision: its parameters cast, its
buffers (rotary tables) as loaded. With `rollout.engine=vllm` the sampler is the vLLM inference
engine itself, in `rollout.dtype` (gspo/rollout/engine/client.py). Evaluation still runs on the trainer's
model: it scores the policy being trained, not its low-precision copy or the engine's.
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Callable, Iterator, Optional

import torch

from gspo.core.errors import ConfigError
from gspo.models import adapters


def sampler_dtype(cfg) -> str:
    """The sampler's precision: `rollout.dtype`, or the trainer's (`hardware.dtype`) when unset."""
    return cfg.rollout.dtype or cfg.hardware.dtype


def separate(cfg) -> bool:
    """Whether something other than the trainer's model samples: an inference engine (rollout.engine=vllm), a
    copy of the policy in another precision (rollout.dtype != hardware.dtype), or a LoRA policy's merged copy
    (model.lora.sample_merged)."""
    return cfg.rollout.engine == "vllm" or sampler_dtype(cfg) != cfg.hardware.dtype or merged_copy(cfg)


def merged_copy(cfg) -> bool:
    """A LoRA run samples with a plain copy of its policy in the trainer's precision, the adapters merged
    (model.lora.sample_merged): the same function to rounding, decoded without the adapters' products."""
    return bool(cfg.model.lora.r and cfg.model.lora.sample_merged)


def old_logprobs_mode(cfg) -> str:
    """Where the old policy's log-probs come from: `sampler` (recorded while sampling) or `recompute`.

    `auto`: the sampler's when the sampler IS the float32 trainer, where they equal a recomputed
    forward to ~1e-6 per token (tests/models/test_logprobs.py), so the old-policy pass is wasted work; a
    recomputed pass whenever the two differ (a bf16/fp16 trainer, whose sampling and training kernels
    disagree by more than GSPO's clip range, docs/benchmarks.md, a sampler in another precision, an inference
    engine, or a batch sampled `rollout.staleness` steps ago).
    """
    mode = cfg.rollout.old_logprobs
    if mode != "auto":
        return mode
    # a stale batch (rollout.staleness > 0) was sampled by an older policy: the ratio is taken against the current
    # weights (the proximal policy), the behaviour gap left to the mismatch corrections
    # a float32 merged copy (model.lora.sample_merged) is the trainer's function to rounding: W x + s B A x against
    # (W + s B A) x, ~1e-6 per token (tests/rollout/decoding/test_sampler.py)
    same = cfg.hardware.dtype == "float32" and not cfg.rollout.staleness and cfg.rollout.engine != "vllm" \
        and sampler_dtype(cfg) == cfg.hardware.dtype
    return "sampler" if same else "recompute"


def check(cfg, on_cpu: bool) -> None:
    """Refuse what a copy in another precision cannot do (called by gspo.train.preflight.check, which resolves
    `on_cpu` from hardware.device; the engine's checks are gspo/rollout/engine/client.py `check`)."""
    if separate(cfg) and cfg.rollout.engine != "vllm" and cfg.hardware.strategy == "fsdp":
        what = (f"rollout.dtype={cfg.rollout.dtype}: a sampler in another precision than the trainer "
                f"({cfg.hardware.dtype})") if sampler_dtype(cfg) != cfg.hardware.dtype else \
            "model.lora.sample_merged=true: a merged sampling copy"
        raise ConfigError(f"{what} is not supported with hardware.strategy=fsdp (sharded weights); use "
                          "hardware.strategy=ddp, or sample with the trainer's model")
    if sampler_dtype(cfg) == "int8":
        from gspo.rollout.decoding import quantized

        why = quantized.available()
        if cfg.rollout.engine == "vllm" or cfg.rollout.workers:
            why = (f"rollout.{'engine=vllm' if cfg.rollout.engine == 'vllm' else 'workers'} samples in another "
                   "process, from float weights")
        elif not on_cpu:
            why = "its kernels are the CPU's (fbgemm); on a GPU sample in bfloat16"
        if why is not None:
            raise ConfigError(f"rollout.dtype=int8 (an int8 sampling copy) is not available here: {why}")


class Sampler:
    """The trainer's own model as the sampler: nothing to copy or sync."""

    @staticmethod
    def for_run(model: torch.nn.Module, cfg, engine: Optional[Callable[[], "Sampler"]] = None) -> "Sampler":
        """`model` itself, a `_Copy` in `rollout.dtype` when that differs from the trainer's, or with
        `rollout.engine=vllm` what `engine()` starts (gspo/rollout/engine/client.py `EngineSampler`)."""
        if cfg.rollout.engine == "vllm":
            return engine()
        if sampler_dtype(cfg) == "int8":
            return _Int8Copy(model)
        return _Copy(model, getattr(torch, sampler_dtype(cfg))) if separate(cfg) else Sampler()

    def sync(self, model: torch.nn.Module, step: Optional[int] = None) -> dict[str, float]:
        """Refresh the sampler from the trainer's weights before it samples `step`'s batch; its metrics
        (`time/weight_sync_s`)."""
        return {}

    def close(self) -> None:
        """Release what the sampler holds (an engine's process)."""

    @contextlib.contextmanager
    def serve(self, model: torch.nn.Module, dist) -> Iterator[torch.nn.Module]:
        """The module to sample with, for the block (FSDP: the trainer's weights gathered; `dist` None: one process)."""
        model.eval()
        with dist.gathered(model) if dist is not None else contextlib.nullcontext():
            yield model


class _Copy(Sampler):
    """A copy of the policy in another precision (LoRA: adapters merged), synced before each rollout."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        self.module = _plain(model)
        for p in self.module.parameters():
            p.requires_grad_(False)
            p.data = p.data.to(dtype)
        self.module.eval()
        self.feeds: dict[str, list] = {}  # a parameter's name -> the modules computing with a derived form of it

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, step: Optional[int] = None) -> dict[str, float]:
        """Copy what training changes into the copy, cast to its precision: every weight, or under LoRA only the
        adapted ones, W0 + ΔW from the adapters' factors (`adapters.merged_parameters`: no merged model built)."""
        t0 = time.time()
        mine = dict(self.module.named_parameters())
        for name, value, trained in adapters.merged_parameters(model):
            if not trained:
                continue
            if name in mine:
                mine[name].copy_(value)
            for module, slot in self.feeds.get(name, ()):  # an int8 projection (a tied head: the embedding's name)
                module.load(**{slot: value})
        return {"time/weight_sync_s": time.time() - t0}

    @contextlib.contextmanager
    def serve(self, model: torch.nn.Module, dist) -> Iterator[torch.nn.Module]:
        yield self.module


class _Int8Copy(_Copy):
    """A float32 copy of the policy whose Linear products run in int8 (gspo/rollout/decoding/quantized.py), re-quantized
    from the trainer's weights at every sync."""

    def __init__(self, model: torch.nn.Module):
        from gspo.rollout.decoding import quantized

        super().__init__(model, torch.float32)
        self.feeds = quantized.quantize(self.module)


def _plain(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` as one plain Hugging Face model: a LoRA model's adapters merged into the base.

    Training-only hooks do not come along: gradient checkpointing under peft puts a hook on the input
    embeddings that makes their output require grad (`enable_input_require_grads`); the sampler never
    takes a gradient, and the fast decode engine refuses a model with hooks it would bypass."""
    out = copy.deepcopy(model)
    out = out.merge_and_unload() if adapters.is_adapted(out) else out
    for module in out.modules():  # transformers names the hook make_inputs_require_grad(s), by version
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
                del module._forward_hooks[key]
    return out
