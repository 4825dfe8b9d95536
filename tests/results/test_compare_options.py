"""`gspo compare`'s options are declared once (gspo/results/compare_options.py): the CLI command and the results
pages' compare blocks are both built from that table."""

from __future__ import annotations

import typer.main

from cli.main import app
from gspo.results import pages
from gspo.results.compare_options import OPTIONS, page_options


def test_the_cli_command_has_exactly_the_declared_options():
    command = typer.main.get_command(app).commands["compare"]
    options = [p for p in command.params if p.param_type_name == "option"]
    assert [(p.name, p.opts, p.default, p.help) for p in options] == [
        (o.name, [f"--{o.name}"], o.default, o.help) for o in OPTIONS]
    assert [p.is_flag for p in options] == [o.type is bool for o in OPTIONS]
    assert [p.name for p in command.params if p.param_type_name == "argument"] == ["paths"]


def test_a_page_block_takes_the_options_a_page_may_give():
    given = {"by": "algo.loss", "threshold": "0.5", "baseline": "grpo", "power": "0.05"}
    assert set(given) == {o.name for o in page_options()}  # a new option: give it here too
    ns = pages._arguments("runs/a runs/b " + " ".join(f"--{k} {v}" for k, v in given.items()))
    assert ns.paths == ["runs/a", "runs/b"]
    assert {o.name: getattr(ns, o.name) for o in page_options()} == {o.name: o.type(given[o.name])
                                                                      for o in page_options()}
    defaults = pages._arguments("runs/a")
    assert {o.name: getattr(defaults, o.name) for o in page_options()} == {o.name: o.default for o in page_options()}
    assert not {"out", "wide"} & set(vars(ns))  # the page's own: a temporary directory, compare.md's tables
