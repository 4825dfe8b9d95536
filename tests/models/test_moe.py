"""Tests for gspo.models.moe: routing capture / replay on a tiny Qwen3-MoE (and, where parametrized, Qwen2-MoE: a
shared expert beside the routed ones, a dense layer between the MoE layers), and the routing statistics."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from gspo.core.errors import ConfigError
from gspo.models.build import enable_checkpointing
from gspo.models.moe import (
    capture_routing,
    check_routers,
    expert_load,
    find_routers,
    is_moe,
    moe_metrics,
    replay_routing,
    router_shift,
    routing_volatility,
)

B, T, L, K, E = 2, 6, 2, 2, 8
FAMILIES = ["qwen3_moe", "qwen2_moe"]


def tiny_moe(norm_topk_prob: bool = False, seed: int = 0, family: str = "qwen3_moe") -> torch.nn.Module:
    """L MoE layers of E experts, top-K. `qwen2_moe`: as the MoE split from SmolLM2 is to be, Llama's attention (no
    q/k/v biases), a shared expert in each MoE layer, and a dense layer between the two (`mlp_only_layers`): routing
    layer l is the l-th router, not the l-th layer."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=32, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 intermediate_size=64, moe_intermediate_size=32, num_experts=E, num_experts_per_tok=K,
                 norm_topk_prob=norm_topk_prob)
    if family == "qwen2_moe":
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**shape, num_hidden_layers=L + 1, mlp_only_layers=[1],
                                                   shared_expert_intermediate_size=64, qkv_bias=False))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_hidden_layers=L))
    model.eval()
    # Large router weights: well-separated top-k, so float noise (KV cache vs full pass) never flips a choice.
    for router in find_routers(model):
        torch.nn.init.normal_(router.weight, std=1.0)
    return model


def ids(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randint(0, 32, (B, length), generator=torch.Generator().manual_seed(seed))


def perturb_routers(model: torch.nn.Module) -> None:
    """Simulate a big optimiser update on the routers only."""
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.add_(torch.randn_like(r.weight) * 3.0)


# ----------------------------------------------------------------------------- discovery
@pytest.mark.parametrize("family", FAMILIES)
def test_find_routers_moe_and_dense(family):
    model = tiny_moe(family=family)
    routers = find_routers(model)
    assert len(routers) == L and is_moe(model)
    # layer order, dense layers skipped (Qwen2-MoE's shared expert gate, a Linear to one output, is no router)
    assert routers == [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert check_routers(model, replay=True) is None  # accepted for replay: its rule read off its first call

    dense = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64,
    ))
    assert find_routers(dense) == [] and not is_moe(dense)


