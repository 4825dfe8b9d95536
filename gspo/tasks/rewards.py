"""Rewards: what a completion is worth.

Two kinds, picked by `reward=<name>`:

* a rule on the task's verdict (`tinyzero`, `binary`): one small function in a registry; the task verifies
  every completion and the rule only decides what a verdict is worth;
* your own functions (`reward=python reward.fn=FILE.py:NAME`, or a list with `reward.weights`), called as TRL's
  GRPOTrainer calls them, by keyword, once per rollout batch::

      def accuracy(completions, answer, **kwargs) -> list[float | None]: ...

  with `prompts` (each row's prompt as the task holds it: a string, or chat messages), `completions` (the text
  the model wrote, decoded as TRL decodes it: special tokens skipped, EOS removed; for chat prompts a list
  `[{"role": "assistant", "content": text}]` as TRL passes it), `completion_ids` (its token ids, EOS included),
  `trainer_state` (a transformers TrainerState with `global_step` = rollout steps done before this batch and
  `max_steps` = `train.steps`) and every column of the row by its name, each a list of one
  value per row (for `task=data`, every column of your file except the prompt; for the built-in tasks,
  `answer` and the task's own fields). A function without `**kwargs` gets only the names it takes. A
  coroutine function (`async def`) is awaited (one function after another; TRL runs them concurrently).
  `None` in the returned list means "no reward from this function for this row": the reward is the weighted
  sum over the functions that gave one (TRL's nansum); a row no function scored gets 0 and is counted in
  `reward/unscored/mean`. Each function is logged as `reward/fn/<name>/mean`, its `None`s left out (under its
  own namespace, so any name works, `correct` included).

  Every completion is shown to the functions, as TRL shows it, including one the model broke off with a
  special token before its EOS (a stray `<|im_start|>`; see `tasks.judge`): such rows are counted in
  `reward/ill_formed/mean`. `reward.ill_formed=X` (a number; default null) opts out: those rows then get X
  and the functions are not called on them. A function that raises, returns the wrong number of
  values, NaN or a non-number stops the run with a one-line `RewardError` naming it and the sample; `probe`
  calls each function on one real sample before any work.

`reward=model reward.path=DIR` (or a list of directories) scores with learned reward models
(gspo/tasks/reward_model.py), each called as one more function (a model's metric is
`reward/fn/<directory name>/mean`), first in `reward.weights`, then any `reward.fn` functions beside them.

Every completion is also judged by the task, whatever the reward: `reward/correct/mean` and
`reward/format/mean` are logged and held-out accuracy is the task's verdict (an ill-formed completion is
neither correct nor well-formed there: the built-in tasks keep their own verdict).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import inspect
import math
import numbers
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from gspo.core.errors import ConfigError
from gspo.tasks import reward_model
from gspo.tasks.base import Problem, Task, Verdict, judge, judge_all

RewardFn = Callable[[Verdict, object], float]
REWARDS: dict[str, RewardFn] = {}
PYTHON = "python"  # reward=python: the user's functions, not a registry entry
MODEL = "model"  # reward=model: reward models (reward.path), and reward.fn functions beside them if any
FUNCTIONS = (PYTHON, MODEL)  # the rewards made of called functions (weights, None, reward/fn/<name>)
USER = "fn/"  # a user function's part (and metric reward/fn/<name>/mean): apart from gspo's own parts


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} registered twice")
        REWARDS[name] = fn
        return fn

    return deco


@register_reward("tinyzero")
def tinyzero(v: Verdict, cfg) -> float:
    """TinyZero's rule: `correct` for a right answer, `format_score` for a well-formed wrong one, else 0."""
    return cfg.correct if v.correct else (cfg.format_score if v.well_formed else 0.0)


@register_reward("binary")
def binary(v: Verdict, cfg) -> float:
    """`correct` for a right answer, 0 otherwise."""
    return cfg.correct if v.correct else 0.0


class RewardError(ConfigError):
    """A task verifier or reward function failed on a sample (the CLI prints one line, exit code 2)."""


# --------------------------------------------------------------------------- user functions


