"""The `gspo` command: train | eval | compare | vllm-serve. Thin: parse, compose, call gspo.*.

`gspo train` validates the overrides itself (so a typo gets a one-line message and
exit code 2), then hands them to Hydra's own run/multirun machinery: sweeps,
launchers and run directories are Hydra's, not ours.
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer
from hydra.errors import HydraException
from omegaconf import OmegaConf

from gspo.config.checks import check_machine, ignored_override, run_config_file
from gspo.core.errors import ConfigError, RunFailed, tidy_warnings
from gspo.config.loading import (_explain, compose, load_run_config, quote_tool_lists, resume_overrides, resume_target,
                                 sweep_combinations)
from gspo.config.schema import GROUPS, group_options
from gspo.results.compare_options import OPTIONS as COMPARE_OPTIONS
from gspo.train.run import rundir, sweep
from gspo.train.run.resume import check as check_resume


def _groups_help() -> str:
    # "\b" keeps Click from rewrapping the paragraph to the terminal's width
    lines = [f"  {g:<9} {', '.join(group_options(g))}" for g in GROUPS]
    lines.append(f"  +experiment={{{','.join(group_options('experiment'))}}}  presets over several groups")
    lines.append(f"  +cell={{{','.join(group_options('cell'))}}}  a study's treatments (after +experiment)")
    return "Config groups and their options (pick with GROUP=OPTION):\n\n\b\n" + "\n".join(lines)


app = typer.Typer(
    help="gspo: GRPO, GSPO, DAPO and relatives on your model, side by side.\n\n" + _groups_help(),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


@app.callback()
def _every_command() -> None:
    tidy_warnings()  # gspo's warnings as one line each, library deprecations hidden


def _fail(msg: str) -> None:
    typer.echo(f"gspo: error: {msg}", err=True)
    raise typer.Exit(2)


TRAIN_EXAMPLES = """
  gspo train                                      # the default: GSPO on a tiny Qwen3-MoE, addition
  gspo train algo=grpo train.steps=50 seed=1
  gspo train -m algo=grpo,gspo seed=0,1,2          # a sweep (Hydra multirun)
  gspo train resume=outputs/2026-01-01/12-00-00     # continue a stopped run
  gspo train resume=outputs/2026-01-01/12-00-00 train.steps=400   # ... for longer
  gspo train --cfg job algo=grpo                  # print the composed config, run nothing
"""

TRAIN_HELP = f"""Train with Hydra OVERRIDES (KEY=VALUE or GROUP=OPTION).

Examples:

\b{TRAIN_EXAMPLES}
Every key, its meaning and what it accepts: docs/contracts.md and gspo/config/schema.py.

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
    return quote_tool_lists(overrides), flags


# Hydra flags after which nothing is trained: the machine checks do not apply
_PRINT_ONLY_FLAGS = {"--cfg", "-c", "--info", "--help", "-h", "--hydra-help", "--shell-completion", "-sc"}
# launchers whose jobs run on this machine (the others, e.g. slurm, run them on other nodes)
_LOCAL_LAUNCHERS = {"basic", "parallel", "joblib", "local-submitit", "submitit_local"}


def _flag_value(flags: list[str], *names: str) -> Optional[str]:
    """The value after the first of `names` in Hydra's flags, or None."""
    for i, flag in enumerate(flags[:-1]):
        if flag in names:
            return flags[i + 1]
    return None


def _given(overrides: list[str], key: str) -> Optional[str]:
    """The value the last `key=VALUE` of `overrides` gives, or None."""
    values = [o.partition("=")[2] for o in overrides if o.partition("=")[0] == key]
    return values[-1] if values else None


