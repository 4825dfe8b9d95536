"""The results pages' tables are `gspo compare`'s output on the run logs kept in docs/data (gspo/results/pages.py):
a number typed into a block, or a log changed under it, fails here."""

from __future__ import annotations

from pathlib import Path

from gspo.results import pages
from test_compare import sweep

ROOT = Path(__file__).resolve().parents[1]


def test_every_compare_block_on_the_pages_is_what_its_logs_give():
    stale = [(page.name, m["args"]) for page in pages.pages(ROOT) for m in pages.blocks(page.read_text())
             if pages.tables(m["args"], ROOT) != m["body"]]
    assert not stale, f"blocks that differ from their logs (python -m gspo.results.pages rewrites them): {stale}"


def test_a_block_is_rewritten_from_its_logs_and_a_typed_number_is_caught(tmp_path):
    root = sweep(tmp_path)  # grpo finals 0.5, 0.6, 0.7; gspo finals 0.8, 0.9
    args = f"{root.relative_to(tmp_path)} --baseline grpo"
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    page.write_text(f"# Results\n\nText.\n\n<!-- gspo compare {args} -->\n| made up |\n<!-- end gspo compare -->\n\nMore.\n")
    assert pages.main(["--check", "--root", str(tmp_path), str(page)]) == 1  # the typed table is caught
    assert pages.main(["--root", str(tmp_path), str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Results\n\nText.\n\n<!-- gspo compare ") and text.endswith("<!-- end gspo compare -->\n\nMore.\n")
    assert "| made up |" not in text and "| grpo | 3 | 20 | 0.300±0.000 | 0.600 [0.352, 0.848] |" in text
    assert "**Against the baseline `grpo`**" in text and "\n## " not in text  # the page's own sections stay its own
    assert pages.main(["--check", "--root", str(tmp_path), str(page)]) == 0
    page.write_text(text.replace("0.600 [0.352, 0.848]", "0.650 [0.352, 0.848]", 1))
    assert pages.main(["--check", "--root", str(tmp_path), str(page)]) == 1
