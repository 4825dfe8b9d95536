"""Results pages whose tables are `gspo compare`'s own output on the run logs kept in the repository.

A page holds a block

    <!-- gspo compare docs/data/smollm2_matched --baseline grpo -->
    | group | seeds | ... |          (what that command tabulates: gspo/results/report.py `tables_markdown`)
    <!-- end gspo compare -->

and the lines between the markers are exactly what the command in the first marker gives, run from the repository
root. `python -m gspo.results.pages` rewrites every block of README.md and docs/*.md from the logs; `--check` only
says which blocks differ (tests/test_results_pages.py runs it), so a number on a page is a number the logs give.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

BLOCK = re.compile(r"^<!-- gspo compare (?P<args>.*?) -->\n(?P<body>.*?)^<!-- end gspo compare -->$",
                   re.MULTILINE | re.DOTALL)


def _arguments(args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gspo compare", add_help=False, exit_on_error=False)
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--by", default="algo")
    parser.add_argument("--threshold", type=float)
    parser.add_argument("--baseline")
    return parser.parse_args(shlex.split(args))


def tables(args: str, root: Path) -> str:
    """The markdown a block with the command `gspo compare ARGS` holds (paths relative to `root`): compare's
    tables and legends, its section titles as bold lines (a block sits inside a page's own section)."""
    from gspo.results.compare import compare
    from gspo.results.report import tables_markdown

    ns = _arguments(args)
    with tempfile.TemporaryDirectory() as out:
        result = compare([root / p for p in ns.paths], by=ns.by, out=out, threshold=ns.threshold, plot=False,
                         baseline=ns.baseline)
    lines = [f"**{line[3:]}**" if line.startswith("## ") else line for line in tables_markdown(result)]
    return "\n".join(lines).strip("\n") + "\n"


def blocks(text: str) -> Iterator[re.Match]:
    """The compare blocks of a page."""
    return BLOCK.finditer(text)


def regenerate(text: str, root: Path) -> str:
    """The page with every block's body made what its command gives now."""
    return BLOCK.sub(lambda m: f"<!-- gspo compare {m['args']} -->\n{tables(m['args'], root)}<!-- end gspo compare -->",
                     text)


def pages(root: Path) -> list[Path]:
    """The pages that may hold blocks: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo.results.pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="markdown pages (default: README.md and docs/*.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (paths are relative to it)")
    ns = parser.parse_args(argv)
    stale = []
    for page in ns.pages or pages(ns.root):
        text = page.read_text()
        if not any(blocks(text)):
            continue
        new = regenerate(text, ns.root)
        if new != text:
            stale.append(page)
            if not ns.check:
                page.write_text(new)
    verb = "differ from their logs" if ns.check else "rewritten from their logs"
    for page in stale:
        print(f"{page}: compare blocks {verb}")
    return 1 if ns.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
