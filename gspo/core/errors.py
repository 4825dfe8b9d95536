"""Errors meant for people: the CLI prints them without a traceback."""

import sys


class ConfigError(ValueError):
    """A bad config value or command-line input. The CLI exits with code 2."""


class RunFailed(RuntimeError):
    """The run cannot go on (a diverged loss, non-finite logits, a lost rank): the CLI prints one line, exit
    code 1; the finished steps, their metrics and checkpoints stay on disk."""


def tidy_warnings() -> None:
    """Warnings as people read them, for the `gspo` command (not on import: a library user keeps Python's).

    gspo's own warnings become one `gspo: warning: ...` line, without Python's source line; a library's
    FutureWarning / DeprecationWarning (about how gspo calls it, nothing a user can act on) is hidden; any
    other library warning is one line naming the library.
    """
    import warnings
    from pathlib import Path

    here = str(Path(__file__).resolve().parent.parent)  # the gspo package

    def show(message, category, filename, lineno, file=None, line=None):
        ours = str(Path(filename).resolve()).startswith(here)
        if not ours and issubclass(category, (FutureWarning, DeprecationWarning)):
            return
        text = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
        source = "" if ours else f"({_package(filename)}) "
        print(f"gspo: warning: {source}{text}", file=file or sys.stderr)

    warnings.showwarning = show


def _package(filename: str) -> str:
    """The top-level package a file belongs to (site-packages/transformers/x.py -> transformers)."""
    from pathlib import Path

    parts = Path(filename).parts
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            return parts[parts.index(anchor) + 1]
    return Path(filename).stem
