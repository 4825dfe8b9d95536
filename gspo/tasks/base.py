"""Tasks with verifiable answers: prompt generators, reference solutions, verifiers.

Every task splits its problem space into a training part and a held-out part by a
stable hash of the problem's *canonical form* (`Task.canonical`: `12+34=` and `34+12=`
are one problem), so training never samples a held-out problem or an equivalent of one,
and the held-out evaluation set is the same for every run, seed and algorithm.

This module holds what every task shares (Problem, Verdict, the Task protocol, the held-out
split, the registry); `gspo.tasks` re-exports it with `build_task`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Callable, Protocol


@dataclass(frozen=True)
class Problem:
    prompt: str  # what the model is given
    answer: str  # a reference solution (warm-start target; the verifier may accept others)
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Verdict:
    correct: bool  # the completion solves the problem
    well_formed: bool  # the completion has the expected form (TinyZero's format reward)
    timed_out: bool = False  # the checker ran out of time on it (gspo/tasks/mathcheck.py): scored as wrong


class Task(Protocol):
    """What every task has. Two optional methods serve rollouts with tools (gspo/tasks/calculator.py has both):
    `reference_conversation(problem) -> messages` after the prompt (the warm start's target; default: the answer
    as one assistant message) and `conversation_parts(conversations, problems) -> {name: (N,) tensor}` (its own
    diagnostics of the trajectories, logged as reward/<name>/mean and eval/<name>)."""

    name: str
    alphabet: str  # every character prompts and answers may contain
    # optional: "characters" (the default: short arithmetic for gspo's tiny models, bare answers), "chat" (natural
    # language for a pretrained chat model: refused on the tiny ones), "any" (a user's data)
    prompts: str

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]: ...
    def eval_set(self, n: int) -> list[Problem]: ...
    def verify(self, completion: str, problem: Problem) -> Verdict: ...
    def canonical(self, problem: Problem) -> str: ...  # one key per class of equivalent problems


def canonical(task: Task, problem: Problem) -> str:
    """The key the held-out split hashes: the task's canonical form, or the prompt for a task without one."""
    fn = getattr(task, "canonical", None)
    return fn(problem) if fn is not None else problem.prompt


def judge(task: Task, text: str, problem: Problem, ill_formed: bool = False) -> Verdict:
    """The verdict on a completion: the task's, except that a completion holding a special token
    before its final EOS (a sampled `<pad>`, a stray `<|im_start|>`) is ill-formed whatever the task
    would say. Decoding skips special tokens, so without this `1<pad>25` would be scored as `125`."""
    return Verdict(False, False) if ill_formed else task.verify(text, problem)


def judge_all(task: Task, texts: list[str], problems: list[Problem], ill_formed: list[bool]) -> list[Verdict]:
    """`judge` on every completion; through the task's `verify_batch` when it has one (a batch at a time: the
    data task checks math in a process of its own, gspo/tasks/mathcheck.py)."""
    batch = getattr(task, "verify_batch", None)
    if batch is None:
        return [judge(task, t, p, bad) for t, p, bad in zip(texts, problems, ill_formed)]
    keep = [i for i, bad in enumerate(ill_formed) if not bad]
    got = dict(zip(keep, batch([texts[i] for i in keep], [problems[i] for i in keep]) if keep else []))
    return [got.get(i, Verdict(False, False)) for i in range(len(texts))]


def is_heldout(key: str, fraction: float) -> bool:
    """Stable membership of a problem in the held-out split (independent of seeds and processes)."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return (h % 1_000_000) < fraction * 1_000_000


TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str) -> Callable:
    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        if name in TASKS:
            raise ValueError(f"task {name!r} registered twice")
        TASKS[name] = factory
        return factory

    return deco