@dataclass(frozen=True)
class UserFn:
    """A reward function loaded from a user's file."""

    spec: str  # FILE.py:NAME as given
    name: str  # NAME: the metric is reward/<name>/mean
    fn: Callable
    takes: frozenset[str] | None  # keyword names it accepts; None = **kwargs (everything)


def _specs(fn) -> list[str]:
    if fn is None:
        return []
    return [str(fn)] if isinstance(fn, str) else [str(x) for x in fn]


def _import(path: Path, spec: str):
    """Import a user's file once per process (keyed by its resolved path)."""
    key = "gspo_user_rewards_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if key in sys.modules:
        return sys.modules[key]
    mod_spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[key] = module
    try:
        mod_spec.loader.exec_module(module)
    except BaseException as e:  # the user's file raised on import: one line, the file named
        del sys.modules[key]
        raise ConfigError(f"reward.fn={spec}: importing {path} raised {type(e).__name__}: {e}") from None
    return module


def load_user_fn(spec: str) -> UserFn:
    """`FILE.py:NAME` -> the function, checked: the file imports, NAME is callable and can be called by keyword."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file or not name.isidentifier():
        raise ConfigError(f"reward.fn={spec}: expected FILE.py:NAME, e.g. examples/rewards.py:accuracy")
    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"reward.fn={spec}: no such file {file}")
    module = _import(path, spec)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"reward.fn={spec}: {file} has no function '{name}'. Functions there: {', '.join(found) or 'none'}")
    if not callable(fn):
        raise ConfigError(f"reward.fn={spec}: '{name}' in {file} is a {type(fn).__name__}, not a function")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: trust it
        return UserFn(spec, name, fn, None)
    # TRL calls reward functions by keyword only: a required positional-only parameter can never be filled
    stuck = [p.name for p in params if p.kind == p.POSITIONAL_ONLY and p.default is p.empty]
    if stuck:
        raise ConfigError(f"reward.fn={spec}: '{name}' has positional-only parameter(s) {', '.join(stuck)}; reward "
                          "functions are called by keyword, as TRL does: def f(completions, **kwargs)")
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return UserFn(spec, name, fn, None)
    return UserFn(spec, name, fn, frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)))


def model_fn(path: str, cfg) -> UserFn:
    """A reward model directory as a function (checked now, loaded on its first call: `probe` makes that call)."""
    reward_model.check(path)

    def score(prompts: list, completions: list, **kwargs) -> list[float]:
        return reward_model.RewardModel.load(path, cfg.device, cfg.batch_size)(prompts, completions)

    return UserFn(path, Path(path).resolve().name, score, None)


def user_fns(cfg) -> tuple[list[UserFn], list[float]]:
    """The configured functions (reward=model: its models first) and their weights, checked."""
    specs = _specs(cfg.fn)
    models = reward_model.paths(getattr(cfg, "path", None)) if cfg.name == MODEL else []
    if cfg.name == MODEL and not models:
        raise ConfigError("reward=model needs reward.path=DIR: a reward model (AutoModelForSequenceClassification, "
                          "num_labels 1), or a list [DIR1,DIR2]")
    if not specs and not models:
        raise ConfigError("reward=python needs reward.fn=FILE.py:NAME (or a list [A.py:f,B.py:g])")
    fns = [model_fn(p, cfg) for p in models] + [load_user_fn(s) for s in specs]
    weights = [1.0] * len(fns) if cfg.weights is None else [float(w) for w in cfg.weights]
    if len(weights) != len(fns):
        parts = (f"{len(models)} reward model(s) and " if models else "") + f"{len(specs)} reward.fn function(s)"
        raise ConfigError(f"reward.weights has {len(weights)} values for {parts}; give one each"
                          + (", the models first" if models else ""))
    if not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"reward.weights={list(weights)}: every weight must be a finite number")
    names = [f.name for f in fns]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"reward.fn: two functions are named '{n}'; names key the metrics "
                              "(reward/fn/<name>/mean), rename one")
    return fns, weights


def check(cfg) -> None:
    """Before any work (`gspo.train.preflight.check`): reward=python's files import and its functions exist;
    reward=model's directories hold one-output reward models."""
    if cfg.reward.name in FUNCTIONS:
        user_fns(cfg.reward)
    elif cfg.reward.name not in REWARDS:
        raise ConfigError(f"reward={cfg.reward.name}: no such reward. Valid: {', '.join(sorted([*REWARDS, *FUNCTIONS]))}")
    elif cfg.reward.fn is not None:
        raise ConfigError(f"reward.fn is set but reward={cfg.reward.name}; use reward=python to score with your functions")


