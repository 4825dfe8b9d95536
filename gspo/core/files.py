"""Writing files that others read: whole or not at all, with the modes open() and mkdir() give.

A run's files (summary.json, metrics.jsonl rewritten, sweep.json), its checkpoints and the caches gspo builds
(dequantized GGUF copies, warm-started bases, split MoEs) are written into a temporary file or directory of the
writer's own, then renamed into place: a reader, or a process killed midway, never sees half of one, and two
writers never rename each other's. tempfile's mkstemp / mkdtemp would make them owner-only (0o600 / 0o700),
so a colleague on a shared results or cache directory could not read them; these give what a plain open() or
mkdir() gives (0o666 / 0o777 less the umask, the directory's default ACL), the kernel applying the umask.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def replace_text(path: Path | str, text: str) -> None:
    """Write `text` to `path` whole: into a temporary file of this call's own beside it, renamed over it, so a
    reader (or a process killed midway) never sees half of it, and two writers never rename each other's file.
    The file gets the mode a plain open() gives a new file (0o666 less the umask, a directory's default ACL), not
    mkstemp's owner-only 0o600: a colleague reading a shared results directory reads every run file alike."""
    path = Path(path)
    fd, tmp = temp_file(path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fresh(parent: Path | str, prefix: str, suffix: str, make: Callable[[Path], T]) -> T:
    """`make(name)` on the first random `parent/prefix<hex>suffix` that no one has taken (mkstemp's loop)."""
    for _ in range(100):
        candidate = Path(parent) / f"{prefix}{secrets.token_hex(6)}{suffix}"
        try:
            return make(candidate)
        except FileExistsError:  # (48 random bits: another caller's name only by a fluke, or by design)
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(Path(parent) / f"{prefix}*{suffix}"))


def temp_file(parent: Path | str, prefix: str = ".tmp-", suffix: str = "") -> tuple[int, str]:
    """mkstemp's (fd, path) of a new file in `parent`, created as open() creates one: mode 0o666, from which the
    kernel takes the umask (and applies the directory's default ACL). Reading the umask ourselves would mean
    setting it (os.umask), a race with every other thread creating a file meanwhile; the kernel does it safely."""
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    return _fresh(parent, prefix, suffix, lambda p: (os.open(p, flags, 0o666), str(p)))


def temp_dir(parent: Path | str, prefix: str = ".tmp-") -> Path:
    """mkdtemp's new directory in `parent` (to be filled, then renamed into place), created as mkdir creates one:
    mode 0o777 less the umask (the kernel's, as in `temp_file`), not mkdtemp's owner-only 0o700, so that what is
    renamed from it (a checkpoint, a merged export) is as readable as the run directory around it."""
    return _fresh(parent, prefix, "", lambda p: (os.mkdir(p, 0o777), p)[1])


def widen_to_open_modes(tree: Path | str) -> None:
    """Give each file under directory `tree` (made by `temp_dir`) at least the mode open() gives a new file there:
    the directory's own mode less its execute bits (0o777 less the umask, less 0o111). Writers that write through a
    temporary file of their own leave theirs owner-only: safetensors 0.8 renames a 0o600 file into place (the
    weights of a checkpoint, of a merged export). Only widens: a mode a writer chose beyond that is kept."""
    tree = Path(tree)
    wanted = stat.S_IMODE(tree.stat().st_mode) & 0o666
    for path in tree.rglob("*"):
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & wanted != wanted:
            os.chmod(path, stat.S_IMODE(st.st_mode) | wanted)


