"""The `gspo` command: train | eval | compare. Thin: parse, compose, call gspo.*.

`gspo train` validates the overrides itself (so a typo gets a one-line message and
exit code 2), then hands them to Hydra's own run/multirun machinery: sweeps,
launchers and run directories are Hydra's, not ours.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from gspo.config import GROUPS, compose, group_options, sweep_combinations
from gspo.errors import ConfigError


def _groups_help() -> str:
    lines = [f"  {g:<9} {', '.join(group_options(g))}" for g in GROUPS]
    lines.append(f"  +experiment={{{','.join(group_options('experiment'))}}}  presets over several groups")
    return "Config groups and their options (pick with GROUP=OPTION):\n\n" + "\n\n".join(lines)


app = typer.Typer(
    help="gspo: GRPO, GSPO, DAPO and relatives on your model, side by side.\n\n" + _groups_help(),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _fail(msg: str) -> None:
    typer.echo(f"gspo: error: {msg}", err=True)
    raise typer.Exit(2)


TRAIN_HELP = f"""Train with Hydra OVERRIDES (KEY=VALUE or GROUP=OPTION).

Examples:

  gspo train                                   # the default: GSPO on a tiny Qwen3-MoE, addition

  gspo train algo=grpo train.steps=50 seed=1

  gspo train -m algo=grpo,gspo seed=0,1,2       # a sweep (Hydra multirun)

  gspo train resume=outputs/2026-01-01/12-00-00  # continue a stopped run

Keys are documented in gspo/config.py; `gspo train --cfg job` prints the composed config.

{_groups_help()}
"""


# Hydra's own flags that take a value (`--cfg job`, `-cn my_config`, ...): passed through untouched
_HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-dir", "-cd", "--config-name", "-cn"}


def _split_hydra_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, Hydra flags with their values) from the extra command-line arguments."""
    overrides, flags, it = [], [], iter(args)
    for a in it:
        if a in _HYDRA_VALUE_FLAGS:
            flags += [a, next(it, "")]
        elif a.startswith("-"):
            flags.append(a)
        else:
            overrides.append(a)
    return overrides, flags


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, help=TRAIN_HELP,
             options_metavar="[-m] [OVERRIDES]...")
def train(
    ctx: typer.Context,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Run a sweep over comma-separated values."),
) -> None:
    overrides, hydra_flags = _split_hydra_flags(ctx.args)
    from gspo.distributed import check as check_distributed

    try:
        for combo in sweep_combinations(overrides) if multirun else [overrides]:
            check_distributed(compose(combo))  # e.g. prompts that do not split over hardware.nproc: exit 2
    except ConfigError as e:
        _fail(str(e))
    from cli.hydra_app import hydra_train

    sys.argv = ["gspo train", *(["--multirun"] if multirun else []), *hydra_flags, *overrides]
    hydra_train()


@app.command(help="Evaluate a run (or a checkpoint, or a warm-start base) on the held-out split.")
def eval(
    target: Optional[str] = typer.Argument(None, help="Run directory or checkpoint directory; omit to evaluate the warm-start base."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Config overrides, e.g. task.eval_size=500 eval.pass_k=4"),
    examples: int = typer.Option(5, help="Example completions to print."),
) -> None:
    from gspo.evaluate import run_eval

    try:
        run_eval(target, list(overrides or []), examples=examples)
    except ConfigError as e:
        _fail(str(e))


@app.command(help="Compare runs or sweeps: a figure and a table, grouped by a config key, seeds aggregated.")
def compare(
    paths: List[Path] = typer.Argument(..., help="Run directories or sweep directories."),
    by: str = typer.Option("algo", "--by", help="Config key that tells the groups apart (dotted; 'algo' = algo.name)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output directory (default: SWEEP/compare)."),
    threshold: Optional[float] = typer.Option(None, help="Accuracy target for 'steps to target' (default: halfway from base to best)."),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="A group to compare every other group with (difference of means, Welch 95% interval)."),
) -> None:
    from gspo.compare import compare as run_compare
    from gspo.compare import print_report

    try:
        result = run_compare(paths, by=by, out=out, threshold=threshold, baseline=baseline)
    except ConfigError as e:
        _fail(str(e))
    print_report(result)
    if not result.groups:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
