"""Held-out evaluation: greedy accuracy, pass@k, completion length, well-formedness."""

from __future__ import annotations

from math import comb

import torch

from gspo import timeouts
from gspo.rollout import generate
from gspo.tasks import Problem, Task, judge


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, arXiv 2107.03374):
    1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n:
        raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    task: Task,
    problems: list[Problem],
    max_new_tokens: int,
    pass_k: int = 0,
    temperature: float = 1.0,
    chat_template: bool = False,
    batch_size: int = 256,
    examples: int = 0,
    timeout_s: float = 0.0,
) -> dict:
    """Greedy accuracy on `problems` (and pass@k from n = 2k samples when pass_k > 0).

    `timeout_s`: the task's verifier may take this long on a batch (`reward.timeout_s`; 0 = no limit).
    Returns metrics under `eval/` keys, plus `examples`: a few (prompt, completion, correct).
    """
    def verdicts(r, chunk_problems) -> list:  # one problem per completion
        return timeouts.call(lambda: [judge(task, t, p, bool(b)) for t, p, b in
                                      zip(r.texts, chunk_problems, r.ill_formed.tolist())],
                             timeout_s, f"the task's verifier on {len(r.texts)} held-out completions")

    was_training = model.training
    model.eval()
    correct, formed, lengths, shown = [], [], [], []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        r = generate(model, tokenizer, [p.prompt for p in chunk], 1, max_new_tokens, greedy=True, chat_template=chat_template)
        for text, p, n, v in zip(r.texts, chunk, r.lengths.tolist(), verdicts(r, chunk)):
            correct.append(v.correct)
            formed.append(v.well_formed)
            lengths.append(n)
            if len(shown) < examples:
                shown.append({"prompt": p.prompt, "completion": text, "correct": v.correct, "reference": p.answer})
    out = {
        "eval/accuracy": sum(correct) / max(1, len(correct)),
        "eval/format": sum(formed) / max(1, len(formed)),
        "eval/len_mean": sum(lengths) / max(1, len(lengths)),
    }
    if pass_k > 0:
        n = 2 * pass_k
        scores = []
        for i in range(0, len(problems), max(1, batch_size // n)):
            chunk = problems[i : i + max(1, batch_size // n)]
            r = generate(model, tokenizer, [p.prompt for p in chunk], n, max_new_tokens, temperature=temperature, chat_template=chat_template)
            right = [v.correct for v in verdicts(r, [p for p in chunk for _ in range(n)])]
            for j in range(len(chunk)):
                scores.append(pass_at_k(n, sum(right[j * n : (j + 1) * n]), pass_k))
        out[f"eval/pass@{pass_k}"] = sum(scores) / max(1, len(scores))
    if examples:
        out["examples"] = shown
    model.train(was_training)
    return out


def heldout_problems(task: Task, tcfg) -> list[Problem]:
    """The held-out problems to score: up to `task.eval_size` of them.

    Fewer than asked is a warning (the accuracy is then an estimate over that many); none is a
    ConfigError, since an accuracy over zero problems would read as 0%.
    """
    import sys

    from gspo.errors import ConfigError

    problems = task.eval_set(tcfg.eval_size)
    if not problems:
        raise ConfigError(f"task={tcfg.name}: the held-out split is empty (task.eval_fraction={tcfg.eval_fraction}); "
                          "raise task.eval_fraction, or use a larger problem set")
    if len(problems) < tcfg.eval_size:
        print(f"gspo: warning: task.eval_size={tcfg.eval_size} but the held-out split has {len(problems)} problems: "
              f"evaluating those {len(problems)} (raise task.eval_fraction for a tighter estimate)", file=sys.stderr)
    return problems


DEFAULT_PASS_K = 4  # `gspo eval` estimates pass@4 unless eval.pass_k=K is given


def run_eval(target: str | None, overrides: list[str], examples: int = 5, pass_k: int | None = None) -> dict:
    """`gspo eval`: score a run's last checkpoint, a checkpoint directory, or the warm-start base.

    With a run directory, writes RUN_DIR/eval.json. Overrides change the task or the
    budget (e.g. `task=countdown`, `task.eval_size=500`, `eval.pass_k=8`; 0 = no pass@k).
    pass@k is estimated with k = `pass_k` if given, else `eval.pass_k` from the overrides,
    else DEFAULT_PASS_K (a run's own eval.pass_k is about evaluation during training).
    """
    import json
    from pathlib import Path


    from gspo import checkpoint
    from gspo.config import compose, load_run_config
    from gspo.errors import ConfigError
    from gspo.models import base_model
    from gspo.tasks import build_task

    if target is not None and "=" in target:  # `gspo eval task.eval_size=50`: no target, all overrides
        overrides, target = [target, *overrides], None
    run_dir, model_dir = None, None
    if target is None:
        cfg = compose(overrides)
    else:
        path = Path(target)
        if (path / "config.yaml").is_file():
            run_dir, model_dir = path, checkpoint.latest(path)
            if model_dir is None:
                raise ConfigError(f"{path}: this run has no checkpoint yet")
        elif checkpoint.is_checkpoint(path):  # full weights, or a LoRA adapter
            from gspo.adapters import is_adapter_dir
            from gspo.checks import model_dir_problem

            problem = None if is_adapter_dir(path) else model_dir_problem(path)
            if problem:
                raise ConfigError(f"{target}: {problem}")
            model_dir = path
            run_dir = path.parent.parent if (path.parent.parent / "config.yaml").is_file() else None
        else:
            raise ConfigError(f"{target}: neither a run directory (config.yaml) nor a checkpoint (config.json)")
        if run_dir is not None:
            cfg = load_run_config(run_dir, overrides)
        else:
            cfg = compose(overrides)
    task = build_task(cfg.task)
    if model_dir is None:
        model_dir = base_model(cfg, task)
    problems = heldout_problems(task, cfg.task)
    if pass_k is None:
        pass_k = cfg.eval.pass_k if any(o.startswith("eval.pass_k=") for o in overrides) else DEFAULT_PASS_K
    model, tokenizer = checkpoint.load_model(model_dir)  # a LoRA adapter loads onto the base it records
    res = evaluate(model, tokenizer, task, problems, cfg.rollout.max_new_tokens,
                   pass_k=pass_k, temperature=cfg.rollout.temperature, chat_template=cfg.model.use_chat_template,
                   examples=examples, timeout_s=cfg.reward.timeout_s)
    res["model"] = str(model_dir)
    res["task"] = cfg.task.name
    res["n"] = len(problems)  # what was scored, which a small held-out split makes fewer than task.eval_size
    if run_dir is not None:
        (run_dir / "eval.json").write_text(json.dumps(res, indent=2))
    _print_eval(res)
    return res


def _print_eval(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table()
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, v in res.items():
        if k.startswith("eval/"):
            t.add_row(k, f"{v:.3f}")
    console = Console()
    # the title above the table, not in it: a table's title wraps at the table's width and would break the path
    console.print(f"held-out evaluation: {res['task']}, {res['n']} problems\n{res['model']}", markup=False,
                  highlight=False, soft_wrap=True)
    console.print(t)
    for ex in res.get("examples", []):
        mark = "✓" if ex["correct"] else "✗"
        prompt = ex["prompt"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):  # chat: the last turn is the question
            prompt = f"{prompt[-1].get('content', '')} -> "
        one_line = lambda x: str(x).replace("\n", "\\n")  # noqa: E731  (one example, one line)
        console.print(f"  {mark} {one_line(prompt)}{one_line(ex['completion'])}   (reference {one_line(ex['reference'])})",
                      markup=False, highlight=False)
