"""Synthetic arithmetic tasks: addition and Countdown (TinyZero rules).

Both are small enough for a character-level model built from config to learn on
a laptop CPU, and both have exact verifiers, so rewards are noise-free.
"""

from __future__ import annotations

import ast
import random
from fractions import Fraction

from gspo.tasks.base import Problem, Verdict, is_heldout, register_task

DIGITS = "0123456789"
EVAL_SEED = 12345  # the held-out set is the same for every run


class _HeldOutSplit:
    """Rejection-samples problems from the training or the held-out part of the space.

    Membership is decided on `canonical(problem)`, so two prompts that state the same problem
    (`12+34=`, `34+12=`) are always on the same side, and the eval set holds each problem once.
    """

    eval_fraction: float

    def _draw(self, rng: random.Random) -> Problem:  # pragma: no cover - interface
        raise NotImplementedError

    def canonical(self, problem: Problem) -> str:
        return problem.prompt

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        out: list[Problem] = []
        while len(out) < n:
            p = self._draw(rng)
            if not is_heldout(self.canonical(p), self.eval_fraction):
                out.append(p)
        return out

    def eval_set(self, n: int) -> list[Problem]:
        rng, out, seen = random.Random(EVAL_SEED), [], set()
        for _ in range(200 * n):
            p = self._draw(rng)
            key = self.canonical(p)
            if key not in seen and is_heldout(key, self.eval_fraction):
                seen.add(key)
                out.append(p)
                if len(out) == n:
                    break
        return out


@register_task("addition")
class Addition(_HeldOutSplit):
    """`a+b=` -> the decimal sum. Operands have up to `digits` digits."""

    name = "addition"
    alphabet = DIGITS + "+="

    def __init__(self, cfg) -> None:
        self.digits = int(cfg.digits)
        self.eval_fraction = float(cfg.eval_fraction)

    def _draw(self, rng: random.Random) -> Problem:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Problem(f"{a}+{b}=", str(a + b))

    def canonical(self, problem: Problem) -> str:
        """a+b and b+a are one problem: the operands as numbers, sorted."""
        a, b = sorted(int(x) for x in problem.prompt.rstrip("=").split("+"))
        return f"{a}+{b}"

    def verify(self, completion: str, problem: Problem) -> Verdict:
        text = completion.strip()
        # ASCII digits only: str.isdigit() also takes '²' (then int() raises) and full-width '４２' (int() reads 42)
        well_formed = text.isascii() and text.isdigit() and len(text) <= self.digits + 1
        return Verdict(correct=well_formed and int(text) == int(problem.answer), well_formed=well_formed)


_OPS = "+-*/"


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of an arithmetic expression tree (+, -, *, / on integers)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ZeroDivisionError
            return a / b
    raise ValueError("not an arithmetic expression")


def _numbers(node: ast.AST) -> list[int]:
    return sorted(n.value for n in ast.walk(node) if isinstance(n, ast.Constant))


@register_task("countdown")
class Countdown(_HeldOutSplit):
    """`3,5,7=22:` -> an expression using each number exactly once that equals the target.

    TinyZero's rules (Pan et al., 2025): a correct equation scores 1, a well-formed
    equation that is wrong (wrong value or wrong numbers) scores the format score.
    """

    name = "countdown"
    alphabet = DIGITS + _OPS + "()=,:"

    def __init__(self, cfg) -> None:
        self.num_operands = int(cfg.num_operands)
        self.max_operand = int(cfg.max_operand)
        self.eval_fraction = float(cfg.eval_fraction)

    def _draw(self, rng: random.Random) -> Problem:
        while True:
            nums = [rng.randint(1, self.max_operand) for _ in range(self.num_operands)]
            expr = str(nums[0])
            for n in nums[1:]:
                op = rng.choice(_OPS)
                # Parenthesise the running expression so the reference is read left to right.
                expr = f"({expr}){op}{n}" if op in "*/" and any(c in expr for c in "+-") else f"{expr}{op}{n}"
            try:
                value = _evaluate(ast.parse(expr, mode="eval").body)
            except ZeroDivisionError:
                continue
            if value.denominator == 1 and 0 <= value <= 99:
                prompt = ",".join(map(str, sorted(nums))) + f"={int(value)}:"
                return Problem(prompt, expr, {"nums": sorted(nums), "target": int(value)})

    def canonical(self, problem: Problem) -> str:
        """One problem per number multiset and target, whatever order the numbers are written in
        (the prompt's own form, which lists them sorted)."""
        nums, target = problem.prompt.rstrip(":").split("=")
        return ",".join(map(str, sorted(int(n) for n in nums.split(",")))) + f"={int(target)}:"

    def verify(self, completion: str, problem: Problem) -> Verdict:
        text = completion.strip()
        if not text or any(c not in DIGITS + _OPS + "()" for c in text):
            return Verdict(False, False)
        try:
            tree = ast.parse(text, mode="eval").body
            value = _evaluate(tree)
        except (SyntaxError, ValueError, ZeroDivisionError):
            return Verdict(False, False)
        correct = _numbers(tree) == problem.meta["nums"] and value == problem.meta["target"]
        return Verdict(correct=correct, well_formed=True)

