"""scripts/README.md is the folder's index: one row per script, saying what it does, which page cites it
and how to run it. Here we check that it stays true. Every file in scripts/ has a row and every row names a
file that exists. Every link resolves. Every page a row says cites its script really does name it."""

from __future__ import annotations

import re

from tests.conftest import REPO

SCRIPTS = REPO / "scripts"
README = SCRIPTS / "README.md"
ROW = re.compile(r"^\| `([\w.-]+)` \|(.*)$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


def rows() -> dict[str, str]:
    """script name -> the rest of its table row."""
    found = {}
    for line in README.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in found, f"two rows for {m.group(1)}"
            found[m.group(1)] = m.group(2)
    return found


def test_every_script_has_one_row_and_every_row_a_script():
    listed = set(rows())
    present = {p.name for p in SCRIPTS.iterdir() if p.is_file() and p.name != "README.md"}
    assert sorted(present - listed) == [], "scripts with no row in scripts/README.md"
    assert sorted(listed - present) == [], "rows in scripts/README.md for scripts that are gone"


def test_every_link_resolves_and_every_cited_page_names_its_script():
    for target in LINK.findall(README.read_text()):
        assert (SCRIPTS / target).exists(), target
    for name, row in rows().items():
        cited = [SCRIPTS / t for t in LINK.findall(row) if t.endswith(".md")]
        assert cited, f"{name}: no page cites it"
        for page in cited:
            assert f"scripts/{name}" in page.read_text(), f"{page.relative_to(REPO)} does not name scripts/{name}"
