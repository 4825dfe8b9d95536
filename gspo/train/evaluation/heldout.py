"""Held-out evaluation during training (and the warm start's check): greedy accuracy, pass@k,
completion length, well-formedness. `gspo eval` (gspo/results/evaluate.py) runs the same on a
finished run.

Each evaluation's per-problem outcomes are kept too, so that two runs (or two models) can be paired on the
same problems (McNemar, a paired bootstrap): RUN_DIR/heldout.jsonl, one line per evaluation,
{"step": S, "n": N, "problems": DIGEST, "correct": "0110..."} (`outcome_record`, written by the metrics
logger; `read_outcomes` reads it back).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from math import comb
from pathlib import Path
from typing import Optional, Sequence

import torch

from gspo.rollout.decoding.multiturn import ToolUse
from gspo.rollout.decoding.params import SamplingParams
from gspo.rollout.decoding.rollouts import rollout
from gspo.tasks import Problem, Task, timeouts
from gspo.tasks.base import judge_all


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv 2107.03374):
    1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


def eval_params(cfg) -> SamplingParams:
    """The held-out evaluation's sampling: the training sampler's length, temperature, top-p, chat template and
    engine (greedy for accuracy, sampled for pass@k); no top-k record, no compiled decode."""
    return SamplingParams.of(cfg, keep_topk=0, compile=False)


@torch.no_grad()
def evaluate(
    sampler,
    tokenizer,
    task: Task,
    problems: list[Problem],
    params: SamplingParams,
    pass_k: int = 0,
    batch_size: int = 256,
    examples: int = 0,
    timeout_s: float = 0.0,
    key: tuple = (),
    tools: Optional[ToolUse] = None,
) -> dict:
    """Greedy accuracy on `problems` (and pass@k from n = 2k samples when pass_k > 0), sampled by `sampler` (a
    torch model or a decoder) as `params` say (training and `gspo eval`: `eval_params(cfg)`; the warm start's
    stopping check keeps the `hf` engine, so cached bases stay what they were).

    `timeout_s`: the task's verifier may take this long on a batch (`reward.timeout_s`; 0 = no limit).
    pass@k samples at `params.temperature` and `params.top_p` (the training sampler's), each problem from a
    generator of its own keyed by `key` (the trainer's: seed and step) and the prompt: the estimate is a function
    of the seed, whatever the batching or the number of ranks.
    `tools` (`rollout.tools`): whole trajectories with tool calls, judged on their last assistant message;
    adds eval/turns_mean, eval/tool_calls_mean and the task's conversation parts (the calculator's
    eval/correct_call), and the examples show the conversations.
    Returns metrics under `eval/` keys, plus `correct`: each problem's greedy verdict (a list of bools in
    `problems`' order, for `outcome_record`), plus `examples`: a few (prompt, completion, correct).
    """
    model = sampler if isinstance(sampler, torch.nn.Module) else None  # put in eval mode while evaluating

    def sample(prompts: list, n: int, greedy: bool, keys: Optional[list] = None):
        return rollout(sampler, tokenizer, prompts, n, replace(params, greedy=greedy), keys, purpose="eval_passk",
                       tools=tools)

    def verdicts(r, chunk_problems) -> list:  # one problem per completion
        return timeouts.call(lambda: judge_all(task, r.texts, chunk_problems, [bool(b) for b in r.ill_formed.tolist()]),
                             timeout_s, f"the task's verifier on {len(r.texts)} held-out completions")

    was_training = model is not None and model.training
    if model is not None:
        model.eval()
    correct, formed, lengths, shown, extra = [], [], [], [], {}
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        r = sample([p.prompt for p in chunk], 1, greedy=True)
        for j, (text, p, n, v) in enumerate(zip(r.texts, chunk, r.lengths.tolist(), verdicts(r, chunk))):
            correct.append(v.correct)
            formed.append(v.well_formed)
            lengths.append(n)
            if len(shown) < examples:
                shown.append({"prompt": p.prompt, "completion": text if r.conversations is None else r.conversations[j],
                              "correct": v.correct, "reference": p.answer})
        if r.conversations is not None:  # per problem: the trajectory's counts and the task's own parts
            parts = {"turns_mean": r.turns, "tool_calls_mean": r.tool_calls}
            parts |= task.conversation_parts(r.conversations, chunk) if hasattr(task, "conversation_parts") else {}
            for name, values in parts.items():
                extra.setdefault(f"eval/{name}", []).extend(values.float().tolist())
    out = {
        "eval/accuracy": sum(correct) / max(1, len(correct)),
        "eval/format": sum(formed) / max(1, len(formed)),
        "eval/len_mean": sum(lengths) / max(1, len(lengths)),
        "eval/n": len(correct),  # problems scored: the binomial error of eval/accuracy is sqrt(p (1 - p) / n)
    } | {k: sum(v) / max(1, len(v)) for k, v in extra.items()}
    out["correct"] = [bool(c) for c in correct]  # (not a metric: the evaluator and `gspo eval` take it out)
    if pass_k > 0:
        n = 2 * pass_k
        scores = []
        for i in range(0, len(problems), max(1, batch_size // n)):
            chunk = problems[i : i + max(1, batch_size // n)]
            r = sample([p.prompt for p in chunk], n, greedy=False, keys=[(*key, repr(p.prompt)) for p in chunk])
            right = [v.correct for v in verdicts(r, [p for p in chunk for _ in range(n)])]
            for j in range(len(chunk)):
                scores.append(pass_at_k(n, sum(right[j * n : (j + 1) * n]), pass_k))
        out[f"eval/pass@{pass_k}"] = sum(scores) / max(1, len(scores))
    if examples:
        out["examples"] = shown
    if model is not None:
        model.train(was_training)
    return out


def heldout_problems(task: Task, tcfg) -> list[Problem]:
    """The held-out problems to score: up to `task.eval_size` of them.

    Fewer than asked is a warning (the accuracy is then an estimate over that many); none is a
    ConfigError, since an accuracy over zero problems would read as 0%.
    """
    import sys
    from collections import Counter

    from gspo.core.errors import ConfigError

    problems = task.eval_set(tcfg.eval_size)
    if not problems:
        raise ConfigError(f"task={tcfg.name}: the held-out split is empty (task.eval_fraction={tcfg.eval_fraction}); "
                          "raise task.eval_fraction, or use a larger problem set")
    if len(problems) < tcfg.eval_size:
        kinds = Counter(p.meta.get("op") for p in problems if p.meta and p.meta.get("op"))  # word problems' kinds
        mix = f" ({', '.join(f'{op} {n}' for op, n in kinds.most_common())})" if kinds else ""
        print(f"gspo: warning: task.eval_size={tcfg.eval_size} but the held-out split has {len(problems)} problems"
              f"{mix}: evaluating those {len(problems)} (raise task.eval_fraction for a tighter estimate)",
              file=sys.stderr)
    return problems


# --------------------------------------------------------------------------- per-problem outcomes

HELDOUT_FILE = "heldout.jsonl"  # RUN_DIR/heldout.jsonl: one line per held-out evaluation
HELDOUT = "_heldout"  # the metrics key under which the evaluator hands the logger an evaluation's outcome record


def problems_digest(problems: Sequence[Problem]) -> str:
    """A short sha256 (16 hex digits) of the problem list, prompts and reference answers in order: two records
    with the same digest scored the same problems in the same order, so their outcome strings pair up."""
    text = json.dumps([[p.prompt, p.answer] for p in problems], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def outcome_record(problems: Sequence[Problem], correct: Sequence[bool]) -> dict:
    """{"n", "problems", "correct"} of one evaluation of `problems` (the whole split, in its order): `correct` a
    string of one character per problem, "1" answered right, "0" not. The writer adds the step."""
    if len(correct) != len(problems):
        raise ValueError(f"{len(correct)} outcomes for {len(problems)} problems")
    return {"n": len(problems), "problems": problems_digest(problems),
            "correct": "".join("1" if c else "0" for c in correct)}


def read_records(run_dir: Path | str) -> list[dict]:
    """The records of RUN_DIR/heldout.jsonl in file order ([] without the file); an unreadable line (a crash
    mid-write) is skipped."""
    path = Path(run_dir) / HELDOUT_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            readable = isinstance(record, dict) and isinstance(record.get("correct"), str) and int(record["step"]) >= 0
        except (ValueError, KeyError, TypeError):
            readable = False
        if readable:
            records.append(record)
    return records


def read_outcomes(run_dir: Path | str) -> dict[int, list[bool]]:
    """{step: [answered right?] per held-out problem, in the split's order} of a run's evaluations
    (RUN_DIR/heldout.jsonl). Pair two runs' lists only where their records' "problems" digests agree."""
    return {int(r["step"]): [c == "1" for c in r["correct"]] for r in read_records(run_dir)}