# ----------------------------------------------------------------------------- capture
@pytest.mark.parametrize("family", FAMILIES)
def test_capture_shapes_and_topk_of_logprobs(family):
    model = tiny_moe(family=family)
    with torch.no_grad(), capture_routing(model) as trace:
        model(ids())
    idx, lp = trace.batch(B)
    assert idx.shape == (B, T, L, K) and idx.dtype == torch.long
    assert lp.shape == (B, T, L, E) and lp.dtype == torch.float32 and not lp.requires_grad
    assert torch.allclose(lp.exp().sum(-1), torch.ones(B, T, L))
    assert torch.equal(idx, lp.topk(K, dim=-1).indices)
    assert torch.equal(trace.live_indices(B), idx)
    # Row-major (B, T) order: batch row 1 alone routes like row 1 of the batch.
    with torch.no_grad(), capture_routing(model) as single:
        model(ids()[1:])
    assert torch.equal(single.indices(1)[0], idx[1])
    # Padding to a longer length marks the extra positions as "no routing".
    padded = trace.indices(B, length=T + 1)
    assert padded.shape == (B, T + 1, L, K) and (padded[:, -1] == -1).all()
    assert torch.equal(padded[:, :T], idx)
    assert trace.logprobs(B, length=T + 1).shape == (B, T + 1, L, E)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_incremental_decoding_matches_full_pass(family):
    model = tiny_moe(family=family)
    seq = ids(length=T + 2)
    with torch.no_grad(), capture_routing(model) as full:
        model(seq)
    with torch.no_grad(), capture_routing(model) as inc:
        out = model(seq[:, :T], use_cache=True)
        for t in (T, T + 1):
            out = model(seq[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
    assert inc.num_calls == 3
    assert inc.indices(B).shape == (B, T + 2, L, K)
    assert torch.equal(inc.indices(B).sort(-1).values, full.indices(B).sort(-1).values)
    assert torch.allclose(inc.logprobs(B), full.logprobs(B), atol=1e-4)


def test_capture_hooks_removed_on_exit():
    model = tiny_moe()
    with torch.no_grad(), capture_routing(model) as trace:
        model(ids())
    with torch.no_grad():
        model(ids())
    assert trace.num_calls == 1


# ----------------------------------------------------------------------------- replay
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norm", [False, True])
def test_replay_forces_old_routing(norm, family):
    model = tiny_moe(norm_topk_prob=norm, family=family)
    x = ids()
    with torch.no_grad(), capture_routing(model) as old:
        model(x)
    old_idx = old.indices(B)
    perturb_routers(model)

    with torch.no_grad(), capture_routing(model) as live:
        model(x)
    vol, _ = routing_volatility(old_idx, live.indices(B), torch.ones(B, T))
    assert vol > 0.2  # the update really changed the routing

    with torch.no_grad(), replay_routing(model, old_idx), capture_routing(model) as replayed:
        model(x)
    assert routing_volatility(old_idx, replayed.indices(B), torch.ones(B, T))[0] == 0.0
    assert torch.equal(replayed.indices(B), old_idx)
    # The live choice is still visible through the log-probs (what moe_metrics needs).
    assert routing_volatility(old_idx, replayed.live_indices(B), torch.ones(B, T))[0] > 0.2

    # Capture entered outside replay still records the forced routing (hook order).
    with torch.no_grad(), capture_routing(model) as outer:
        with replay_routing(model, old_idx):
            model(x)
    assert torch.equal(outer.indices(B), old_idx)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_of_own_routing_is_identity_in_values_and_gradients(family):
    for norm in (False, True):
        model = tiny_moe(norm_topk_prob=norm, family=family)
        x = ids()
        with torch.no_grad(), capture_routing(model) as own:
            model(x)
        ref = model(x).logits
        ref_grads = torch.autograd.grad(ref.square().mean(), [r.weight for r in find_routers(model)])
        with replay_routing(model, own.indices(B)):
            got = model(x).logits
        grads = torch.autograd.grad(got.square().mean(), [r.weight for r in find_routers(model)])
        assert torch.allclose(got, ref, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, r, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_gradients_reach_every_router(family):
    model = tiny_moe(norm_topk_prob=True, family=family)
    x = ids()
    with torch.no_grad(), capture_routing(model) as old:
        model(x)
    perturb_routers(model)
    with replay_routing(model, old.indices(B)):
        out = model(x, output_router_logits=True)
    out.logits.square().mean().backward()
    for r in find_routers(model):
        assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0
    # Live logits are passed through: the aux loss is computed and layer 0 sees the live input.
    assert torch.isfinite(out.aux_loss)
    with torch.no_grad():
        live = model(x, output_router_logits=True)
    assert torch.allclose(out.router_logits[0], live.router_logits[0], atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_minus_one_uses_live_routing(family):
    model = tiny_moe(family=family)
    x = ids()
    with torch.no_grad(), capture_routing(model) as old:
        model(x)
    old_idx = old.indices(B)
    perturb_routers(model)
    with torch.no_grad(), capture_routing(model) as live:
        ref = model(x).logits
    live_idx = live.indices(B)

    with torch.no_grad(), replay_routing(model, torch.full_like(old_idx, -1)):
        assert torch.equal(model(x).logits, ref)  # all -1: exactly the live pass

    partial = old_idx.clone()
    partial[:, -1] = -1  # the last token was never routed during sampling
    with torch.no_grad(), replay_routing(model, partial), capture_routing(model) as got:
        model(x)
    got_idx = got.indices(B)
    assert torch.equal(got_idx[:, :-1], old_idx[:, :-1])
    # The last token's routing is live: layer 0 sees the same input as the live pass.
    assert torch.equal(got_idx[:, -1, 0], live_idx[:, -1, 0])
    assert torch.equal(got_idx[:, -1], got.live_indices(B)[:, -1])


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_with_gradient_checkpointing(family):
    model = tiny_moe(norm_topk_prob=True, family=family)
    x = ids()
    with torch.no_grad(), capture_routing(model) as old:
        model(x)
    perturb_routers(model)
    weights = [r.weight for r in find_routers(model)]
    with replay_routing(model, old.indices(B)):
        ref = torch.autograd.grad(model(x).logits.square().mean(), weights)
    enable_checkpointing(model)  # as model.gradient_checkpointing=true does
    model.train()  # checkpointing is only active in training mode
    with replay_routing(model, old.indices(B)):  # backward inside: recomputation is replayed too
        got = torch.autograd.grad(model(x, use_cache=False).logits.square().mean(), weights)
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, atol=1e-6)


def test_replay_generic_router_without_norm_attribute():
    """Mixtral's router always renormalises and has no norm_topk_prob: detected from its output."""
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, num_local_experts=E, num_experts_per_tok=K,
    )).eval()
    assert len(find_routers(model)) == L
    for r in find_routers(model):
        torch.nn.init.normal_(r.weight, std=1.0)
    x = ids()
    with torch.no_grad(), capture_routing(model) as own:
        ref = model(x).logits
    with torch.no_grad(), replay_routing(model, own.indices(B)):
        assert torch.allclose(model(x).logits, ref, atol=1e-6)


class ReluRouter(torch.nn.Module):
    """A router with the right signature but weights that are no scoring rule gspo knows: not replayable."""

    def __init__(self):
        super().__init__()
        self.top_k, self.num_experts = K, E
        self.weight = torch.nn.Parameter(torch.randn(E, 4))

    def forward(self, h):
        logits = h @ self.weight.T
        scores, idx = logits.relu().topk(self.top_k, dim=-1)
        return logits, scores, idx


def test_replay_rejects_an_unknown_scoring_rule_in_one_line():
    model = torch.nn.Sequential(ReluRouter())
    assert is_moe(model)
    with pytest.raises(ConfigError, match="ReluRouter cannot be replayed: its weights are neither"), torch.no_grad():
        with replay_routing(model, torch.zeros(1, 3, 1, K, dtype=torch.long)):
            model(torch.randn(3, 4))


class AllExpertsRouter(torch.nn.Module):
    """Mixtral's rule (softmax, renormalised top-k) over every expert (top_k = num_experts, as a split model at
    top_k = experts has it), its (logits, weights, indices) returned in `order`: the two float tensors have one
    shape, so only their values tell the logits from the weights."""

    def __init__(self, order: tuple[str, ...], experts: int = 4, hidden: int = 6):
        super().__init__()
        self.top_k = self.num_experts = experts
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))
        self.order = order

    def forward(self, h):
        logits = h @ self.weight.T
        weights, indices = torch.softmax(logits.float(), -1).topk(self.top_k, dim=-1)
        parts = {"logits": logits, "weights": weights / weights.sum(-1, keepdim=True), "indices": indices}
        return tuple(parts[name] for name in self.order)


