"""Results pages whose tables are regenerated from the run logs kept in the repository.

A page holds blocks of two kinds. A compare block

    <!-- gspo compare docs/data/smollm2_matched --baseline grpo -->
    | group | seeds | ... |          (what that command tabulates: gspo/results/report.py `tables_markdown`)
    <!-- end gspo compare -->

holds exactly what `gspo compare` gives on the runs the marker names, run from the repository root. A table block

    <!-- gspo table
    f32 = docs/data/smollm2_probe/float32.json
    | sampler | samples right |
    |---|---:|
    | float32 | {{f32 correct .1%}} of {{f32 sequences d}} |
    -->
    | sampler | samples right |        (the template with every {{...}} replaced by the value it names)
    |---|---:|
    | float32 | 15.4% of 512 |
    <!-- end gspo table -->

holds a table typed as a template whose every number is a field of a kept log: `{{FILE FIELD [*N|/N] [SPEC]}}`
(FILE: a path relative to the root or a name the template's first lines define as `NAME = PATH`; FIELD: a key
path into the file's JSON, its parts joined by `:` (`paired/ci95:0`), or `/REGEX/`, whose first group in the
file's text is the value; `*N` or `/N` scales it; SPEC is Python's format spec, `.3g` unless given). A `.json`
file is one object or JSON lines, any other file is read as text whose lines that are JSON objects are its
records (a key comes from the last record that holds it: a run's `metrics.jsonl`, the JSON line a probe
printed), a `.safetensors` file is its header's metadata (a value that is a JSON string is read as JSON).

`python -m gspo.results.pages` rewrites every block of README.md and docs/**/*.md from the logs; `--check` only
says which blocks differ (tests/results/test_results_pages.py runs it), so a number in a block is a number the logs
give.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from gspo.results.compare_options import page_options

BLOCK = re.compile(r"^<!-- gspo compare (?P<args>.*?) -->\n(?P<body>.*?)^<!-- end gspo compare -->$",
                   re.MULTILINE | re.DOTALL)
TABLE = re.compile(r"^<!-- gspo table\n(?P<args>.*?)^-->\n(?P<body>.*?)^<!-- end gspo table -->$",
                   re.MULTILINE | re.DOTALL)
KINDS = {"compare": BLOCK, "table": TABLE}
FIELD = re.compile(r"\{\{(.*?)\}\}")
ALIAS = re.compile(r"^(?P<name>[A-Za-z_]\w*) = (?P<path>\S+)$")


@dataclass
class Block:
    """One block of a page: its kind ("compare" or "table"), what its marker holds (compare's arguments, or the
    table's template) and the lines between the markers."""

    kind: str
    args: str
    body: str
    start: int
    end: int

    def __getitem__(self, key: str) -> str:  # m["args"], m["body"], as the compare blocks' matches read
        return getattr(self, key)


def _arguments(args: str) -> argparse.Namespace:
    """A compare block's `gspo compare ARGS`, parsed: its paths and the options a page may give (compare_options)."""
    parser = argparse.ArgumentParser(prog="gspo compare", add_help=False, exit_on_error=False)
    parser.add_argument("paths", nargs="+")
    for o in page_options():  # (no help text: this parser prints none, and argparse would take its % for formats)
        if o.type is bool:
            parser.add_argument(f"--{o.name}", action="store_true")
        else:
            parser.add_argument(f"--{o.name}", type=o.type, default=o.default)
    return parser.parse_args(shlex.split(args))


def tables(args: str, root: Path) -> str:
    """The markdown a block with the command `gspo compare ARGS` holds (paths relative to `root`): compare's
    tables and legends, its section titles as bold lines (a block sits inside a page's own section)."""
    from gspo.results.compare import compare
    from gspo.results.report import tables_markdown

    ns = _arguments(args)
    with tempfile.TemporaryDirectory() as out:
        result = compare([root / p for p in ns.paths], out=out, plot=False,
                         **{o.name: getattr(ns, o.name) for o in page_options()})
    lines = [f"**{line[3:]}**" if line.startswith("## ") else line for line in tables_markdown(result)]
    return "\n".join(lines).strip("\n") + "\n"


# --------------------------------------------------------------------------- table blocks: a template over kept logs


class LogError(ValueError):
    """A field a table block names that its log does not give."""


def _records(path: Path) -> tuple[str, list[dict]]:
    """A log's text and its JSON objects (the whole file's, or its lines' that are objects)."""
    if path.suffix == ".safetensors":
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        return json.dumps(meta), [meta]
    text = path.read_text()
    if path.suffix == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            return text, [whole]
    records = []
    for line in text.splitlines():
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                records.append(obj)
    return text, records


def _walk(value: Any, parts: list[str], where: str) -> Any:
    for part in parts:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise LogError(f"{where}: {part!r} under a value that is not JSON") from None
        if isinstance(value, list):
            try:
                value = value[int(part)]
            except (ValueError, IndexError):
                raise LogError(f"{where}: no item {part!r} in a list of {len(value)}") from None
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise LogError(f"{where}: no key {part!r}")
    return value


def field(path: Path, name: str) -> Any:
    """The value FIELD `name` names in the log at `path`: `/REGEX/` (its first group, first match) or a key path."""
    where = f"{path}: {name}"
    if not path.is_file():
        raise LogError(f"{path}: no such log")
    text, records = _records(path)
    if len(name) > 1 and name.startswith("/") and name.endswith("/"):
        m = re.search(name[1:-1], text, re.MULTILINE)
        if not m:
            raise LogError(f"{where}: no match")
        return m.group(1) if m.groups() else m.group(0)
    parts = name.split(":")
    holding = [r for r in records if parts[0] in r]
    if not holding:
        raise LogError(f"{where}: no record holds {parts[0]!r}")
    return _walk(holding[-1][parts[0]], parts[1:], where)


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value.replace(",", ""))
        except ValueError:
            return value
    return value


