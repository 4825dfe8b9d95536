"""Your data: a JSONL or Parquet file, one problem per row (`task=data task.path=FILE`; `task=jsonl` is the same).

A row holds a prompt and a reference answer, under `task.prompt_column` / `task.answer_column`:

* the prompt is a plain string, or chat messages `[{"role": "user", "content": "..."}, ...]`, rendered with
  the tokenizer's chat template (so a checkpoint whose tokenizer has one: `model=hf`); `task.system_prompt`
  puts a system message before every prompt that has none of its own;
* the answer is GSM8K-style (`"... #### 42"`: what follows the last `####` is the answer) or free text.
  Answers are compared with `math-verify` (`1/2` = `0.5` = `\\frac{1}{2}`, `1,234` = `1234`); an answer it
  cannot read as math is compared as text (whitespace collapsed, case ignored).

The held-out split is a stable hash of the NORMALISED prompt (its non-system turns, whitespace collapsed; a plain
string counts as one user turn), so a problem that appears twice in the file is on one side of the split only. Every other column of the
row is kept and handed to `reward=python` functions as a keyword argument (gspo/tasks/rewards.py).

The warm start of the tiny models trains on the training rows' answers (see `WarmStartConfig` in gspo/config/schema.py).
"""

from __future__ import annotations

import functools
import json
import random
import warnings
from pathlib import Path
from typing import Any

from gspo.config import model_path
from gspo.core.errors import ConfigError
from gspo.tasks.answers import check_answer, final_answer  # noqa: F401  (check_answer, final_answer: this task's API)
from gspo.tasks.base import Problem, Verdict, is_heldout, register_task

EVAL_SEED = 12345  # the held-out sample's own seed: every run of a file scores the same problems
SMALL_HELDOUT = 50  # fewer held-out problems than this: eval/accuracy is too coarse to compare runs, so we warn
PARQUET_SUFFIXES = (".parquet", ".pq")
_WARNED: set[tuple[str, int]] = set()


# --------------------------------------------------------------------------- reading


