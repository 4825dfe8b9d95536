"""Two reward functions on different scales, for GDPO against GRPO on the default job (docs/results.md).

`correct` is 0/1; `length` counts characters, so its spread within a group (a few characters) is several times
the 0/1 one's, and it pulls against the answer: the default task wants the number alone (`57`), and anything
written after it both lengthens the completion and makes it wrong. GRPO normalises the weighted sum, in which
`length` dominates; GDPO normalises each function within its group before summing (docs/algorithms.md, GDPO).

    gspo train -m algo=grpo,gdpo reward=python "reward.fn=[examples/two_scales.py:correct,examples/two_scales.py:length]"
"""


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def correct(completions, answer, **kwargs):
    """1.0 when the completion is exactly the answer (surrounding spaces aside), else 0.0."""
    return [1.0 if _text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def length(completions, **kwargs):
    """The completion's length in characters."""
    return [float(len(_text(c))) for c in completions]
