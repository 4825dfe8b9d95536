"""A task from a local JSONL file with `prompt` and `answer` fields (e.g. GSM8K you downloaded).

Answers are checked with `math-verify` when it is installed, else by exact match
after stripping whitespace. The held-out split is a stable hash of the prompt.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gspo.errors import ConfigError
from gspo.tasks import Problem, Verdict, is_heldout, register_task


@register_task("jsonl")
class JsonlTask:
    name = "jsonl"

    def __init__(self, cfg) -> None:
        if not cfg.path or not Path(cfg.path).is_file():
            raise ConfigError(f"task=jsonl needs task.path=FILE (a JSONL file with prompt/answer fields); got {cfg.path!r}")
        rows = [json.loads(line) for line in Path(cfg.path).read_text().splitlines() if line.strip()]
        missing = [i for i, r in enumerate(rows) if "prompt" not in r or "answer" not in r]
        if missing:
            raise ConfigError(f"{cfg.path}: line {missing[0] + 1} lacks a 'prompt' or 'answer' field")
        problems = [Problem(str(r["prompt"]), str(r["answer"])) for r in rows]
        self.train = [p for p in problems if not is_heldout(p.prompt, cfg.eval_fraction)]
        self.heldout = [p for p in problems if is_heldout(p.prompt, cfg.eval_fraction)]
        self.alphabet = "".join(sorted({c for p in problems for c in p.prompt + p.answer}))

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self.train) for _ in range(n)]

    def eval_set(self, n: int) -> list[Problem]:
        return self.heldout[:n]

    def verify(self, completion: str, problem: Problem) -> Verdict:
        try:
            from math_verify import parse, verify
        except ImportError:
            ok = completion.strip() == problem.answer.strip()
            return Verdict(ok, bool(completion.strip()))
        gold, pred = parse(problem.answer), parse(completion)
        return Verdict(bool(pred) and verify(gold, pred), bool(pred))
