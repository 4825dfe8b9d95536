"""Word problems in natural language, GSM8K-style, for pretrained chat models (`task=word_problems`).

No GSM8K or MATH data ships in a package these machines can install, so the problems are generated: one to
three arithmetic steps on small numbers, stated in many phrasings with varying names and objects, asked as
chat messages. A 135 M instruct model (SmolLM2, `model=smollm2`) solves some of them and not others: the
task's knob is `task.max_steps`, and one-step problems are drawn most often.

**Answers are read from free text as a number** (`read_answer`): the last `\\boxed{...}`; else the sentence
after the last "answer is" / "answer:" / "####"; of that, the number it states: its first number, or the result of
an equation that follows it ("The answer is 13 apples, because she had 21 and gave away 8." reads 13, "The answer
is 21 - 8 = 13." reads 13); with neither, the reply's last number. A number reads as what it says: `$1,200` is
1200, `12.0` is 12, `1/2` is one half. Correct = that number equals the reference. Well-formed = a box or a marker
states a number (`\\boxed{}`, `\\boxed{?}` and "The answer is unknown." are not), which the TinyZero reward
(`reward=tinyzero`) pays 0.1 for: a nudge towards stating it, never worth as much as being right.

**The held-out split** is by the problem's *arithmetic* (`canonical` = `arithmetic_key`: sums and products with
their operands sorted at every level), not its wording or its operands' order: a held-out problem has no twin in
training with other names, objects, phrasing, or `12 + 3` for `3 + 12`. The held-out set draws each kind as
training does while the kind's held-out part has room; the spaces are small, so at `task.max_steps=1` with the
default `task.eval_fraction=0.25` it is the whole held-out part, 154 problems (88 `x-y`, 32 `x+y`, 23 `x/y`,
11 `x*y`), while training draws each kind a quarter of the time.
"""

from __future__ import annotations

import ast
import copy
import math
import random
import re
import string
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Optional

from gspo.tasks.arithmetic import EVAL_SEED, _HeldOutSplit
from gspo.tasks.base import Problem, Verdict, is_heldout, register_task

NAMES = ("Tom", "Anna", "Sam", "Lena", "Omar", "Mia", "Ravi", "Sofia", "Ben", "Yuki", "Carlos", "Emma", "Noah",
         "Zara", "Liam", "Ava", "Ivan", "Nora", "Leo", "Maya", "Jack", "Aisha", "Hugo", "Ines")
OBJECTS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "balloons",
           "oranges", "toy cars", "beads", "eggs", "flowers", "coins", "crayons", "candies")
ITEMS = ("notebook", "pen", "ticket", "sandwich", "toy", "plant", "mug", "kite")


@dataclass(frozen=True)
class Kind:
    """One structure of problem: its operation (the canonical key's prefix), its number of arithmetic steps, how
    its operands are drawn, the answer, and the phrasings it is asked in."""

    op: str
    steps: int
    draw: Callable[[random.Random], tuple[int, ...]]
    answer: Callable[..., int]
    phrasings: tuple[str, ...]


def _r(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, hi)


