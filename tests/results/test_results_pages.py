"""The results pages' tables are regenerated from the run logs kept in docs/data (gspo/results/pages.py): compare
blocks are `gspo compare`'s output, table blocks a template whose every number is a field of a kept log. A number
typed into a block, or a log changed under it, fails here."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tests.conftest import REPO

from gspo.results import pages
from tests.results.test_compare import sweep

ROOT = REPO


def test_the_pages_scanned_are_the_readme_and_every_docs_page():
    scanned = {p.relative_to(ROOT).as_posix() for p in pages.pages(ROOT)}
    assert {"README.md", "docs/results.md", "docs/compare.md"} <= scanned
    assert any(p.startswith("docs/results/") for p in scanned)  # the results' own pages, one per question
    assert not any(p.startswith("docs/data/") for p in scanned)  # compare's outputs kept beside the logs are not pages


def test_every_block_on_the_pages_is_what_its_logs_give():
    found = [(page, b) for page in pages.pages(ROOT) for b in pages.blocks(page.read_text())]
    assert {b.kind for _, b in found} == {"compare", "table"}  # both kinds are in use (a regex gone wrong finds none)
    stale = [(page.relative_to(ROOT).as_posix(), b.kind, b.args.splitlines()[0] if b.args.strip() else "")
             for page, b in found if pages.render(b, ROOT) != b.body]
    assert not stale, f"blocks that differ from their logs (python -m gspo.results.pages rewrites them): {stale}"


def test_every_real_model_study_page_has_its_numbers_from_blocks():
    """A page of a real-model study holds at least one block (its table regenerated, not typed)."""
    for page in sorted((ROOT / "docs" / "results").glob("smollm2*.md")):
        assert any(pages.blocks(page.read_text())), page.name


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


def _logs(tmp_path: Path) -> Path:
    logs = tmp_path / "docs" / "data" / "probe"
    logs.mkdir(parents=True)
    (logs / "f32.json").write_text(json.dumps({"correct": 0.154296875, "sequences": 512, "rollout/mismatch_kl": 3.16e-9,
                                               "paired/ci95": [-0.0939, -0.0037]}))
    (logs / "eval.txt").write_text("# gspo eval ...\n│ eval/accuracy │   0.162 │\n"
                                   "Maximum resident set size (kbytes): 7117976\n"
                                   '{"step": 0, "eval/accuracy": 0.0}\n{"step": 1, "time/step_s": 451.3}\n'
                                   '{"step": 2, "time/step_s": 470.5}\n')
    meta = {"record": json.dumps({"seconds": {"calibration": 41.1}, "kl_by_spread": {"0.01": 0.1664}})}
    header = json.dumps({"__metadata__": meta}).encode()
    (logs / "recipe.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return logs


TEMPLATE = """p = docs/data/probe/f32.json
e = docs/data/probe/eval.txt
| sampler | right | KL | CI | acc | RSS | step | build | KL at 0.01 |
|---|---:|---:|---:|---:|---:|---:|---:|---:|
| float32 | {{p correct .1%}} of {{p sequences d}} | {{p rollout/mismatch_kl .2g}} | [{{p paired/ci95:0 *100 .1f}}, {{p paired/ci95:1 *100 .1f}}] | {{e '/eval\\/accuracy │\\s+([\\d.]+)/' .1%}} | {{e '/Maximum resident set size \\(kbytes\\): (\\d+)/' /1048576 .2f}} GiB | {{e time/step_s .0f}} s | {{docs/data/probe/recipe.safetensors record:seconds:calibration .0f}} s | {{docs/data/probe/recipe.safetensors record:kl_by_spread:0.01 .3f}} |
"""

RENDERED = """| sampler | right | KL | CI | acc | RSS | step | build | KL at 0.01 |
|---|---:|---:|---:|---:|---:|---:|---:|---:|
| float32 | 15.4% of 512 | 3.2e-9 | [-9.4, -0.4] | 16.2% | 6.79 GiB | 470 s | 41 s | 0.166 |
"""


def test_a_table_block_renders_its_template_from_the_logs(tmp_path):
    """JSON keys (a list item by index, a value scaled), a regex on a text log, the last JSON line holding a key
    (a run's metrics), a safetensors file's metadata (a JSON string read as JSON), names defined at the top."""
    _logs(tmp_path)
    assert pages.table(TEMPLATE, tmp_path) == RENDERED


def test_a_table_block_is_rewritten_and_a_typed_number_is_caught(tmp_path):
    _logs(tmp_path)
    page = tmp_path / "docs" / "results" / "probe.md"
    page.parent.mkdir(parents=True)
    page.write_text(f"# Probe\n\n<!-- gspo table\n{TEMPLATE}-->\n| typed |\n<!-- end gspo table -->\n\nAfter.\n")
    assert pages.main(["--check", "--root", str(tmp_path)]) == 1  # found under docs/results/ by the default scan
    assert pages.main(["--root", str(tmp_path)]) == 0
    text = page.read_text()
    assert f"-->\n{RENDERED}<!-- end gspo table -->\n\nAfter.\n" in text and "| typed |" not in text
    assert pages.main(["--check", "--root", str(tmp_path)]) == 0
    page.write_text(text.replace("| 16.2% |", "| 16.3% |"))
    assert pages.main(["--check", "--root", str(tmp_path)]) == 1


@pytest.mark.parametrize("cell,why", [("{{docs/data/probe/f32.json nope}}", "no record holds 'nope'"),
                                      ("{{docs/data/probe/gone.json correct}}", "no such log"),
                                      ("{{docs/data/probe/eval.txt '/absent (\\d+)/'}}", "no match"),
                                      ("{{docs/data/probe/f32.json paired/ci95:5}}", "no item '5'")])
def test_a_table_block_naming_what_its_log_lacks_fails_saying_so(tmp_path, capsys, cell, why):
    _logs(tmp_path)
    page = tmp_path / "docs" / "results.md"
    page.write_text(f"<!-- gspo table\n| x |\n|---|\n| {cell} |\n-->\n| 1 |\n<!-- end gspo table -->\n")
    assert pages.main(["--root", str(tmp_path), str(page)]) == 1
    assert why in capsys.readouterr().err
    assert "| 1 |" in page.read_text()  # a page whose block cannot be rendered is left as it was
