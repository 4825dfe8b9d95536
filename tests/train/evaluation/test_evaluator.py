"""The evaluator decides its own timing: when the loop's `maybe_run` acts."""

from __future__ import annotations

from gspo.config.loading import compose
from gspo.train.evaluation.evaluator import Evaluator
from gspo.train.ranks.distributed import Dist


def test_evaluates_the_base_every_eval_every_steps_and_the_last():
    ev = Evaluator(compose(["train.steps=7", "eval.every=3"]), Dist(), None, None, None, [])
    assert [s for s in range(8) if ev.due(s)] == [0, 3, 6, 7]
    ev = Evaluator(compose(["train.steps=7", "eval.every=0"]), Dist(), None, None, None, [])
    assert [s for s in range(8) if ev.due(s)] == [0, 7] and ev.maybe_run(3) == {}
