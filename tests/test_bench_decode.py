"""scripts/bench_decode.py measures what it says: its bare products are the model's own projections, and its timer
counts gspo's decode steps (one per token after the first, on the engine asked for). No timings are checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import bench_decode as bd  # noqa: E402

from gspo.rollout import generate as gen  # noqa: E402
from gspo.rollout.params import SamplingParams  # noqa: E402

ALPHABET = "0123456789+="


@pytest.mark.parametrize("name", sorted(bd.TINY))
def test_the_bare_products_are_every_projection_of_the_model_on_its_own_weights(name):
    model, _ = bd.tiny_model(name, ALPHABET)
    prods = bd.products(model)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]  # q k v o gate up down, ..., head
    assert len(prods) == 7 * model.config.num_hidden_layers + 1 == len(linears)
    assert all(w is own for (_, w), own in zip(prods, linears))  # the tensors themselves, in the engine's order
    assert [n for n, _ in prods[:7]] == [f"layers.0.{p}" for p in ("q", "k", "v", "o", "gate", "up", "down")]
    assert prods[-1][1] is model.get_output_embeddings().weight
    assert bd.step_flops(prods, 32) == 2 * 32 * sum(w.numel() for w in linears)
    bd.BareStep(prods, 32)()  # every input fits its weight


def test_the_timer_counts_one_decode_step_per_token_after_the_first_on_the_engine_asked_for():
    model, tok = bd.tiny_model("tiny-llama", ALPHABET)
    ids = gen.encode_prompts(tok, ["1+2=", "34+5="])
    original = gen._Forward.step
    timer = bd.StepTimer()
    with timer.installed():
        for engine in ("fast", "hf"):
            times = timer.sample(model, tok, ids, 2, SamplingParams(max_new_tokens=5, engine=engine), seed=0)
            assert len(times) == 4 and timer.paths == {engine}  # no EOS to sample: every row runs 5 tokens
    assert gen._Forward.step is original
