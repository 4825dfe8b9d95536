"""Checkpoints: Hugging Face format weights plus trainer state, written atomically.

`RUN_DIR/checkpoints/step_<n>/` holds config.json, model.safetensors, the tokenizer
files and `trainer_state.pt` (optimizer, scheduler, step); a LoRA run (`model.lora.r > 0`)
holds adapter_config.json + adapter_model.safetensors instead of the full weights (see
gspo/models/adapters.py). Each is written under a temporary name and renamed, so a crash mid-write
never leaves a broken "latest"; the newest `train.keep_checkpoints` are kept. A write that fails
(no space, no permission) is a one-line CheckpointError naming the path, the older checkpoints
untouched; a resume skips a checkpoint that cannot be read and says so (`resumable`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from gspo.core.errors import ConfigError
from gspo.core.files import temp_dir, widen_to_open_modes
from gspo.models import adapters


class CheckpointError(ConfigError):
    """A checkpoint could not be written (the CLI prints one line, exit code 2)."""


def save(run_dir: Path, step: int, model, tokenizer, optimizer, scheduler, keep: int = 1,
         model_state: Optional[dict] = None, optimizer_state: Optional[dict] = None,
         extra: Optional[dict] = None, files: Optional[dict] = None) -> Path:
    """Save step `step`; keep the newest `keep` checkpoints.

    `model_state` / `optimizer_state`: full state dicts gathered by the caller (FSDP);
    None = the model's and optimizer's own. `extra`: more of the trainer's state (plain containers and
    tensors, loadable with weights_only), e.g. the batches sampled ahead under rollout.staleness.
    `files`: more modules' weights, {file name: state dict}, each written as safetensors (PPO's critic).
    """
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:06d}", None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(root)  # (umask-derived mode: mkdtemp's 0o700 would hide the checkpoint from colleagues)
        if adapters.is_adapted(model):
            adapters.save(unwrap(model), tmp, state_dict=model_state)  # the adapter only: the base is not ours to copy
        else:
            unwrap(model).save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
        tokenizer.save_pretrained(tmp)
        for name, tensors in (files or {}).items():
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp / name))
        optim = optimizer.state_dict() if optimizer_state is None else optimizer_state
        state = {"step": step, "optimizer": optim, "scheduler": scheduler.state_dict(), **(extra or {})}
        torch.save(state, tmp / "trainer_state.pt")
        widen_to_open_modes(tmp)  # (safetensors writes its files owner-only)
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    except (OSError, RuntimeError) as e:  # no space, no permission (torch.save wraps them in RuntimeError)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write the checkpoint of step {step} to {final}: {e}; "
                              "the checkpoints and metrics written before are intact") from None
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None."""
    done = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "trainer_state.pt").is_file())
    return done[-1] if done else None


def resumable(run_dir: Path, log=print) -> Optional[Path]:
    """The newest checkpoint a resume can load: one that cannot be read is skipped, with a line saying so."""
    from safetensors import safe_open

    done = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if p.is_dir())
    for ckpt in reversed(done):
        try:
            load_state(ckpt)
            weights = sorted(ckpt.glob("*.safetensors"))
            if not weights:
                raise OSError("no *.safetensors weights")
            for w in weights:  # the header names every tensor's bytes: a cut-short file fails here
                with safe_open(str(w), "pt") as f:
                    f.keys()
            return ckpt
        except Exception as e:
            older = [p.name for p in done if p < ckpt]
            log(f"gspo: checkpoint {ckpt} is incomplete ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                + (f"falling back to {older[-1]}" if older else "no older checkpoint"))
    return None


def load_state(ckpt: Path) -> dict:
    """Trainer state of a checkpoint (tensors and plain types only: never unpickles code)."""
    return torch.load(Path(ckpt) / "trainer_state.pt", weights_only=True, map_location="cpu")


def load_optimizer(model, opt, state: dict, fsdp: bool = False) -> None:
    """Load a checkpoint's optimizer state into `opt`, whichever strategy (and world size) wrote it.

    One process and DDP save `optimizer.state_dict()` (keyed by parameter number); FSDP
    saves the full state keyed by parameter name. Either loads into either (`fsdp`: `model` is sharded by
    fully_shard, and `opt` holds its shards).
    """
    names = [n for n, _ in unwrap(model).named_parameters()]
    by_name = any(isinstance(p, str) for g in state["param_groups"] for p in g["params"])
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = state if by_name else _rekey(state, dict(enumerate(names)))
        set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(_rekey(state, {n: i for i, n in enumerate(names)}) if by_name else state)


def _rekey(state: dict, key: dict) -> dict:
    """An optimizer state dict with its parameter keys mapped through `key` (number <-> name)."""
    return {"state": {key[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [key[p] for p in g["params"]]} for g in state["param_groups"]]}


def unwrap(model):
    """The bare model under a DDP/FSDP wrapper."""
    return getattr(model, "module", model)


def load_weights(model, ckpt: Path, dtype: torch.dtype = torch.float32) -> None:
    """Load a checkpoint's weights into `model` (resume): the adapter of a LoRA run, else the full weights."""
    if adapters.is_adapter_dir(ckpt):
        adapters.load_weights(model, ckpt)
        return
    from gspo.models.build import load_pretrained

    unwrap(model).load_state_dict(load_pretrained(ckpt, dtype)[0].state_dict())


def load_module(module: torch.nn.Module, path: Path) -> None:
    """Load weights a checkpoint holds as `path` (a safetensors file of `save(files=...)`) into `module`; a tied
    alias left out of the file (saved once, as transformers saves tied weights) loads through its twin."""
    state = load_file(str(path), device=str(next(module.parameters()).device))
    missing, unexpected = unwrap(module).load_state_dict(state, strict=False)
    tied = {n for n, p in unwrap(module).named_parameters(remove_duplicate=False)} - {n for n, _ in unwrap(module).named_parameters()}
    if unexpected or set(missing) - tied:
        raise CheckpointError(f"{path}: does not match the model (missing {sorted(set(missing) - tied)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]})")


def load_model(ckpt: Path, dtype: torch.dtype = torch.float32, attn: str = "auto", base_dir=None):
    """(model, tokenizer) of a checkpoint for inference: full weights, or base + adapter (`base_dir` overrides
    the base an adapter records)."""
    if adapters.is_adapter_dir(ckpt):
        return adapters.load(ckpt, dtype, attn, base_dir=base_dir)
    from gspo.models.build import load_pretrained

    return load_pretrained(ckpt, dtype, attn)


def is_checkpoint(path: Path) -> bool:
    """A directory with full weights (config.json) or a LoRA adapter (adapter_config.json)."""
    return (Path(path) / "config.json").is_file() or adapters.is_adapter_dir(path)