def _where(path: str, line: int, parquet: bool) -> str:
    return f"{path} row {line}" if parquet else f"{path}:{line}"


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> tuple[tuple[int, dict], ...]:
    """(line number, row) for every row of the file; cached on the file's identity (checked, then trained on)."""
    if path.lower().endswith(PARQUET_SUFFIXES):
        try:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # a corrupt or non-Parquet file: say so in one line
            raise ConfigError(f"task.path={path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        return tuple((i + 1, r) for i, r in enumerate(rows))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"task.path={path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    # JSON Lines separates records by "\n" alone: str.splitlines() would also split at U+2028, U+0085 ..., which
    # JSON allows raw inside a string
    for lineno, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
        out.append((lineno, row))
    return tuple(out)


def read_rows(path: str | Path) -> tuple[tuple[int, dict], ...]:
    """The rows of a JSONL or Parquet file with their line (JSONL) or row (Parquet) numbers, 1-based.

    Raises ConfigError, one line naming the file and line, on anything unreadable or empty.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"task.path={path}: no such file (task=data needs a .jsonl or .parquet file)")
    st = p.stat()
    rows = _read(str(path), st.st_mtime_ns, st.st_size)
    if not rows:
        raise ConfigError(f"task.path={path}: the file has no rows")
    return rows


def _prompt(value: Any, where: str, column: str) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise ConfigError(f"{where}: the prompt ('{column}') is empty")
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(f"{where}: the prompt ('{column}') must be a string or a list of "
                      f'{{"role": ..., "content": ...}} messages, got {json.dumps(value)[:120]}')


def _answer(value: Any, where: str, column: str) -> str:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where}: the answer ('{column}') must be a non-empty string or a number, got {json.dumps(value)[:120]}")


def _with_system(prompt: str | list[dict], system: str | None) -> str | list[dict]:
    if not system:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if any(m["role"] == "system" for m in messages):
        return messages  # the row's own system message wins
    return [{"role": "system", "content": system}, *messages]


def load_problems(cfg) -> list[Problem]:
    """The file's rows as Problems: prompt (string or messages), answer, and `meta["row"]` = the other columns."""
    path = cfg.path
    if not path:
        raise ConfigError(f"task={cfg.name} needs task.path=FILE: a .jsonl or .parquet file, one problem per row")
    parquet = str(path).lower().endswith(PARQUET_SUFFIXES)
    rows = read_rows(path)
    # every row has every column (None where a JSONL row lacks it), as a Parquet table or a datasets.Dataset has
    columns = list(dict.fromkeys(k for _, row in rows for k in row if k != cfg.prompt_column))
    problems = []
    for line, row in rows:
        where = _where(path, line, parquet)
        for column in (cfg.prompt_column, cfg.answer_column):
            if column not in row:
                raise ConfigError(f"{where}: no '{column}' field (the row has: {', '.join(map(str, row)) or 'nothing'}); "
                                  f"name the column with task.prompt_column / task.answer_column")
        prompt = _with_system(_prompt(row[cfg.prompt_column], where, cfg.prompt_column), cfg.system_prompt)
        answer = _answer(row[cfg.answer_column], where, cfg.answer_column)
        fields = {k: row.get(k) for k in columns}
        problems.append(Problem(prompt, answer, {"row": fields, "where": where}))
    return problems


def normalise(prompt: str | list[dict]) -> str:
    """The held-out key of a prompt: its non-system turns, whitespace collapsed. A plain string is the one user
    turn it becomes under a chat template, so `"2+2?"` and `[{"role": "user", "content": "2+2?"}]` are one key."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return "\n".join(f"{m['role']}: {' '.join(m['content'].split())}" for m in messages if m["role"] != "system")


def uses_chat(problems: list[Problem]) -> bool:
    """Whether any prompt is chat messages (and so needs the tokenizer's chat template)."""
    return any(not isinstance(p.prompt, str) for p in problems)


@functools.lru_cache(maxsize=1)
def _checker():
    import atexit

    from gspo.tasks.mathcheck import MathChecker

    checker = MathChecker()  # one child process per process, started at the first batch
    atexit.register(checker.close)
    return checker


# --------------------------------------------------------------------------- the task


@register_task("data")
@register_task("jsonl")
class DataTask:
    """Problems from a file; held-out split by a hash of the normalised prompt."""

    prompts = "any"  # a user's data: plain text for any model, or chat messages for one with a template

    def __init__(self, cfg) -> None:
        self.name = cfg.name
        self.eval_fraction = float(cfg.eval_fraction)
        problems = load_problems(cfg)
        self.train = [p for p in problems if not is_heldout(self.canonical(p), self.eval_fraction)]
        heldout, seen = [], set()
        for p in problems:  # a duplicate prompt is one held-out problem, not two
            key = self.canonical(p)
            if key not in seen and is_heldout(key, self.eval_fraction):
                seen.add(key)
                heldout.append(p)
        self.heldout = heldout
        if not self.heldout or not self.train:
            side = "held-out" if not self.heldout else "training"
            raise ConfigError(f"task.path={cfg.path}: {len(problems)} rows leave no {side} problems at "
                              f"task.eval_fraction={self.eval_fraction}; add rows or change task.eval_fraction")
        if len(self.heldout) < SMALL_HELDOUT and (str(cfg.path), len(self.heldout)) not in _WARNED:
            _WARNED.add((str(cfg.path), len(self.heldout)))  # once per process: checked, then built again to train
            warnings.warn(f"task.path={cfg.path}: only {len(self.heldout)} held-out problems ({len(problems)} rows, "
                          f"task.eval_fraction={self.eval_fraction}): eval/accuracy moves in steps of "
                          f"{100 / len(self.heldout):.1f} points; add rows or raise task.eval_fraction",
                          UserWarning, stacklevel=2)
        text = [m["content"] for p in problems for m in ([{"content": p.prompt}] if isinstance(p.prompt, str) else p.prompt)]
        self.alphabet = "".join(sorted(set("".join(text + [p.answer for p in problems]))))

    @staticmethod
    def canonical(problem: Problem) -> str:
        return normalise(problem.prompt)

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self.train) for _ in range(n)]

    def eval_set(self, n: int) -> list[Problem]:
        """n held-out problems drawn at random with a fixed seed, the same for every run of the file (all of them
        when there are fewer: the true count is len() of this). Not the first n: a file sorted by difficulty
        would be evaluated on its easiest rows."""
        if n >= len(self.heldout):
            return list(self.heldout)
        return random.Random(EVAL_SEED).sample(self.heldout, n)

    def verify(self, completion: str, problem: Problem) -> Verdict:
        return self.verify_batch([completion], [problem])[0]

    def verify_batch(self, completions: list[str], problems: list[Problem]) -> list[Verdict]:
        """math-verify in a process of its own (gspo/tasks/mathcheck.py): a completion can never hang the run."""
        return _checker().verdicts([(c, p.answer) for c, p in zip(completions, problems)])


# --------------------------------------------------------------------------- config check


def _has_chat_template(path: str) -> bool:
    """Whether the model `model.path` names has a chat template (a GGUF file: in its header)."""
    source = model_path.gguf_file(path)
    if source is not None:
        return bool(model_path.gguf_header(source).get("tokenizer.chat_template"))
    d = model_path.resolve(path)
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    tc = d / "tokenizer_config.json"
    return tc.is_file() and bool(json.loads(tc.read_text()).get("chat_template"))


def check(cfg) -> None:
    """Before any work (`gspo.train.preflight.check`): the file reads, has rows and the columns, and the model can render it."""
    if cfg.task.name not in ("data", "jsonl"):
        return
    task = DataTask(cfg.task)
    if not (uses_chat(task.train + task.heldout) or cfg.task.system_prompt):
        return
    why = "task.system_prompt is set" if cfg.task.system_prompt else f"the prompts in {cfg.task.path} are chat messages"
    if cfg.model.arch != "hf":
        raise ConfigError(f"{why}, which need a tokenizer with a chat template; model={cfg.model.name} has a "
                          "character tokenizer without one: use model=hf model.path=DIR")
    if cfg.model.path and not _has_chat_template(cfg.model.path):
        raise ConfigError(f"{why}, which need a chat template, and the tokenizer in model.path={cfg.model.path} has none")
