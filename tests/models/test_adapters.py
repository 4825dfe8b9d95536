"""LoRA through peft: what is adapted (never a router), what trains, the KL reference, save / reload / eval (its exact
resume: tests/contracts/test_resume_equals_uninterrupted.py)."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from gspo.config.loading import compose
from gspo.config.schema import LoraConfig
from gspo.core.errors import ConfigError
from gspo.models import adapters, moe
from gspo.models.build import build_model, char_tokenizer
from gspo.rollout.decoding.generate import generate, token_logprobs
from gspo.rollout.decoding.params import SamplingParams
from gspo.tasks import build_task
from gspo.train.loop.trainer import train
from gspo.train.preflight import check
from gspo.train.run import checkpoint
from tests.conftest import tiny

# the tiny shapes of conftest.tiny: hidden 32, 2 heads x 16 (q: 32 wide), 1 kv head x 16, 2 layers
H, Q, KV, LAYERS, E, I_MOE, I_DENSE = 32, 32, 16, 2, 8, 32, 64


def model_of(arch: str, **extra):
    cfg = compose(tiny("unused", model="qwen3-moe" if arch == "qwen3_moe" else "qwen3-tiny", **extra))
    tok = char_tokenizer("0123456789+=")
    return build_model(cfg.model, len(tok), tok, seed=0), tok


def lora(**kw):
    return OmegaConf.structured(LoraConfig(**kw))


# --------------------------------------------------------------------------- what is adapted


def test_trainable_parameters_of_a_dense_model_by_hand(tmp_path):
    model, _ = model_of("qwen3")
    total = sum(p.numel() for p in model.parameters())
    peft_model = adapters.apply(model, lora(r=4), tmp_path)
    # LoRA on a Linear (in -> out) adds r * (in + out) parameters
    per_layer = sum(4 * (i + o) for i, o in [(H, Q), (H, KV), (H, KV), (Q, H),  # q k v o
                                             (H, I_DENSE), (H, I_DENSE), (I_DENSE, H)])  # gate up down
    assert per_layer == 4 * 512
    trainable, all_params = adapters.count_parameters(peft_model)
    assert trainable == LAYERS * per_layer and all_params == total + trainable
    assert all("lora_" in n for n, p in peft_model.named_parameters() if p.requires_grad)


def test_moe_experts_are_adapted_as_fused_parameters_and_routers_never(tmp_path):
    model, _ = model_of("qwen3_moe")
    routers = moe.find_routers(model)
    peft_model = adapters.apply(model, lora(r=2), tmp_path)
    # attention as above; each fused expert weight (E, out, in) gets a rank-r adapter per expert: r * E * (in + out)
    attention = sum(2 * (i + o) for i, o in [(H, Q), (H, KV), (H, KV), (Q, H)])
    experts = 2 * E * (H + 2 * I_MOE) + 2 * E * (I_MOE + H)  # gate_up_proj (E, 2I, H), down_proj (E, H, I)
    assert adapters.count_parameters(peft_model)[0] == LAYERS * (attention + experts)
    # the MoE code finds the very same routers through the PeftModel, and they stay frozen
    assert [id(r) for r in moe.find_routers(peft_model)] == [id(r) for r in routers] and len(routers) == LAYERS
    assert not any(p.requires_grad for r in routers for p in r.parameters())
    assert not any("gate.lora" in n or ".gate.base_layer" in n for n, _ in peft_model.named_modules())


def test_adapted_experts_change_the_output_and_disabling_restores_the_base(tmp_path):
    model, _ = model_of("qwen3_moe")
    ids = torch.randint(3, 15, (2, 6))
    base = model(input_ids=ids).logits.detach()
    peft_model = adapters.apply(model, lora(r=2, target_modules=[]), tmp_path)  # experts only
    for n, p in peft_model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    assert (peft_model(input_ids=ids).logits - base).abs().max() > 1e-3
    ref = adapters.reference(peft_model)
    assert torch.equal(ref(input_ids=ids).logits, base)
    assert (peft_model(input_ids=ids).logits - base).abs().max() > 1e-3  # adapters back on after the reference pass


@pytest.mark.parametrize("field, targets", [("target_modules", "[q_proj,gate]"),
                                            ("target_parameters", "[mlp.gate.weight]"),
                                            ("target_modules", "[router]")])
def test_a_target_naming_a_router_is_refused_up_front(field, targets):
    with pytest.raises(ConfigError, match="names an MoE router; routers are never adapted"):
        check(compose(["model.lora.r=4", f"model.lora.{field}={targets}"]))


def test_a_router_reached_anyway_is_refused_after_wrapping(tmp_path):
    """Past the config's name check (apply called directly, as a router under another name would be):
    the structural check on the wrapped model still refuses it."""
    model, _ = model_of("qwen3_moe")
    with pytest.raises(ConfigError, match="routers are never adapted"):
        adapters.apply(model, lora(r=2, target_modules=["q_proj"], target_parameters=["gate.weight"]), tmp_path)


@pytest.mark.parametrize("override, message", [
    ("model.lora.r=-1", "must be >= 0"),
    ("model.lora.save_merged=true", "needs adapters"),
    ("model.lora.dropout=0.1", "cannot apply dropout to the fused MoE expert weights"),
    ("model.lora.alpha=0", "must be > 0"),
])
def test_bad_lora_values_are_refused_up_front(override, message):
    extra = ["model.lora.r=4"] if "r=" not in override and "save_merged" not in override else []
    with pytest.raises(ConfigError, match=message):
        check(compose([override, *extra]))


def test_dropout_is_fine_on_a_dense_model(tmp_path):
    compose(["model=qwen3-tiny", "model.lora.r=4", "model.lora.dropout=0.1"])
    model, _ = model_of("qwen3")
    assert adapters.is_adapted(adapters.apply(model, lora(r=4, dropout=0.1), tmp_path))


def test_targets_that_name_nothing_list_the_modules(tmp_path):
    model, _ = model_of("qwen3")
    with pytest.raises(ConfigError, match=r"name nothing in this model; its Linear modules: .*q_proj"):
        adapters.apply(model, lora(r=4, target_modules=["c_attn"], target_parameters=[]), tmp_path)


def test_an_adapter_on_a_tied_lm_head_is_never_served_merged(tmp_path, cache_dir):
    """The tiny models tie their LM head to the input embeddings, and named_parameters lists a tied weight once:
    the merged weights a separate sampler takes held no delta of an adapted head (the rollout.dtype copy's logits
    were off by ~20 here), and merging it into the one tensor would change the embeddings too. Refused in one line,
    before any sampling; the trainer's own model samples it as it trains it."""
    model, _ = model_of("qwen3")
    peft_model = adapters.apply(model, lora(r=4, target_modules=["lm_head", "q_proj"]), tmp_path)
    assert adapters.tied_adapted(peft_model) == [("lm_head.weight", "model.embed_tokens.weight")]
    with pytest.raises(ConfigError, match="adapts lm_head.weight, which this model ties to model.embed_tokens"):
        list(adapters.merged_parameters(peft_model))
    assert adapters.tied_adapted(adapters.apply(model_of("qwen3")[0], lora(r=4), tmp_path)) == []  # q k v o, MLP
    o = tiny(cache_dir, model="qwen3-tiny", **{"model.lora.r": 4, "model.lora.target_modules": "[lm_head,q_proj]",
                                               "train.steps": 1})
    with pytest.raises(ConfigError, match="merged weights"):
        train(compose([*o, "rollout.dtype=bfloat16"]), tmp_path / "copy")
    assert not (tmp_path / "copy" / "metrics.jsonl").exists()
    train(compose(o), tmp_path / "own")  # the trainer's model samples: nothing merged


