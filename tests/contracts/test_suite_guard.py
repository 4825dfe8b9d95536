"""The default suite's time bound (tests/conftest.py): a test that is neither `slow` nor `engine` and runs longer
than GSPO_TEST_MAX_S fails the session, naming itself; `slow` and `engine` tests are not bound."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, child_env

ROOT = REPO

TESTS = '''
import time
import pytest

def test_unmarked():
    time.sleep(0.3)

@pytest.mark.slow
def test_marked_slow():
    time.sleep(0.3)

@pytest.mark.engine
def test_marked_engine():
    time.sleep(0.3)

def test_quick():
    pass
'''


def test_a_default_test_over_the_bound_fails_the_session_and_slow_or_engine_ones_do_not(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary  # noqa\n")
    (tmp_path / "test_timed.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: long\n    engine: vLLM\n")
    env = child_env(GSPO_TEST_MAX_S="0.2")
    env.pop("PYTEST_XDIST_WORKER", None)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "4 passed" in out, out
    too_slow = [line for line in out.splitlines() if line.startswith("too slow for the default suite")]
    assert len(too_slow) == 1 and "test_timed.py::test_unmarked took 0 s > 0.2 s" in too_slow[0], out


def test_the_tests_run_first_exist_and_are_collected_first(request):
    """conftest's FIRST names test modules, or tests by the start of their names, that exist (a renamed one would
    silently lose its place), and this session collected them before every other test, in that order."""
    from tests.conftest import FIRST, first_rank

    for first in FIRST:
        module, _, test = first.partition("::")
        assert f"def {test}" in (ROOT / "tests" / module).read_text(), first
    ranks = [first_rank(item) for item in request.session.items]
    assert ranks == sorted(ranks)
