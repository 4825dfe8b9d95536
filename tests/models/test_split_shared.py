"""A sparse MoE split from a dense Llama with a shared expert (model.split_experts.shared: a Qwen2MoeForCausalLM) and
its layer-wise recovery (model.split_experts.layerwise_epochs, gspo/models/split_recovery.py `recover_layers`).

On the tiny Llamas of test_split_experts (nothing downloaded): with the shared expert, every routed expert active
and a router that does not rescale, the split model computes the dense model's outputs and holds each neuron once;
the shared expert is the neurons of largest mean contribution; the layer-wise recovery sees the inputs the model's
own forward gives its MoE blocks, moves only the experts, lowers each layer's error and the held-out KL, and a
build interrupted midway continues to the same weights; the checkpoint is keyed by what runs, loads as transformers'
Qwen2MoeForCausalLM (its training under Routing Replay and its fast engine: test_split_experts, parametrized
over the shared expert)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from tests.cli.test_cli import one_line_exit_2
from tests.rollout.decoding.test_fast_decode import TOK
from tests.models.test_families import run_config, tiny_checkpoint
from tests.models.test_split_experts import _dense, _ids, _logp
from transformers import AutoModelForCausalLM, Qwen2MoeForCausalLM
from typer.testing import CliRunner

from cli.main import app
from gspo.config.schema import SplitExpertsConfig
from gspo.models import moe, split_experts, split_recovery
from gspo.train.start import split_moe

E, K, S = 4, 2, 64  # 4 routed experts of (256 - 64) / 4 = 48 neurons, top-2, a shared expert of 64
SHARED = SplitExpertsConfig(experts=E, top_k=K, calibration_sequences=8, calibration_tokens=32, shared=S)
S_TINY = 16  # test_families' tiny checkpoints: (64 - 16) / 4 = 12 neurons an expert


def _split(dense, ids, mask, top_k: int = K):
    """The split of `dense` on (ids, mask) without recovery, routers at a logit spread of 0.1."""
    shared, groups = split_experts.group_all_layers(dense, ids, mask, E, 0, S)
    routers, spreads = split_experts.fit_routers(dense, ids, mask, groups)
    return split_experts.to_moe(dense, shared, groups, routers, top_k, [0.1 / max(s, 1e-12) for s in spreads])


def test_a_shared_expert_beside_every_routed_expert_under_a_uniform_router_is_the_dense_model():
    dense = _dense()
    built, record = split_moe.build(dense, TOK, SplitExpertsConfig(E, E, 8, 32, shared=S), log=lambda m: None)
    assert isinstance(built, Qwen2MoeForCausalLM) and record["kl_to_dense"] < 1e-5
    with torch.no_grad():
        for r in moe.find_routers(built):
            r.weight.zero_()
    torch.testing.assert_close(_logp(built, _ids()), _logp(dense, _ids()), atol=1e-5, rtol=0)
    for src, dst in zip(dense.model.layers, built.model.layers):  # each dense neuron in one expert, once
        width = (src.mlp.gate_proj.weight.shape[0] - S) // E
        rows = torch.cat([dst.mlp.shared_expert.gate_proj.weight,
                          dst.mlp.experts.gate_up_proj[:, :width].reshape(-1, src.mlp.gate_proj.weight.shape[1])])
        dense_rows = src.mlp.gate_proj.weight
        assert rows.shape == dense_rows.shape
        order = lambda t: t[torch.argsort(t[:, 0])]  # noqa: E731
        assert torch.equal(order(rows), order(dense_rows))
        assert not dst.mlp.shared_expert_gate.weight.any() and not dst.self_attn.q_proj.bias


def test_the_shared_expert_is_the_neurons_of_largest_mean_contribution():
    h = torch.tensor([[1.0, -4.0, 0.5, 0.0], [1.0, 2.0, -0.5, 3.0]])  # 2 tokens, 4 neurons
    down = torch.tensor([[3.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 1.0]])  # column norms 5, 1, 1, sqrt 2
    # mean |h_i| * ||down_i||: 5, 3, 0.5, 1.5 * 1.414 = 2.12
    assert split_experts.shared_neurons(h, down, 2).tolist() == [0, 1]
    assert split_experts.shared_neurons(h, down, 3).tolist() == [0, 1, 3]
    assert split_experts.shared_neurons(h, down, 0).numel() == 0


def test_layerwise_recovery_sees_the_models_own_block_inputs(monkeypatch):
    """What each layer is fitted on is what the model's own forward gives its MoE block, on the real tokens of a
    right-padded batch (its attention, RoPE and causal mask as the model's)."""
    dense = _dense().eval()
    ids, mask = split_moe.calibration_ids(dense, TOK, 6, 24, seed=0)
    assert not mask.all()  # (right-padded rows among them)
    model = _split(dense, ids, mask)
    seen, fitted = {}, []
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: seen.setdefault(i, []).append(a[0]))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for h in hooks:
        h.remove()
    monkeypatch.setattr(split_recovery, "_fit_block", lambda block, x, y, *a: fitted.append((x, y)) or {
        "before": 0.0, "after": 0.0})
    split_recovery.recover_layers(dense, model, ids, mask, epochs=1, lr=1e-3, batch=4, log=lambda m: None)
    for layer, (x, y) in enumerate(fitted):
        torch.testing.assert_close(x, seen[layer][0][mask.bool()], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y, dense.model.layers[layer].mlp(x), atol=0, rtol=0)