@pytest.mark.parametrize("order", list(itertools.permutations(("logits", "weights", "indices"))),
                         ids=lambda o: ",".join(o))
def test_a_router_over_every_expert_is_read_by_its_values_in_any_order(order):
    """top_k = num_experts: weights and logits are both (N, E), and the shape read fell back to the tuple's order,
    so (indices, weights, logits) (GraniteMoe's order) recorded the weights' softmax as the router's distribution
    and replayed weights as logits. Read by their values (the weights are the rule of the logits at the indices):
    the capture records log_softmax(logits) and a replay of its own routing returns the router's own output."""
    torch.manual_seed(0)
    router = AllExpertsRouter(order)
    model = torch.nn.Sequential(router)
    h = torch.randn(5, 6)
    with torch.no_grad(), capture_routing(model) as trace:
        own = model(h)
    logits = own[order.index("logits")]
    torch.testing.assert_close(trace.logprobs(1)[0, :, 0], torch.log_softmax(logits, -1), atol=1e-6, rtol=0)
    with torch.no_grad(), replay_routing(model, trace.indices(1)):
        again = model(h)
    for name in ("logits", "weights", "indices"):
        torch.testing.assert_close(again[order.index(name)], own[order.index(name)], atol=1e-6, rtol=0)


def test_replay_rejects_wrong_shapes():
    model = tiny_moe()
    with pytest.raises(ValueError, match="L=2"):
        with replay_routing(model, torch.zeros(B, T, 3, K, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match="rows"), torch.no_grad():
        with replay_routing(model, torch.zeros(B, T + 1, L, K, dtype=torch.long)):
            model(ids())
    with pytest.raises(ValueError, match="num_experts"):
        with replay_routing(model, torch.full((B, T, L, K), E, dtype=torch.long)):
            pass


# ----------------------------------------------------------------------------- statistics
# One sequence, two tokens, L=2 layers, k=2, E=8 (set semantics: order within k is irrelevant).
OLD = torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]])
NEW = torch.tensor([[[[1, 0], [2, 5]], [[4, 6], [0, 1]]]])
#  t0: layer0 same set (0 changed), layer1 3 -> 5 (1 changed)
#  t1: layer0 5 -> 6 (1 changed), layer1 both changed (2)


