"""Learned reward models: `reward=model reward.path=DIR` scores each prompt + completion with a local
`AutoModelForSequenceClassification` (num_labels = 1), as TRL's GRPOTrainer does when `reward_funcs` names a model
(trl 1.16 `GRPOTrainer.__init__` and `_calculate_rewards`):

- the model's own tokenizer (its pad token the EOS when it has none; the model's config told that pad id, so
  the head reads the last token that is not padding);
- the text: prompt + completion as strings, or, for chat prompts, the messages prompt + [assistant completion]
  through the reward tokenizer's chat template (`apply_chat_template(..., tokenize=False)`); with tools, the
  prompt (a string as one user message) + the whole conversation after it, the same way;
- tokenized without special tokens, padded on the right; scored in `torch.no_grad`, the first logit per row.

A `RewardModel` is called as a TRL reward function is (`prompts`, `completions` by keyword), so it sits among
the `reward.fn` functions with its own weight and metric (gspo/tasks/rewards.py). Differences from TRL:
scored in batches of `reward.batch_size` rows (TRL: the whole batch in one forward), loaded once per process
and kept (workers load their own), on `reward.device` (default: the trainer's `hardware.device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from gspo.core.errors import ConfigError

_LOADED: dict[tuple[str, str], "RewardModel"] = {}  # one copy per (directory, device) in a process
_CHECKED: set[str] = set()  # directories `check` passed (the reward functions are listed again at every batch)


def paths(spec) -> list[str]:
    """`reward.path`: one directory or a list of them."""
    if spec is None:
        return []
    return [str(spec)] if isinstance(spec, (str, Path)) else [str(p) for p in spec]


def check(path: str) -> None:
    """Refuse, in one line, a directory that is not a one-output sequence-classification checkpoint with a tokenizer."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    p = Path(path)
    if str(p.resolve()) in _CHECKED:
        return
    if not (p / "config.json").is_file():
        raise ConfigError(f"reward.path={path}: not a Hugging Face checkpoint directory (no config.json there)")
    try:
        config = AutoConfig.from_pretrained(p)
    except (OSError, ValueError) as e:
        raise ConfigError(f"reward.path={path}: its config.json does not load ({str(e).splitlines()[0]})") from None
    if type(config) not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        raise ConfigError(f"reward.path={path}: {type(config).__name__} has no sequence-classification class in "
                          "transformers; a reward model is an AutoModelForSequenceClassification")
    if config.num_labels != 1:
        raise ConfigError(f"reward.path={path}: a reward model has one output (num_labels = 1); this one has "
                          f"{config.num_labels}")
    if not any(p.glob("*.safetensors")):
        raise ConfigError(f"reward.path={path}: no *.safetensors weights there (gspo loads safetensors only)")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")):
        raise ConfigError(f"reward.path={path}: no tokenizer there; save one into it with tokenizer.save_pretrained")
    _CHECKED.add(str(p.resolve()))


def device_of(name) -> torch.device:
    """`reward.device` (cpu | cuda | auto) as a torch device; auto: CUDA where one is visible. CUDA is this
    process's current GPU, by index: a DDP rank's (or its rollout worker's), never GPU 0 for every process."""
    name = name or "auto"
    device = torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None \
        else device


@dataclass
class RewardModel:
    """A reward model called as a TRL reward function: `rm(prompts=..., completions=...) -> list[float]`."""

    name: str  # the directory's name, as TRL names it: the metric is reward/fn/<name>/mean
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    batch_size: int

    @staticmethod
    def load(path: str, device: str | None, batch_size: int) -> "RewardModel":
        dev = device_of(device)
        key = (str(Path(path).resolve()), str(dev))
        if key not in _LOADED:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            check(path)
            tokenizer = AutoTokenizer.from_pretrained(path)
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, use_safetensors=True)
            # the head reads each row's last token that is not padding: the model must know the pad id
            model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
            _LOADED[key] = RewardModel(Path(path).resolve().name, model.to(dev).eval(), tokenizer, dev, int(batch_size))
        return _LOADED[key]

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the reward model reads: prompt + completion as strings; where either is chat messages (chat prompts,
        or with rollout.tools each whole conversation after the prompt), the messages prompt + completion through
        its chat template, as TRL renders them, a string prompt as the one user message the policy was shown."""
        out = []
        for p, c in zip(prompts, completions):
            if isinstance(p, str) and isinstance(c, str):
                out.append(p + c)
                continue
            if not getattr(self.tokenizer, "chat_template", None):
                raise ConfigError(f"reward model {self.name}: the completions are chat messages (chat prompts, or "
                                  "rollout.tools' conversations) and its tokenizer has no chat template to render them")
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            messages += [{"role": "assistant", "content": c}] if isinstance(c, str) else list(c)
            out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return out

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts, out = self.texts(prompts, completions), []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", padding=True,
                                 padding_side="right", add_special_tokens=False).to(self.device)
            out += self.model(**enc).logits[:, 0].float().tolist()
        return out
