"""reward=python: users' reward functions, batched, weighted, checked before work and named when they fail."""

import json
import math

import pytest
from omegaconf import OmegaConf
from typer.testing import CliRunner

from cli.main import app
from gspo.config.loading import compose
from gspo.config.schema import RewardConfig, TaskConfig
from gspo.core.errors import ConfigError
from gspo.tasks import Problem, Verdict, build_task
from gspo.tasks.rewards import RewardError, score
from gspo.train.preflight import check
from tests.conftest import REPO, tiny

FNS = '''
import math

CALLS = []

def exact(prompts, completions, answer, **kwargs):
    CALLS.append(("exact", list(completions), sorted(kwargs)))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def length(prompts, completions):
    return [len(c) / 10 for c in completions]

def only_answer(prompts, completions, answer):
    return [float(a) for a in answer]

def raises_on_x(prompts, completions, **kw):
    return [1 / 0 if c == "x" else 0.0 for c in completions]

def short(prompts, completions, **kw):
    return [0.0]

def nan_on_x(prompts, completions, **kw):
    return [math.nan if c == "x" else 0.0 for c in completions]

def text_on_x(prompts, completions, **kw):
    return ["high" if c == "x" else 0.0 for c in completions]

def not_a_list(prompts, completions, **kw):
    return 3.0

def positional_only(prompts, completions, /):
    return [0.0 for _ in completions]

def correct(prompts, completions, **kw):
    return [0.0 for _ in completions]

NOT_CALLABLE = 3
'''