def render_value(value: Any, scale: str | None, spec: str) -> str:
    """A value as the page shows it: scaled (`*N`, `/N`), then Python's format spec; exponents without padding
    (2.6e-6, not 2.6e-06)."""
    value = _number(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if scale:
            factor = float(scale[1:])
            value = value * factor if scale[0] == "*" else value / factor
        if spec.rstrip().endswith(("d", "n")) and not isinstance(value, int):
            value = int(round(value))
    elif scale:
        raise LogError(f"cannot scale {value!r}")
    out = format(value, spec)
    return re.sub(r"e([+-])0*(\d)", lambda m: f"e{'' if m[1] == '+' else '-'}{m[2]}", out)


def table(template: str, root: Path) -> str:
    """The markdown a table block with this template holds: its lines after the `NAME = PATH` definitions, every
    `{{FILE FIELD [*N|/N] [SPEC]}}` replaced by that log's value."""
    lines = template.splitlines()
    names: dict[str, str] = {}
    while lines and (m := ALIAS.match(lines[0].strip())):
        names[m["name"]] = m["path"]
        lines.pop(0)

    def one(m: re.Match) -> str:
        words = shlex.split(m.group(1))
        if len(words) < 2:
            raise LogError(f"{m.group(0)}: a field is {{{{FILE FIELD [*N|/N] [SPEC]}}}}")
        file, name, rest = words[0], words[1], words[2:]
        scale = rest.pop(0) if rest and re.fullmatch(r"[*/][0-9.eE+-]+", rest[0]) else None
        spec = rest.pop(0) if rest else ".3g"
        if rest:
            raise LogError(f"{m.group(0)}: more words than FILE FIELD [*N|/N] [SPEC]")
        return render_value(field(root / names.get(file, file), name), scale, spec)

    return "\n".join(FIELD.sub(one, line) for line in lines).strip("\n") + "\n"


# --------------------------------------------------------------------------- pages


def blocks(text: str) -> Iterator[Block]:
    """The blocks of a page, compare and table blocks, in page order."""
    found = [Block(kind, m["args"], m["body"], m.start(), m.end()) for kind, rx in KINDS.items()
             for m in rx.finditer(text)]
    return iter(sorted(found, key=lambda b: b.start))


def render(block: Block, root: Path) -> str:
    """What the block's body is, from the logs now."""
    return tables(block.args, root) if block.kind == "compare" else table(block.args, root)


def _whole(block: Block, body: str) -> str:
    if block.kind == "compare":
        return f"<!-- gspo compare {block.args} -->\n{body}<!-- end gspo compare -->"
    return f"<!-- gspo table\n{block.args}-->\n{body}<!-- end gspo table -->"


def regenerate(text: str, root: Path) -> str:
    """The page with every block's body made what its logs give now."""
    out, at = [], 0
    for block in blocks(text):
        out += [text[at:block.start], _whole(block, render(block, root))]
        at = block.end
    return "".join(out) + text[at:]


def pages(root: Path) -> list[Path]:
    """The pages that may hold blocks: README.md and every markdown page under docs/ (docs/data's outputs aside)."""
    docs = root / "docs"
    readme = [root / "README.md"] if (root / "README.md").is_file() else []
    return [*readme, *sorted(p for p in docs.rglob("*.md") if (docs / "data") not in p.parents)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gspo.results.pages", description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="markdown pages (default: README.md and docs/**/*.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (paths are relative to it)")
    ns = parser.parse_args(argv)
    stale, broken = [], []
    for page in ns.pages or pages(ns.root):
        text = page.read_text()
        if not any(blocks(text)):
            continue
        try:
            new = regenerate(text, ns.root)
        except LogError as e:
            broken.append(f"{page}: {e}")
            continue
        if new != text:
            stale.append(page)
            if not ns.check:
                page.write_text(new)
    verb = "differ from their logs" if ns.check else "rewritten from their logs"
    for page in stale:
        print(f"{page}: blocks {verb}")
    for line in broken:
        print(f"{line}: a block names what its log does not hold", file=sys.stderr)
    return 1 if broken or (ns.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
