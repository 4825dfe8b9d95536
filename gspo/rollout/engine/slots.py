"""Weight slots: files in /dev/shm (the temp dir elsewhere) holding every sampling weight, flat, in the
sampler's dtype, mapped by the trainer and by the processes that sample (rollout workers, the vLLM engine's
process) alike with `torch.from_file(shared=True)`: a weight push is one copy into a slot, no pickling.
With `rollout.vllm.lora_push=adapter` a slot is a directory instead, holding a LoRA run's adapter as peft saves it
(`adapters.write_adapter`): the engine serving it holds the base already and loads only that.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path

import torch

from gspo.models import adapters

PREFIX = "gspo-weights-"
ADAPTER = "-adapter"  # how an adapter slot's (a directory's) name ends; a weight slot's ends in ".bin"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def layout_of(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every sampling weight, in slot order: the plain model's parameters (LoRA merged)."""
    return adapters.merged_layout(model)


def map_slot(path: str, layout: list, dtype: torch.dtype, create: bool = False) -> dict[str, torch.Tensor]:
    """Views (name -> tensor) of the weights in the slot file `path`, shared with every process that maps it."""
    total = sum(int(torch.Size(shape).numel()) for _, shape in layout)
    if create:
        with open(path, "wb") as f:
            f.truncate(total * torch.tensor([], dtype=dtype).element_size())
    flat = torch.from_file(path, shared=True, size=total, dtype=dtype)
    views, at = {}, 0
    for name, shape in layout:
        n = int(torch.Size(shape).numel())
        views[name] = flat[at : at + n].view(shape)
        at += n
    return views


def slot_path(stem: str, adapter: bool) -> str:
    """Where the slot named `stem` (it starts with PREFIX and the trainer's pid) lives: a weight file or, for adapter
    pushes, a directory."""
    return os.path.join(shm_dir(), stem + (ADAPTER if adapter else ".bin"))


def remove(path: str) -> None:
    """Delete a slot, a file or an adapter directory; nothing if it is gone."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def remove_stale_slots() -> None:
    """Slots left by a trainer that was killed (-9): its pid is gone."""
    for path in glob.glob(os.path.join(shm_dir(), f"{PREFIX}*")):
        if not path.endswith((".bin", ADAPTER)):
            continue
        try:
            pid = int(os.path.basename(path)[len(PREFIX):].split("-")[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            remove(path)
        except (ValueError, PermissionError):
            continue
