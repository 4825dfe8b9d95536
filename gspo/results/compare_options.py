"""The options of `gspo compare`, declared once.

The Typer command (cli/main.py) and the compare blocks of the results pages (gspo/results/pages.py, which run the
same command on kept logs) are both built from `OPTIONS`, so an option added here is an option of both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Option:
    """`--NAME VALUE` (a flag when `type` is bool): the keyword NAME of `compare()`, or of `print_report()`."""

    name: str
    type: type  # of the value: str, float, Path, or bool for a flag
    default: Any
    help: str
    report: bool = False  # an option of the console report (`print_report`), not of `compare()`
    page: bool = True  # a page's compare block may give it (False: the page decides it itself)


OPTIONS: tuple[Option, ...] = (
    Option("by", str, "algo", "Config key that tells the groups apart (dotted; 'algo' = algo.name)."),
    Option("out", Path, None, "Output directory (default: SWEEP/compare).", page=False),  # a page's: a temp dir
    Option("threshold", float, None,
           "Accuracy target for 'steps to target' (default: halfway from base to best)."),
    Option("baseline", str, None,
           "A group to compare every other group with (difference of means: Welch 95% interval, paired by seed where "
           "they share seeds; the smallest difference detectable at 80% power)."),
    Option("power", float, None,
           "With --baseline: how many seeds a difference of final accuracy this large (0.05 = 5 points) needs at 80% "
           "power, from each comparison's own spread."),
    Option("wide", bool, False,
           "Every column on the console (as compare.md has them), not the brief table in the terminal's width.",
           report=True, page=False),  # a page holds compare.md's tables, not the console's
)


def page_options() -> tuple[Option, ...]:
    """The options a page's compare block may give: those of `compare()` that the page does not decide itself."""
    return tuple(o for o in OPTIONS if o.page and not o.report)