def test_the_adapter_pushed_to_an_engine_is_the_trainers_as_peft_saves_it(tmp_path):
    """adapters.write_adapter (rollout.vllm.lora_push=adapter): a directory peft loads, holding the current factors
    in the sampler's dtype, rewritten at every push (the config once): base + that adapter is the trainer's model."""
    model, tok = model_of("qwen3")
    model.save_pretrained(tmp_path / "base")
    peft_model = adapters.apply(model, lora(r=4), tmp_path / "base").eval()
    push = tmp_path / "push"
    adapters.write_adapter(peft_model, push, torch.bfloat16)
    first = load_file(push / "adapter_model.safetensors")
    assert len(first) == LAYERS * 7 * 2 and all(v.dtype == torch.bfloat16 for v in first.values())  # A, B of 7 Linears
    assert all(not v.any() for k, v in first.items() if "lora_B" in k)  # peft starts B at zero
    with torch.no_grad():  # an update: B moves, so the adapter changes the model
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    config = (push / "adapter_config.json").stat().st_mtime_ns
    adapters.write_adapter(peft_model, push, torch.float32)
    assert (push / "adapter_config.json").stat().st_mtime_ns == config
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), str(push)).eval()
    ids = torch.tensor([tok("12+34=")["input_ids"]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        assert torch.allclose(reloaded(input_ids=ids).logits, want, atol=1e-6)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")(input_ids=ids).logits
        assert not torch.allclose(base, want, atol=1e-3)  # so the comparison can fail


def test_lora_and_full_runs_share_the_warm_started_base(cache_dir):
    """The warm-start cache key leaves model.lora out: a LoRA run and a full run start from the same weights."""
    from gspo.train.start.warm_start import _base_key

    full = compose(tiny(cache_dir))
    assert _base_key(full) == _base_key(compose(tiny(cache_dir, **{"model.lora.r": 8, "model.lora.alpha": 4})))
    assert _base_key(full) != _base_key(compose(tiny(cache_dir, **{"model.num_experts": 4})))  # the key can differ


# --------------------------------------------------------------------------- training


@pytest.fixture
def captured(monkeypatch):
    """The adapted model the trainer builds (adapters.apply is wrapped to keep it)."""
    seen = []
    apply = adapters.apply

    def keep(*a, **kw):
        seen.append(apply(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(adapters, "apply", keep)
    return seen


def rollout_for(model, tokenizer, cfg):
    task = build_task(cfg.task)
    gen = torch.Generator().manual_seed(0)
    return generate(model, tokenizer, [p.prompt for p in task.eval_set(4)], 2, SamplingParams(4), generator=gen)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, cache_dir):
    """A 2-step LoRA run on the tiny MoE with the KL term on, no copy of the model allowed, merged export at the end."""
    import gspo.train.loop.setup as setup
    import gspo.train.loop.trainer as trainer

    run_dir = tmp_path_factory.mktemp("lora")
    seen = []
    apply, frozen = adapters.apply, setup._frozen_copy
    adapters.apply = lambda *a, **kw: seen.append(apply(*a, **kw)) or seen[-1]
    setup._frozen_copy = lambda m: pytest.fail("the LoRA path must not copy the model for the reference")
    try:
        cfg = compose(tiny(cache_dir, algo="grpo", **{"model.lora.r": 4, "model.lora.save_merged": True,
                                                      "train.lr": 0.05, "moe.routing_replay": "R2"}))
        assert cfg.algo.beta > 0
        summary = trainer.train(cfg, run_dir)
    finally:
        adapters.apply, setup._frozen_copy = apply, frozen
    return run_dir, cfg, seen[0], summary


def test_lora_run_trains_the_adapters_only(lora_run):
    run_dir, cfg, model, summary = lora_run
    assert summary["status"] == "finished"
    base_dir = Path(json.loads((checkpoint.latest(run_dir) / "adapter_config.json").read_text())["base_model_name_or_path"])
    on_disk = dict(AutoModelForCausalLM.from_pretrained(base_dir).named_parameters())  # (experts re-fused on load)
    base_now = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
                for n, p in model.named_parameters() if "lora_" not in n}
    assert set(on_disk) <= set(base_now)
    for name, tensor in on_disk.items():  # every base weight, routers included, is exactly the warm-started one
        assert torch.equal(base_now[name], tensor), name
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # initialised at 0: each one moved


def test_lora_run_logs_kl_to_the_base_and_replays_routing(lora_run):
    run_dir = lora_run[0]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2]
    assert lines[2]["kl/ref"] > 0.0  # after one update the adapted policy differs from the base
    assert all(m["moe/update_mismatch"] == 0.0 for m in lines[1:])  # R2 with adapters on
    assert "moe/routing_volatility" in lines[2]


def test_saved_adapter_reloads_with_peft_to_the_same_logprobs(lora_run):
    run_dir, cfg, model, _ = lora_run
    ckpt = checkpoint.latest(run_dir)
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    base_dir = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(ckpt)).eval()
    model.eval()
    tokenizer = checkpoint.load_model(ckpt)[1]
    ro = rollout_for(model, tokenizer, cfg)
    with torch.no_grad():
        want = token_logprobs(model, ro)[0]
        assert torch.allclose(token_logprobs(reloaded, ro)[0], want, atol=1e-6)
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged")  # the optional merged export
        assert type(merged).__name__ == "Qwen3MoeForCausalLM"
        assert torch.allclose(token_logprobs(merged, ro)[0], want, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        assert not torch.allclose(token_logprobs(base, ro)[0], want, atol=1e-5)  # so the comparisons can fail


def test_eval_and_compare_work_on_a_lora_run(lora_run):
    from gspo.results.compare import compare
    from gspo.results.evaluate import run_eval

    run_dir = lora_run[0]
    res = run_eval(str(run_dir), [], examples=1, pass_k=1)
    assert res["n"] == 16 and "step_000002" in res["model"]
    assert res["eval/accuracy"] == json.loads((run_dir / "summary.json").read_text())["final_accuracy"]
    res = run_eval(str(checkpoint.latest(run_dir)), ["task.eval_size=4"], examples=0, pass_k=1)  # the checkpoint itself
    assert res["n"] == 4
    result = compare([run_dir], by="algo", out=run_dir / "cmp")
    assert result.groups


def test_gradient_checkpointing_still_reaches_the_adapters(tmp_path, cache_dir, captured):
    from gspo.train.loop.trainer import train

    over = {"model.lora.r": 4, "model.gradient_checkpointing": True, "train.steps": 1, "train.lr": 0.05}
    assert train(compose(tiny(cache_dir, **over)), tmp_path)["status"] == "finished"
    assert all(p.abs().sum() > 0 for n, p in captured[0].named_parameters() if "lora_B" in n)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_lora_on_two_ranks_computes_what_one_process_computes(strategy, tmp_path, cache_dir):
    """GRPO with the KL term (reference = adapters off) and LoRA: 2 gloo ranks == 1 process, adapter for adapter."""
    from gspo.train.loop.trainer import train
    from tests.train.ranks.test_distributed import assert_adam_close, cli, jsonl, small

    over = small(cache_dir, **{"model.lora.r": 4, "train.lr": 0.05})
    train(compose(over), tmp_path / "one")
    cli("train", "hardware=cpu-ddp", f"hardware.strategy={strategy}", f"hydra.run.dir={tmp_path / 'two'}", *over,
        cwd=tmp_path)
    a, b = jsonl(tmp_path / "one" / "metrics.jsonl"), jsonl(tmp_path / "two" / "metrics.jsonl")
    for key in ("reward/mean", "train/loss", "train/grad_norm"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-7), key
    assert a[1]["kl/ref"] >= 0.0 and "kl/ref" in b[1]
    wa = load_file(str(checkpoint.latest(tmp_path / "one") / "adapter_model.safetensors"))
    wb = load_file(str(checkpoint.latest(tmp_path / "two") / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and any(v.abs().sum() > 0 for k, v in wa.items() if "lora_B" in k)
    for k in wa:
        assert_adam_close(wb[k], wa[k], lr=0.05, name=k)


def test_a_run_saved_before_these_keys_existed_still_loads(tmp_path, cache_dir):
    """config.yaml of an older run has no model.lora / task.*_column / reward.fn: eval and resume fill the defaults."""
    import yaml

    from gspo.config.loading import load_run_config
    from gspo.results.evaluate import run_eval
    from gspo.train.loop.trainer import train

    train(compose(tiny(cache_dir, model="qwen3-tiny", **{"train.steps": 1})), tmp_path)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del saved["model"]["lora"]
    for key in ("prompt_column", "answer_column", "system_prompt"):
        del saved["task"][key]
    for key in ("fn", "weights", "ill_formed"):
        del saved["reward"][key]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    cfg = load_run_config(tmp_path)
    assert cfg.model.lora.r == 0 and cfg.reward.fn is None and cfg.task.prompt_column == "prompt"
    assert run_eval(str(tmp_path), ["task.eval_size=4"], examples=0, pass_k=1)["n"] == 4
    assert train(compose(tiny(cache_dir, model="qwen3-tiny", **{"train.steps": 2, "resume": str(tmp_path)})),
                 tmp_path)["status"] == "finished"
