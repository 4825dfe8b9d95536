"""`gspo eval` on a run (the unbiased pass@k estimator by hand: tests/train/evaluation/test_heldout.py), and its
title."""

import json

import pytest

from gspo.config.loading import compose
from gspo.results.evaluate import run_eval
from gspo.train.loop.trainer import train
from tests.conftest import tiny


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, cache_dir):
    """A tiny run of one step (the tests below each write their own eval.json into it, and read it at once)."""
    run_dir = tmp_path_factory.mktemp("one-step") / "run"
    train(compose(tiny(cache_dir, **{"train.steps": 1})), run_dir)
    return run_dir


def test_eval_of_a_run_writes_eval_json(one_step_run):
    run_dir = one_step_run
    res = run_eval(str(run_dir), ["task.eval_size=8"], examples=2, pass_k=2)
    saved = json.loads((run_dir / "eval.json").read_text())
    assert saved["n"] == 8 and 0.0 <= saved["eval/accuracy"] <= 1.0 and "eval/pass@2" in saved
    assert len(res["examples"]) == 2 and "checkpoints/step_000001" in saved["model"]
    assert "correct" not in saved and saved["heldout"]["n"] == 8  # the outcomes as a record, not a list


def test_eval_of_a_run_records_which_problems_it_answered(one_step_run, cache_dir):
    """eval.json's "heldout" is the record heldout.jsonl keeps for the run's own evaluations: `gspo eval` of the
    last checkpoint on the run's problems gives its final evaluation's line (the same weights, greedy); on another
    problem list, another digest, so the two are never paired."""
    from gspo.train.evaluation.heldout import read_records

    run_dir = one_step_run
    final = read_records(run_dir)[-1]
    res = run_eval(str(run_dir), [], examples=0, pass_k=0)
    saved = json.loads((run_dir / "eval.json").read_text())["heldout"]
    assert saved == res["heldout"] == final and final["step"] == 1
    assert saved["correct"].count("1") == round(res["eval/accuracy"] * res["n"])
    other = run_eval(str(run_dir), ["task.eval_size=8"], examples=0, pass_k=0)["heldout"]
    assert other["n"] == 8 and other["problems"] != final["problems"]
    base = run_eval(None, tiny(cache_dir, **{"task.eval_size": 8}), examples=0, pass_k=0)["heldout"]
    assert base["step"] is None and base["problems"] == other["problems"]  # not a run's checkpoint; same problems


def test_eval_of_the_warm_start_base(cache_dir):
    res = run_eval(None, tiny(cache_dir, **{"task.eval_size": 8}), examples=0, pass_k=1)
    assert "base-" in res["model"] and 0.0 <= res["eval/accuracy"] <= 1.0


def test_eval_of_a_run_on_another_task(one_step_run):
    """GROUP=OPTION swaps the run's whole task node; KEY=VALUE then tunes it."""
    run_dir = one_step_run
    res = run_eval(str(run_dir), ["task=countdown", "task.eval_size=4"], examples=1, pass_k=1)
    assert res["task"] == "countdown" and res["n"] == 4
    assert "," in res["examples"][0]["prompt"]  # a Countdown prompt ("3,5,7=22:"), not "a+b="


def test_eval_reports_the_number_of_problems_it_scored_and_warns_when_short(cache_dir, capsys):
    """1-digit addition has 55 problems (a+b = b+a), about 10% held out: asking for 200 scores the ~10 there are."""
    res = run_eval(None, tiny(cache_dir, **{"task.digits": 1, "task.eval_size": 200}), examples=0, pass_k=1)
    from gspo.tasks import is_heldout

    held_out = sum(is_heldout(f"{a}+{b}", 0.1) for a in range(10) for b in range(a, 10))  # one per canonical problem
    assert 0 < held_out < 200 and res["n"] == held_out
    err = capsys.readouterr().err
    assert "task.eval_size=200" in err and f"{held_out} problems" in err


def test_eval_of_an_empty_held_out_split_is_refused(cache_dir):
    from gspo.core.errors import ConfigError

    with pytest.raises(ConfigError, match="task.eval_fraction"):
        run_eval(None, tiny(cache_dir, **{"task.digits": 1, "task.eval_fraction": 0.0001}), examples=0, pass_k=1)


def test_one_temperature_for_pass_at_k_in_training_and_in_gspo_eval(tmp_path, cache_dir, monkeypatch):
    """Both sample pass@k at rollout.temperature, the temperature the policy is trained at."""
    import gspo.results.evaluate
    import gspo.train.evaluation.evaluator
    import gspo.train.evaluation.heldout

    seen = []

    def spy(*args, **kwargs):
        seen.append(args[4].temperature)  # evaluate(sampler, tokenizer, task, problems, params, ...)
        return real(*args, **kwargs)

    real = gspo.train.evaluation.heldout.evaluate
    monkeypatch.setattr(gspo.train.evaluation.evaluator, "evaluate", spy)
    monkeypatch.setattr(gspo.results.evaluate, "evaluate", spy)
    over = {"train.steps": 1, "eval.pass_k": 1, "rollout.temperature": 0.7, "task.eval_size": 4}
    train(compose(tiny(cache_dir, **over)), tmp_path)
    run_eval(str(tmp_path), [], examples=0, pass_k=1)
    assert seen and all(t == 0.7 for t in seen), seen


def test_eval_pass_k_override_is_used_not_ignored(cache_dir):
    res = run_eval(None, tiny(cache_dir, **{"task.eval_size": 4, "eval.pass_k": 2}), examples=0)
    assert "eval/pass@2" in res and "eval/pass@4" not in res
    res = run_eval(None, tiny(cache_dir, **{"task.eval_size": 4}), examples=0)
    assert "eval/pass@4" in res  # the default
    res = run_eval(None, tiny(cache_dir, **{"task.eval_size": 4, "eval.pass_k": 0}), examples=0)
    assert not any(k.startswith("eval/pass@") for k in res)


def test_eval_title_keeps_a_long_path_on_one_line(monkeypatch, capsys):
    from gspo.results.evaluate import _print_eval

    monkeypatch.setenv("COLUMNS", "40")
    path = "outputs/2026-11-23/08-38-17/checkpoints/step_000200"
    _print_eval({"model": path, "task": "addition", "n": 200, "eval/accuracy": 0.5})
    out = capsys.readouterr().out
    assert path in out.splitlines() and "eval/accuracy" in out
