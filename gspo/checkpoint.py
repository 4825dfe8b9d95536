"""Checkpoints: Hugging Face format weights plus trainer state, written atomically.

`RUN_DIR/checkpoints/step_<n>/` holds config.json, model.safetensors, the tokenizer
files and `trainer_state.pt` (optimizer, scheduler, step); a LoRA run (`model.lora.r > 0`)
holds adapter_config.json + adapter_model.safetensors instead of the full weights (see
gspo/adapters.py). Each is written under a temporary name and renamed, so a crash mid-write
never leaves a broken "latest".
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from gspo import adapters


def save(run_dir: Path, step: int, model, tokenizer, optimizer, scheduler, keep: int = 1,
         model_state: Optional[dict] = None, optimizer_state: Optional[dict] = None) -> Path:
    """Save step `step`; keep the newest `keep` checkpoints.

    `model_state` / `optimizer_state`: full state dicts gathered by the caller (FSDP);
    None = the model's and optimizer's own.
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    if adapters.is_adapted(model):
        adapters.save(unwrap(model), tmp, state_dict=model_state)  # the adapter only: the base is not ours to copy
    else:
        unwrap(model).save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    tokenizer.save_pretrained(tmp)
    optim = optimizer.state_dict() if optimizer_state is None else optimizer_state
    state = {"step": step, "optimizer": optim, "scheduler": scheduler.state_dict()}
    torch.save(state, tmp / "trainer_state.pt")
    final = root / f"step_{step:06d}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None."""
    done = sorted(p for p in (Path(run_dir) / "checkpoints").glob("step_*") if (p / "trainer_state.pt").is_file())
    return done[-1] if done else None


def load_state(ckpt: Path) -> dict:
    """Trainer state of a checkpoint (tensors and plain types only: never unpickles code)."""
    return torch.load(Path(ckpt) / "trainer_state.pt", weights_only=True, map_location="cpu")


def unwrap(model):
    """The bare model under a DDP/FSDP wrapper."""
    return getattr(model, "module", model)


def load_weights(model, ckpt: Path, dtype: torch.dtype = torch.float32) -> None:
    """Load a checkpoint's weights into `model` (resume): the adapter of a LoRA run, else the full weights."""
    if adapters.is_adapter_dir(ckpt):
        adapters.load_weights(model, ckpt)
        return
    from gspo.models import load_pretrained

    unwrap(model).load_state_dict(load_pretrained(ckpt, dtype)[0].state_dict())


def load_model(ckpt: Path, dtype: torch.dtype = torch.float32, attn: str = "auto", base_dir=None):
    """(model, tokenizer) of a checkpoint for inference: full weights, or base + adapter (`base_dir` overrides
    the base an adapter records)."""
    if adapters.is_adapter_dir(ckpt):
        return adapters.load(ckpt, dtype, attn, base_dir=base_dir)
    from gspo.models import load_pretrained

    return load_pretrained(ckpt, dtype, attn)


def is_checkpoint(path: Path) -> bool:
    """A directory with full weights (config.json) or a LoRA adapter (adapter_config.json)."""
    return (Path(path) / "config.json").is_file() or adapters.is_adapter_dir(path)
