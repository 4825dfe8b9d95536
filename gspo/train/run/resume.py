"""A resume continues the experiment it resumes: what it may change, and the record of what it changed.

A resume may change how long the run goes on (`train.steps`), how it is logged, checkpointed and
evaluated, and the hardware it runs on (a checkpoint loads under any world size or device). Every
other key (algorithm, model, task, reward, rollout, loss hyperparameters, learning rate, seed, the
training dtype) defines the experiment: changing it is refused in one line naming the keys. What a
resume changes is appended to RUN_DIR/resumes.jsonl with the step it applies from, and to the list
`resumes` in RUN_DIR/summary.json. Some of what a resume may change changes the run's numbers
(NUMERICS: a run is a function of its seed and config only at one thread count, on one device, ...,
docs/contracts.md), and so does going on on another machine or package set (gspo/core/provenance.py): such a
resume is refused unless forced (`force_resume=true`; a requeued job's is forced, no one being there to refuse it),
and a forced one is said in one line (`numbers_warning`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gspo.core import provenance
from gspo.core.errors import ConfigError
from gspo.core.files import replace_text
from gspo.config.keys import resume_may_change

RECORD = "resumes.jsonl"
# keys a resume may change that change the run's numbers from that step on (docs/contracts.md, `seed`): another
# thread count splits float sums otherwise (the trainer's, the sampler's), another device or attention kernel
# computes otherwise, another world size or backend reduces the gradients in another order, a compiled sampler
# decodes with other kernels
NUMERICS = ("hardware.threads", "rollout.worker_threads", "hardware.device", "model.attn_implementation",
            "hardware.name", "hardware.nproc", "hardware.strategy", "hardware.backend", "hardware.compile")
NOT_RECORDED = ("resume", "force_resume")  # how the resume was asked for, not what it changes
SUMMARY = "summary.json"


def _flat(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return out


def changes(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """key -> (old value, new value) for every key whose value differs."""
    a, b = _flat(old), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def may_change(key: str) -> bool:
    """Whether a resume may change `key` (dotted, or a group's `x.`): the schema's markings say (gspo/config/keys.py)."""
    return resume_may_change(key)


def experiment_key(cfg: Any) -> tuple:
    """What makes a run the experiment it is, hashable: every key and value but those a resume may change."""
    return tuple(sorted((k, repr(v)) for k, v in _flat(cfg).items() if not may_change(k)))


def other_experiment(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """The changes from `old` to `new` that a resume may not make: key -> (old value, new value)."""
    return {k: v for k, v in changes(old, new).items() if not may_change(k)}


def listed(bad: dict[str, tuple[Any, Any]]) -> str:
    """`key=new (it ran with old), ...` for `other_experiment`'s answer."""
    return ", ".join(f"{k}={n} (it ran with {o})" for k, (o, n) in bad.items())


def check(old: Any, new: Any) -> None:
    """Refuse, in one line naming them, the changes that would make the resumed run another experiment."""
    bad = other_experiment(old, new)
    if bad:
        raise ConfigError(f"resume: {listed(bad)}: changes what the run is; a resume continues the same experiment, so "
                          "start a new run for that. A resume may change train.steps, checkpointing, logging, "
                          "evaluation and hardware (not hardware.dtype)")


def entry(run_dir: Path | str, old: Any, new: Any, from_step: int) -> dict:
    """What a resume of `run_dir` from `from_step` changes ({} for nothing: its run is the uninterrupted one): the
    config's keys, and `machine.*` where the run goes on on another machine or package set than its last session's
    (gspo/core/provenance.py; a key the run's record lacks, from before it was recorded, is not compared)."""
    diff = {k: {"was": o, "now": n} for k, (o, n) in changes(old, new).items() if k not in NOT_RECORDED}
    try:
        was = json.loads((Path(run_dir) / SUMMARY).read_text()).get("machine") or {}
    except (OSError, ValueError):  # none yet, or unreadable: nothing to compare with
        was = {}
    diff |= {f"machine.{k}": v for k, v in provenance.compared(was, provenance.machine()).items()}
    if not diff:
        return {}
    return {"from_step": from_step, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "changes": diff}


def refuse_numbers(entry: dict, forced: bool) -> None:
    """Refuse, in one line, a resume whose `entry` changes the run's numbers (a thread count, the device, the
    machine, ...: NUMERICS) unless `forced` (`force_resume=true`): the resumed run would no longer be the one its
    seed and config give, and a study that mixes such runs cannot tell it from an effect."""
    changed = numbers_changed(entry)
    if changed and not forced:
        raise ConfigError(f"resume: {changed} from step {entry['from_step']} on: the run would no longer be the one "
                          "its seed and config give (docs/contracts.md); resume where it ran, or add "
                          "force_resume=true to go on anyway (recorded in summary.json's resumes)")


def record(run_dir: Path | str, entry: dict) -> dict:
    """Append a resume's `entry` (from `entry`; nothing for {}) to RUN_DIR/resumes.jsonl and to summary.json's
    `resumes`. Returns the entry."""
    if entry:
        with (Path(run_dir) / RECORD).open("a") as fh:
            fh.write(json.dumps(entry) + "\n")
        _into_summary(Path(run_dir) / SUMMARY, entry)
    return entry


def _into_summary(path: Path, entry: dict) -> None:
    """`entry` appended to summary.json's `resumes`, the file replaced whole (written before the resumed run starts,
    which then keeps it: gspo/train/loop/checkpointer.py's Summary)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet (killed before step 0's summary), or unreadable: the list alone
        data = {}
    data["resumes"] = [*data.get("resumes", []), entry]
    replace_text(path, json.dumps(data, indent=2))


def numbers_changed(entry: dict) -> str:
    """`hardware.threads 1 -> 2, machine.cpu A -> B` for what a resume's `entry` changes of what changes the run's
    numbers ('' for nothing)."""
    changed = {k: v for k, v in entry.get("changes", {}).items()
               if k in NUMERICS or (k.startswith("machine.") and k.removeprefix("machine.") in provenance.NUMERICS)}
    return ", ".join(f"{k} {v['was']} -> {v['now']}" for k, v in changed.items())


def numbers_warning(entry: dict) -> str | None:
    """One line when a resume's `entry` (from `entry`) changes what changes the run's numbers, else None (said for
    a forced resume and a requeued job's, which no one was there to refuse)."""
    said = numbers_changed(entry)
    if not said:
        return None
    return (f"gspo: warning: this resume changes {said}: from step {entry['from_step']} on, the run is no longer the "
            "one its seed and config give (docs/contracts.md); recorded in summary.json's resumes")
