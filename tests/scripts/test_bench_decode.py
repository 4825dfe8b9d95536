"""scripts/bench_decode.py measures what it says: its bare products are the model's own projections, and its timer
counts gspo's decode steps (one per token after the first, on the engine asked for). No timings are checked."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))

import bench_decode as bd  # noqa: E402

from gspo.rollout.decoding import generate as gen  # noqa: E402
from gspo.rollout.decoding.params import SamplingParams  # noqa: E402

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


@pytest.mark.parametrize("kernel", ["float32", *(k for k in bd.KERNELS if k != "fused")])  # fused: float32's
def test_every_kernel_computes_the_same_product_within_its_precision(kernel):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g) / 8
    lacks = {"mkl_packed": (not torch.backends.mkl.is_available(), "MKL"),
             "onednn_packed": (not torch.backends.mkldnn.is_available(), "oneDNN"),
             "int8": ("fbgemm" not in torch.backends.quantized.supported_engines, "fbgemm")}
    if lacks.get(kernel, (False, ""))[0]:
        pytest.skip(f"this torch build has no {lacks[kernel][1]}")
    y, exact = bd.prepared(kernel, x, w)(), x @ w.T
    tol = {"bf16": 2e-2, "int8": 5e-2}.get(kernel, 1e-5)  # relative to the output's scale; float32 kernels 1e-5
    assert (y.float() - exact).abs().max() <= tol * exact.abs().max()
    with pytest.raises(ValueError, match="kernel 'fp8'"):
        bd.prepared("fp8", x, w)


def test_the_fused_products_are_the_separate_ones_side_by_side():
    model, _ = bd.tiny_model("tiny-llama", ALPHABET)
    prods = bd.products(model)
    fused = bd.fused(prods)
    assert len(fused) == 4 * model.config.num_hidden_layers + 1
    assert [n for n, _ in fused[:5]] == [f"layers.0.{p}" for p in ("qkv", "o", "gate_up", "down")] + ["layers.1.qkv"]
    x = torch.randn(3, model.config.hidden_size)
    separate = [torch.nn.functional.linear(x, w) for _, w in prods[:3]]
    assert torch.equal(torch.nn.functional.linear(x, fused[0][1]), torch.cat(separate, dim=1))
    assert sum(w.numel() for _, w in fused) == sum(w.numel() for _, w in prods)
