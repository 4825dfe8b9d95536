"""Tasks: held-out splits never leak, verifiers accept references, rewards follow TinyZero."""

import json
import os
import random
import statistics
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from gspo.config.schema import RewardConfig, TaskConfig
from gspo.tasks import Problem, Verdict, build_task, canonical, is_heldout
from gspo.tasks.reasoning import final_answer, scratchpad_sum
from gspo.tasks.rewards import RewardError, score

GENERATED = ["addition", "countdown", "long_addition", "chain"]
PRESETS = {"long_addition": {"digits": 4}, "chain": {"num_operands": 7}}  # as in conf/task/*.yaml


def task(name, **kw):
    return build_task(OmegaConf.structured(TaskConfig(name=name, **{**PRESETS.get(name, {}), **kw})))


@pytest.mark.parametrize("name", GENERATED)
def test_train_never_samples_a_heldout_problem_or_an_equivalent(name):
    t = task(name)
    heldout = {t.canonical(p) for p in t.eval_set(200)}
    assert len(heldout) == 200  # each held-out problem once, whatever way it is written
    train = t.sample_train(random.Random(0), 20000)
    assert not heldout & {t.canonical(p) for p in train}
    assert all(not is_heldout(t.canonical(p), t.eval_fraction) for p in train)


@pytest.mark.parametrize("name", ["addition", "long_addition"])
def test_the_twin_of_a_heldout_sum_is_never_trained_on(name):
    # the leak this split fixes: 187 of 200 held-out `a+b=` had their `b+a=` in training
    t = task(name)
    twins = {"+".join(reversed(p.prompt.rstrip("=").split("+"))) + "=" for p in t.eval_set(200)}
    train = {p.prompt for p in t.sample_train(random.Random(0), 20000)}
    assert not twins & train


def test_canonical_forms_by_hand():
    add, cd, la, ch = (task(n) for n in GENERATED)
    assert add.canonical(Problem("34+12=", "46")) == add.canonical(Problem("12+34=", "46")) == "12+34"
    assert cd.canonical(Problem("3,5,7=22:", "")) == "3,5,7=22:"
    assert la.canonical(Problem("0397+0482=", "")) == la.canonical(Problem("0482+0397=", "")) == "397+482"
    assert ch.canonical(Problem("7+5-3+8=", "")) == ch.canonical(Problem("8+7-3+5=", "")) == "+5,+7,+8,-3"
    assert ch.canonical(Problem("7+5-3+8=", "")) != ch.canonical(Problem("7-5+3+8=", ""))
    # a task without its own canonical form is keyed by its prompt
    assert canonical(object(), Problem("p", "a")) == "p"


@pytest.mark.parametrize("name", GENERATED)
def test_reference_answers_verify(name):
    t = task(name)
    for p in t.sample_train(random.Random(1), 300) + t.eval_set(50):
        assert t.verify(p.answer, p) == Verdict(True, True), p


_EVAL_SET = "from gspo.tasks import build_task; from omegaconf import OmegaConf; import json, random\n" \
    "out = {}\n" \
    "for n, kw in {'addition': {}, 'countdown': {}, 'long_addition': {'digits': 4}, 'chain': {'num_operands': 7}}.items():\n" \
    "    t = build_task(OmegaConf.create({'name': n, 'eval_fraction': 0.1, 'digits': 2, 'num_operands': 3, 'max_operand': 9, **kw}))\n" \
    "    out[n] = [p.prompt for p in t.eval_set(50) + t.sample_train(random.Random(3), 20)]\n" \
    "print(json.dumps(out))"


def test_eval_set_is_the_same_for_every_run_and_process():
    assert task("addition").eval_set(20) == task("addition").eval_set(20)
    # and in other processes, whatever Python's string-hash seed: nothing in a split may depend on it
    outs = [subprocess.run([sys.executable, "-c", _EVAL_SET], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1]
    here = json.loads(outs[0])
    assert here["chain"][:50] == [p.prompt for p in task("chain").eval_set(50)]
    assert here["addition"][:3] == [p.prompt for p in task("addition").eval_set(3)]


def test_scratchpad_sum_by_hand():
    assert scratchpad_sum(482, 397, 4) == "2+7+0=9,8+9+0=17,4+3+1=8,0+0+0=0#879"
    assert scratchpad_sum(9999, 1, 4) == "9+1+0=10,9+0+1=10,9+0+1=10,9+0+1=10#10000"
    assert task("long_addition").sample_train(random.Random(0), 1)[0].prompt.count("+") == 1


def test_chain_reference_by_hand():
    t = task("chain", num_operands=4)
    p = t.sample_train(random.Random(5), 1)[0]
    terms = [int(x) for x in p.prompt.rstrip("=").replace("-", "+-").split("+")]
    steps, answer = p.answer.split("#")
    assert int(answer) == sum(terms) and len(steps.split(",")) == 3
    assert all(v >= 0 for v in (int(s.split("=")[1]) for s in steps.split(",")))  # never below 0


def test_final_answer_parsing():
    assert final_answer("anything at all#879", 5) == 879
    assert final_answer(" 2+7=9#0 ", 5) == 0
    assert final_answer("#879", 5) == 879  # the derivation is free, even empty
    for bad in ("879", "1#2#879", "x#", "x#-879", "x#0879", "x#87 9", "x#+879", "x#123456"):
        assert final_answer(bad, 5) is None, bad


def test_long_task_verdicts_judge_the_final_answer_only():
    la, ch = task("long_addition"), task("chain")
    p = Problem("0482+0397=", scratchpad_sum(482, 397, 4))
    assert la.verify(p.answer, p) == Verdict(True, True)
    assert la.verify("wrong scratch work#879", p) == Verdict(True, True)
    assert la.verify("2+7+0=9,8+9+0=17,4+3+1=8,0+0+0=0#878", p) == Verdict(False, True)
    assert la.verify("2+7+0=9,8+9+0=17,4+3+1=8,0+0+0=0", p) == Verdict(False, False)  # no final answer
    assert la.verify("2+7+0=9#879#879", p) == Verdict(False, False)
    q = Problem("7+5-3+8=", "7+5=12,12-3=9,9+8=17#17")
    assert ch.verify(q.answer, q) == Verdict(True, True)
    assert ch.verify("#17", q) == Verdict(True, True)
    assert ch.verify("7+5=12#18", q) == Verdict(False, True)


@pytest.mark.parametrize("name", ["long_addition", "chain"])
def test_reasoning_tasks_are_long(name):
    # the references the warm start imitates: >= 32 tokens with EOS on median (one token per character)
    t = task(name)
    lengths = [len(p.answer) + 1 for p in t.sample_train(random.Random(0), 2000)]
    assert statistics.median(lengths) >= 32
    assert set("".join(p.prompt + p.answer for p in t.eval_set(50))) <= set(t.alphabet)


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


def test_the_addition_verifier_takes_ascii_digits_only():
    """'²' is a digit to str.isdigit() (int() then raised) and full-width '４' was read as 4."""
    from omegaconf import OmegaConf

    from gspo.config.schema import TaskConfig
    from gspo.tasks import Problem, Verdict, build_task

    t = build_task(OmegaConf.structured(TaskConfig(name="addition")))
    p = Problem("40+2=", "42")
    assert t.verify("42", p) == Verdict(True, True)
    assert t.verify("４２", p) == Verdict(False, False)
    assert t.verify("4²", p) == Verdict(False, False)
