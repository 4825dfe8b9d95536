"""`gspo eval`: held-out accuracy, pass@k, completion length and well-formedness of a run's last
checkpoint, a checkpoint directory or the warm-start base (the scoring itself: gspo/train/evaluation/heldout.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from gspo.train.evaluation.heldout import eval_params, evaluate, heldout_problems, outcome_record

DEFAULT_PASS_K = 4  # `gspo eval` estimates pass@4 unless eval.pass_k=K is given


def run_eval(target: str | None, overrides: list[str], examples: int = 5, pass_k: int | None = None) -> dict:
    """`gspo eval`: score a run's last checkpoint, a checkpoint directory, or the warm-start base.

    With a run directory, writes RUN_DIR/eval.json. Its "heldout" is the evaluation's outcome record, as a line
    of RUN_DIR/heldout.jsonl has it: {"step" (the checkpoint's; null for a model that is not a run's
    checkpoint), "n", "problems" (the problem list's digest), "correct" ("0110...", one character per problem)}.
    Overrides change the task or the budget (e.g. `task=countdown`, `task.eval_size=500`, `eval.pass_k=8`;
    0 = no pass@k).
    pass@k is estimated with k = `pass_k` if given, else `eval.pass_k` from the overrides,
    else DEFAULT_PASS_K (a run's own eval.pass_k is about evaluation during training).
    """
    import json

    from gspo.config.loading import compose, load_run_config
    from gspo.core.errors import ConfigError
    from gspo.rollout.decoding.multiturn import ToolUse
    from gspo.tasks import build_task
    from gspo.train.preflight import check
    from gspo.train.run import checkpoint
    from gspo.train.start.warm_start import base_model

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
            from gspo.config.checks import model_dir_problem
            from gspo.models.adapters import is_adapter_dir

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
    check(cfg)
    task = build_task(cfg.task)
    if model_dir is None:
        model_dir = base_model(cfg, task)
    problems = heldout_problems(task, cfg.task)
    if pass_k is None:
        pass_k = cfg.eval.pass_k if any(o.startswith("eval.pass_k=") for o in overrides) else DEFAULT_PASS_K
    model, tokenizer = checkpoint.load_model(model_dir)  # a LoRA adapter loads onto the base it records
    res = evaluate(model, tokenizer, task, problems, eval_params(cfg), pass_k=pass_k, examples=examples,
                   timeout_s=cfg.reward.timeout_s, key=(cfg.seed, "gspo-eval"), tools=ToolUse.of(cfg))
    res["heldout"] = {"step": checkpoint_step(model_dir), **outcome_record(problems, res.pop("correct"))}
    res["model"] = str(model_dir)
    res["task"] = cfg.task.name
    res["n"] = len(problems)  # what was scored, which a small held-out split makes fewer than task.eval_size
    if run_dir is not None:
        (run_dir / "eval.json").write_text(json.dumps(res, indent=2))
    _print_eval(res)
    return res


def checkpoint_step(model_dir: Path) -> Optional[int]:
    """The step of a run's checkpoint directory (`checkpoints/step_000040` -> 40); None for any other model."""
    import re

    m = re.fullmatch(r"step_(\d+)", Path(model_dir).name)
    return int(m.group(1)) if m and Path(model_dir).parent.name == "checkpoints" else None


def _print_eval(res: dict) -> None:
    import json

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
        elif not isinstance(ex["completion"], str):  # a conversation after a plain prompt
            prompt = f"{prompt} -> "
        # one example, one line (with tools the completion is a conversation: its JSON)
        one_line = lambda x: (x if isinstance(x, str) else json.dumps(x)).replace("\n", "\\n")  # noqa: E731
        console.print(f"  {mark} {one_line(prompt)}{one_line(ex['completion'])}   (reference {one_line(ex['reference'])})",
                      markup=False, highlight=False)