KINDS = (
    Kind("x+y", 1, lambda g: (_r(g, 2, 20), _r(g, 2, 12)), lambda x, y: x + y, (
        "{A} has {x} {o}. {A} gets {y} more. How many {o} does {A} have now?",
        "{A} has {x} {o} and {B} has {y} {o}. How many {o} do they have together?",
        "{A} has {x} {o}. {B} has {y} more {o} than {A}. How many {o} does {B} have?",
        "There are {x} {o} in a basket and {y} {o} on the table. How many {o} are there in all?")),
    Kind("x-y", 1, lambda g: (lambda x: (x, _r(g, 1, x - 1)))(_r(g, 5, 25)), lambda x, y: x - y, (
        "{A} had {x} {o} and gave {y} of them to {B}. How many {o} does {A} have left?",
        "{A} has {x} {o}. {A} loses {y} of them. How many {o} does {A} have now?",
        "There were {x} {o} in a box. {A} took {y} of them. How many {o} are left in the box?")),
    Kind("x*y", 1, lambda g: (_r(g, 2, 9), _r(g, 2, 12)), lambda x, y: x * y, (
        "{A} buys {x} boxes of {o}. Each box holds {y} {o}. How many {o} does {A} buy?",
        "There are {x} bags with {y} {o} in each bag. How many {o} are there in total?",
        "A {i} costs ${y}. How many dollars do {x} {i}s cost?")),
    Kind("x/y", 1, lambda g: (lambda q, y: (q * y, y))(_r(g, 2, 10), _r(g, 2, 9)), lambda x, y: x // y, (
        "{A} shares {x} {o} equally among {y} friends. How many {o} does each friend get?",
        "{A} puts {x} {o} into bags of {y}. How many bags does {A} fill?")),
    Kind("x+y-z", 2, lambda g: (lambda x, y: (x, y, _r(g, 1, x)))(_r(g, 3, 12), _r(g, 2, 8)), lambda x, y, z: x + y - z, (
        "{A} has {x} {o}. {A} buys {y} more and then gives {z} to {B}. How many {o} does {A} have now?",
        "There are {x} {o} on a shelf. {A} adds {y} more, and then {B} takes {z}. How many {o} are on the shelf now?")),
    Kind("x*y-z", 2, lambda g: (lambda x, y: (x, y, _r(g, 1, x * y - 1)))(_r(g, 2, 5), _r(g, 2, 6)),
         lambda x, y, z: x * y - z, (
        "{A} buys {x} packs of {o} with {y} {o} in each pack. {A} gives away {z} of them. How many {o} are left?",)),
    Kind("z+x*y", 2, lambda g: (_r(g, 2, 4), _r(g, 2, 5), _r(g, 2, 12)), lambda x, y, z: z + x * y, (
        "{A} has {z} {o}. {A} buys {x} bags with {y} {o} in each bag. How many {o} does {A} have now?",)),
    Kind("x+2x", 2, lambda g: (_r(g, 2, 50),), lambda x: 3 * x, (
        "{A} has {x} {o}. {B} has twice as many {o} as {A}. How many {o} do they have together?",)),
    Kind("x*y*z", 2, lambda g: (_r(g, 2, 9), _r(g, 2, 5), _r(g, 2, 4)), lambda x, y, z: x * y * z, (
        "{A} earns ${x} per hour and works {y} hours a day. How many dollars does {A} earn in {z} days?",)),
    Kind("x+y*z-w", 3, lambda g: (lambda x, y, z: (x, y, z, _r(g, 1, x)))(_r(g, 2, 10), _r(g, 2, 3), _r(g, 2, 4)),
         lambda x, y, z, w: x + y * z - w, (
        "{A} has {x} {o}. {A} buys {y} bags with {z} {o} in each bag, then gives {w} {o} to {B}. "
        "How many {o} does {A} have now?",)),
    Kind("x-y*z+w", 3, lambda g: (lambda y, z: (_r(g, y * z + 1, 30), y, z, _r(g, 2, 9)))(_r(g, 2, 4), _r(g, 2, 5)),
         lambda x, y, z, w: x - y * z + w, (
        "{A} has ${x}. {A} buys {y} {i}s for ${z} each and then earns ${w}. How many dollars does {A} have now?",)),
)
STEP_WEIGHTS = {1: 0.5, 2: 0.35, 3: 0.15}  # most problems one step: the 135 M model solves some of those
_EVAL_SETS: dict[tuple, list[Problem]] = {}  # WordProblems.eval_set, by setting