def row_fields(problem: Problem) -> dict:
    """The fields of a problem's row that user functions receive: a data file's columns, else answer + meta."""
    if "row" in problem.meta:
        return dict(problem.meta["row"])
    return {"answer": problem.answer, **problem.meta}


def is_conversational(prompt) -> bool:
    """Chat messages (a list of {"role", "content"} dicts), as TRL tells a conversational prompt from plain text."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def completion_ids(rollout) -> list[list[int]]:
    """Each row's completion token ids (its EOS included, padding not), as TRL's `completion_ids` holds them:
    with tools, every token after the prompt, the tools' replies included."""
    tools = getattr(rollout, "turns", None) is not None
    written = rollout.attention_mask[:, rollout.prompt_len :] if tools else rollout.completion_mask
    ids, keep = rollout.completion_ids.cpu().tolist(), written.cpu().bool().tolist()
    return [[t for t, k in zip(row, m) if k] for row, m in zip(ids, keep)]  # lists: no per-row tensor indexing


def trainer_state(step: int, max_steps: int):
    """A transformers TrainerState holding what gspo knows: `global_step` (rollout steps done) and `max_steps`
    (`train.steps`, in the same unit, so `global_step / max_steps` is the share of the run done)."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps)


def _short(x, n: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def _sample(i: int, prompts, completions) -> str:
    return f"sample {i}: prompt {_short(prompts[i])}, completion {_short(completions[i])}"


def _value(v) -> float | None:
    """A reward value as a float; NaN for None (no reward from this function); None when it is not a number."""
    if v is None:
        return math.nan
    if isinstance(v, numbers.Real):
        return float(v)
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:  # a 0-d tensor / numpy scalar
        x = v.item()
        return float(x) if isinstance(x, numbers.Real) else None
    return None


async def _wait(awaitable):
    return await awaitable


_LOOP: list = []  # one event loop for the process, as TRL keeps one: asyncio objects a reward module creates
# once (a Semaphore rate limiter, a client session) are bound to the loop they were first used on


def _run(out):
    """A reward function's result; an async function's coroutine is awaited first (one function at a time)."""
    if not inspect.isawaitable(out):
        return out
    if not _LOOP or _LOOP[0].is_closed():
        _LOOP[:] = [asyncio.new_event_loop()]
    return _LOOP[0].run_until_complete(_wait(out))


def _call(f: UserFn, kwargs: dict):
    return _run(f.fn(**(kwargs if f.takes is None else {k: v for k, v in kwargs.items() if k in f.takes})))


def call_user_fn(f: UserFn, prompts: list, completions: list, fields: dict[str, list],
                 extra: dict | None = None) -> list[float]:
    """Run one user function on a batch, by keyword as TRL calls it: `prompts`, `completions`, `completion_ids`
    and each column are lists of one value per row, `extra` (e.g. `trainer_state`) passed as is.

    Returns one float per row, NaN where the function returned None. Any failure is a RewardError naming the
    function and the sample.
    """
    extra = extra or {}
    kwargs = {**fields, **extra, "prompts": prompts, "completions": completions}
    who = f"reward function {f.spec}"
    try:
        out = _call(f, kwargs)
    except Exception as e:
        # find the sample it fails on: a batched call does not say which row it choked on
        for i in range(len(completions)):
            try:
                _call(f, {k: (v if k in extra else v[i : i + 1]) for k, v in kwargs.items()})
            except Exception as e1:
                raise RewardError(f"{who} raised {type(e1).__name__}: {e1} on {_sample(i, prompts, completions)}") from e1
        raise RewardError(f"{who} raised {type(e).__name__}: {e} on a batch of {len(completions)} "
                          f"(not on any sample alone); first {_sample(0, prompts, completions)}") from e
    try:
        values = list(out)
    except TypeError:
        raise RewardError(f"{who} returned a {type(out).__name__}, not a list of {len(completions)} numbers") from None
    if len(values) != len(completions):
        raise RewardError(f"{who} returned {len(values)} values for {len(completions)} completions")
    rewards = []
    for i, v in enumerate(values):
        x = _value(v)
        if x is None:
            raise RewardError(f"{who} returned {_short(v, 60)} ({type(v).__name__}), not a number or None, on "
                              f"{_sample(i, prompts, completions)}")
        if math.isnan(x) and v is not None or math.isinf(x):
            raise RewardError(f"{who} returned {x} on {_sample(i, prompts, completions)} (return None for 'no reward')")
        rewards.append(x)
    return rewards


def _user_rewards(cfg, texts: list[str], problems: list[Problem], flags: list[bool],
                  ids: list[list[int]] | None, state, conversations: list | None = None) -> tuple[list[float], dict]:
    """The user functions' weighted rewards and parts; `texts` as TRL decodes them (special tokens skipped).

    Every row is scored, unless `reward.ill_formed` is a number: then ill-formed rows get it, unscored.
    `conversations` (rollouts with tools): each row's messages after the prompt, passed as its completion.
    """
    fns, weights = user_fns(cfg)
    fixed = cfg.ill_formed is not None
    keep = [i for i, bad in enumerate(flags) if not (bad and fixed)]
    prompts = [problems[i].prompt for i in keep]
    # TRL's conversational completions: one assistant message per row for prompts that are messages, or the
    # whole conversation after the prompt (its tool calls and the tools' replies) in a rollout with tools
    completions = [conversations[i] if conversations is not None else
                   [{"role": "assistant", "content": texts[i]}] if is_conversational(problems[i].prompt) else texts[i]
                   for i in keep]
    rows = [row_fields(problems[i]) for i in keep]
    fields = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
    fields["completion_ids"] = [ids[i] for i in keep] if ids is not None else [None] * len(keep)
    extra = {"trainer_state": state if state is not None else trainer_state(0, 0)}
    total = [float(cfg.ill_formed) if fixed else 0.0] * len(texts)
    parts = {}
    scored = [False] * len(texts)  # a row some function gave a reward (not None)
    sums = [0.0] * len(texts)
    for f, w in zip(fns, weights):
        values = call_user_fn(f, prompts, completions, fields, extra) if keep else []
        per_row = [0.0] * len(texts)  # rows the function was not called on (reward.ill_formed set): 0 in its curve
        for i, v in zip(keep, values):
            per_row[i] = v  # NaN (None): left out of the function's mean, as TRL's nanmean
            if not math.isnan(v):
                sums[i] += w * v
                scored[i] = True
        parts[USER + f.name] = torch.tensor(per_row)
    for i in keep:
        total[i] = sums[i]  # TRL's weighted nansum; a row no function scored gets 0 (reward/unscored/mean)
    kept = set(keep)
    parts["ill_formed"] = torch.tensor([float(b) for b in flags])
    parts["unscored"] = torch.tensor([float(i in kept and not scored[i]) for i in range(len(texts))])
    return total, parts


def components(cfg, rewards: torch.Tensor, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[float]]:
    """The reward's parts as GDPO normalises them (algo.advantage=gdpo), (N, K), and their weights: each reward
    function's values (NaN where it returned None; `reward.weights`, models first), or the whole reward for a
    built-in rule; DAPO's overlong penalty, when on, one more part of weight 1."""
    overlong = parts.get("overlong")
    if cfg.name in FUNCTIONS:
        cols = [v for k, v in parts.items() if k.startswith(USER)]
        weights = [1.0] * len(cols) if cfg.weights is None else [float(w) for w in cfg.weights]
    else:
        cols, weights = [rewards - (0.0 if overlong is None else overlong)], [1.0]
    if overlong is not None:
        cols, weights = [*cols, overlong], [*weights, 1.0]
    return torch.stack([c.float() for c in cols], dim=1), weights


