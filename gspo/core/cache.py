"""The build-once cache: a checkpoint gspo derives from others, made once, keyed by content, shared.

What gspo builds from a user's files (a GGUF file's dequantized copy, gspo/models/gguf.py; a dense model split into
experts, gspo/train/start/split_moe.py) is cached in `cache_dir` under a key holding the content hash of every file it
reads (`file_sha256`) and what builds it: a changed file, or a copy other code wrote, is never reused. One process
builds while the others that want it (the ranks of a DDP run, the jobs of a sweep sharing cache_dir) wait on a lock
file, then reuse it (`build_once`); written into a temporary directory and renamed, so nothing sees half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

from gspo.core.files import temp_dir, widen_to_open_modes


def build_once(target: Path, write: Callable[[Path], None]) -> bool:
    """Make the cached checkpoint `target` (complete once it holds config.json) by `write(tmp)` into a temporary
    directory beside it, then renamed into place, under a lock on the cache (one process builds, the others wait,
    then reuse it: ranks, sweep jobs). False, without building, when it exists or another process made it meanwhile."""
    if (target / "config.json").is_file():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():  # made by the process that held the lock before this one
            return False
        tmp = temp_dir(target.parent, f".tmp-{target.name}-")
        try:
            write(tmp)
            widen_to_open_modes(tmp)  # (save_pretrained's safetensors are written owner-only)
            try:
                os.rename(tmp, target)
            except OSError:  # without flock, another process may have finished first: use its copy
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return True


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` for the block, waiting for any other holder. flock's lock goes with
    the holder's open file: a process that dies releases it, so a stale one never blocks, and the file is left in
    place (removing it would let two processes lock two different files)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): parallel callers each build, and the rename keeps one copy
        yield
        return
    with open(lock_file, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def file_sha256(path: str | Path) -> str:
    """A file's content hash (what caches built from it are keyed by)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
