"""The distillation teacher (`teacher.path`): a frozen checkpoint beside the reference model, whose log-probs of
the student's own samples make the distillation loss component (gspo/algos/distill.py).

Built once by `setup` when `teacher.path` is set, never trained, never checkpointed (the path is in config.yaml,
so a resumed run loads it again). `teacher.path` names what `model.path` may name (a checkpoint directory, a GGUF
file, `pkg:DIST/FILE`); a GGUF file is loaded from its dequantized copy in cache_dir, the one a student of the same
file loads (gspo/models/gguf.py). It must share the student's tokenizer: the teacher scores the student's token
ids, so a different vocabulary is refused in one line before any step.
"""

from __future__ import annotations

from typing import Optional

import torch

from gspo.core.errors import ConfigError
from gspo.models.build import load_pretrained
from gspo.models.gguf import checkpoint_dir
from gspo.rollout.decoding.generate import token_logprobs


class Teacher:
    """A frozen teacher model and what the loop asks of it: its log-probs of a rollout's tokens."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @staticmethod
    def for_run(cfg, tokenizer, dist, dtype: torch.dtype) -> Optional["Teacher"]:
        """The run's teacher (None without `teacher.path`), loaded in the training precision and wrapped frozen as
        the reference is; ConfigError when its tokenizer is not the student's."""
        if not cfg.teacher.path:
            return None
        # a GGUF file: dequantized once into cache_dir, every rank waiting on the one that writes it
        path = checkpoint_dir(cfg.teacher.path, cfg.cache_dir, log=print if dist.is_main else None, key="teacher.path")
        model, teacher_tokenizer = load_pretrained(path, dist.storage_dtype(dtype), cfg.model.attn_implementation,
                                                   device=dist.device)
        problem = tokenizer_difference(tokenizer, teacher_tokenizer)
        if problem:
            raise ConfigError(f"teacher.path={cfg.teacher.path}: its tokenizer is not the student's ({problem}); "
                              "on-policy distillation scores the student's token ids with the teacher, so both must "
                              "share one tokenizer")
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return Teacher(dist.wrap(model.to(dist.device), dtype, frozen=True))

    @torch.no_grad()
    def logprobs(self, rollout, temperature: float) -> torch.Tensor:
        """(B, T) the teacher's log-probs of the rollout's completion tokens, at the sampling temperature."""
        return token_logprobs(self.model, rollout, temperature)[0]


def tokenizer_difference(student, teacher) -> Optional[str]:
    """What makes two tokenizers encode differently, in a few words, or None when they share the vocabulary and the
    special tokens the rollout uses."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        only = sorted(set(a) ^ set(b))
        if only:
            return f"{len(a)} and {len(b)} tokens, e.g. {only[0]!r} in only one"
        moved = sorted(k for k in a if a[k] != b[k])
        return f"{len(moved)} tokens have other ids, e.g. {moved[0]!r}: {a[moved[0]]} and {b[moved[0]]}"
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(student, name) != getattr(teacher, name):
            return f"{name} {getattr(student, name)} and {getattr(teacher, name)}"
    return None