def test_routing_volatility_hand_computed():
    vol, layers = routing_volatility(OLD, NEW, torch.tensor([[1, 1]]))
    assert vol == pytest.approx(4 / 8) and layers == pytest.approx([1 / 4, 3 / 4])
    vol, layers = routing_volatility(OLD, NEW, torch.tensor([[1, 0]]))
    assert vol == pytest.approx(1 / 4) and layers == pytest.approx([0.0, 1 / 2])
    # -1 rows (no recorded routing) are left out.
    new = NEW.clone()
    new[0, 1, 1] = -1
    vol, layers = routing_volatility(OLD, new, torch.tensor([[1, 1]]))
    assert vol == pytest.approx(2 / 6) and layers == pytest.approx([1 / 4, 1 / 2])


def test_router_shift_hand_computed():
    old_lp = torch.zeros(1, 3, 2, 4)
    new_lp = torch.zeros(1, 3, 2, 4)
    idx = torch.tensor([[[[0, 1], [2, 3]]] * 3])  # (1, 3, 2, 2)
    new_lp[0, 0, 0, 0] = -math.log(2)  # t0 layer0: factors 1/2, 1 -> 3/4; layer1: 1 -> token sqrt(3/4)
    new_lp[0, 1, 0, :2] = math.log(4)  # t1 layer0: 1/4, 1/4 -> 1/4; layer1: 1 -> token 1/2
    new_lp[0, 2, 1, 3] = 5.0  # masked-out token: reported as 1
    new_lp[0, 0, 0, 2] = 9.0  # experts outside the old top-k do not count
    per_token, mean = router_shift(old_lp, new_lp, idx, torch.tensor([[1, 1, 0]]))
    assert per_token.shape == (1, 3)
    assert per_token[0].tolist() == pytest.approx([math.sqrt(0.75), 0.5, 1.0])
    assert mean == pytest.approx((math.sqrt(0.75) + 0.5) / 2)
    assert router_shift(old_lp, old_lp, idx, torch.ones(1, 3))[1] == pytest.approx(1.0)