@pytest.fixture
def fns(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(FNS)
    return path


def cfg(fn, weights=None, ill_formed=None):
    return OmegaConf.structured(RewardConfig(name="python", fn=fn, weights=weights, ill_formed=ill_formed))


def addition():
    return build_task(OmegaConf.structured(TaskConfig(name="addition")))


class Unjudged:
    """A task whose verifier has no opinion: the reward is the functions' alone."""

    name = "unjudged"

    def verify(self, completion, problem):
        return Verdict(False, False)


PROBS = [Problem("1+1=", "2"), Problem("2+2=", "4"), Problem("3+3=", "6")]


def test_weighted_sum_of_functions_and_one_part_each(fns):
    texts = ["2", "5", "123"]
    r, parts = score(addition(), cfg([f"{fns}:exact", f"{fns}:length"], weights=[1.0, 0.5]), texts, PROBS)
    # exact: 1, 0, 0; length: 0.1, 0.1, 0.3 -> 1 + 0.05, 0 + 0.05, 0 + 0.15
    assert r.tolist() == pytest.approx([1.05, 0.05, 0.15])
    assert parts["fn/exact"].tolist() == [1.0, 0.0, 0.0] and parts["fn/length"].tolist() == pytest.approx([0.1, 0.1, 0.3])
    assert parts["correct"].tolist() == [1.0, 0.0, 0.0]  # the task's own verdict is still logged
    assert parts["ill_formed"].tolist() == [0.0, 0.0, 0.0]


def test_one_function_as_a_string_and_weights_default_to_one(fns):
    r, _ = score(addition(), cfg(f"{fns}:length"), ["ab", "abcd", ""], PROBS)
    assert r.tolist() == pytest.approx([0.2, 0.4, 0.0])


def test_functions_see_prompts_and_row_fields_as_lists(fns):
    import sys

    score(addition(), cfg(f"{fns}:exact"), ["2", "4", "7"], PROBS)
    module = next(m for k, m in sys.modules.items() if k.startswith("gspo_user_rewards_") and hasattr(m, "CALLS")
                  and m.__file__ == str(fns))
    # addition rows have `answer` only, named explicitly; TRL's completion_ids and trainer_state come in **kwargs
    assert module.CALLS[-1] == ("exact", ["2", "4", "7"], ["completion_ids", "trainer_state"])
    # a function without **kwargs gets only the fields it names
    r, _ = score(addition(), cfg(f"{fns}:only_answer"), ["a", "b", "c"],
                 [Problem("p", "1", {"row": {"answer": "1", "extra": 9}})] * 3)
    assert r.tolist() == [1.0, 1.0, 1.0]


def test_lazy_ids_and_state_are_built_only_for_user_functions(fns):
    """The trainer hands completion_ids and trainer_state over as callables: built only when functions run."""
    def never():
        raise AssertionError("built for a reward that does not read it")

    r, _ = score(addition(), OmegaConf.structured(RewardConfig(name="tinyzero")), ["2", "x", "7"], PROBS,
                 completion_ids=never, state=never)
    assert r.tolist() == score(addition(), OmegaConf.structured(RewardConfig(name="tinyzero")), ["2", "x", "7"], PROBS)[0].tolist()
    built = []
    score(addition(), cfg(f"{fns}:exact"), ["2", "4", "7"], PROBS,
          completion_ids=lambda: built.append("ids") or [[1], [2], [3]], state=lambda: built.append("state") or None)
    assert sorted(built) == ["ids", "state"]


def test_completion_ids_keep_each_rows_tokens_up_to_its_eos_and_drop_the_padding():
    from types import SimpleNamespace

    import torch

    from gspo.tasks.rewards import completion_ids

    ro = SimpleNamespace(completion_ids=torch.tensor([[5, 6, 2, 0], [7, 2, 0, 0], [8, 9, 9, 9]]),
                         completion_mask=torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    assert completion_ids(ro) == [[5, 6, 2], [7, 2], [8, 9, 9, 9]]


def test_every_row_is_shown_to_the_functions_decoded_as_trl_decodes_it(fns):
    """As TRL: the functions score ill-formed rows too (their text with special tokens skipped); the built-in
    task still judges them wrong and reward/ill_formed/mean counts them."""
    r, parts = score(addition(), cfg(f"{fns}:length"), ["1<pad>2", "5"], PROBS[:2], ill_formed=[True, False],
                     clean_texts=["12", "5"])
    assert r.tolist() == pytest.approx([0.2, 0.1])  # len("12") / 10: the function saw the clean text
    assert parts["ill_formed"].tolist() == [1.0, 0.0] and parts["correct"].tolist() == [0.0, 0.0]
    assert parts["unscored"].tolist() == [0.0, 0.0]


def test_reward_ill_formed_opts_out_of_scoring_ill_formed_rows(fns):
    r, parts = score(addition(), cfg(f"{fns}:raises_on_x", ill_formed=-1.0), ["1", "x", "2"], PROBS,
                     ill_formed=[False, True, False])
    assert r.tolist() == [0.0, -1.0, 0.0]  # the "x" row would raise: it was never passed in
    assert parts["ill_formed"].tolist() == [0.0, 1.0, 0.0] and parts["fn/raises_on_x"].tolist() == [0.0, 0.0, 0.0]
    r, _ = score(addition(), cfg(f"{fns}:length", ill_formed=0.0), ["x", "y"], PROBS[:2], ill_formed=[True, True])
    assert r.tolist() == [0.0, 0.0]


def test_a_function_may_take_any_name_gspo_logs_itself(fns):
    """User functions live under reward/fn/<name>: one named `correct` does not hide the task's verdict."""
    check(compose(["reward=python", f"reward.fn={fns}:correct"]))
    r, parts = score(addition(), cfg(f"{fns}:correct"), ["2", "5"], PROBS[:2])
    assert parts["fn/correct"].tolist() == [0.0, 0.0] and parts["correct"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("name, message", [
    ("raises_on_x", r"reward function .*:raises_on_x raised ZeroDivisionError: division by zero on sample 1: "
                    r"prompt '2\+2=', completion 'x'"),
    ("short", r"reward function .*:short returned 1 values for 3 completions"),
    ("nan_on_x", r"reward function .*:nan_on_x returned nan on sample 1: prompt '2\+2=', completion 'x' "
                 r"\(return None for 'no reward'\)"),
    ("text_on_x", r"reward function .*:text_on_x returned 'high' \(str\), not a number or None, on sample 1"),
    ("not_a_list", r"reward function .*:not_a_list returned a float, not a list of 3 numbers"),
])
def test_a_failing_function_is_named_with_the_sample(fns, name, message):
    with pytest.raises(RewardError, match=message) as e:
        score(addition(), cfg(f"{fns}:{name}"), ["1", "x", "2"], PROBS)
    assert isinstance(e.value, ConfigError) and "\n" not in str(e.value)


@pytest.mark.parametrize("override, message", [
    ("reward.fn={d}/nope.py:f", r"reward.fn=.*nope.py:f: no such file"),
    ("reward.fn={d}/my_rewards.py:missing", r"has no function 'missing'. Functions there: .*exact.*length"),
    ("reward.fn={d}/my_rewards.py:NOT_CALLABLE", r"'NOT_CALLABLE' in .* is a int, not a function"),
    ("reward.fn={d}/my_rewards.py:positional_only", r"'positional_only' has positional-only parameter\(s\) prompts, "
                                                    r"completions; reward functions are called by keyword"),
    ("reward.fn=[{d}/my_rewards.py:exact,{d}/my_rewards.py:exact]", r"two functions are named 'exact'"),
    ("reward.fn={d}/my_rewards.py", r"expected FILE.py:NAME"),
    ("reward.fn={d}/broken.py:f", r"importing .*broken.py raised NameError"),
])
def test_load_failures_are_caught_before_work(fns, tmp_path, override, message):
    (tmp_path / "broken.py").write_text("undefined_name\n")
    with pytest.raises(ConfigError, match=message):
        check(compose(["reward=python", override.format(d=tmp_path)]))


def test_weights_must_match_the_functions(fns):
    with pytest.raises(ConfigError, match=r"reward.weights has 1 values for 2 reward.fn function\(s\)"):
        check(compose(["reward=python", f"reward.fn=[{fns}:exact,{fns}:length]", "reward.weights=[1.0]"]))
    with pytest.raises(ConfigError, match=r"reward=python needs reward.fn=FILE.py:NAME"):
        check(compose(["reward=python"]))
    with pytest.raises(ConfigError, match="reward.fn is set but reward=tinyzero"):
        check(compose([f"reward.fn={fns}:exact"]))


def test_cli_refuses_a_missing_function_in_one_line(fns, cache_dir):
    res = CliRunner().invoke(app, ["train", "reward=python", f"reward.fn={fns}:nope", *tiny(cache_dir)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "has no function 'nope'" in res.output and len(res.output.strip().splitlines()) == 1


def test_each_function_is_logged_and_a_failure_keeps_the_finished_steps(tmp_path, cache_dir):
    """The probe and step 1 score fine, step 2's call raises: the error names the function, steps 0-1 stay on disk."""
    from gspo.train.loop.trainer import train

    counter = tmp_path / "calls"
    (tmp_path / "fns.py").write_text(f'''
from pathlib import Path
def ok(prompts, completions, answer, **kw):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]
def fails_later(prompts, completions, **kw):
    p = Path({str(counter)!r})
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n >= 2:  # call 0: the probe before any work, call 1: step 1
        raise RuntimeError("boom")
    return [0.5] * len(completions)
''')
    overrides = tiny(cache_dir, model="qwen3-tiny", reward="python", **{
        "reward.fn": f"[{tmp_path}/fns.py:ok,{tmp_path}/fns.py:fails_later]", "reward.weights": "[1.0,2.0]",
        "train.steps": 3})
    with pytest.raises(RewardError, match=r"fns.py:fails_later raised RuntimeError: boom on sample 0"):
        train(compose(overrides), tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    step1 = lines[1]
    # every row is passed to the functions, ill-formed ones (a sampled special token) included
    assert step1["reward/fn/fails_later/mean"] == pytest.approx(0.5)
    assert 0.0 <= step1["reward/fn/ok/mean"] <= 1.0
    assert step1["reward/mean"] == pytest.approx(step1["reward/fn/ok/mean"] + 2 * step1["reward/fn/fails_later/mean"])
    assert math.isfinite(step1["reward/python/mean"])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] != "finished"


def test_the_shipped_reward_file():
    path = REPO / "examples" / "rewards.py"
    problems = [Problem([{"role": "user", "content": "q"}], "3 + 4 = 7\n#### 7", {"row": {"answer": "3 + 4 = 7\n#### 7"}})] * 4
    texts = ["3 + 4 = 7\n#### 7", "#### 8", "7", "#### 7.0"]
    r, parts = score(Unjudged(), cfg([f"{path}:accuracy", f"{path}:formatted"], weights=[1.0, 0.2]), texts, problems)
    assert parts["fn/accuracy"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert parts["fn/formatted"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert r.tolist() == pytest.approx([1.2, 0.2, 0.0, 1.2])


def test_a_hanging_function_ends_the_run_in_one_line_and_keeps_the_finished_steps(tmp_path, cache_dir, monkeypatch):
    """reward.timeout_s: step 2's call never returns; one line names the limit and where the function is stuck,
    exit 2; steps 0-1 and step 1's checkpoint are on disk. (Call 0 is the up-front probe, call 1 step 1's.)"""
    from gspo.train.run import checkpoint
    from tests.cli.test_cli import one_line_exit_2

    counter = tmp_path / "calls"
    (tmp_path / "slow.py").write_text(f'''
import time
from pathlib import Path
def hangs_later(prompts, completions, **kw):
    p = Path({str(counter)!r})
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    if n >= 2:
        time.sleep(60)
    return [0.0] * len(completions)
''')
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    res = CliRunner().invoke(app, ["train", *tiny(cache_dir, reward="python", **{
        "reward.fn": f"{tmp_path}/slow.py:hangs_later", "reward.timeout_s": 1, "train.steps": 3,
        "train.checkpoint_every": 1}), f"hydra.run.dir={run}"])
    one_line_exit_2(res, "reward.timeout_s=1", "scoring step 2's", f"stuck in hangs_later() at {tmp_path}/slow.py:")
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert checkpoint.load_state(checkpoint.latest(run))["step"] == 1


def test_the_time_limit_covers_the_tasks_verifier(monkeypatch):
    import time

    import gspo.tasks.rewards
    from gspo.tasks import timeouts

    def verifier_that_hangs(task, text, problem, bad):
        time.sleep(30)

    monkeypatch.setattr(gspo.tasks.rewards, "judge", verifier_that_hangs)
    with pytest.raises(timeouts.ScoringTimeout, match=r"reward.timeout_s=0.2: scoring .* stuck in verifier_that_hangs\(\)"):
        timeouts.call(lambda: score(addition(), OmegaConf.structured(RewardConfig(name="tinyzero")), ["1"], PROBS[:1]),
                      0.2, "scoring")
    assert timeouts.call(lambda: 7, 0.2, "x") == 7 and timeouts.call(lambda: 8, 0, "x") == 8
    with pytest.raises(ZeroDivisionError):  # the function's own errors pass through
        timeouts.call(lambda: 1 / 0, 5, "x")


def test_a_verifier_that_hangs_in_the_base_evaluation_ends_the_run(tmp_path, cache_dir, monkeypatch):
    """The held-out evaluation (step 0, before any RL step) verifies under the same limit."""
    import time

    import gspo.train.evaluation.heldout
    from gspo.tasks.timeouts import ScoringTimeout
    from gspo.train.loop.trainer import train

    def verifier_that_hangs(task, texts, problems, bad):
        time.sleep(30)

    monkeypatch.setattr(gspo.train.evaluation.heldout, "judge_all", verifier_that_hangs)
    with pytest.raises(ScoringTimeout, match=r"reward.timeout_s=0.5: the task's verifier on \d+ held-out completions"):
        train(compose(tiny(cache_dir, **{"reward.timeout_s": 0.5})), tmp_path)