# a number as written in a reply: 1,200 (thousands grouped by commas), 12.5, 1/2, with a sign or a currency sign
_NUMBER = re.compile(r"(?<![\w.])(-?)\$?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:/(\d+))?(?!\d)")
_MARKER = re.compile(r"answer\s*(?:is|:)|####", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
# after a stated number: more operators and operands, then "=" (an equation whose result is the answer)
_EQUATION = re.compile(r"(?:\s*[-+*/x×÷]\s*\$?\d[\d,]*(?:\.\d+)?)*\s*=\s*(?:-?\$?\d{1,3}(?:,\d{3})+|-?\$?\d+)(?:\.\d+)?(?:/\d+)?")


def arithmetic_key(op: str, numbers: tuple[int, ...]) -> str:
    """A canonical form of the arithmetic `op` states on `numbers` (`"z+x*y"`, (2, 3, 5) -> `"(5+(2*3))"`): sums and
    products flattened and their operands sorted at every level, so `3+12` and `12+3`, or `5+2*3` and `3*2+5`, are
    one key, and the held-out split never puts one order in training and another in the held-out set. Differences
    keep their subtrahends apart (`x+y-z` is `(x+y-z)` with the terms added and the terms taken away each sorted);
    division is not reordered."""
    names = dict(zip("xyzw", numbers))
    expr = re.sub(r"(\d)([a-z])", r"\1*\2", op)  # "2x" -> "2*x"
    return _canon(ast.parse(re.sub(r"[a-z]", lambda m: str(names[m.group()]), expr), mode="eval").body)


def _canon(node: ast.expr) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        plus, minus = [], []
        _terms(node, True, plus, minus)
        return "(" + "+".join(sorted(plus)) + "".join("-" + t for t in sorted(minus)) + ")"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        factors: list[str] = []
        _factors(node, factors)
        return "(" + "*".join(sorted(factors)) + ")"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return f"({_canon(node.left)}/{_canon(node.right)})"
    raise ValueError(f"not an arithmetic expression of + - * /: {ast.dump(node)}")


def _terms(node: ast.expr, positive: bool, plus: list[str], minus: list[str]) -> None:
    """The signed terms of a sum (a - (b - c) = a - b + c)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        _terms(node.left, positive, plus, minus)
        _terms(node.right, positive == isinstance(node.op, ast.Add), plus, minus)
    else:
        (plus if positive else minus).append(_canon(node))


def _factors(node: ast.expr, out: list[str]) -> None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        _factors(node.left, out)
        _factors(node.right, out)
    else:
        out.append(_canon(node))


def _numbers(text: str) -> list[Fraction]:
    out = []
    for sign, whole, frac, denom in _NUMBER.findall(text):
        value = Fraction(int(whole.replace(",", "")))
        if frac:
            value += Fraction(int(frac), 10 ** len(frac))
        if denom and int(denom):
            value /= int(denom)
        out.append(-value if sign else value)
    return out


def _stated(text: str) -> Optional[Fraction]:
    """The number `text` states as its answer: its first number, or, where an equation follows that number
    ("21 - 8 = 13", "5 x 3 = 15 = 15"), the equation's result. None: no number."""
    first = _NUMBER.search(text)
    if first is None:
        return None
    end = first.end()
    while True:  # past the operators and operands up to "=", then to the number after it
        eq = _EQUATION.match(text, end)
        if eq is None:
            break
        end = eq.end()
    return _numbers(text[first.start():end])[-1]


def read_answer(text: str) -> tuple[Optional[Fraction], bool]:
    """The number a reply gives as its answer, and whether it states one where a format says (a box or a marker).

    The last `\\boxed{...}`; else the sentence after the last "answer is", "answer:" or "####"; of either, the number
    it states (`_stated`: the first, or the result of an equation that follows it: "The answer is 13 apples,
    because she had 21 and gave away 8." gives 13, "The answer is 54 + 27 = 81." gives 81). A box or a marker
    with no number after it (`\\boxed{}`, "The answer is unknown.") states nothing: then the reply's last number,
    not stated (explicit False). None: no number at all.
    """
    boxed = _BOXED.findall(text)
    value = _stated(boxed[-1]) if boxed else None
    if value is not None:
        return value, True
    markers = list(_MARKER.finditer(text))
    if markers:
        # the marker's sentence: up to a line break, or a full stop that ends a sentence (not 12.5's)
        value = _stated(re.split(r"\n|\.(?=\s|$)", text[markers[-1].end():], maxsplit=1)[0])
        if value is not None:
            return value, True
    found = _numbers(text)
    return (found[-1] if found else None), False


@register_task("word_problems")
class WordProblems(_HeldOutSplit):
    """GSM-style word problems of one to `task.max_steps` arithmetic steps, asked as chat messages (a system
    message `task.system_prompt`, then the problem as the user's), answered in free text."""

    name = "word_problems"
    alphabet = string.printable
    prompts = "chat"  # natural-language prompts for a pretrained chat model (gspo/train/preflight.py)

    def __init__(self, cfg) -> None:
        self.eval_fraction = float(cfg.eval_fraction)
        self.system = cfg.get("system_prompt")
        self.kinds = [k for k in KINDS if k.steps <= int(cfg.get("max_steps", 3))]
        self.weights = [STEP_WEIGHTS[k.steps] / sum(1 for j in self.kinds if j.steps == k.steps) for k in self.kinds]

    def _draw(self, rng: random.Random) -> Problem:
        kind = rng.choices(self.kinds, weights=self.weights)[0]
        numbers = kind.draw(rng)
        names = rng.sample(NAMES, 2)
        values = dict(zip("xyzw", numbers), A=names[0], B=names[1], o=rng.choice(OBJECTS), i=rng.choice(ITEMS))
        question = rng.choice(kind.phrasings).format(**values)
        prompt = ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": question}]
        return Problem(prompt, str(kind.answer(*numbers)), meta={"op": kind.op, "numbers": numbers,
                                                                 "steps": kind.steps})

    def eval_set(self, n: int) -> list[Problem]:
        """`n` distinct held-out problems, each kind drawn as often as training draws it (as far as its held-out
        part has room): plain rejection sampling would fill the set with the kinds of many distinct problems.
        Drawn once per process and setting (where the split holds fewer than `n`, all 400 n draws are made: ~3 s);
        each call gets its own copy."""
        key = (self.eval_fraction, self.system, tuple(k.op for k in self.kinds), n)
        if key not in _EVAL_SETS:
            _EVAL_SETS[key] = self._draw_eval_set(n)
        return copy.deepcopy(_EVAL_SETS[key])

    def _draw_eval_set(self, n: int) -> list[Problem]:
        quota = {k.op: math.ceil(n * w) for k, w in zip(self.kinds, self.weights)}
        rng, out, seen = random.Random(EVAL_SEED), [], set()
        for attempt in range(400 * n):
            p = self._draw(rng)
            key = self.canonical(p)
            full = quota[p.meta["op"]] <= 0 and attempt < 200 * n  # past half the draws: any kind fills the rest
            if key in seen or full or not is_heldout(key, self.eval_fraction):
                continue
            seen.add(key)
            quota[p.meta["op"]] -= 1
            out.append(p)
            if len(out) == n:
                break
        return out

    def canonical(self, problem: Problem) -> str:
        """The problem's arithmetic in a canonical form (`arithmetic_key`): every wording of one problem, and every
        order of the operands of a sum or a product, is one key."""
        return arithmetic_key(problem.meta["op"], problem.meta["numbers"])

    def verify(self, completion: str, problem: Problem) -> Verdict:
        value, explicit = read_answer(completion)
        return Verdict(correct=value is not None and value == int(problem.answer), well_formed=explicit)