def test_expert_load_and_metrics_hand_computed():
    idx = torch.tensor([[[[0, 1], [3, 2]], [[0, 2], [3, 1]], [[7, 6], [7, 6]]]])  # (1, 3, 2, 2)
    mask = torch.tensor([[1, 1, 0]])
    load = expert_load(idx, mask, 8)
    expected = torch.zeros(2, 8)
    expected[0, :3] = torch.tensor([0.5, 0.25, 0.25])
    expected[1, 1:4] = torch.tensor([0.25, 0.25, 0.5])
    assert torch.allclose(load, expected)

    lp = torch.zeros(1, 3, 2, 8)
    m = moe_metrics(idx, idx, lp, lp, mask, num_experts=8)
    assert m["moe/routing_volatility"] == 0.0 and m["moe/router_shift"] == pytest.approx(1.0)
    assert m["moe/expert_load_max"] == pytest.approx(0.5)
    # Entropy of (1/2, 1/4, 1/4) = 1.5 ln 2, normalised by ln 8 = 3 ln 2 -> 0.5, in both layers.
    assert m["moe/expert_load_entropy"] == pytest.approx(0.5)
    assert m["moe/expert_load/layer_1/expert_3"] == pytest.approx(0.5)
    assert m["moe/routing_volatility/layer_1"] == 0.0
    expected_keys = {"moe/routing_volatility", "moe/router_shift", "moe/expert_load_max",
                     "moe/expert_load_entropy"}
    expected_keys |= {f"moe/routing_volatility/layer_{i}" for i in range(2)}
    expected_keys |= {f"moe/expert_load/layer_{i}/expert_{j}" for i in range(2) for j in range(8)}
    assert set(m) == expected_keys and all(isinstance(v, float) for v in m.values())


def test_metrics_on_real_capture_after_update():
    model = tiny_moe()
    x = ids()
    with torch.no_grad(), capture_routing(model) as old:
        model(x)
    perturb_routers(model)
    with torch.no_grad(), replay_routing(model, old.indices(B)), capture_routing(model) as new:
        model(x)
    m = moe_metrics(old.indices(B), new.live_indices(B), old.logprobs(B), new.logprobs(B),
                    torch.ones(B, T), num_experts=E)
    assert 0 < m["moe/routing_volatility"] <= 1 and 0 < m["moe/router_shift"] < 1
    assert 0 < m["moe/expert_load_entropy"] <= 1


def test_the_loops_moe_component_is_a_no_op_on_a_dense_model():
    """The loop calls MoEStep at fixed points whatever the model; for a dense one nothing happens."""
    from omegaconf import OmegaConf

    from gspo.config.loading import compose
    from gspo.config.schema import ModelConfig
    from gspo.models.build import build_model, char_tokenizer
    from gspo.rollout.decoding.generate import generate, token_logprobs
    from gspo.rollout.decoding.params import SamplingParams
    from gspo.train.loop.moe_step import MoEStep

    TOK = char_tokenizer("0123456789+=")
    model = build_model(OmegaConf.merge(OmegaConf.structured(ModelConfig), {"name": "d", "arch": "qwen3"}),
                        len(TOK), TOK, 0)
    step = MoEStep.for_model(model, compose(["model=qwen3-tiny"]), dist=None, old_pass=True)
    assert type(step) is MoEStep and step.sample_kwargs() == {}
    r = generate(model, TOK, ["1+2="], 2, SamplingParams(4), generator=[torch.Generator().manual_seed(0)])
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())  # noqa: E731
    with step.old_pass(model, r):
        assert hooks() == 0
        old = token_logprobs(model, r)[0]
    with step.minibatch(model, r, torch.arange(2)) as mb:
        assert hooks() == 0
        assert mb.router_shift(r) is None and mb.aux_loss(r) == 0.0 and mb.stats() == {}
    assert step.end_step(model, r, 1) == {} and hooks() == 0
    torch.testing.assert_close(token_logprobs(model, r)[0], old)


