"""Tools the model may call in a rollout (`rollout.tools=FILE.py:fn1,fn2`), run where they cannot hurt the run.

A tool is a plain Python function with type hints and a Google-style docstring, as TRL's GRPOTrainer takes them
(`tools=[fn, ...]`): transformers' `get_json_schema` turns each into the JSON schema the chat template's `tools`
renders, and a call `{"name": ..., "arguments": {...}}` runs `fn(**arguments)`; its result, as `str(result)`, is
the tool message. A tool that raises answers `str({"error": str(e)})`, TRL's tool message for a failure; so do
a call to an unknown tool, a call that times out and a call that kills the tool's process. An `async def` tool is
awaited.

The functions run in a child process (`python -m gspo.tasks.tools FD`, started by `Toolbox`, never by hand),
one call at a time, each under `rollout.tool_timeout_s`: a call that hangs is cut there (the child is killed,
the next call starts a new one), a tool that kills its process (`os._exit`, a segfault) costs that call only,
and what a tool prints never reaches gspo's output (the child's stdout is /dev/null; its stderr is gspo's).
The user's files are imported in the child only, so an import that prints or hangs cannot either. Tools should
be functions of their arguments (as TRL's are): a run is a function of its seed and config only if they are.

`FILE.py:fn1,fn2` names functions of a file; `package.module:fn1,fn2` of an importable module (the built-in
task's calculator: `gspo.tasks.calculator:calc`); a list of such strings combines them.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Optional

from gspo.core.errors import ConfigError
from gspo.core.processes import die_with_parent

START_S = 60.0  # importing the user's files (and transformers' schema code, once) may take this long


def specs_of(value) -> list[str]:
    """`rollout.tools` as a list of `SOURCE:fn1,fn2` strings (None: no tools)."""
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]


def _parse(spec: str) -> tuple[str, list[str]]:
    """`SOURCE:fn1,fn2` -> (SOURCE, names); SOURCE a .py file (made absolute) or a module name."""
    source, sep, names = spec.rpartition(":")
    fns = [n.strip() for n in names.split(",") if n.strip()]
    if not sep or not source or not fns or not all(n.isidentifier() for n in fns):
        raise ConfigError(f"rollout.tools={spec}: expected FILE.py:fn1,fn2 (or module.name:fn1,fn2), "
                          "e.g. examples/tools.py:multiply,add")
    if source.endswith(".py"):
        if not Path(source).is_file():
            raise ConfigError(f"rollout.tools={spec}: no such file {source}")
        source = str(Path(source).resolve())
    return source, fns


class Toolbox:
    """The tools of `specs`, served by a child process; `schemas` for the chat template, `call` to run one."""

    def __init__(self, specs: list[str], timeout_s: float):
        self.specs, self.timeout_s = list(specs), float(timeout_s)
        self.sources = [_parse(s) for s in self.specs]
        self.schemas: list[dict] = []
        self._proc: Optional[subprocess.Popen] = None
        self._conn: Optional[Connection] = None
        self._start(with_schemas=True)
        self.names = [s["function"]["name"] for s in self.schemas]

    # -- the child's lifetime ---------------------------------------------------
    def _start(self, with_schemas: bool = False) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_root(), os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen([sys.executable, "-m", "gspo.tasks.tools", str(theirs.fileno())], env=env,
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        reply = self._ask({"op": "load", "sources": self.sources, "schemas": with_schemas}, START_S + self.timeout_s)
        if reply is None or "error" in reply:
            self.close()
            why = "it did not start" if reply is None else reply["error"]
            raise ConfigError(f"rollout.tools={','.join(self.specs)}: {why}")
        if with_schemas:
            self.schemas = reply["schemas"]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._conn.close()
        self._proc = self._conn = None

    def _ask(self, message: dict, timeout_s: float) -> Optional[dict]:
        """The child's reply; None when none comes within `timeout_s` (or it died: then it has exited)."""
        try:
            self._conn.send_bytes(json.dumps(message).encode())
            if not self._conn.poll(timeout_s):
                return None
            return json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):  # it closed its end: it is exiting, so its exit code comes at once
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            return None

    # -- calls --------------------------------------------------------------------
    def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """(the tool message's content, whether the call failed): `str(result)`, or `str({"error": ...})`."""
        if name not in self.names:
            return _error(f"Tool {name} not found."), True  # TRL's words
        if self._proc is None:
            self._start()
        reply = self._ask({"op": "call", "name": name, "arguments": arguments}, self.timeout_s)
        if reply is None:  # hung or dead: either way this child is done; the next call starts another
            code = self._proc.poll()
            self.close()
            if code is None:
                return _error(f"{name} timed out after {self.timeout_s:g} s (rollout.tool_timeout_s)"), True
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            return _error(f"{name}'s process died ({how})"), True
        return (reply["error"], True) if "error" in reply else (reply["content"], False)