def _runs_here(overrides: list[str]) -> bool:
    """Whether the jobs these overrides describe run on this machine."""
    launchers = [o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+") == "hydra/launcher"]
    return all(name in _LOCAL_LAUNCHERS for name in launchers)


def _check_before_work(overrides: list[str], hydra_flags: list[str], multirun: bool) -> list:
    """Every check that needs no work, for each job; raises ConfigError. Returns the jobs' configs."""
    from gspo.train.preflight import check, used_only_when  # imports torch and the registries: not for `gspo --help`
    from gspo.train.ranks.distributed import check as check_distributed

    resume = resume_target(overrides)
    if resume and multirun:
        raise ConfigError(f"resume={resume}: resume continues one run; it cannot be swept (-m). "
                          "Resume each run with its own `gspo train resume=DIR`")
    if resume:
        run_config_file(resume, "resume")
    if resume:  # the run's own config, with the KEY=VALUE overrides it accepts
        rundir.check_free(resume)  # not while the run is alive
        cfgs = [load_run_config(resume, resume_overrides(overrides))]
        check_resume(load_run_config(resume), cfgs[0])  # nothing that makes it another experiment
        cfgs[0].resume = resume
    else:
        cfgs = [compose(combo) for combo in (sweep_combinations(overrides) if multirun else [overrides])]
    if not resume:  # a key the chosen options never read: refuse, rather than train on something else in silence
        for o in overrides:
            problem = ignored_override(cfgs, o, used_only_when())
            if problem:
                raise ConfigError(problem)
    machine = _runs_here(overrides) and not _PRINT_ONLY_FLAGS.intersection(hydra_flags)
    for cfg in cfgs:
        check(cfg)  # registries, LoRA, data file, reward functions, sampler
        check_distributed(cfg)  # e.g. prompts that do not split over hardware.nproc
        if machine:
            check_machine(cfg)
    return cfgs


def _sweep_jobs(overrides: list[str], cfgs: list) -> tuple[list[str], list[str]]:
    """For -m: the keys that name the jobs' directories and the names, checked against what the sweep directory
    holds already (the same sweep run again continues it; another is refused)."""
    combos, sweep_dir = sweep_combinations(overrides), _given(overrides, "hydra.sweep.dir")
    keys = sweep.name_keys(sweep_dir, overrides)
    sweep.check(sweep_dir, overrides, combos, cfgs, keys)
    return keys, sweep.job_names(overrides, combos, keys)


def distributed_main() -> bool:
    """This process speaks for the run (not a rank > 0 of a torchrun started by hand)."""
    from gspo.train.ranks.launcher import is_main_process

    return is_main_process()


def _say_what_the_preset_does(overrides: list[str], cfg) -> None:
    """`+experiment=NAME`: one or two lines on what it switched on beyond the defaults."""
    from gspo.config.loading import preset_summary
    from gspo.rollout.decoding.sampler import old_logprobs_mode

    summary = preset_summary(overrides, cfg)
    if summary:
        typer.echo(f"gspo: {summary}; old log-probs: {old_logprobs_mode(cfg)}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, help=TRAIN_HELP,
             options_metavar="[-m] [OVERRIDES]...")
def train(
    ctx: typer.Context,
    multirun: bool = typer.Option(False, "-m", "--multirun", help="Run a sweep over comma-separated values."),
) -> None:
    overrides, hydra_flags = _split_hydra_flags(ctx.args)
    try:
        cfgs = _check_before_work(overrides, hydra_flags, multirun)
        keys, names = _sweep_jobs(overrides, cfgs) if multirun else ([], [])
    except ConfigError as e:
        _fail(str(e))
    if not resume_target(overrides) and not _PRINT_ONLY_FLAGS.intersection(hydra_flags) and distributed_main():
        # a sweep's first job stands for all (the preset is the same in every job; `algo=grpo,gspo` is no choice)
        _say_what_the_preset_does(sweep_combinations(overrides)[0] if multirun else overrides, cfgs[0])
    extra = []
    shown = _flag_value(hydra_flags, "--cfg", "-c")
    if multirun and shown is not None:  # Hydra prints no sweep (it refuses --cfg with --multirun): each job here
        if shown != "job":
            _fail(f"--cfg {shown} with -m: a sweep's configs are printed job by job with --cfg job")
        for name, combo, cfg in zip(names, sweep_combinations(overrides), cfgs):
            typer.echo(f"# job {name}: {' '.join(combo)}\n{OmegaConf.to_yaml(cfg)}", nl=False)
        return
    if resume_target(overrides):
        if shown == "job":  # Hydra would print the default config, not the run's
            typer.echo(OmegaConf.to_yaml(cfgs[0]), nl=False)
            return
        # Hydra's run directory is the resumed one, with no .hydra/ (it would record a default config there)
        extra = ["hydra.run.dir=${resume}", "hydra.output_subdir=null"]
    elif not _PRINT_ONLY_FLAGS.intersection(hydra_flags):
        try:
            extra = rundir.run_dir_overrides(overrides, multirun)
        except ConfigError as e:
            _fail(str(e))
        target = _given([*overrides, *extra], "hydra.sweep.dir")
        if multirun and target:  # (none: a rank > 0 of a torchrun started by hand)
            sweep.record(target, keys)
    if multirun:
        extra += sweep.hydra_overrides(overrides, keys)
    from cli import hydra_app

    sys.argv = ["gspo train", *(["--multirun"] if multirun else []), *hydra_flags, *overrides, *extra]
    # Hydra prints a job's exception with a traceback and exits 1; with HYDRA_FULL_ERROR it re-raises
    # it instead, so a ConfigError from a job run by another process also ends as one line and exit 2.
    saved = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    hydra_app.JOB_ERRORS.clear()
    try:
        hydra_app.hydra_train()
    except ConfigError as e:
        _fail(str(e))
    except RunFailed as e:  # the run could not go on: one line, exit 1 (finished steps are on disk)
        typer.echo(f"gspo: error: {e}", err=True)
        raise typer.Exit(1)
    except HydraException as e:  # Hydra's own composition (e.g. a launcher plugin that is not installed)
        _fail(_explain(e))
    finally:
        if saved is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved
    if hydra_app.JOB_ERRORS:  # jobs of this process that refused their input or failed: one line each
        for msg, _ in hydra_app.JOB_ERRORS:
            typer.echo(f"gspo: error: {msg}", err=True)
        raise typer.Exit(max(code for _, code in hydra_app.JOB_ERRORS))


@app.command(help="Evaluate a run (or a checkpoint, or a warm-start base) on the held-out split.")
def eval(
    target: Optional[str] = typer.Argument(None, help="Run directory or checkpoint directory; omit to evaluate the warm-start base."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Config overrides, e.g. task.eval_size=500 eval.pass_k=4"),
    examples: int = typer.Option(5, help="Example completions to print."),
) -> None:
    from gspo.results.evaluate import run_eval

    try:
        run_eval(target, list(overrides or []), examples=examples)
    except ConfigError as e:
        _fail(str(e))


def _with_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with a Typer option per `gspo compare` option (gspo/results/compare_options.py) in place of its
    `**options`: Typer reads a command's options off its signature, and they are declared once, there."""
    signature = inspect.signature(command, eval_str=True)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    for o in COMPARE_OPTIONS:
        params.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY,
                                        annotation=o.type if o.default is not None else Optional[o.type],
                                        default=typer.Option(o.default, f"--{o.name}", help=o.help)))
    command.__signature__ = signature.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params}  # (what Typer's get_type_hints reads)
    return command