# ----------------------------------------------------------------------------- scoring rules
def test_scoring_weights_and_distribution_hand_computed():
    from gspo.models.moe import Scoring

    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0)]])  # sigmoids 1/2, 3/4, 1/4
    idx = torch.tensor([[1, 0]])
    sig = Scoring("sigmoid", normalise=True, scale=2.5)
    assert torch.allclose(sig.weights(logits, idx), torch.tensor([[0.6 * 2.5, 0.4 * 2.5]]))
    assert torch.allclose(Scoring("sigmoid", False).weights(logits, idx), torch.tensor([[0.75, 0.5]]))
    # the distribution: affinities normalised over all experts, 1/2 : 3/4 : 1/4 = 1/3 : 1/2 : 1/6
    assert torch.allclose(sig.log_probs(logits).exp(), torch.tensor([[1 / 3, 1 / 2, 1 / 6]]))
    assert torch.allclose(sig.probs(logits), torch.tensor([[1 / 3, 1 / 2, 1 / 6]]))
    soft = Scoring("softmax", normalise=False)  # softmax of (0, ln 3, -ln 3) = (3, 9, 1) / 13
    assert torch.allclose(soft.weights(logits, idx), torch.tensor([[9 / 13, 3 / 13]]))
    assert torch.allclose(Scoring("softmax", True).weights(logits, idx), torch.tensor([[0.75, 0.25]]))
    assert torch.allclose(soft.log_probs(logits).exp(), torch.tensor([[3 / 13, 9 / 13, 1 / 13]]))


def test_scoring_gradients_match_autograd_of_the_formula():
    from gspo.models.moe import Scoring

    torch.manual_seed(0)
    z = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(6)[:2] for _ in range(5)])
    up = torch.randn(5, 2, dtype=torch.float64)
    got = torch.autograd.grad((Scoring("sigmoid", True, 2.5).weights(z, idx) * up).sum(), z)[0]
    s = 1 / (1 + torch.exp(-z.detach()))
    # d/dz_j of 2.5 s_a / (s_a + s_b) at the chosen experts, by hand: s' = s (1 - s)
    want = torch.zeros_like(z)
    for n in range(5):
        a, b = idx[n].tolist()
        tot = s[n, a] + s[n, b]
        for slot, (i, j) in enumerate(((a, b), (b, a))):
            g_i = 2.5 * s[n, i] * (1 - s[n, i]) * s[n, j] / tot ** 2  # d w_i / d z_i
            g_j = -2.5 * s[n, i] * s[n, j] * (1 - s[n, j]) / tot ** 2  # d w_i / d z_j
            want[n, i] += up[n, slot] * g_i
            want[n, j] += up[n, slot] * g_j
    assert torch.allclose(got, want)


def test_scoring_read_off_a_sigmoid_group_limited_router():
    """DeepSeek-V3's router (bias-corrected, group-limited choice; sigmoid weights, renormalised, x 2.5)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from gspo.models.moe import Scoring

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=16, n_routed_experts=E, num_experts_per_tok=K, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, routed_scaling_factor=2.5,
    )).eval()
    for r in find_routers(model):
        torch.nn.init.normal_(r.weight, std=1.0)
        r.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, E))  # moves the choice, not the weights
    x = ids()
    with torch.no_grad(), capture_routing(model) as own:
        ref = model(x).logits
    assert own.scorings == [Scoring("sigmoid", True, 2.5)] * L
    idx = own.indices(B)
    # group-limited: each token's experts lie in one group of E/2
    assert ((idx // (E // 2)) == (idx[..., :1] // (E // 2))).all()
    with torch.no_grad(), replay_routing(model, idx):
        assert torch.allclose(model(x).logits, ref, atol=1e-5)


def test_load_balancing_loss_of_a_sigmoid_router_hand_computed():
    """Normalised affinities as P, the router's own pick as f: E * sum_e f_e P_e."""
    from gspo.models.moe import Scoring, load_balancing_loss

    logits = torch.tensor([[0.0, math.log(3.0), -math.log(3.0)], [0.0, 0.0, 0.0]])  # P rows (1/3, 1/2, 1/6), (1/3,)*3
    chosen = torch.tensor([[0], [2]])  # not the top-1 of P: the router's own (bias-corrected) pick counts
    loss = load_balancing_loss([logits], 1, torch.ones(1, 2), scorings=[Scoring("sigmoid", True)], chosen=[chosen])
    f = torch.tensor([0.5, 0.0, 0.5])
    P = torch.tensor([(1 / 3 + 1 / 3) / 2, (1 / 2 + 1 / 3) / 2, (1 / 6 + 1 / 3) / 2])
    assert loss.item() == pytest.approx(3 * float((f * P).sum()))
