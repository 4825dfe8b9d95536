"""The int8 sampling copy (`rollout.dtype=int8`, gspo/rollout/decoding/quantized.py): its products, which modules it
quantizes, its weight sync, both engines on it, and a run sampled by it."""

from __future__ import annotations

import json

import pytest
import torch

from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.models import moe
from gspo.models.build import build_model, char_tokenizer
from gspo.rollout.decoding import fast_decode
from gspo.rollout.decoding.quantized import Int8Linear, available, quantize
from gspo.rollout.decoding.sampler import Sampler, _plain, old_logprobs_mode, separate
from gspo.train.loop.trainer import train
from gspo.train.preflight import check
from tests.conftest import tiny
from tests.rollout.decoding.test_fast_decode import QWEN2_MOE_SMOL, SMOL, _assert_same, _both, _family, _model

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def test_an_int8_product_is_the_float_product_to_quantization_error():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40)
    q = Int8Linear(linear)
    x = torch.randn(3, 5, 96)
    want = linear(x).detach()
    got = q(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    # per-channel weights and a per-tensor input scale of 7 bits: ~1% of the output's size, not 0
    err = (got - want).norm() / want.norm()
    assert 1e-4 < err < 0.03
    assert torch.equal(q(x), got)  # deterministic
    loud = x.clone()
    loud[0, 0] *= 1000  # one token's massive activations: the other rows keep their own resolution
    rest = (q(loud)[1:] - want[1:]).norm() / want[1:].norm()
    assert rest < 0.03
    q.load(bias=torch.zeros(40))  # the bias alone: the weight kept
    torch.testing.assert_close(q(x), got - linear.bias.detach(), atol=1e-5, rtol=0)
    q.load(weight=2 * linear.weight)
    assert ((q(x) - 2 * (want - linear.bias.detach())).norm() / want.norm()) < 0.06
    assert q(x.to(torch.bfloat16)).dtype == torch.bfloat16  # a caller's dtype comes back


def test_quantize_takes_the_projections_and_head_not_the_routers_and_feeds_a_tied_head_from_its_embedding():
    model = _model("qwen3_moe")
    routers = moe.find_routers(model)
    feeds = quantize(model)
    kinds = {type(m) for m in model.modules()}
    assert torch.nn.Linear not in kinds and Int8Linear in kinds
    assert all(type(r) is not Int8Linear for r in moe.find_routers(model)) and len(routers) == 3
    assert "model.layers.0.self_attn.q_proj.weight" in feeds
    assert any(q is model.lm_head for fed in feeds.values() for q, _ in fed)
    tied = _family("llama", **SMOL)
    feeds = quantize(tied)
    assert isinstance(tied.lm_head, Int8Linear)
    [(head, slot)] = feeds["model.embed_tokens.weight"]  # tied: the embedding's name feeds the head
    assert head is tied.lm_head and slot == "weight"


@pytest.mark.parametrize("name,make", [
    ("llama", lambda: _family("llama", 1, 2.0, **SMOL)),  # SmolLM2 in miniature, tied head
    ("qwen2", lambda: _family("qwen2", 4, 1.5)),  # q/k/v biases
    ("qwen3_moe", lambda: _model("qwen3_moe")),  # float32 routers and experts, int8 attention and head
    ("qwen2_moe", lambda: _family("qwen2_moe", 3, 1.0, **QWEN2_MOE_SMOL)),  # int8 shared experts and their gates too
])
def test_both_engines_sample_the_same_from_an_int8_copy(name, make):
    model = _plain(make())
    quantize(model)
    assert fast_decode.resolve("fast", model) == "fast"
    hf, fast = _both(model, temperature=0.7, top_p=0.9)
    _assert_same(hf, fast)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_the_int8_copy_follows_the_trainer_at_each_sync():
    cfg = compose(["model=qwen3-tiny", "rollout.dtype=int8"])
    assert separate(cfg) and old_logprobs_mode(cfg) == "recompute"
    assert old_logprobs_mode(compose(["rollout.dtype=int8", "rollout.old_logprobs=sampler"])) == "sampler"
    tok = char_tokenizer("0123456789+=")
    model = build_model(cfg.model, len(tok), tok, seed=0).eval()
    sampler = Sampler.for_run(model, cfg)
    copy = sampler.module
    assert not any(p.requires_grad for p in copy.parameters())
    ids = torch.tensor([tok.encode("12+34=")])
    gap = (_logits(copy, ids) - _logits(model, ids)).abs().max()
    assert 0 < gap < 0.1 * _logits(model, ids).abs().max()  # close to the trainer, not equal to it
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.1)  # an update
    stale = _logits(copy, ids)
    assert set(sampler.sync(model)) == {"time/weight_sync_s"}
    fresh = Sampler.for_run(model, cfg).module  # an int8 copy built from the updated weights
    assert not torch.equal(_logits(copy, ids), stale)
    assert torch.equal(_logits(copy, ids), _logits(fresh, ids))


def test_int8_where_it_cannot_sample_is_refused_in_one_line():
    check(compose(["rollout.dtype=int8"]))
    for extra, why in ((["rollout.engine=vllm"], "engine=vllm"), (["rollout.workers=1"], "workers"),
                       (["hardware.device=cuda"], "on a GPU")):
        with pytest.raises(ConfigError, match=f"rollout.dtype=int8.*{why}"):
            check(compose(["rollout.dtype=int8", *extra]))


@pytest.mark.parametrize("extra", [{}, {"model.lora.r": 4}])  # LoRA: the adapted weights merged, then quantized
def test_a_run_sampled_by_an_int8_copy_logs_its_mismatch(tmp_path, cache_dir, extra):
    opts = tiny(cache_dir, **{"model": "qwen3-tiny", "rollout.dtype": "int8", "train.minibatches": 1, **extra})
    assert train(compose(opts), tmp_path)["status"] == "finished"
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    for m in steps:
        assert m["time/weight_sync_s"] >= 0 and m["rollout/logprob_abs_diff_mean"] > 0
        assert m["policy/ratio_min"] == pytest.approx(1.0, abs=1e-5)  # recomputed: the first update starts at 1