@app.command(help="Compare runs or sweeps: a figure and a table, grouped by a config key, seeds aggregated.")
@_with_options
def compare(paths: List[Path] = typer.Argument(..., help="Run directories or sweep directories."),
            **options: Any) -> None:
    from gspo.results.compare import compare as run_compare
    from gspo.results.compare import print_report

    report = {o.name: options.pop(o.name) for o in COMPARE_OPTIONS if o.report}
    try:
        result = run_compare(paths, **options)
    except ConfigError as e:
        _fail(str(e))
    except OSError as e:  # writing the figure and table, no space or permission (an unreadable run is skipped)
        _fail(f"{e.filename or options['out']}: {e.strerror or e}")
    print_report(result, **report)
    if not result.groups:
        raise typer.Exit(1)


@app.command("vllm-serve", help="Serve the vLLM engine to runs on other hosts (rollout.vllm.mode=server "
                                  "rollout.vllm.server=HOST:PORT), one run at a time; GSPO_VLLM_KEY must hold the "
                                  "secret the runs share. docs/scaling.md, \"Where the engines run\".")
def vllm_serve(
    host: str = typer.Option("0.0.0.0", help="The address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8765, help="The port to listen on (0: one the system picks, printed)."),
    threads: Optional[int] = typer.Option(None, help="The engine's threads on a CPU (default: this host's cores)."),
) -> None:
    from gspo.rollout.engine import client as engine
    from gspo.rollout.engine.server import serve_runs

    if not engine.installed():
        _fail(f"vLLM is not installed in this environment; on a CPU: {engine.INSTALL_CPU}; on a GPU: "
              f"{engine.INSTALL_GPU}")
    try:
        serve_runs(host, port, threads or len(os.sched_getaffinity(0)), say=lambda line: typer.echo(line))
    except ConfigError as e:
        _fail(str(e))
    except OSError as e:  # the port is taken, the address not this host's
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