def _error(text: str) -> str:
    return str({"error": text})


_BOXES: dict[tuple, Toolbox] = {}


def toolbox(value, timeout_s: float) -> Toolbox:
    """The process's Toolbox for `rollout.tools` = `value` (started on first use, closed at exit)."""
    key = (tuple(specs_of(value)), float(timeout_s))
    if key not in _BOXES:
        if not _BOXES:
            atexit.register(lambda: [b.close() for b in _BOXES.values()])
        _BOXES[key] = Toolbox(list(key[0]), timeout_s)
    return _BOXES[key]


def check(cfg) -> None:
    """Before any work (`gspo.train.preflight.check`): the tool files import, the functions exist, have schemas."""
    if cfg.rollout.tools is not None:
        toolbox(cfg.rollout.tools, cfg.rollout.tool_timeout_s)


def _root() -> str:
    """The directory gspo is imported from (the child must import the same gspo)."""
    return str(Path(__file__).resolve().parents[2])


# --------------------------------------------------------------------------- the child


def _load(sources: list, with_schemas: bool) -> tuple[dict, list[dict]]:
    import importlib
    import importlib.util

    fns: dict = {}
    for source, names in sources:
        if source.endswith(".py"):
            key = "gspo_user_tools_" + str(abs(hash(source)))
            spec = importlib.util.spec_from_file_location(key, source)
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
        for name in names:
            fn = getattr(module, name, None)
            if not callable(fn):
                found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
                raise ValueError(f"{source} has no function '{name}'. Functions there: {', '.join(found) or 'none'}")
            if name in fns:
                raise ValueError(f"two tools are named '{name}'; the model calls them by name")
            fns[name] = fn
    schemas = []
    if with_schemas:
        from transformers.utils import get_json_schema

        for name, fn in fns.items():
            try:
                schemas.append(get_json_schema(fn))
            except Exception as e:  # no docstring, an argument without a type hint or a description
                raise ValueError(f"{name}: {e} (a tool needs type hints and a docstring with an Args: section, "
                                 "as transformers' get_json_schema reads them)") from None
    return fns, schemas


def _serve(fd: int) -> None:
    # Ctrl-C and SLURM's SIGTERM reach the whole process group: the trainer finishes its step (its calls included,
    # so a resumed run equals an uninterrupted one) and then closes us; we die with it in any case
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    conn = Connection(fd)
    send = lambda message: conn.send_bytes(json.dumps(message).encode())  # noqa: E731
    fns: dict = {}
    loop = None
    while True:
        try:
            message = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message["op"] == "load":
            try:
                fns, schemas = _load(message["sources"], message["schemas"])
                send({"schemas": schemas})
            except BaseException as e:  # the user's file raised (or exited) on import
                send({"error": f"{type(e).__name__}: {e}"})
            continue
        try:
            out = fns[message["name"]](**message["arguments"])
            if hasattr(out, "__await__"):  # an async tool: one event loop for the child, as TRL keeps one
                import asyncio

                loop = loop or asyncio.new_event_loop()
                out = loop.run_until_complete(out)
            send({"content": str(out)})
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: a tool's exit is its call's failure
            send({"error": _error(str(e))})


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
