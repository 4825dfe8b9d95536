"""Checking a completion's answer against a reference answer, as math (`task=data`).

`check_answer(completion, answer)` reads the final answer of each (after the last `####`, else the whole
text) and compares them with math-verify; a reference it cannot read as math is compared as text. It runs
in gspo/tasks/mathcheck.py's child process, where math-verify's own time limits work and a hang can be killed.
"""

from __future__ import annotations

import functools
import threading

from gspo.tasks.base import Verdict


def final_answer(text: str) -> str:
    """The answer part of a text: what follows the last `####` on its line (GSM8K), else the whole text."""
    if "####" in text:
        text = text.rsplit("####", 1)[1].split("\n", 1)[0]
    return text.strip()


def _parse(text: str) -> list:
    from math_verify import parse

    # math-verify times out with signal.alarm, which only the main thread may use
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return parse(text, parsing_timeout=timeout)


_LATEX_MARKS = ("\\", "^", "_", "{", "}")


def _looks_like_latex(text: str) -> bool:
    """A reference written as bare LaTeX (MATH's `answer` column: `2\\sqrt{3}`, `\\dfrac{3}{4}`, `x^2+1`) or a
    tuple / interval (`(1,2)`), with no `$...$` or `\\boxed{}` to tell math-verify where the math is."""
    t = text.strip()
    if "$" in t or "\\boxed" in t:
        return False
    return any(m in t for m in _LATEX_MARKS) or (t[:1] in "([" and t[-1:] in ")]" and "," in t)


@functools.lru_cache(maxsize=65536)
def _gold(answer: str) -> tuple[list, str]:
    """The reference, parsed: bare LaTeX as LaTeX (math-verify's default extraction reads `2\\sqrt{3}` as 2 and
    gives up on `\\sqrt{2}`), anything else with its default extraction; and the text, for non-math answers."""
    text = final_answer(answer)
    parsed = _parse(f"${text}$") if _looks_like_latex(text) else []
    return parsed or _parse(text), " ".join(text.split()).casefold()


def check_answer(completion: str, answer: str) -> Verdict:
    """Verdict on a completion against a reference answer (math-verify; text equality for non-math answers).

    Well-formed = an answer could be read from the completion.
    """
    from math_verify import verify

    gold, gold_text = _gold(answer)
    text = final_answer(completion)
    if not gold:  # not math: compare as text
        ok = " ".join(text.split()).casefold() == gold_text
        return Verdict(ok, bool(text))
    pred = _parse(text)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return Verdict(bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout)), bool(pred))
