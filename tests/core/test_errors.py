"""What a run shows: gspo's warnings as one line each, library deprecations hidden (eval's title whole:
tests/results/test_evaluate.py)."""

import warnings
from pathlib import Path

import pytest

import gspo
from gspo.core.errors import tidy_warnings


@pytest.fixture
def tidy(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
    tidy_warnings()


def warn_from(filename: str, message: str, category=UserWarning) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning(category(message), category, filename, 12)


def test_gspo_warnings_are_one_line_and_library_deprecations_hidden(tidy, capsys):
    ours = str(Path(gspo.__file__).parent / "tasks" / "data.py")
    lib = "/venv/lib/python3.11/site-packages/transformers/modeling_utils.py"
    warn_from(ours, "task.path=x.jsonl: only 10 held-out problems")
    warn_from(lib, "`is_gradient_checkpointing` is deprecated", FutureWarning)
    warn_from(lib, "`x` is deprecated", DeprecationWarning)
    warn_from("/venv/lib/python3.11/site-packages/peft/tuners/lora.py", "fan_in_fan_out is set\nsecond line")
    assert capsys.readouterr().err.splitlines() == [
        "gspo: warning: task.path=x.jsonl: only 10 held-out problems",
        "gspo: warning: (peft) fan_in_fan_out is set",
    ]


def test_a_real_warning_through_the_warnings_module(tidy, capsys):
    from gspo.tasks import data

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("held-out split is small", UserWarning, data.__file__, 1)
    err = capsys.readouterr().err
    assert err == "gspo: warning: held-out split is small\n" and "data.py" not in err