def test_layerwise_recovery_moves_only_the_experts_and_brings_the_moe_closer(tmp_path):
    dense = _dense().eval()
    ids, mask = split_moe.calibration_ids(dense, TOK, 64, 32, seed=0)
    held, held_mask, ids, mask = ids[-8:], mask[-8:], ids[:-8], mask[:-8]
    model = _split(dense, ids, mask)
    ref = [split_recovery.token_logps(dense, held, held_mask)]
    before = split_recovery.next_token_kl(ref, model, held, held_mask)
    kept = {k: v.clone() for k, v in model.state_dict().items()
            if ".experts." not in k and ".shared_expert." not in k}
    flags = [p.requires_grad for p in model.parameters()]
    records = split_recovery.recover_layers(dense, model, ids, mask, epochs=5, lr=3e-3, state_dir=tmp_path / "p",
                                            log=lambda m: None)
    after = split_recovery.next_token_kl(ref, model, held, held_mask)
    assert all(r["after"] < r["before"] for r in records) and after < before, (records, before, after)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in kept.items())  # routers, shared gate, attention
    assert [p.requires_grad for p in model.parameters()] == flags

    # a build interrupted after its first layer continues there, to the same weights as the one never interrupted
    (tmp_path / "p" / "layer-001.json").unlink()
    again = _split(dense, ids, mask)
    resumed = split_recovery.recover_layers(dense, again, ids, mask, epochs=5, lr=3e-3, state_dir=tmp_path / "p",
                                            log=lambda m: None)
    untimed = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert untimed(resumed) == untimed(records)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


def test_the_shared_split_is_built_once_keyed_by_what_runs_and_loads_as_qwen2_moe(tmp_path):
    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    scfg = OmegaConf.create({**SHARED.__dict__, "shared": S_TINY, "layerwise_epochs": 2})
    path = split_moe.checkpoint(dense_dir, scfg, tmp_path / "cache", log=None)
    record = json.loads((path / "split_experts.json").read_text())
    assert len(record["layerwise"]) == 2 and "kl_to_dense_before_layerwise" in record
    assert not (path / split_experts.RECIPE).exists() and not path.with_name(path.name + ".partial").exists()
    # interrupted in its second layer, the build continues from its calibration text, split and first layer
    done = []
    real = split_recovery._fit_block

    def stop_at_second(block, *a):
        if done:
            raise KeyboardInterrupt
        done.append(1)
        return real(block, *a)

    other = OmegaConf.create({**scfg, "seed": 1})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(split_recovery, "_fit_block", stop_at_second)
        with pytest.raises(KeyboardInterrupt):
            split_moe.checkpoint(dense_dir, other, tmp_path / "cache", log=None)
    partial = next((tmp_path / "cache").glob("*.partial"))
    assert {p.name for p in partial.iterdir()} == {"cpu.json", "calibration.pt", "carve.safetensors",
                                                   "layer-000.json", "layer-000.safetensors"}
    fitted = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(split_recovery, "_fit_block", lambda block, *a: fitted.append(1) or real(block, *a))
        mp.setattr(split_moe, "calibration_ids", lambda *a: pytest.fail("the calibration text was written again"))
        mp.setattr(split_experts, "group_all_layers", lambda *a: pytest.fail("the neurons were grouped again"))
        resumed = split_moe.checkpoint(dense_dir, other, tmp_path / "cache", log=None)
    assert fitted == [1] and not partial.exists()
    assert json.loads((resumed / "split_experts.json").read_text())["layerwise"][0]["layer"] == 0
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert type(loaded) is Qwen2MoeForCausalLM and loaded.config.shared_expert_intermediate_size == S_TINY
    assert loaded.config.num_experts == E and loaded.config.num_experts_per_tok == K
    assert split_moe.keyed(SplitExpertsConfig(experts=E, top_k=K)) == {
        "experts": E, "top_k": K, "calibration_sequences": 64, "calibration_tokens": 160, "seed": 0}  # as before
    keys = split_moe.keyed(SplitExpertsConfig(experts=E, top_k=K, shared=S, layerwise_epochs=2))
    assert keys["shared"] == S and keys["layerwise_epochs"] == 2 and keys["layerwise_lr"] == 1e-3


def test_what_the_shared_split_cannot_do_is_refused_in_one_line(tmp_path):
    dense_dir = tiny_checkpoint("llama", tmp_path / "dense")
    split = {"model.split_experts.experts": 5, "model.split_experts.top_k": 2, "model.split_experts.shared": 16}
    res = CliRunner().invoke(app, ["train", *run_config(dense_dir, tmp_path / "cache", **split),
                                   f"hydra.run.dir={tmp_path / 'run'}"])
    one_line_exit_2(res, "model.split_experts.experts=5: must divide the dense MLP's 64 - 16 = 48 routed neurons")
    res = CliRunner().invoke(app, ["train", *run_config(dense_dir, tmp_path / "cache", **{
        **split, "model.split_experts.experts": 4, "model.split_experts.recipe": "smollm2_moe.split.safetensors"}),
        f"hydra.run.dir={tmp_path / 'run'}"])
    one_line_exit_2(res, "a recipe holds a split without recovery or a shared expert; set "
                         "model.split_experts.shared=0")
