"""task=word_problems: answers read from free text as the numbers they are, a held-out split with no twin in
training under other names or wording, and the task refused on models that cannot read it."""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest
from omegaconf import OmegaConf

from gspo.config.loading import compose
from gspo.config.schema import CONF_DIR
from gspo.core.errors import ConfigError
from gspo.tasks import Problem, Verdict, build_task, is_heldout
from gspo.tasks.word_problems import KINDS, STEP_WEIGHTS, arithmetic_key, read_answer
from gspo.train.preflight import check


@pytest.mark.parametrize("text, value, explicit", [
    ("Tom has 3 + 4 = 7 apples.", 7, False),  # the last number
    ("The answer is 12.", 12, True),
    ("So the total is \\boxed{12}.", 12, True),
    ("He spends $1,200 in all.", 1200, False),
    ("12.0", 12, False),
    ("The answer is 54 + 27 = 81.", 81, True),  # the marker's sentence, its last number
    ("The answer is 12. I hope 3 helps!", 12, True),  # an explicit answer wins over a later number
    ("#### 2\nThe answer is: 3", 3, True),  # the last marker
    ("Each friend gets 1/2 of a cake", Fraction(1, 2), False),
    ("It costs $12.50 in total.", Fraction(25, 2), False),
    ("It went down to -5 degrees", -5, False),
    ("48 - 32 = 16", 16, False),  # a minus between numbers is not a sign
    ("\\boxed{3, 4}", 3, True),  # the first number a box states
    ("no number here", None, False),
    # the number the sentence states, not the last one in it
    ("The answer is 13 apples, because she had 21 and gave away 8.", 13, True),
    ("The answer is 21 - 8 = 13.", 13, True),  # an equation after it: its result
    ("The answer is 5 x 3 = 15 = 15 stickers, since 5 packs", 15, True),
    ("So she has \\boxed{13 apples}, because 21 - 8 = 13 and 2 were lost", 13, True),
    ("\\boxed{21 - 8 = 13} since 2", 13, True),
    # a format with no number in it states nothing: the reply's last number, not explicit
    ("\\boxed{}", None, False),
    ("I get 7, so \\boxed{?}", 7, False),
    ("The answer is unknown.", None, False),
])
def test_answers_are_read_as_the_numbers_they_say(text, value, explicit):
    assert read_answer(text) == ((Fraction(value) if value is not None else None), explicit)


def _task(**over):
    cfg = OmegaConf.merge(OmegaConf.load(CONF_DIR / "task" / "word_problems.yaml"), over)
    return build_task(cfg)


def test_the_verdict():
    task = _task()
    problem = next(p for p in task.sample_train(random.Random(0), 100) if p.answer == "12")
    assert task.verify("The answer is 12.", problem) == Verdict(True, True)
    assert task.verify("I think 12", problem) == Verdict(True, False)  # right, but not stated as the answer
    assert task.verify("The answer is 120.", problem) == Verdict(False, True)
    assert task.verify("1 2", problem) == Verdict(False, False)  # the last number is 2
    assert task.verify("I do not know", problem) == Verdict(False, False)


def test_prompts_are_chat_messages_with_the_system_prompt():
    p = _task().sample_train(random.Random(1), 1)[0]
    assert [m["role"] for m in p.prompt] == ["system", "user"] and "The answer is 7." in p.prompt[0]["content"]
    assert [m["role"] for m in _task(system_prompt=None).sample_train(random.Random(1), 1)[0].prompt] == ["user"]


