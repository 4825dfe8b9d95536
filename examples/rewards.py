"""Example reward functions for `reward=python` (see examples/README.md), written as for TRL's GRPOTrainer.

gspo calls each function once per rollout batch, by keyword, as TRL does:

    fn(prompts=..., completions=..., completion_ids=..., trainer_state=..., answer=..., ...) -> list[float | None]

Every argument is a list with one value per completion. The example data is in chat format, so
`completions[i]` is `[{"role": "assistant", "content": "<what the model wrote>"}]` (a plain-text prompt
gives a plain string), and `answer[i]` is that row's `answer` column. Name what you use and take
`**kwargs` for the rest. Return None for a completion a function has no opinion on.
"""

import re

FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")  # the last line: "#### 42"


def _final_number(text: str):
    m = FINAL.search(text.strip())
    return float(m.group(1).replace(",", "")) if m else None


def accuracy(completions, answer, **kwargs):
    """1.0 when the completion's final '#### N' equals the reference answer's, else 0.0."""
    contents = [completion[0]["content"] for completion in completions]
    out = []
    for content, reference in zip(contents, answer):
        got, want = _final_number(content), _final_number(reference)
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


def formatted(completions, **kwargs):
    """1.0 when the completion ends with a '#### N' line, else 0.0 (logged as reward/formatted/mean)."""
    return [1.0 if _final_number(completion[0]["content"]) is not None else 0.0 for completion in completions]
