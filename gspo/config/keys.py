"""What defines an experiment, read off the schema's markings (gspo/config/schema.py, `RUN`, `SEED`, ...).

Three questions ask it, each answered here from the same markings:

- may a resume change this key? (`resume_may_change`: gspo/train/run/resume.py, and a sweep run again)
- do two runs that differ in this key belong to different arms of a comparison? (`separates_arms`: `gspo compare`)
- does the warm-started base depend on this key? (`base_depends_on`, `base_part`: gspo/train/start/warm_start.py's cache)

A key is dotted (`hardware.threads`), or a node's prefix (`hardware.`) for a whole group. A key the schema lacks
(one an older gspo wrote) takes the markings of the nearest node above it that the schema has.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any, Callable

from gspo.config.schema import Config


@functools.cache
def _marked() -> dict[tuple[str, ...], dict[str, Any]]:
    """Every schema key and node, as its path, -> its markings: each the one set by the nearest field on its path."""
    table: dict[tuple[str, ...], dict[str, Any]] = {(): {}}

    def walk(node: type, path: tuple[str, ...]) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            here = (*path, f.name)
            table[here] = {**table[path], **f.metadata}
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], here)

    walk(Config, ())
    return table


def markings(key: str) -> dict[str, Any]:
    """The markings of a dotted key or a node's prefix (`x.`): the schema's own, or for a key it lacks, those of the
    nearest node above it."""
    path = tuple(key.rstrip(".").split("."))
    table = _marked()
    while path not in table:
        path = path[:-1]
    return table[path]


def resume_may_change(key: str) -> bool:
    """A resume may change `key` (it continues the same experiment): a RUN key, unless it is KEPT_ON_RESUME, and a
    RESUMABLE one (`train.steps`)."""
    m = markings(key)
    return bool(m.get("resume", m.get("run", False)))


def separates_arms(key: str) -> bool:
    """Two runs that differ in `key` are different arms of a comparison, not seeds of one: every key but the RUN
    ones, the seed and a preset's name (LABEL)."""
    m = markings(key)
    return not (m.get("run") or m.get("seed") or m.get("label"))


def base_depends_on(key: str) -> bool:
    """The warm-started base depends on `key`: a model.* or task.* key that is neither RUN, LABEL nor NOT_BASE, or
    a key marked BASE."""
    m = markings(key)
    if "base" in m:
        return bool(m["base"])
    return key.startswith(("model.", "task.")) and not (m.get("run") or m.get("label"))


def _below(node: type, prefix: str) -> list[str]:
    """Every key under a schema node, its nodes' prefixes (`x.`) among them."""
    hints = typing.get_type_hints(node)
    out: list[str] = []
    for f in dataclasses.fields(node):
        key, sub = prefix + f.name, hints[f.name]
        out += [key + ".", *_below(sub, key + ".")] if dataclasses.is_dataclass(sub) else [key]
    return out


def prefixes(test: Callable[[str], bool], node: type = Config, prefix: str = "") -> tuple[str, ...]:
    """The schema's keys under `node` for which `test` holds, a node whose every key holds (and so would a key it
    lacks) as one `x.` prefix: what `key.startswith(...)` takes."""
    hints = typing.get_type_hints(node)
    out: list[str] = []
    for f in dataclasses.fields(node):
        key, sub = prefix + f.name, hints[f.name]
        if not dataclasses.is_dataclass(sub):
            out += [key] if test(key) else []
        elif test(key + ".") and all(map(test, _below(sub, key + "."))):
            out.append(key + ".")
        else:
            out += prefixes(test, sub, key + ".")
    return tuple(out)


def base_part(group: str, values: dict[str, Any]) -> dict[str, Any]:
    """A group's resolved values (`model`, `task`) without the keys the warm-started base does not depend on (a
    node none of whose keys it depends on goes whole, as `model.lora` does). `values` is left as it was."""
    node = typing.get_type_hints(Config)[group]
    out = copy.deepcopy(values)
    for key in prefixes(lambda k: not base_depends_on(k), node, f"{group}."):
        *parents, last = key.removeprefix(f"{group}.").rstrip(".").split(".")
        holder = functools.reduce(lambda d, p: d.get(p) if isinstance(d, dict) else None, parents, out)
        if isinstance(holder, dict):
            holder.pop(last, None)
    return out
