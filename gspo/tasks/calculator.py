"""`calculator`: products too long for the tiny models to work out in their head, and a calculator tool.

    347*829  ->  calc(expr="347*829")  ->  287663  ->  287663

The reward is the final answer's (the task's verdict on the last assistant message), so RL must improve both
the calls (call the tool, with the right expression) and the answers (copy its result). Without the tool
(`rollout.tools` unset) a tiny model answers from its head and is almost never right.

The warm start teaches the conversation above on a fifth of the problems and a direct answer (the product, which
a tiny model can only guess) on the rest (`DIRECT_SHARE`): a base that knows the call but answers from its head
when greedy and calls its tool on a minority of its samples, so the share of trajectories that get the product
from the tool (`reward/correct_call/mean`, `eval/correct_call`) has room to rise, as the answers' accuracy has
(docs/results.md, "Tool use"). `calc` is the tool: `rollout.tools=gspo.tasks.calculator:calc`
(`+experiment=tools` sets it).
"""

from __future__ import annotations

import ast
import random

import torch

from gspo.tasks.arithmetic import _evaluate, _HeldOutSplit
from gspo.tasks.base import Problem, Verdict, register_task

DIRECT_SHARE = 0.8  # warm-start references answered without the tool
TOOL = "calc"


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expr: The expression: integers with + - * / and parentheses, e.g. 347*829.
    """
    value = _evaluate(ast.parse(expr.strip(), mode="eval").body)
    return str(value)  # a Fraction: "287663", or "7/3"


@register_task("calculator")
class Calculator(_HeldOutSplit):
    """`a*b` -> the product, both operands of `digits` digits; a*b and b*a are one problem."""

    name = "calculator"
    alphabet = "".join(map(chr, range(32, 127)))  # printable ASCII: the JSON of a call, a tool's error message

    def __init__(self, cfg) -> None:
        self.digits = int(cfg.digits)
        self.eval_fraction = float(cfg.eval_fraction)

    def _draw(self, rng: random.Random) -> Problem:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        return Problem(f"{a}*{b}", str(a * b), {"direct": rng.random() < DIRECT_SHARE})

    def canonical(self, problem: Problem) -> str:
        a, b = sorted(int(x) for x in problem.prompt.split("*"))
        return f"{a}*{b}"

    def verify(self, completion: str, problem: Problem) -> Verdict:
        text = completion.strip()
        well_formed = text.isascii() and text.isdigit() and len(text) <= 2 * self.digits
        return Verdict(correct=well_formed and int(text) == int(problem.answer), well_formed=well_formed)

    def reference_conversation(self, problem: Problem) -> list[dict]:
        """The warm start's target after the prompt: the call, its result, the answer (or the answer alone)."""
        answer = {"role": "assistant", "content": problem.answer}
        if problem.meta.get("direct"):
            return [answer]
        call = {"type": "function", "function": {"name": TOOL, "arguments": {"expr": problem.prompt}}}
        return [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": TOOL, "content": problem.answer}, answer]

    def conversation_parts(self, conversations: list[list[dict]], problems: list[Problem]) -> dict[str, torch.Tensor]:
        """`correct_call`: the trajectory called `calc` and got the product back (whatever it answered after)."""
        return {"correct_call": torch.tensor([
            float(any(m["role"] == "tool" and m.get("name") == TOOL and m["content"] == p.answer for m in conv))
            for conv, p in zip(conversations, problems)])}
