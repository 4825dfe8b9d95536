"""Reasoning-length tasks: a written derivation, then the final answer after `#`.

The GSPO-vs-GRPO question is about long completions: with 3 tokens a sequence ratio and
its token ratios barely differ. These tasks make the model write 30-50 characters (one
token each with the character tokenizer) before its answer, and score the answer alone:

    long_addition   0482+0397=  ->  2+7+0=9,8+9+0=17,4+3+1=8,0+0+0=0#879
    chain           7+5-3+8=    ->  7+5=12,12-3=9,9+8=17#17

The derivation is free text: the verifier reads only what follows the single `#` (an
integer, nothing else), so a model may reason differently from the reference, or not
at all. The reference traces are the warm start's targets (`Problem.answer`).
"""

from __future__ import annotations

import random
import re

from gspo.tasks.arithmetic import DIGITS, Addition, _HeldOutSplit
from gspo.tasks.base import Problem, Verdict, register_task

MARK = "#"  # separates the derivation from the final answer
_INT = re.compile(r"(0|[1-9][0-9]*)")  # a non-negative integer as the references write it


def final_answer(completion: str, max_digits: int) -> int | None:
    """The integer after the completion's one `#`, or None if the completion is malformed.

    Malformed: no `#` or more than one, nothing after it, anything but a plain
    non-negative integer after it (signs, spaces, leading zeros, other characters), or
    more than `max_digits` digits.
    """
    text = completion.strip()
    if text.count(MARK) != 1:
        return None
    answer = text.split(MARK)[1]
    if len(answer) > max_digits or not _INT.fullmatch(answer):
        return None
    return int(answer)


def _verdict(completion: str, expected: int) -> Verdict:
    got = final_answer(completion, max_digits=len(str(expected)) + 2)
    return Verdict(correct=got == expected, well_formed=got is not None)


@register_task("long_addition")
class LongAddition(Addition):
    """`0482+0397=` -> a per-digit scratchpad, right to left, then `#` and the sum.

    Each operand is written with exactly `digits` digits (leading zeros), so the i-th
    column sits at the same prompt position in every problem; each scratchpad step is
    `a+b+carry=s`. With 4 digits the reference is 34-39 characters. The operands, and so
    the held-out split (a+b and b+a are one problem), are `addition`'s.
    """

    name = "long_addition"
    alphabet = DIGITS + "+=,#"

    def _draw(self, rng: random.Random) -> Problem:
        a, b = _operands(super()._draw(rng))
        return Problem(f"{a:0{self.digits}d}+{b:0{self.digits}d}=", scratchpad_sum(a, b, self.digits))

    def verify(self, completion: str, problem: Problem) -> Verdict:
        return _verdict(completion, sum(_operands(problem)))


def _operands(problem: Problem) -> tuple[int, int]:
    a, b = (int(x) for x in problem.prompt.rstrip("=").split("+"))
    return a, b


def scratchpad_sum(a: int, b: int, digits: int) -> str:
    """The reference trace of a + b: one `x+y+carry=s` step per column, least significant first."""
    steps, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return ",".join(steps) + MARK + str(a + b)


@register_task("chain")
class Chain(_HeldOutSplit):
    """`7+5-3+8=` -> the running value written step by step, left to right, then `#` and the result.

    `num_operands` numbers from 0..`max_operand` (the first from 1), joined by + and -;
    a `-` never takes the running value below 0. Each step is `value op n=new`. With 7
    operands (conf/task/chain.yaml) the reference is 37-49 characters, 41 on median.
    """

    name = "chain"
    alphabet = DIGITS + "+-=,#"

    def __init__(self, cfg) -> None:
        self.num_operands = int(cfg.num_operands)
        self.max_operand = int(cfg.max_operand)
        self.eval_fraction = float(cfg.eval_fraction)

    def _draw(self, rng: random.Random) -> Problem:
        value = rng.randint(1, self.max_operand)
        prompt, steps = str(value), []
        for _ in range(self.num_operands - 1):
            op = rng.choice("+-")
            n = rng.randint(0, self.max_operand if op == "+" else min(self.max_operand, value))
            new = value + n if op == "+" else value - n
            steps.append(f"{value}{op}{n}={new}")
            prompt += f"{op}{n}"
            value = new
        return Problem(prompt + "=", ",".join(steps) + MARK + str(value))

    @staticmethod
    def _terms(prompt: str) -> list[tuple[str, int]]:
        return [(sign or "+", int(n)) for sign, n in re.findall(r"([+-]?)(\d+)", prompt.rstrip("="))]

    def canonical(self, problem: Problem) -> str:
        """One problem per multiset of signed terms: reordering them does not change the result."""
        return ",".join(f"{s}{n}" for s, n in sorted(self._terms(problem.prompt)))

    def verify(self, completion: str, problem: Problem) -> Verdict:
        value = sum(n if s == "+" else -n for s, n in self._terms(problem.prompt))
        return _verdict(completion, value)
