"""Tasks: held-out splits never leak, verifiers accept references, rewards follow TinyZero."""

import random

import pytest
from omegaconf import OmegaConf

from gspo.config import RewardConfig, TaskConfig
from gspo.rewards import RewardError, score
from gspo.tasks import Problem, Verdict, build_task, is_heldout


def task(name, **kw):
    return build_task(OmegaConf.structured(TaskConfig(name=name, **kw)))


@pytest.mark.parametrize("name", ["addition", "countdown"])
def test_train_never_samples_heldout(name):
    t = task(name)
    heldout = {p.prompt for p in t.eval_set(200)}
    assert len(heldout) == 200
    train = {p.prompt for p in t.sample_train(random.Random(0), 3000)}
    assert not heldout & train
    assert all(not is_heldout(p, t.eval_fraction) for p in train)


@pytest.mark.parametrize("name", ["addition", "countdown"])
def test_reference_answers_verify(name):
    t = task(name)
    for p in t.sample_train(random.Random(1), 300) + t.eval_set(50):
        assert t.verify(p.answer, p) == Verdict(True, True), p


def test_eval_set_is_the_same_for_every_run():
    assert task("addition").eval_set(20) == task("addition").eval_set(20)


def test_addition_verdicts():
    t = task("addition")
    p = Problem("12+34=", "46")
    assert t.verify("46", p) == Verdict(True, True)
    assert t.verify("47", p) == Verdict(False, True)
    assert t.verify("4+6", p) == Verdict(False, False)
    assert t.verify("", p) == Verdict(False, False)


def test_countdown_verdicts():
    t = task("countdown")
    p = Problem("3,5,7=22:", "3*5+7", {"nums": [3, 5, 7], "target": 22})
    assert t.verify("7+5*3", p) == Verdict(True, True)  # any correct equation, not only the reference
    assert t.verify("(3+5)*7", p) == Verdict(False, True)  # well-formed, wrong value
    assert t.verify("3*5+7+3", p) == Verdict(False, True)  # right numbers used twice: wrong
    assert t.verify("15+7", p) == Verdict(False, True)  # wrong numbers
    assert t.verify("3*5+", p) == Verdict(False, False)
    assert t.verify("7/0+3+5", p) == Verdict(False, False)


def test_tinyzero_and_binary_rewards():
    t = task("addition")
    probs = [Problem("1+1=", "2")] * 3
    r, parts = score(t, OmegaConf.structured(RewardConfig(name="tinyzero")), ["2", "3", "x"], probs)
    assert r.tolist() == pytest.approx([1.0, 0.1, 0.0])
    assert parts["correct"].tolist() == [1, 0, 0] and parts["format"].tolist() == [1, 1, 0]
    r, _ = score(t, OmegaConf.structured(RewardConfig(name="binary", format_score=0.0)), ["2", "3", "x"], probs)
    assert r.tolist() == [1.0, 0.0, 0.0]


def test_a_raising_verifier_names_itself_and_the_sample():
    class Broken:
        name = "broken"

        def verify(self, completion, problem):
            raise KeyError("oops")

    with pytest.raises(RewardError, match=r"tinyzero.*broken.*KeyError.*'1\+1='.*'2'"):
        score(Broken(), OmegaConf.structured(RewardConfig(name="tinyzero")), ["2"], [Problem("1+1=", "2")])
