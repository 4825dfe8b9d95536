"""Example reward functions for `reward=python` (see examples/README.md).

gspo calls each function once per rollout batch:

    fn(prompts, completions, **row_fields) -> list[float]   # one float per completion

`prompts[i]` is row i's prompt as your file holds it (here: a list of chat messages), `completions[i]`
the text the model wrote, and `row_fields` holds the other columns of your file as lists, e.g.
`answer[i]`. Name only the columns you need (as below), or take `**kwargs` to get them all.
"""

import re

FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")  # the last line: "#### 42"


def _final_number(text: str):
    m = FINAL.search(text.strip())
    return float(m.group(1).replace(",", "")) if m else None


def accuracy(prompts, completions, answer, **kwargs):
    """1.0 when the completion's final '#### N' equals the reference answer's, else 0.0."""
    out = []
    for completion, reference in zip(completions, answer):
        got, want = _final_number(completion), _final_number(reference)
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def formatted(prompts, completions, **kwargs):
    """1.0 when the completion ends with a '#### N' line, else 0.0 (logged as reward/formatted/mean)."""
    return [1.0 if _final_number(c) is not None else 0.0 for c in completions]