def probe(task: Task, cfg, encode: Callable[[str], list[int]]) -> None:
    """Before any work: call each reward=python function on one real training sample of the task, as training will.

    The completion is the sample's reference answer (the only text at hand before the model has written any).
    A failure is a one-line RewardError naming the function, the sample and the error.
    """
    if cfg.reward.name not in FUNCTIONS:
        return
    import random

    problem = task.sample_train(random.Random(cfg.seed), 1)[0]
    text = str(problem.answer)
    conversations = None if cfg.rollout.tools is None else [[{"role": "assistant", "content": text}]]
    _user_rewards(cfg.reward, [text], [problem], [False], [encode(text)], trainer_state(0, cfg.train.steps),
                  conversations)


# --------------------------------------------------------------------------- scoring


def score(task: Task, cfg, texts: list[str], problems: list[Problem], ill_formed=None,
          completion_ids: list[list[int]] | Callable[[], list[list[int]]] | None = None,
          state=None, clean_texts: list[str] | None = None,
          conversations: list | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rewards (N,) for completions `texts` of `problems`, plus per-part diagnostics (N,) each.

    `ill_formed` (N,) bool, from the rollout: rows with a special token before their EOS (tasks.judge).
    `clean_texts`: the same completions decoded with special tokens skipped, as TRL hands them to reward
    functions (None: `texts`); the task's verifier reads `texts`.
    `completion_ids` (each row's token ids) and `state` (a TrainerState) are passed on to reward=python functions;
    either may be a zero-argument callable, called only then (the trainer's are: the first TrainerState imports
    transformers' trainer, seconds, and the ids are a pass over the rollout, for rewards that never read them).
    `conversations` (rollouts with tools): each row's messages after the prompt; `texts` is then the last
    assistant message's content. reward=python functions get the conversations as `completions`, and a task
    with `conversation_parts` adds its own parts (the calculator's `correct_call`).
    """
    flags = [False] * len(texts) if ill_formed is None else [bool(x) for x in ill_formed]
    if cfg.name not in FUNCTIONS and cfg.name not in REWARDS:
        raise ConfigError(f"reward={cfg.name}: no such reward. Valid: {', '.join(sorted([*REWARDS, *FUNCTIONS]))}")
    batched = hasattr(task, "verify_batch")  # the data task: math-verify in a process it can kill
    verdicts = judge_all(task, texts, problems, flags) if batched else []
    for text, problem, bad in ([] if batched else zip(texts, problems, flags)):
        try:
            verdicts.append(judge(task, text, problem, bad))
        except Exception as e:  # name the culprit: a user's verifier on a user's data
            raise RewardError(
                f"reward {cfg.name!r}: the verifier of task {task.name!r} raised {type(e).__name__}: {e} "
                f"on prompt {_short(problem.prompt)}, completion {_short(text)}"
            ) from e
    parts = {"correct": torch.tensor([float(v.correct) for v in verdicts]),
             "format": torch.tensor([float(v.well_formed) for v in verdicts])}
    if batched:  # the share the checker had to give up on (scored as wrong)
        parts["verify_timeout"] = torch.tensor([float(v.timed_out) for v in verdicts])
    if conversations is not None and hasattr(task, "conversation_parts"):
        parts |= task.conversation_parts(conversations, problems)
    if cfg.name in FUNCTIONS:
        ids, state = (x() if callable(x) else x for x in (completion_ids, state))
        rewards, user_parts = _user_rewards(cfg, clean_texts if clean_texts is not None else texts, problems,
                                            flags, ids, state, conversations)
        return torch.tensor(rewards), parts | user_parts
    fn, values = REWARDS[cfg.name], _plain(cfg)  # plain values: an OmegaConf lookup per sample is slow
    return torch.tensor([float(fn(v, values)) for v in verdicts]), parts


def _plain(cfg):
    """The reward config as a namespace of plain values (attribute access, like the DictConfig)."""
    from types import SimpleNamespace

    from omegaconf import DictConfig, OmegaConf

    return SimpleNamespace(**OmegaConf.to_container(cfg, resolve=True)) if isinstance(cfg, DictConfig) else cfg