def test_no_held_out_problem_has_a_twin_in_training():
    """The split is by operation and numbers: every wording (names, objects, phrasing) of a held-out problem is
    held out, so training never sees one in disguise."""
    task = _task()
    heldout = {task.canonical(p) for p in task.eval_set(200)}
    train = task.sample_train(random.Random(0), 5000)
    assert len(heldout) == 200 and not heldout & {task.canonical(p) for p in train}
    assert all(is_heldout(k, task.eval_fraction) for k in heldout)
    # many wordings of one problem, one key
    first = train[0]
    twins = [p for p in train if p.meta["op"] == first.meta["op"] and p.meta["numbers"] == first.meta["numbers"]]
    assert len({p.prompt[-1]["content"] for p in twins}) > 1 and len({task.canonical(p) for p in twins}) == 1
    mine = task.eval_set(200)  # drawn once per process (~3 s): each caller gets a copy of its own
    mine[0].prompt[-1]["content"] = "changed by a caller"
    assert task.eval_set(200) == task._draw_eval_set(200)  # the same for every run and call


# the operand orders of each kind that state the same arithmetic (sums and products commute)
SAME_ARITHMETIC = {"x+y": [(1, 0)], "x*y": [(1, 0)], "x+y-z": [(1, 0, 2)], "x*y-z": [(1, 0, 2)], "z+x*y": [(1, 0, 2)],
                   "x*y*z": [(1, 0, 2), (0, 2, 1), (2, 1, 0), (1, 2, 0), (2, 0, 1)], "x+y*z-w": [(0, 2, 1, 3)],
                   "x-y*z+w": [(0, 2, 1, 3)]}


@pytest.mark.parametrize("max_steps", [1, 3])
def test_no_held_out_problem_has_an_operand_swapped_twin_in_training(max_steps):
    """`3 + 12` held out and `12 + 3` trained would be one problem on both sides: every order of a sum's or a
    product's operands, at every level, is on the held-out problem's side."""
    task = _task(max_steps=max_steps)
    twins = 0
    for p in task.eval_set(200):
        for order in SAME_ARITHMETIC.get(p.meta["op"], []):
            numbers = tuple(p.meta["numbers"][i] for i in order)
            twin = Problem(p.prompt, p.answer, meta={**p.meta, "numbers": numbers})
            twins += 1
            assert is_heldout(task.canonical(twin), task.eval_fraction), (p.meta, numbers)
    assert twins > 30


def test_equal_arithmetic_is_one_key():
    assert arithmetic_key("x+y", (3, 12)) == arithmetic_key("x+y", (12, 3)) == "(12+3)"
    assert arithmetic_key("z+x*y", (2, 3, 5)) == arithmetic_key("z+x*y", (3, 2, 5)) == "((2*3)+5)"
    assert arithmetic_key("x+2x", (5,)) == arithmetic_key("z+x*y", (2, 5, 5))  # 5 + 2*5 either way
    assert arithmetic_key("x-y*z+w", (20, 2, 3, 4)) == "(20+4-(2*3))"
    assert arithmetic_key("x-y", (12, 3)) != arithmetic_key("x-y", (3, 12))  # not reordered: other problems
    assert arithmetic_key("x/y", (12, 3)) != arithmetic_key("x/y", (3, 12))


def test_held_out_and_training_draw_the_kinds_alike():
    """The held-out set is drawn per kind as often as training draws it (within a few problems): the steps' mix
    is the one training sees, not skewed to the kinds with many distinct problems."""
    task = _task()
    steps = Counter(p.meta["steps"] for p in task.eval_set(200))
    for s, w in STEP_WEIGHTS.items():
        assert abs(steps[s] - 200 * w) <= 12, (steps, STEP_WEIGHTS)
    assert {p.meta["steps"] for p in _task(max_steps=1).eval_set(50)} == {1}
    for kind in KINDS:  # every answer a whole number, at least 0
        for _ in range(50):
            numbers = kind.draw(random.Random(_))
            assert kind.answer(*numbers) >= 0


def test_refused_on_the_tiny_models():
    with pytest.raises(ConfigError, match="task=word_problems asks questions in natural language .* model=smollm2"):
        check(compose(["task=word_problems"]))
    with pytest.raises(ConfigError, match="task.max_steps=4: must be 1, 2 or 3"):
        compose(["task=word_problems", "task.max_steps=4"])
