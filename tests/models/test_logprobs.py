"""Chunked LM-head log-probs and entropy equal the naive full-vocabulary computation, values and gradients."""

import pytest
import torch
from omegaconf import OmegaConf

from gspo.config.schema import ModelConfig
from gspo.models import logprobs
from gspo.models.build import build_model, char_tokenizer
from gspo.models.logprobs import selected_logprobs
from gspo.rollout.decoding.generate import generate, position_ids, token_logprobs
from gspo.rollout.decoding.params import SamplingParams

TOK = char_tokenizer("0123456789+=")


def naive(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T) / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk_elements", [1 << 24, 37])  # one chunk; many uneven chunks of 3 rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_the_naive_computation(monkeypatch, chunk_elements, temperature):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", chunk_elements)
    g = torch.Generator().manual_seed(0)
    M, H, V = 11, 5, 13
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(V, (M,), generator=g)
    upstream = torch.randn(M, generator=g, dtype=torch.float64)

    logp, ent = selected_logprobs(hidden, weight, targets, temperature, with_entropy=True)
    ref_logp, ref_ent = naive(hidden, weight, targets, temperature)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-6, atol=1e-6)  # float32 results
    torch.testing.assert_close(ent.double(), ref_ent.detach(), rtol=1e-6, atol=1e-6)

    got = torch.autograd.grad((logp.double() * upstream).sum(), (hidden, weight), retain_graph=True)
    want = torch.autograd.grad((ref_logp * upstream).sum(), (hidden, weight), retain_graph=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the entropy carries its gradient (an entropy bonus), alone and beside the log-probs'
    bonus = torch.randn(M, generator=g, dtype=torch.float64)
    for use_logp in (0.0, 1.0):
        got = torch.autograd.grad((use_logp * logp.double() * upstream + ent.double() * bonus).sum(), (hidden, weight),
                                  retain_graph=True)
        want = torch.autograd.grad((use_logp * ref_logp * upstream + ref_ent * bonus).sum(), (hidden, weight),
                                   retain_graph=True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_the_entropy_pass_leaves_the_log_probs_and_their_gradients_alone(monkeypatch, temperature):
    """The forward takes lse and the entropy from one exp pass when asked for the entropy, logsumexp otherwise:
    the log-probs and the gradients are the same either way (bitwise on the CPUs tried; here to float32 rounding)."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 5000)  # chunks of 5 rows over V = 1000
    g = torch.Generator().manual_seed(2)
    hidden0, weight0 = torch.randn(23, 16, generator=g), torch.randn(1000, 16, generator=g) * 0.3
    targets, upstream = torch.randint(1000, (23,), generator=g), torch.randn(23, generator=g)
    out = {}
    for with_entropy in (False, True):
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        logp, _ = selected_logprobs(hidden, weight, targets, temperature, with_entropy=with_entropy)
        out[with_entropy] = (logp.detach(), *torch.autograd.grad((logp * upstream).sum(), (hidden, weight)))
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_gradcheck_in_float64(monkeypatch):
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 14)  # chunks of 2 rows over V=7
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(7, (5,), generator=g)

    def f(h, w):
        return selected_logprobs(h, w, targets, 0.9)[0]

    # finite differences in float64 through a float32 output: compare at float32 resolution
    torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)


def _tiny(arch="qwen3_moe"):
    mcfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "t", "arch": arch})
    return build_model(mcfg, len(TOK), TOK, seed=0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_token_logprobs_equal_a_full_forward_values_and_gradients(arch):
    model = _tiny(arch)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    r = generate(model, TOK, ["12+34=", "5+6=", "70+8="], 2, SamplingParams(6), generator=gens)
    sel = r.completion_mask.bool()

    logp, entropy, _ = token_logprobs(model, r, temperature=0.8, with_entropy=True)
    grads = torch.autograd.grad(logp[sel].sum(), list(model.parameters()), allow_unused=True)

    # the naive path: every logit in float32, log-softmax, gather
    res = model(input_ids=r.input_ids, attention_mask=r.attention_mask, position_ids=position_ids(r.attention_mask))
    logits = res.logits[:, r.prompt_len - 1 : -1].float() / 0.8
    all_lp = torch.log_softmax(logits, -1)
    ref = all_lp.gather(-1, r.completion_ids[..., None]).squeeze(-1)
    ref_grads = torch.autograd.grad(ref[sel].sum(), list(model.parameters()), allow_unused=True)

    torch.testing.assert_close(logp[sel], ref[sel], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[sel], -(all_lp.exp() * all_lp).sum(-1)[sel].detach(), rtol=1e-5, atol=1e-5)
    assert (logp[~sel] == 0).all()
    for a, b in zip(grads, ref_grads):
        if b is None:
            assert a is None or a.abs().max() == 0
        else:
            # float32 sums in another order: errors scale with the tensor's largest element (~1e-6 of
            # it seen), not with each element (a near-zero element can be off by more than 1e-6)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_sampler_logprobs_equal_recomputed_ones_in_float32():
    """The log-probs recorded while sampling are what a full forward gives (float32, one process)."""
    model = _tiny()
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    r = generate(model, TOK, ["1+2=", "33+4=", "5+66=", "7="], 4, SamplingParams(8, temperature=0.9), generator=gens)
    with torch.no_grad():
        recomputed = token_logprobs(model, r, temperature=0.9)[0]
    sel = r.completion_mask.bool()
    assert (r.sampler_logp[~sel] == 0).all()
    torch.testing.assert_close(r.sampler_logp[sel], recomputed[sel], rtol=0, atol=2e-5)


@pytest.mark.slow  # torch.compile builds C++ kernels: about a minute on 2 cores
def test_compiled_static_cache_decoding_samples_what_the_eager_loop_samples():
    """`hardware.compile`: the static-cache, compiled decode draws the same tokens with the same log-probs."""
    model = _tiny()
    prompts = ["1+2=", "33+4=", "5+66="]

    def sample(compile: bool):
        gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        return generate(model, TOK, prompts, 4, SamplingParams(8, temperature=0.9, compile=compile), generator=gens)

    eager, compiled = sample(False), sample(True)
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    assert torch.equal(compiled.completion_mask, eager.completion_mask)
    torch.testing.assert_close(compiled.sampler_logp, eager.sampler_logp, rtol=0, atol=1e-5)
